"""`python -m connector keygen FILE`: a prefill key (README, Security). Writes the private half to FILE (mode 0600,
never over an existing file) for prefill's `prefill_key_file`, and prints the public half and the decode setting
that trusts it (`trusted_prefill_keys`). `--public FILE` prints the public half of an existing key file again.

One key may serve every prefill node of a cluster (copy the file), or each node gets its own and decode lists them
all: a decode refuses a prefill whose key it does not list, before anything about its memory leaves."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from connector.core.errors import CliError
from connector.protocol.auth import engine_public_key, key_from_text, new_engine_key


def add_subcommand(subs: Any) -> None:
    p = subs.add_parser("keygen", help="a prefill key: the private half to a file (prefill_key_file), the public "
                                       "half printed (decode's trusted_prefill_keys)")
    p.add_argument("file", type=Path, help="where the private key goes (refused if it exists)")
    p.add_argument("--public", action="store_true", help="print the public half of the existing key in FILE")
    p.set_defaults(run=run)


def run(args: Any) -> int:
    path: Path = args.file
    if args.public:
        try:
            key = key_from_text(path.read_text(encoding="utf-8"), str(path))
        except OSError as exc:
            raise CliError(f"{path}: cannot be read: {exc.strerror}") from None
        except ValueError as exc:
            raise CliError(str(exc)) from None
        print(engine_public_key(key).hex())
        return 0
    key = new_engine_key()
    try:
        # O_EXCL: an existing key (maybe the one every prefill node already uses) is never overwritten.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise CliError(f"{path} exists: keygen never overwrites a key (`--public {path}` prints its public "
                       f"half)") from None
    except OSError as exc:
        raise CliError(f"{path}: cannot be created: {exc.strerror}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(key.hex() + "\n")
    public = engine_public_key(key).hex()
    print(public)
    print(f"# prefill: \"prefill_key_file\": {json.dumps(str(path.resolve()))} (this file, on every prefill node "
          f"that uses the key; keep it private)")
    print(f"# decode:  \"trusted_prefill_keys\": [{json.dumps(public)}]")
    return 0
