"""What both halves of the scheduler side read from a vLLM request: its kv_transfer_params checked, and its block
ids. Pure."""

from __future__ import annotations

from typing import Any

from connector.core.errors import ConfigError
from connector.protocol.addressing import PrefillAddress, host_allowed
from connector.protocol.auth import MAX_TRANSFER_SECRET, new_transfer_secret
from connector.core.untrusted import is_id, shown
from connector.protocol.messages import MAX_TRANSFER_ID

ROUTER_HINT = "pass the kv_transfer_params of prefill's response to decode unchanged, or send both legs the " \
              "same transfer_id with prefill_addr on decode (examples/proxy.py)"


def check_params(params: dict[str, Any], *, decode: bool, allowed_hosts: tuple[str, ...] = ()) -> str:
    """'' if the request's kv_transfer_params are usable, else a one-line reason naming the key and the fix.
    (Prefill accepts a missing transfer_id: it then makes one, see PrefillScheduler.transfer_id_of.)"""
    given = sorted(params)  # (the client's keys: shown, never raw)
    if decode or "transfer_id" in params:
        tid = params.get("transfer_id")
        if not isinstance(tid, str) or not tid:
            what = "no transfer_id" if "transfer_id" not in params else \
                f"an unusable transfer_id ({shown(repr(tid), 100)})"
            return f"kv_transfer_params has {what} (keys given: {shown(given, 300)}): {ROUTER_HINT}"
        if len(tid) > MAX_TRANSFER_ID:
            return (f"kv_transfer_params transfer_id has {len(tid)} characters, more than the side channel's "
                    f"{MAX_TRANSFER_ID}: use a shorter id (a UUID)")
        if not is_id(tid):
            return (f"kv_transfer_params transfer_id {shown(tid, 100, quote=True)} holds a control, line-separator "
                    f"or bidi character, which the side channel refuses in an id: use a printable id (a UUID)")
    secret = params.get("transfer_secret")
    if secret is not None and (not isinstance(secret, str) or not 0 < len(secret) <= MAX_TRANSFER_SECRET):
        return (f"kv_transfer_params transfer_secret must be a string of 1 to {MAX_TRANSFER_SECRET} characters, "
                f"got {type(secret).__name__} of {len(str(secret))} characters (never shown: it is a secret): pass "
                f"prefill's kv_transfer_params on unchanged, "
                f"or mint one per request (secrets.token_urlsafe(16)) and give both legs the same")
    if decode:
        if "prefill_addr" not in params:
            return f"kv_transfer_params has no prefill_addr (keys given: {shown(given, 300)}): {ROUTER_HINT}"
        try:
            addr = PrefillAddress.parse(params["prefill_addr"])
        except ConfigError as exc:
            return f"kv_transfer_params prefill_addr: {exc}"
        if not host_allowed(addr.host, allowed_hosts):
            return (f"kv_transfer_params prefill_addr names host {shown(addr.host, 100, quote=True)}, which is not "
                    f"in this decode's allowed_prefill_hosts ({len(allowed_hosts)} entries): decode connects only "
                    f"to the prefills it is configured for; add the host (or its network) there if it is one")
    return ""


def secret_of(params: dict[str, Any], require: bool = False) -> str:
    """Prefill: the capability of a request's transfer. The one its kv_transfer_params carry; else, when they name
    no transfer_id (the sequential flow: decode learns the id from prefill's response, so nobody can register it
    before), a fresh one, returned in the response; else (a router that named the id without a secret, in the
    concurrent flow) none: the transfer is open, unless `require` (require_transfer_secret) mints one anyway."""
    secret = params.get("transfer_secret")
    if isinstance(secret, str) and secret:
        return secret
    return new_transfer_secret() if require or not params.get("transfer_id") else ""


def all_block_ids(kv_cache_manager: Any, req_id: str, blocks: Any) -> tuple[list[int], ...]:
    """Every block of the request per group, from token 0 (prefix hits included), as the workers index them by
    token."""
    if kv_cache_manager is not None:
        return tuple(list(g) for g in kv_cache_manager.get_block_ids(req_id))
    return tuple(list(g) for g in blocks.get_block_ids())
