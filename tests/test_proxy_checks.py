"""examples/proxy.py with data-parallel prefills, and the mistakes it refuses before any request (issue 34): an HTTP
port given as a side channel, swapped --prefill/--decode URLs, a decode left waiting for KV no rank will send.
Real sockets: aiohttp servers standing in for the engines' HTTP servers, and the connector's own side-channel server
(ControlServer and its handshake) where a side channel must answer."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from connector.protocol.messages import Hello
from connector.transport.control import ControlServer
from connector.transport.ports import free_ports
from tests.helpers import log_records, prefill_side_channel
from tests.test_proxy import proxy

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]
ranks = sys.modules["proxy_ranks"]  # examples/proxy_ranks.py, as examples/proxy.py imported it


@pytest.fixture
def side_channel():
    """A real prefill side channel (the connector's ControlServer) on 127.0.0.1: (port, peers that registered)."""
    with prefill_side_channel("t" * 32, "proxy-side-channel") as got:
        yield got


class Engine:
    """An aiohttp server standing in for vLLM's OpenAI server. `answer(body, headers)` -> (status, JSON) of a
    completion; `hang` makes it never answer (a decode waiting for KV)."""

    def __init__(self, answer=None, hang: bool = False, counts: bool = False) -> None:
        self.answer, self.hang, self.counts = answer, hang, counts
        """`counts`: its /metrics count each request with do_remote_prefill as KV received and each with
        do_remote_decode as KV sent, as working engines' do (what the router reads; the real-engine test,
        tests/real_engine/test_real_dp_router.py, has real ones)."""
        self.seen: list[tuple[dict[str, Any], dict[str, str]]] = []
        self.cancelled = asyncio.Event()

    def app(self) -> web.Application:
        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            self.seen.append((body, dict(request.headers)))
            try:
                if self.hang:
                    await asyncio.sleep(60)
                status, data = self.answer(body, request.headers)
                return web.json_response(data, status=status)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise

        async def health(_request: web.Request) -> web.Response:
            return web.Response(text="")

        async def models(_request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

        async def metrics(_request: web.Request) -> web.Response:
            def n(flag: str) -> int:
                return sum(1 for body, _ in self.seen if (body.get("kv_transfer_params") or {}).get(flag)) \
                    if self.counts else 0
            return web.Response(text=f'vllm:sparse_kv_recvs_ok_total{{engine="0"}} {n("do_remote_prefill")}.0\n'
                                     f'vllm:sparse_kv_sends_ok_total{{engine="0"}} {n("do_remote_decode")}.0\n')

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        return app


def prefill_answer(side_port: int, ranks_per_dp: int = 1):
    """What a SparseKVConnector prefill answers: kv_transfer_params naming the DP rank it ran on."""
    def answer(body: dict[str, Any], headers) -> tuple[int, dict[str, Any]]:
        rank = int(headers.get("X-data-parallel-rank", "0"))
        return 200, {"choices": [{"text": "x"}], "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": body["kv_transfer_params"]["transfer_id"],
            "prefill_addr": f"127.0.0.1:{side_port + rank * ranks_per_dp}", "prefill_dp_rank": rank}}
    return answer


def plain_answer(body: dict[str, Any], headers) -> tuple[int, dict[str, Any]]:
    """What a decode (or an engine without the connector) answers a prefill leg: no kv_transfer_params."""
    return 200, {"choices": [{"text": "hello"}], "kv_transfer_params": None}


@pytest.fixture
async def serve():
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.2)
        runners.append(runner)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for r in reversed(runners):
        await r.cleanup()


def test_parse_prefill_with_data_parallel_sizes() -> None:
    p = proxy.parse_prefill("http://h:8100,h:5600,dp=2,tp=2,pp=2")
    assert (p.dp, p.ranks_per_dp, [p.side_channel(r) for r in range(2)]) == (2, 4, ["h:5600", "h:5604"])
    assert proxy.parse_prefill("http://h:8100,h:5600").side_channel(0) == "h:5600"
    for bad, needle in (("http://h:8100,h:5600,dp=0", "'dp=0' is not dp=N"), ("http://h:8100,h:5600,ep=2", "ep=2"),
                        ("http://h:8100,h:65535,dp=2", "do not fit above port 65535"),
                        ("http://h:8100", "URL,SIDE_HOST:SIDE_PORT")):
        with pytest.raises(ValueError, match=needle):
            proxy.parse_prefill(bad)


