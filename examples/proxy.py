#!/usr/bin/env python3
"""Disaggregated prefill/decode proxy for `SparseKVConnector` (push protocol; decode registers first).

For each `/v1/completions` or `/v1/chat/completions` POST the proxy makes a transfer id and its capability (a
128-bit `transfer_secret`, which only the two legs get: a peer that knows the id but not the secret cannot take the
transfer; README, Security) and sends, at the same time, the request to a prefill instance (as a 1-token, non-streamed request with `do_remote_decode`) and to a
decode instance (the original request with `do_remote_prefill` and the prefill instance's side-channel address).
The decode instance registers its blocks with the prefill instance's side channel, and prefill pushes the KV into
them layer by layer while it computes. The client gets the decode response, streamed through unchanged.

    python examples/proxy.py --port 8001 \
        --prefill http://P_HOST:8100,P_HOST:5600 --decode http://D_HOST:8200 [--prefill ...] [--decode ...]

Data parallel: a prefill started with `--data-parallel-size N` (vLLM's own load balancer behind one API server) is
N engines, each with its own side channel (DP rank r: side_channel_port + r * tp * pp). Decode must be told the
side channel before prefill runs, so the proxy picks the rank itself (the fewest requests in flight through it,
ties round-robin), sends the prefill leg to it with vLLM's `X-data-parallel-rank` header, and tells decode that
rank's side channel. Give the sizes after the side channel (tp and pp default to 1):

    python examples/proxy.py --prefill http://P_HOST:8100,P_HOST:5600,dp=2[,tp=1][,pp=1] --decode http://D_HOST:8200

Prefill's answer must confirm it kept the KV for decode on that rank (its kv_transfer_params name the rank and side
channel): an answer without them (a plain request: swapped URLs, an engine without the connector) or naming
another rank ends the decode leg at once, and the client gets a 502 naming the cause instead of waiting for KV
that no rank will send.

Before it listens, the proxy checks the deployment (up to --startup-wait s, default 300, for the engines to come
up; --no-startup-checks skips it) and refuses to start, naming the flag and the fix, when a side-channel address
answers HTTP (an engine's API port given as side channel), or when a 16-token PD request through each prefill DP
rank and to each decode does not move KV (prefill's answer must confirm the KV kept for that rank, and decode's
/metrics count it received, prefill's sent: swapped --prefill/--decode, wrong dp/tp/pp). The probe costs prefill one
INFO line per DP rank, which quotes the check (it sends a Reject, not a Hello: a probe, not a refused peer). With vLLM's
--api-key, the checks need the key in the router's VLLM_API_KEY.

Several instances of each kind: the prefill DP ranks of all instances are taken by fewest requests in flight
(ties round-robin), decodes round-robin. The default port, 8001, leaves 8000 to
examples/sequential_router.py, so both can run in front of the same engines. `build_app()` is the importable entry
(tests use it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import uuid
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

try:
    import aiohttp
    from aiohttp import web
except ImportError:  # the system python has no aiohttp; vLLM's environment always has it
    if __name__ != "__main__":
        raise
    raise SystemExit(f"{__file__} needs aiohttp: run it with the python of vLLM's environment (which has it), e.g. "
                     f".venv-cpu/bin/python {__file__} ..., or `pip install aiohttp`") from None

try:  # each transfer's capability is minted where the connector mints its own (128 random bits)
    from connector.protocol.auth import new_transfer_secret
except ImportError:
    if __name__ != "__main__":
        raise
    raise SystemExit(f"{__file__} mints transfer secrets with the connector's own function: run it with the python "
                     f"of an environment that has sparse-kv-connector installed (vLLM's, or the image's)") from None

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its helper, examples/proxy_ranks.py
from proxy_ranks import (DP_HEADER, MAX_ANSWER_BYTES, RECVS_OK, SENDS_OK, Prefill, RankPicker,  # noqa: E402
                         StartupError, check_kv_moved, check_side_channels, check_url, confirm_prefill, counter,
                         parse_prefill, read_capped, served_model, wait_healthy, warmup_body)

_check_url = check_url
log = logging.getLogger("sparse_kv_proxy")

# Response headers that describe the upstream hop, not the payload; aiohttp sets its own for the client hop.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
                         "date", "server"})


class LegError(Exception):
    """One leg failed before the client got anything; becomes a JSON error naming the leg."""

    def __init__(self, leg: str, upstream: str, status: int, detail: str) -> None:
        super().__init__(f"{leg} leg ({upstream}) failed: {detail}")
        self.leg, self.upstream, self.status = leg, upstream, status

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": str(self), "type": "upstream_error", "leg": self.leg,
                                            "upstream": self.upstream, "code": self.status}}, status=self.status)


SESSION = web.AppKey("session", aiohttp.ClientSession)


def prefill_body(body: dict[str, Any], transfer_id: str, secret: str) -> dict[str, Any]:
    """The prefill leg only has to compute the prompt's KV: one token, no streaming, and keep the blocks for decode."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}  # min_tokens > 1 is invalid
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id,
                                                               "transfer_secret": secret})
    if "max_completion_tokens" in out:  # chat: takes precedence over max_tokens in vLLM
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], transfer_id: str, side_channel: str, secret: str) -> dict[str, Any]:
    return {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id,
                                           "prefill_addr": side_channel, "transfer_secret": secret}}


