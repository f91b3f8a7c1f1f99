"""`doctor` against running engines' processes, before any request: an HTTP port given as the side channel, swapped
--prefill-url/--decode-url, the engines' own UCX environment (not doctor's shell), and one line for a range of
side-channel ports that fail alike. The engines here are real processes on loopback: an aiohttp server answering
/health and, for prefill, a child process listening on the side-channel port, as vLLM's engine core does below its
API server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from connector.transport.ports import free_ports
from tests.test_doctor import TOKEN, config, doctor, failures

ENGINE = r'''
import subprocess, sys
port, side = int(sys.argv[1]), int(sys.argv[2])
if side:  # the "engine core": a child that listens on the side-channel port
    child = subprocess.Popen([sys.executable, "-c", "import socket, sys, time\n"
                              "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
                              "print('listening', flush=True); time.sleep(300)", str(side)], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "listening"

from aiohttp import web  # (answers a side-channel Hello with HTTP 400 at once, as vLLM's uvicorn does)

async def ok(request):
    return web.json_response({})

app = web.Application()
app.router.add_get("/health", ok)
app.router.add_get("/metrics", ok)
app.router.add_get("/v1/models", ok)
web.run_app(app, host="127.0.0.1", port=port, print=lambda *_: print("ready", flush=True))
'''


class Engine:
    """A process group serving HTTP on `port` (and a child listening on `side_port` when given)."""

    def __init__(self, port: int, side_port: int = 0, env: dict | None = None) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(port), str(side_port)],
                                     stdout=subprocess.PIPE, text=True, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        try:
            line = self.proc.stdout.readline()  # (the process prints "ready" or dies: readline returns)
            assert line.strip() == "ready", f"engine stand-in on {port} did not start: {line!r}"
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def engines():
    started = []

    def start(*args, **kwargs) -> Engine:
        started.append(Engine(*args, **kwargs))
        return started[-1]

    yield start
    for engine in started:
        engine.stop()


def run(side_port: int, *more: str, env: dict | None = None):
    return doctor("--prefill", config("kv_producer", side_channel_host="127.0.0.1", side_channel_port=side_port,
                                      auth_token=TOKEN),
                  "--decode", config("kv_consumer", auth_token=TOKEN), "--timeout", "1", *more, env=env)


def test_prefill_http_port_given_as_the_side_channel(engines):
    side = free_ports()
    prefill = engines(free_ports(), side)
    fails = failures(run(side, "--prefill-url", prefill.url, "--side-channel", f"127.0.0.1:{prefill.port}"))
    assert any(f"--side-channel: 127.0.0.1:{prefill.port} is prefill's HTTP server ({prefill.url}), not a side "
               f"channel" in f and f"prefill's side channel is side_channel_port {side}" in f for f in fails), fails
    # Without the URL, the probe finds the HTTP server by its answer.
    fails = failures(run(side, "--side-channel", f"127.0.0.1:{prefill.port}"))
    assert any(f"--side-channel: 127.0.0.1:{prefill.port} is an HTTP server" in f for f in fails), fails


def test_swapped_engine_urls_and_the_engines_own_ucx_environment(engines):
    side = free_ports()
    prefill = engines(free_ports(), side, env={"UCX_NET_DEVICES": "eth7", "UCX_TLS": "tcp"})
    decode = engines(free_ports(), env={"UCX_NET_DEVICES": "eth8"})
    out = run(side, "--prefill-url", decode.url, "--decode-url", prefill.url, env={"UCX_NET_DEVICES": "lo"})
    fails = failures(out)
    assert any(f"engine URLs: swapped: prefill's side channel (port {side}) listens in the engine behind "
               f"--decode-url {prefill.url}" in f for f in fails), fails
    # doctor's own shell says lo; each engine's process says what it runs with.
    assert f"UCX_NET_DEVICES: eth7 (prefill engine" not in out.stdout  # (--prefill-url was decode's)
    assert f"UCX_NET_DEVICES: eth7 (decode engine: the environment of pid {prefill.proc.pid}" in out.stdout
    assert f"UCX_NET_DEVICES: eth8 (prefill engine: the environment of pid {decode.proc.pid}" in out.stdout
    assert "(this shell" not in out.stdout, out.stdout
    out = run(side, "--prefill-url", prefill.url, "--decode-url", decode.url)
    assert f"ok    engine URLs: prefill's side channel (port {side}) listens in the engine behind --prefill-url " \
           f"{prefill.url}" in out.stdout, out.stdout


def test_the_same_url_twice(engines):
    side = free_ports()
    prefill = engines(free_ports(), side)
    fails = failures(run(side, "--prefill-url", prefill.url, "--decode-url", prefill.url))
    assert any("are the same engine" in f for f in fails), fails


def test_without_engine_urls_doctor_says_it_reads_its_own_shell():
    out = run(free_ports(), env={"UCX_NET_DEVICES": "lo"})
    assert "warn" not in out.stdout.split("engine environment")[0].splitlines()[-1]
    assert "ok    engine environment: cannot read the engines' UCX settings (no --prefill-url or --decode-url " \
           "given): the lines below are doctor's own shell's" in out.stdout, out.stdout
    assert "UCX_NET_DEVICES: lo: prefill and decode on this machine (this shell" in out.stdout


def test_a_range_of_unreachable_side_channel_ports_is_one_line(engines):
    """Prefill's HTTP server runs with tp=8, rank 0's side channel port answers TCP, the other seven do not."""
    side = free_ports(8)
    prefill = engines(free_ports(), side)
    fails = failures(run(side, "--prefill-url", prefill.url, "--prefill-layout", "tp=8,pp=1"))
    unreachable = [f for f in fails if "nothing answers" in f]
    assert len(unreachable) == 1, fails
    assert unreachable[0].startswith(f"FAIL  side channels 127.0.0.1:{side + 1}-{side + 7}: nothing answers"), fails
    assert len(unreachable[0]) < 400, unreachable[0]
