"""Text from outside (a peer's ids and reasons, a request's kv_transfer_params, msgspec's account of a peer's frame)
as it may appear in a log line or an error message: `shown`. Pure.

The rule, everywhere in the connector: a string another party chose is formatted through `shown` where it enters
a log line or an exception message, never raw, and never with `!r` alone (repr escapes control characters but
bounds nothing). Identifiers on the wire (and a request's transfer id, connector.vllm.requests) are refused when
they hold a control, separator or bidi character (`ID_PATTERN`), so for them `shown` mostly bounds the length; free
text (Reject, Abort, Error, RegisterError and Scattered reasons, msgspec's account of a frame, a request's
parameters, vLLM request ids) is escaped here.

Escaped: C0 controls (newline, CR, ESC of ANSI sequences...), DEL, C1 controls, and every other character Python
does not call printable (str.isprintable: line and paragraph separators U+2028/U+2029, bidi controls such as
U+202E and U+2066-U+2069, zero-width and other format characters, unassigned code points) except the space: each
becomes `\\xNN`, `\\uNNNN` or `\\UNNNNNNNN`. A backslash stays a backslash, so text already shown comes out of
`shown` unchanged (a message that holds a shown id can be shown again, bounded again, without turning `\\x0a`
into `\\\\x0a`)."""

from __future__ import annotations

import re

ID_LIMIT = 512
"""Characters of an id shown (the longest transfer id the side channel accepts: an id is shown whole)."""
ID_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]*\Z"
"""What an id may hold (engine ids, NIXL agent names, fingerprints, transfer ids; a msgspec `pattern`, and
`is_id`): any Unicode but C0 and C1 controls, DEL, the zero-width and bidi format characters (U+061C,
U+200B-U+200F, U+202A-U+202E, U+2060-U+206F, U+FEFF) and the line and paragraph separators: what would let an id
break, hide or reorder a log line. (vLLM request ids, which become transfer ids, come from clients: Unicode letters
are theirs to use.) `\\Z`, not `$`: `$` also matches before a final newline."""
TEXT_LIMIT = 2000
"""Characters of free text (a reason, an error message) shown."""


def escape_char(c: str) -> str:
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def shown(text: object, limit: int = ID_LIMIT, *, quote: bool = False) -> str:
    """`text` (str() of it, if not a string) safe for one log line: every non-printable character escaped, and at
    most `limit` characters of it kept (escapes included), then "…(+N chars)" for the N characters left out.
    `quote`: in single quotes, as `!r` shows a plain string (a quote inside is escaped)."""
    if not isinstance(text, str):
        text = str(text)
    if len(text) <= limit and text.isprintable() and not (quote and "'" in text):
        return f"'{text}'" if quote else text
    out: list[str] = []
    used = 0
    for i, c in enumerate(text):
        piece = c if c.isprintable() else escape_char(c)
        if quote and c == "'":
            piece = "\\'"
        if used + len(piece) > limit:
            out.append(f"…(+{len(text) - i} chars)")
            break
        out.append(piece)
        used += len(piece)
    body = "".join(out)
    return f"'{body}'" if quote else body


def shown_text(text: object, limit: int = TEXT_LIMIT) -> str:
    """`shown` with the bound of free text (a peer's reason, an exception's message)."""
    return shown(text, limit)


_ID = re.compile(ID_PATTERN)


def is_id(text: object) -> bool:
    """Whether `text` is a string an id may be (`ID_PATTERN`; the length is each id's own limit)."""
    return isinstance(text, str) and _ID.search(text) is not None