async def test_the_probe_tells_a_side_channel_from_an_http_port(side_channel, serve) -> None:
    port, registered = side_channel
    with log_records("connector.transport.control") as records:
        assert await ranks.probe_side_channel("127.0.0.1", port, 5) == "side channel"
        for _ in range(50):  # (the server logs from its own thread)
            if records:
                break
            await asyncio.sleep(0.05)
    # prefill's one line names who asked: an operator reading it knows it was the router's check
    lines = [(r.levelname, r.getMessage()) for r in records]
    assert any(level == "INFO" and "first frame is Reject, expected Hello (a probe): the peer says examples/proxy.py "
               "start-up check: is this a side channel?" in line for level, line in lines), lines  # happy path: no WARNING
    http = await serve(Engine(plain_answer).app())
    assert await ranks.probe_side_channel("127.0.0.1", int(http.rsplit(":", 1)[1]), 5) == "http"
    assert (await ranks.probe_side_channel("127.0.0.1", free_ports(), 2)).startswith("unreachable")
    assert registered == []  # the probe never got past the opening


def test_the_router_refuses_an_http_port_as_side_channel_at_start(tmp_path) -> None:
    # examples/proxy.py as a user runs it, against a real HTTP server given where the side channel belongs
    http_port = free_ports()
    http = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(http_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and ranks_probe(http_port) != "http":
            time.sleep(0.1)
        started = time.monotonic()
        out = subprocess.run([sys.executable, str(ROOT / "examples" / "proxy.py"), "--port", str(free_ports()),
                              "--prefill", f"http://127.0.0.1:{http_port},127.0.0.1:{http_port}",
                              "--decode", f"http://127.0.0.1:{http_port}", "--startup-wait", "5"],
                             capture_output=True, text=True, timeout=40)
    finally:
        http.terminate()
        http.wait(10)
    assert out.returncode != 0
    assert f"refusing to start: --prefill http://127.0.0.1:{http_port},127.0.0.1:{http_port}: 127.0.0.1:{http_port} " \
           f"(side channel of http://127.0.0.1:{http_port}) answers HTTP" in out.stderr, out.stderr
    assert "--prefill http://127.0.0.1:" in out.stderr and "HOST:SIDE_CHANNEL_PORT" in out.stderr
    assert time.monotonic() - started < 20  # refused at once, not after --startup-wait


def ranks_probe(port: int) -> str:
    return asyncio.run(ranks.probe_side_channel("127.0.0.1", port, 2))


async def test_swapped_urls_are_refused_at_start(side_channel, serve) -> None:
    # --prefill names decode's URL (it answers the prefill leg as a plain request), --decode names prefill's
    port, _ = side_channel
    decode_url = await serve(Engine(plain_answer).app())
    prefill_url = await serve(Engine(prefill_answer(port)).app())
    app = proxy.build_app([f"{decode_url},127.0.0.1:{port}"], [prefill_url], timeout=10, startup_wait=5)
    runner = web.AppRunner(app)
    with pytest.raises(ranks.StartupError) as err:
        await runner.setup()
    await runner.cleanup()
    msg = str(err.value)
    assert f"--prefill {decode_url},127.0.0.1:{port} --decode {prefill_url}: a 16-token check request failed" in msg
    assert "answered without kv_transfer_params" in msg and "--prefill and --decode swapped?" in msg, msg


async def test_start_up_checks_pass_on_a_right_configuration(side_channel, serve) -> None:
    port, registered = side_channel
    prefill = Engine(prefill_answer(port), counts=True)
    decodes = [Engine(lambda body, headers: (200, {"choices": [{"text": "ok"}]}), counts=True) for _ in range(2)]
    p_url, d_urls = await serve(prefill.app()), [await serve(d.app()) for d in decodes]
    runner = web.AppRunner(proxy.build_app([f"{p_url},127.0.0.1:{port}"], d_urls, timeout=10, startup_wait=5))
    await runner.setup()  # raises StartupError on a finding
    await runner.cleanup()
    # one check request per decode (and per prefill DP rank), both legs each
    assert len(prefill.seen) == 2 and [len(d.seen) for d in decodes] == [1, 1]
    assert all(d.seen[0][0]["kv_transfer_params"]["prefill_addr"] == f"127.0.0.1:{port}" for d in decodes)
    assert registered == []


async def test_a_decode_url_that_loads_no_kv_is_refused_at_start(side_channel, serve, monkeypatch) -> None:
    # --decode names another prefill: it answers the decode leg by computing the prompt itself (a role mismatch)
    monkeypatch.setattr(ranks, "KV_ARRIVAL_S", 1.0)
    port, _ = side_channel
    p_url = await serve(Engine(prefill_answer(port), counts=True).app())
    other_prefill = await serve(Engine(lambda body, headers: (200, {"choices": [{"text": "ok"}]})).app())
    runner = web.AppRunner(proxy.build_app([f"{p_url},127.0.0.1:{port}"], [other_prefill], timeout=10,
                                           startup_wait=5))
    with pytest.raises(ranks.StartupError) as err:
        await runner.setup()
    await runner.cleanup()
    msg = str(err.value)
    assert f"--decode {other_prefill}: a 16-token check request through {p_url} did not load KV" in msg, msg
    assert "stayed at 0 for 1 s after the request, so it computed the prompt itself" in msg, msg
    assert "--prefill and --decode swapped?" in msg, msg


async def test_each_request_pins_a_dp_rank_and_decode_gets_its_side_channel(serve) -> None:
    prefill = Engine(prefill_answer(5600, ranks_per_dp=2))
    decode = Engine(lambda body, headers: (200, {"choices": [{"text": "ok"}]}))
    p_url, d_url = await serve(prefill.app()), await serve(decode.app())
    url = await serve(proxy.build_app([f"{p_url},127.0.0.1:5600,dp=2,tp=2"], [d_url], timeout=10))
    async with aiohttp.ClientSession() as client:
        for _ in range(4):  # one at a time: the least-loaded ranks tie, so they take turns
            async with client.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
    ranks_seen = []
    for (p_body, p_headers), (d_body, _) in zip(prefill.seen, decode.seen, strict=True):
        rank = int(p_headers["X-data-parallel-rank"])
        ranks_seen.append(rank)
        assert d_body["kv_transfer_params"]["prefill_addr"] == f"127.0.0.1:{5600 + 2 * rank}"
        assert d_body["kv_transfer_params"]["transfer_id"] == p_body["kv_transfer_params"]["transfer_id"]
    assert ranks_seen == [0, 1, 0, 1]


def test_least_loaded_rank_first() -> None:
    picker = ranks.RankPicker([proxy.parse_prefill("http://h:1,h:5600,dp=3")])
    a, b = picker.take(), picker.take()
    picker.give_back(a)
    assert (a, b, picker.take(), picker.take()) == (0, 1, 2, 0)  # rank 0 is free again before rank 1


@pytest.mark.parametrize("case", ["plain", "wrong_rank", "wrong_port"])
async def test_a_decode_waiting_for_kv_no_rank_sends_fails_fast_naming_why(serve, case) -> None:
    def answer(body, headers):
        if case == "plain":
            return plain_answer(body, headers)
        status, data = prefill_answer(5600)(body, headers)
        if case == "wrong_rank":  # vLLM's balancer chose: the header was dropped on the way
            data["kv_transfer_params"]["prefill_dp_rank"] = 1 - int(headers.get("X-data-parallel-rank", "0"))
        else:  # the router's dp/tp/pp do not match prefill's
            data["kv_transfer_params"]["prefill_addr"] = "127.0.0.1:5700"
        return status, data
    decode = Engine(hang=True)
    p_url, d_url = await serve(Engine(answer).app()), await serve(decode.app())
    url = await serve(proxy.build_app([proxy.Prefill(p_url, "127.0.0.1:5600", dp=2)], [d_url], timeout=30))
    started = time.monotonic()
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}) as r:
            status, got = r.status, await r.json()
    assert time.monotonic() - started < 5  # not the decode leg's 30 s
    assert status == 502 and got["error"]["leg"] == "prefill", got
    msg = got["error"]["message"]
    assert "no prefill rank will send decode this request's KV" in msg, msg
    assert {"plain": "answered without kv_transfer_params", "wrong_rank": "ignored the X-data-parallel-rank header",
            "wrong_port": "give --prefill the side_channel_port of DP rank 0"}[case] in msg, msg
    await asyncio.wait_for(decode.cancelled.wait(), 5)  # the decode leg was ended, so vLLM aborts it
