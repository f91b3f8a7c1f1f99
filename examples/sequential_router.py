#!/usr/bin/env python3
"""A minimal prefill-then-decode router, written the way vLLM's disaggregation proxy pattern works
(vLLM's `toy_proxy_server.py` for NixlConnector, llm-d's routing sidecar): it knows nothing of SparseKVConnector.

For each `/v1/completions` or `/v1/chat/completions` POST:
  1. send the request to a prefill instance with `max_tokens: 1`, not streamed, and
     `kv_transfer_params: {"do_remote_decode": true, ...}` (the same keys vLLM's toy proxy sends);
  2. take the `kv_transfer_params` of prefill's response;
  3. send the original request to a decode instance with exactly that dict, and relay its answer.

    python examples/sequential_router.py --port 8000 --prefill http://P_HOST:8100 --decode http://D_HOST:8200

SparseKVConnector fills the dict in on prefill (transfer id, prefill side-channel address), so this router works
unchanged with it and with NixlConnector. `examples/proxy.py` is the faster concurrent flow (both legs at once,
KV pushed while prefill computes). `build_app()` is the importable entry (tests use it).
"""

from __future__ import annotations

import argparse
import itertools
import logging
from typing import Any, Sequence

try:
    import aiohttp
    from aiohttp import web
except ImportError:  # the system python has no aiohttp; vLLM's environment always has it
    if __name__ != "__main__":
        raise
    raise SystemExit(f"{__file__} needs aiohttp: run it with the python of vLLM's environment (which has it), e.g. "
                     f".venv-cpu/bin/python {__file__} ..., or `pip install aiohttp`") from None

log = logging.getLogger("sequential_router")
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
                         "date", "server"})
SESSION = web.AppKey("session", aiohttp.ClientSession)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def build_app(prefills: Sequence[str], decodes: Sequence[str], timeout: float = 600.0) -> web.Application:
    next_prefill, next_decode = itertools.cycle(list(prefills)), itertools.cycle(list(decodes))
    client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)

    async def session_ctx(app: web.Application):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=client_timeout) as s:
            app[SESSION] = s
            yield

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session = request.app[SESSION]
        prefill, decode = next(next_prefill), next(next_decode)
        async with session.post(prefill + request.path, json=prefill_request(body)) as r:
            answer = await r.json(content_type=None)
            if r.status != 200:
                return web.json_response(answer, status=r.status)
        params = answer.get("kv_transfer_params")
        if params:
            body = {**body, "kv_transfer_params": params}
        else:
            log.warning("prefill %s returned no kv_transfer_params: decode computes the prompt itself", prefill)
        async with session.post(decode + request.path, json=body) as upstream:
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in HOP_HEADERS:
                    out.headers.add(name, value)
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application(client_max_size=512 * 1024**2)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    ap.add_argument("--prefill", action="append", required=True, metavar="URL", help="repeatable")
    ap.add_argument("--decode", action="append", required=True, metavar="URL", help="repeatable")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    web.run_app(build_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode],
                          args.timeout), host=args.host, port=args.port, handler_cancellation=True)


if __name__ == "__main__":
    main()
