"""The three ways a request reaches its first token, driven from the client side (no proxy hop in between), timed
from the moment the request is sent to the first generated token:

- `local`: one engine computes everything (the baseline);
- `concurrent`: prefill and decode legs at once with a shared transfer id (SparseKVConnector's fast path, what
  examples/proxy.py does): decode registers its blocks while prefill computes and the KV is pushed per layer;
- `sequential`: prefill first, its response's `kv_transfer_params` into the decode leg unchanged (vLLM's proxy
  pattern, llm-d; works for SparseKVConnector and NixlConnector alike).

`prefill_prompt` lets a control run give prefill a different prompt than decode: if decode then follows prefill's
prompt, the KV really came over the wire."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from sparse_kv_lab.pd.client import Completion, complete, completion_body
from connector.protocol.auth import new_transfer_secret

PREFILL_LEG = {"max_tokens": 1, "stream": False}


def local(url: str, prompt: list[int], max_tokens: int = 16, *, stream: bool = True, **extra: Any) -> Completion:
    return complete(url, completion_body(prompt, max_tokens, stream=stream, **extra))


def concurrent(prefill_url: str, side_channel: str, decode_url: str, prompt: list[int], max_tokens: int = 16, *,
               stream: bool = True, prefill_prompt: list[int] | None = None, transfer_id: str | None = None,
               timeout_s: float = 120.0, require_prefill: bool = True, transfer_secret: str | None = None,
               **extra: Any) -> Completion:
    """Both legs at once. Raises the prefill leg's error if it failed (after decode answered), unless
    `require_prefill` is False: then decode's answer is returned whatever became of prefill (a test that kills
    prefill wants to see what decode did about it). Whoever mints the transfer id mints its capability too
    (`transfer_secret`, 128 random bits, given to both legs and nobody else; "" sends none: an open transfer)."""
    tid = transfer_id or uuid.uuid4().hex
    secret = new_transfer_secret() if transfer_secret is None else transfer_secret
    cap = {"transfer_secret": secret} if secret else {}
    pre_body = completion_body(prefill_prompt or prompt, **extra) | PREFILL_LEG | {
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid} | cap}
    dec_body = completion_body(prompt, max_tokens, stream=stream, **extra) | {
        "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": tid, "prefill_addr": side_channel} | cap}
    failure: list[BaseException] = []

    def prefill_leg() -> None:
        try:
            complete(prefill_url, pre_body, timeout_s=timeout_s)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            failure.append(exc)

    start = time.monotonic()
    leg = threading.Thread(target=prefill_leg, name=f"prefill-leg-{tid[:8]}", daemon=True)
    leg.start()
    try:
        out = complete(decode_url, dec_body, timeout_s=timeout_s)
    finally:
        leg.join(timeout_s)
    if failure and require_prefill:
        raise failure[0]
    return _from(out, start)


def sequential(prefill_url: str, decode_url: str, prompt: list[int], max_tokens: int = 16, *, stream: bool = True,
               prefill_prompt: list[int] | None = None, prefill_params: dict[str, Any] | None = None,
               timeout_s: float = 120.0, **extra: Any) -> Completion:
    """Prefill, then decode with the `kv_transfer_params` prefill answered (`prefill_params`: what the router sends
    prefill, default vLLM's toy-proxy keys)."""
    params = prefill_params if prefill_params is not None else {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}
    start = time.monotonic()
    pre = complete(prefill_url, completion_body(prefill_prompt or prompt, **extra) | PREFILL_LEG |
                   {"kv_transfer_params": params}, timeout_s=timeout_s)
    body = completion_body(prompt, max_tokens, stream=stream, **extra)
    if pre.kv_transfer_params:
        body["kv_transfer_params"] = pre.kv_transfer_params
    out = complete(decode_url, body, timeout_s=timeout_s)
    out.kv_transfer_params = pre.kv_transfer_params
    return _from(out, start)


def _from(out: Completion, start: float) -> Completion:
    """The decode leg's completion, timed from the start of the whole request."""
    now = time.monotonic()
    out.ttft_s = now - start - (out.total_s - out.ttft_s)
    out.total_s = now - start
    return out
