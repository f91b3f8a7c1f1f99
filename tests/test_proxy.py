"""examples/proxy.py against fake prefill/decode aiohttp servers, all in-process on 127.0.0.1.

The fakes enforce the protocol: each leg waits (bounded) until the other leg has arrived, so a proxy that sent the
legs one after the other fails these tests instead of passing slowly."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

_spec = importlib.util.spec_from_file_location("sparse_kv_proxy",
                                               Path(__file__).resolve().parents[1] / "examples" / "proxy.py")
assert _spec is not None and _spec.loader is not None
proxy = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = proxy
_spec.loader.exec_module(proxy)

pytestmark = pytest.mark.timeout(30)

LEG_WAIT_S = 2.0
SSE_CHUNKS = [b'data: {"choices":[{"text":"%d"}]}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]


class Fakes:
    """Fake vLLM servers and what they saw. `prefill_mode`: ok | fail | hang; `decode_mode`: ok | hang | reject."""

    def __init__(self) -> None:
        self.prefill_mode = "ok"
        self.decode_mode = "ok"
        self.seen: dict[str, list[dict[str, Any]]] = defaultdict(list)  # server name -> request bodies, in order
        self.arrived: dict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)  # (leg, transfer id)
        self.times: dict[tuple[str, str], float] = {}  # (event, transfer id) -> monotonic time
        self.cancelled: set[tuple[str, str]] = set()  # (server name, transfer id)
        self.changed = asyncio.Event()
        self.sse_gate = asyncio.Event()  # the streaming decode sends its first chunk, then waits for this

    async def _arrive(self, leg: str, name: str, request: web.Request) -> tuple[dict[str, Any], str]:
        body = await request.json()
        tid = body["kv_transfer_params"]["transfer_id"]
        self.seen[name].append(body)
        self.times[(leg, tid)] = time.monotonic()
        self.arrived[(leg, tid)].set()
        return body, tid

    def _cancel(self, name: str, tid: str) -> None:
        self.cancelled.add((name, tid))
        self.changed.set()

    async def wait_cancelled(self, *keys: tuple[str, str]) -> None:
        async def all_there() -> None:
            while not set(keys) <= self.cancelled:
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(all_there(), 3)

    def prefill_app(self, name: str) -> web.Application:
        async def handler(request: web.Request) -> web.Response:
            body, tid = await self._arrive("prefill", name, request)
            try:
                try:  # "computing": the decode leg must show up meanwhile
                    await asyncio.wait_for(self.arrived[("decode", tid)].wait(), LEG_WAIT_S)
                except asyncio.TimeoutError:
                    return web.json_response({"error": "decode leg never arrived"}, status=500)
                if self.prefill_mode == "hang":
                    await asyncio.sleep(60)
                if self.prefill_mode == "fail":
                    return web.json_response({"error": {"message": "CUDA out of memory"}}, status=500)
                self.times[("prefill_done", tid)] = time.monotonic()
                return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {"transfer_id": tid}})
            except asyncio.CancelledError:
                self._cancel(name, tid)
                raise

        return _app(handler, name)

    def decode_app(self, name: str) -> web.Application:
        async def handler(request: web.Request) -> web.StreamResponse:
            body, tid = await self._arrive("decode", name, request)
            try:
                if self.decode_mode == "reject":
                    return web.json_response({"error": {"message": "prompt too long"}}, status=400)
                await asyncio.wait_for(self.arrived[("prefill", tid)].wait(), LEG_WAIT_S)
                if self.decode_mode == "hang":
                    await asyncio.sleep(60)
                if not body.get("stream"):
                    return web.json_response({"choices": [{"text": f"hello from {name}"}]}, status=200)
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(SSE_CHUNKS[0])
                await asyncio.wait_for(self.sse_gate.wait(), LEG_WAIT_S)  # proves the proxy does not buffer
                for chunk in SSE_CHUNKS[1:]:
                    await resp.write(chunk)
                    await asyncio.sleep(0.01)
                await resp.write_eof()
                return resp
            except asyncio.CancelledError:
                self._cancel(name, tid)
                raise

        return _app(handler, name)


def _app(handler: Callable[[web.Request], Awaitable[web.StreamResponse]], name: str) -> web.Application:
    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "owned_by": name}]})

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


class Cluster:
    def __init__(self, fakes: Fakes, url: str, prefills: list[Any], decodes: list[str],
                 client: aiohttp.ClientSession) -> None:
        self.fakes, self.url, self.prefills, self.decodes, self.client = fakes, url, prefills, decodes, client

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.client.post(self.url + path, json=body) as r:
            return r.status, await r.json()


@pytest.fixture
async def cluster() -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    runners: list[web.AppRunner] = []
    clients: list[aiohttp.ClientSession] = []

    async def start(app: web.Application) -> str:
        # handler_cancellation: a handler is cancelled when its client goes away (as vLLM's server aborts).
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.2)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def make(n_prefill: int = 1, n_decode: int = 1, timeout: float = 10.0,
                   prefill_urls: list[str] | None = None) -> Cluster:
        fakes = Fakes()
        urls = prefill_urls or [await start(fakes.prefill_app(f"p{i}")) for i in range(n_prefill)]
        prefills = [proxy.Prefill(u, f"10.0.0.{i + 1}:{5600 + i}") for i, u in enumerate(urls)]
        decodes = [await start(fakes.decode_app(f"d{i}")) for i in range(n_decode)]
        url = await start(proxy.build_app(prefills, decodes, timeout))
        clients.append(aiohttp.ClientSession())
        return Cluster(fakes, url, prefills, decodes, clients[-1])

    yield make
    for c in clients:
        await c.close()
    for r in reversed(runners):
        await r.cleanup()


def _only(fakes: Fakes, name: str) -> dict[str, Any]:
    assert len(fakes.seen[name]) == 1, fakes.seen
    return fakes.seen[name][0]


async def test_completions_both_legs_same_transfer_id_overlapping(cluster) -> None:
    c = await cluster()
    request = {"model": "m", "prompt": "hi", "max_tokens": 50, "min_tokens": 5, "temperature": 0.0}
    status, body = await c.post("/v1/completions", request)
    assert status == 200 and body == {"choices": [{"text": "hello from d0"}]}

    p, d = _only(c.fakes, "p0"), _only(c.fakes, "d0")
    tid, secret = p["kv_transfer_params"]["transfer_id"], p["kv_transfer_params"]["transfer_secret"]
    assert len(tid) == 32 and int(tid, 16) >= 0  # uuid4 hex
    assert len(secret) == 22  # 128 random bits, URL-safe: the transfer's capability, to both legs only
    assert p == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0.0,
                 "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid, "transfer_secret": secret}}
    assert d == {**request, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": tid,
                                                   "prefill_addr": "10.0.0.1:5600", "transfer_secret": secret}}
    # Decode was there while prefill was still computing (push: decode registers first).
    assert c.fakes.times[("decode", tid)] < c.fakes.times[("prefill_done", tid)]


async def test_chat_streaming_sse_passes_through_in_order(cluster) -> None:
    c = await cluster()
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
               "stream_options": {"include_usage": True}, "max_completion_tokens": 64}
    async with c.client.post(c.url + "/v1/chat/completions", json=request) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), LEG_WAIT_S)  # before decode sent the rest
        assert first == SSE_CHUNKS[0]
        c.fakes.sse_gate.set()
        rest = await r.content.read()
    assert first + rest == b"".join(SSE_CHUNKS)

    p, d = _only(c.fakes, "p0"), _only(c.fakes, "d0")
    tid, secret = d["kv_transfer_params"]["transfer_id"], d["kv_transfer_params"]["transfer_secret"]
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid, "transfer_secret": secret}
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and p["messages"] == request["messages"]
    assert d == {**request, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": tid,
                                                   "prefill_addr": "10.0.0.1:5600", "transfer_secret": secret}}


async def test_prefill_failure_cancels_decode_and_names_the_leg(cluster) -> None:
    c = await cluster()
    c.fakes.prefill_mode, c.fakes.decode_mode = "fail", "hang"
    status, body = await c.post("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
    assert status == 500
    assert body["error"]["leg"] == "prefill" and body["error"]["upstream"] == c.prefills[0].url
    assert "prefill leg" in body["error"]["message"] and "CUDA out of memory" in body["error"]["message"]
    tid = _only(c.fakes, "d0")["kv_transfer_params"]["transfer_id"]
    await c.fakes.wait_cancelled(("d0", tid))


async def test_prefill_unreachable_is_502_and_decode_cancelled(cluster) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    c = await cluster(prefill_urls=[dead])
    c.fakes.decode_mode = "hang"
    status, body = await c.post("/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 502 and body["error"]["leg"] == "prefill" and body["error"]["upstream"] == dead
    # The refusal is instant, so the decode leg may be cancelled before the fake even read it; if it did, it is gone.
    await asyncio.sleep(0.2)
    for d in c.fakes.seen["d0"]:
        await c.fakes.wait_cancelled(("d0", d["kv_transfer_params"]["transfer_id"]))


async def test_prefill_timeout_is_504_and_decode_cancelled(cluster) -> None:
    c = await cluster(timeout=0.5)
    c.fakes.prefill_mode = "hang"  # decode streams its headers and first chunk, then waits: it is not silent
    status, body = await c.post("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
    assert status == 504 and body["error"]["leg"] == "prefill"
    tid = _only(c.fakes, "d0")["kv_transfer_params"]["transfer_id"]
    await c.fakes.wait_cancelled(("d0", tid), ("p0", tid))


async def test_decode_rejection_passes_through_and_cancels_prefill(cluster) -> None:
    c = await cluster()
    c.fakes.prefill_mode, c.fakes.decode_mode = "hang", "reject"
    status, body = await c.post("/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 400 and body == {"error": {"message": "prompt too long"}}
    tid = _only(c.fakes, "p0")["kv_transfer_params"]["transfer_id"]
    await c.fakes.wait_cancelled(("p0", tid))


async def test_client_disconnect_cancels_both_legs(cluster) -> None:
    c = await cluster()
    c.fakes.prefill_mode = c.fakes.decode_mode = "hang"
    with pytest.raises(asyncio.TimeoutError):
        await c.client.post(c.url + "/v1/completions", json={"model": "m", "prompt": "hi"},
                            timeout=aiohttp.ClientTimeout(total=0.5))
    tid = _only(c.fakes, "p0")["kv_transfer_params"]["transfer_id"]
    await c.fakes.wait_cancelled(("p0", tid), ("d0", tid))


async def test_round_robin_and_prefill_addr_follows_the_chosen_prefill(cluster) -> None:
    c = await cluster(n_prefill=2, n_decode=2)
    for i in range(4):
        status, body = await c.post("/v1/completions", {"model": "m", "prompt": f"q{i}"})
        assert status == 200 and body["choices"][0]["text"] == f"hello from d{i % 2}"
    for name in ("p0", "p1", "d0", "d1"):
        assert len(c.fakes.seen[name]) == 2
    side = {p["kv_transfer_params"]["transfer_id"]: c.prefills[i].side_channel_addr
            for i in (0, 1) for p in c.fakes.seen[f"p{i}"]}
    decoded = [d for name in ("d0", "d1") for d in c.fakes.seen[name]]
    assert {d["kv_transfer_params"]["transfer_id"] for d in decoded} == set(side)  # one transfer id per request
    for d in decoded:
        assert d["kv_transfer_params"]["prefill_addr"] == side[d["kv_transfer_params"]["transfer_id"]]


async def test_health_models_and_bad_body(cluster) -> None:
    c = await cluster(n_decode=2)
    async with c.client.get(c.url + "/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    async with c.client.get(c.url + "/v1/models") as r:
        assert r.status == 200 and (await r.json())["data"][0]["owned_by"] == "d0"
    async with c.client.post(c.url + "/v1/completions", data=b"[1, 2") as r:
        assert r.status == 400
    async with c.client.post(c.url + "/v1/completions", data=json.dumps([1, 2])) as r:
        assert r.status == 400


async def test_health_degraded_when_an_upstream_is_down(cluster) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    c = await cluster(prefill_urls=[dead])
    async with c.client.get(c.url + "/health") as r:
        body = await r.json()
    assert r.status == 503 and body["status"] == "degraded" and body["upstreams"][dead] != "ok"
    assert body["upstreams"][c.decodes[0]] == "ok"


def test_cli_parsing() -> None:
    assert proxy.parse_prefill("http://h:8100,h:5600") == proxy.Prefill("http://h:8100", "h:5600")
    assert proxy.parse_prefill("http://[::1]:8100/,[::1]:5600") == proxy.Prefill("http://[::1]:8100", "[::1]:5600")
    for bad in ("http://h:8100", "http://h:8100,h", "h:8100,h:5600", "http://h:8100,h:port", "http://h:8100,h:70000"):
        with pytest.raises(ValueError):
            proxy.parse_prefill(bad)
    with pytest.raises(ValueError):
        proxy.build_app([], ["http://d:8200"])