def build_app(prefill_instances: Sequence[Prefill | str], decode_instances: Sequence[str],
              timeout: float = 600.0, startup_wait: float | None = None) -> web.Application:
    """The proxy app. Serve it with `handler_cancellation=True` (as `main` does): a client that disconnects then
    cancels the handler, and so both legs, instead of leaving vLLM computing for nobody. `startup_wait`: seconds
    the start-up checks (every side channel answers as one, one short PD request per prefill DP rank moves KV)
    may wait for the engines; None: no checks."""
    prefills = [p if isinstance(p, Prefill) else parse_prefill(p) for p in prefill_instances]
    decodes = [_check_url(d) for d in decode_instances]
    if not prefills or not decodes:
        raise ValueError("need at least one prefill and one decode instance")
    picker, next_decode = RankPicker(prefills), itertools.cycle(decodes)
    # The prefill leg must finish within `timeout`; the decode leg may stream for longer, but may not stay silent
    # (connect, or between two reads) for longer than `timeout`.
    prefill_timeout = aiohttp.ClientTimeout(total=timeout)
    decode_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        # Created on the serving loop and closed with the app.
        # limit=0: every in-flight request holds two upstream connections; aiohttp's default cap of 100 would
        # silently queue requests behind long decode streams.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            app[SESSION] = session
            if startup_wait is not None:
                await startup_checks(session, startup_wait)
            yield

    async def run_prefill(session: aiohttp.ClientSession, prefill: Prefill, dp_rank: int, path: str,
                          body: dict[str, Any], headers: dict[str, str]) -> None:
        """Returns once prefill answered 2xx AND its answer confirms it kept the KV for decode on `dp_rank`; else
        LegError, which ends the decode leg at once (a decode waiting for KV no rank will send fails fast)."""
        where = prefill.name(dp_rank)
        if prefill.dp > 1:
            headers = {**headers, DP_HEADER: str(dp_rank)}
        try:
            async with session.post(prefill.url + path, json=body, headers=headers, timeout=prefill_timeout) as r:
                raw = await read_capped(r.content, MAX_ANSWER_BYTES)
                if r.status >= 300:
                    text = raw[:2000].decode(errors="replace")
                    raise LegError("prefill", where, r.status, f"HTTP {r.status}: {text}")
        except asyncio.TimeoutError as exc:
            raise LegError("prefill", where, 504, f"no answer within {timeout:g} s") from exc
        except aiohttp.ClientError as exc:
            raise LegError("prefill", where, 502, f"{type(exc).__name__}: {exc}") from exc
        problem = confirm_prefill(prefill, dp_rank, r.status, raw)
        if problem:
            raise LegError("prefill", where, 502, f"no prefill rank will send decode this request's KV: {problem}")

    async def open_decode(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any],
                          headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Returns once the response headers are in; the body is read later, after prefill succeeded."""
        try:
            return await session.post(url + path, json=body, headers=headers, timeout=decode_timeout)
        except asyncio.TimeoutError as exc:
            raise LegError("decode", url, 504, f"no answer within {timeout:g} s") from exc
        except aiohttp.ClientError as exc:
            raise LegError("decode", url, 502, f"{type(exc).__name__}: {exc}") from exc

    async def both_legs(session: aiohttp.ClientSession, slot: int, decode: str, path: str, body: dict[str, Any],
                        headers: dict[str, str], use: Callable[[aiohttp.ClientResponse], Any]) -> Any:
        """Sends both legs, and once prefill confirmed (and decode answered), returns `use(decode's response)`."""
        prefill, dp_rank = picker.slots[slot]
        transfer_id, secret = uuid.uuid4().hex, new_transfer_secret()  # the secret is never logged
        log.info("%s %s: prefill %s, decode %s", transfer_id, path, prefill.name(dp_rank), decode)
        # Both legs at once: decode registers its blocks while prefill computes, so layers are pushed as they finish.
        p_task = asyncio.create_task(run_prefill(session, prefill, dp_rank, path,
                                                 prefill_body(body, transfer_id, secret), headers))
        d_task = asyncio.create_task(open_decode(session, decode, path, decode_body(
            body, transfer_id, prefill.side_channel(dp_rank), secret), headers))
        upstream: aiohttp.ClientResponse | None = None
        try:
            # Nothing goes to the client until prefill succeeded, so a prefill failure can still be a clean JSON
            # error. That costs next to no latency: decode cannot produce a token before prefill's KV has arrived.
            pending: set[asyncio.Task[Any]] = {p_task, d_task}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    result = task.result()  # raises LegError
                    if task is d_task:
                        upstream = result
                        if upstream.status >= 300:  # decode refused: nobody will take the KV, stop prefill
                            p_task.cancel()
                            pending.discard(p_task)
            assert upstream is not None
            return await use(upstream)
        except LegError as exc:
            log.warning("%s: %s", transfer_id, exc)
            raise
        finally:
            picker.give_back(slot)
            # Closing a connection mid-request is what makes vLLM abort that request (and so the transfer).
            p_task.cancel()
            d_task.cancel()
            if p_task.done() and not p_task.cancelled():
                p_task.exception()  # retrieved, so asyncio does not warn about an error we chose not to report
            if upstream is None and d_task.done() and not d_task.cancelled() and d_task.exception() is None:
                upstream = d_task.result()  # decode answered in the same instant prefill failed
            if upstream is not None:
                upstream.close()  # no-op once fully read; otherwise drops the connection rather than reusing it

    async def generate(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body must be a JSON object", "type": "invalid_request"}},
                                     status=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}  # vLLM --api-key
        try:
            return await both_legs(request.app[SESSION], picker.take(), next(next_decode), request.path, body,
                                   headers, lambda upstream: relay(request, upstream))
        except LegError as exc:
            return exc.response()

    async def startup_checks(session: aiohttp.ClientSession, wait_s: float) -> None:
        """Before any request: an HTTP port given as a side channel, engines not up, swapped --prefill/--decode
        URLs, a DP rank the engine does not have or whose side channel is elsewhere: StartupError naming the flag.
        One 16-token PD request per prefill DP rank and per decode (in turn) proves the path and warms it. With
        vLLM's --api-key, give the router its key in VLLM_API_KEY (as vLLM reads it)."""
        deadline = asyncio.get_running_loop().time() + wait_s
        await check_side_channels(prefills, deadline)
        await wait_healthy(session, [p.url for p in prefills] + decodes, deadline)
        key = os.environ.get("VLLM_API_KEY")
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        for i in range(max(len(picker.slots), len(decodes))):
            slot, decode = i % len(picker.slots), decodes[i % len(decodes)]
            prefill, dp_rank = picker.slots[slot]
            before = (await counter(session, prefill.url, SENDS_OK), await counter(session, decode, RECVS_OK))
            picker.in_flight[slot] += 1  # (both_legs gives it back)

            async def read(upstream: aiohttp.ClientResponse) -> tuple[int, bytes]:
                return upstream.status, await read_capped(upstream.content, MAX_ANSWER_BYTES)
            try:
                status, raw = await both_legs(session, slot, decode, "/v1/completions",
                                              warmup_body(await served_model(session, prefill.url, timeout, auth)),
                                              auth, read)
            except LegError as exc:
                raise StartupError(f"--prefill {prefill.spec or prefill.url} --decode {decode}: a 16-token check "
                                   f"request failed: {exc}") from None
            if status != 200:
                raise StartupError(f"--decode {decode}: a 16-token check request through {prefill.name(dp_rank)} "
                                   f"got HTTP {status}: {raw[:1000].decode(errors='replace')}")
            await check_kv_moved(session, prefill, dp_rank, decode, before)
            log.info("start-up check: %s -> %s ok", prefill.name(dp_rank), decode)

    async def relay(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        """Decode's status, headers and bytes as they come (SSE chunks keep their order and timing)."""
        out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in upstream.headers.items():
            if name.lower() not in HOP_HEADERS:
                out.headers.add(name, value)
        await out.prepare(request)
        async for chunk in upstream.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        """200 when every upstream's /health answers 200 within 5 s, else 503; the body says which."""
        session = request.app[SESSION]
        urls = [p.url for p in prefills] + decodes

        async def check(url: str) -> str:
            try:
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return "ok" if r.status == 200 else f"HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return f"{type(exc).__name__}: {exc}".rstrip(": ")

        results = dict(zip(urls, await asyncio.gather(*(check(u) for u in urls))))
        ok = all(v == "ok" for v in results.values())
        return web.json_response({"status": "ok" if ok else "degraded", "upstreams": results},
                                 status=200 if ok else 503)

    async def models(request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            async with request.app[SESSION].get(decodes[0] + "/v1/models", headers=headers,
                                                timeout=prefill_timeout) as r:
                return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return LegError("models", decodes[0], 502, f"{type(exc).__name__}: {exc}").response()

    # Long prompts (and base64 images in chat) easily exceed aiohttp's default 1 MiB request body limit.
    app = web.Application(client_max_size=512 * 1024**2)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse prints an ArgumentTypeError's own text (a plain ValueError becomes 'invalid <fn> value')."""
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return wrapped


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    ap.add_argument("--port", type=int, default=8001, help="port to listen on (default %(default)s)")
    ap.add_argument("--prefill", action="append", required=True, type=_arg(parse_prefill),
                    metavar="URL,SIDE_HOST:PORT[,dp=N][,tp=N][,pp=N]",
                    help="prefill instance: OpenAI server URL, DP rank 0's side-channel address, and its data-, "
                         "tensor- and pipeline-parallel sizes (default 1); repeatable")
    ap.add_argument("--decode", action="append", required=True, type=_arg(_check_url), metavar="URL",
                    help="decode instance: OpenAI server URL; repeatable")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds: prefill must answer within it; decode may not stay silent longer (default 600)")
    ap.add_argument("--startup-wait", type=float, default=300.0,
                    help="seconds the start-up checks wait for the engines to come up (default %(default)s)")
    ap.add_argument("--no-startup-checks", action="store_true",
                    help="skip the start-up checks (side channels, roles, one PD request per prefill DP rank)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args.prefill, args.decode, args.timeout, None if args.no_startup_checks else args.startup_wait)
    try:
        web.run_app(app, host=args.host, port=args.port, handler_cancellation=True)
    except StartupError as exc:
        raise SystemExit(f"examples/proxy.py: refusing to start: {exc}") from None


if __name__ == "__main__":
    main()
