"""`python -m connector doctor` as a user runs it: a good pair passes (exit 0), and each broken pair fails (exit 2)
with a line that names the mistake and the fix. The side-channel probes talk to a real side-channel server (the
connector's own ControlServer and handshake) and to a real HTTP server on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from connector.protocol.messages import Hello
from connector.transport.control import ControlServer
from connector.transport.loop import LoopThread
from connector.transport.ports import free_ports
from tests.helpers import prefill_side_channel

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "a-token-of-thirty-two-characters"


def config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "SparseKVConnector", "kv_role": role, "kv_connector_extra_config": extra})


def doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "connector", "doctor", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "UCX_NET_DEVICES": "lo", **(env or {})})


def pair(prefill: dict | None = None, decode: dict | None = None, *more: str, env: dict | None = None,
         port: int | None = None) -> subprocess.CompletedProcess:
    p = {"side_channel_host": "127.0.0.1", "side_channel_port": port or free_ports(), "auth_token": TOKEN,
         **(prefill or {})}
    d = {"auth_token": TOKEN, **(decode or {})}
    return doctor("--prefill", config("kv_producer", **{k: v for k, v in p.items() if v is not None}),
                  "--decode", config("kv_consumer", **{k: v for k, v in d.items() if v is not None}), *more, env=env)


def failures(out: subprocess.CompletedProcess) -> list[str]:
    assert out.returncode == 2, f"expected exit code 2, got {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return [line for line in out.stdout.splitlines() if line.startswith("FAIL")]


def test_a_good_pair_passes():
    out = pair(None, None, "--prefill-model", "qwen3-8b", "--decode-model", "qwen3-8b", "--prefill-layout",
               "tp=2,pp=2", "--decode-layout", "tp=4,pp=1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok    roles: prefill kv_producer, decode kv_consumer" in out.stdout
    assert "ok    plan: prefill tp=2,pp=2 -> decode tp=4,pp=1" in out.stdout
    assert "free on 127.0.0.1" in out.stdout and "FAIL" not in out.stdout


@pytest.mark.parametrize("prefill_role, decode_role, needle", [
    ("kv_consumer", "kv_producer", "roles: swapped"),
    ("kv_consumer", "kv_consumer", "prefill kv_role: 'kv_consumer': set \"kv_role\": \"kv_producer\" (or \"kv_both\")"),
])
def test_roles(prefill_role, decode_role, needle):
    out = doctor("--prefill", json.dumps({"kv_connector": "SparseKVConnector", "kv_role": prefill_role}),
                 "--decode", json.dumps({"kv_connector": "SparseKVConnector", "kv_role": decode_role}))
    assert any(needle in line for line in failures(out)), out.stdout


def test_kv_both_is_a_role_on_either_side():
    out = doctor("--prefill", json.dumps({"kv_connector": "SparseKVConnector", "kv_role": "kv_both"}),
                 "--decode", json.dumps({"kv_connector": "SparseKVConnector", "kv_role": "kv_both"}))
    assert "ok    roles: prefill kv_both, decode kv_both" in out.stdout, out.stdout


def test_a_misspelt_key_gets_a_did_you_mean():
    fails = failures(pair({"side_chanel_port": 5600}))
    assert any("'side_chanel_port' (value 5600): did you mean 'side_channel_port'?" in f for f in fails), fails


@pytest.mark.parametrize("prefill, decode, needle", [
    ({"auth_token": None}, {}, "auth_token differs between prefill and decode: decode has one, prefill none"),
    ({}, {"auth_token": "another-token-of-32-characters!!"}, "auth_token differs between prefill and decode: give"),
    ({}, {"auth_token": None, "auth_token_env": "SPARSE_KV_DOCTOR_UNSET"}, "SPARSE_KV_DOCTOR_UNSET"),
])
def test_tokens(prefill, decode, needle):
    fails = failures(pair(prefill, decode))
    assert any(needle in f for f in fails), fails


def test_the_same_token_from_a_file_and_a_variable_passes(tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    out = pair({"auth_token": None, "auth_token_file": str(tmp_path / "token")},
               {"auth_token": None, "auth_token_env": "T19"}, env={"T19": TOKEN})
    assert out.returncode == 0 and "ok    auth_token: set on both sides, the same" in out.stdout, out.stdout


@pytest.mark.parametrize("case, needle", [
    ("trusted, no key", "FAIL  prefill keys: decode trusts only prefills with a key in trusted_prefill_keys, and "
                        "prefill has no prefill_key_file"),
    ("another key", "is not in decode's trusted_prefill_keys"),
    ("the same key", "ok    prefill keys: prefill signs its handshakes with"),
    ("key, decode trusts any", "warn  prefill keys: prefill signs its handshakes, but decode trusts any peer"),
])
def test_prefill_keys(tmp_path, capsys, case, needle):
    from connector.cli.main import main as cli

    assert cli(["keygen", str(tmp_path / "prefill.key")]) == 0
    assert cli(["keygen", str(tmp_path / "other.key")]) == 0
    printed = capsys.readouterr().out.splitlines()
    public, other = printed[0], printed[3]
    prefill = {} if case == "trusted, no key" else {"prefill_key_file": str(tmp_path / "prefill.key")}
    decode = {"trusted_prefill_keys": [other if case == "another key" else public]}
    out = pair(prefill, {} if case == "key, decode trusts any" else decode)
    assert needle in out.stdout, out.stdout
    assert (out.returncode == 2) == (case in ("trusted, no key", "another key")), out.stdout


@pytest.mark.parametrize("host, more, needle", [
    ("0.0.0.0", [], "'0.0.0.0' is no address decode can connect to"),
    ("127.0.0.1", ["--multi-node"], "127.0.0.1 is loopback, and decode runs on another node"),
])
def test_side_channel_hosts(host, more, needle):
    fails = failures(pair({"side_channel_host": host}, None, *more))
    assert any(needle in f for f in fails), fails


def test_the_http_port_given_as_the_side_channel_port():
    port = free_ports()
    fails = failures(pair({"side_channel_port": port}, None, "--prefill-url", f"http://127.0.0.1:{port}"))
    assert any(f"side_channel_port: {port} is also prefill's HTTP port" in f for f in fails), fails


def test_a_side_channel_port_in_use():
    port = free_ports()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()  # answers TCP, but no handshake: the probe reports what listens there
        fails = failures(pair({"side_channel_port": port}, None, "--prefill-layout", "tp=2,pp=1"))
    assert any(f"side channel 127.0.0.1:{port + 1}: something else listens there" in f for f in fails), fails


def test_a_side_channel_address_that_is_an_http_server():
    """aiohttp's parser, like vLLM's uvicorn (httptools), answers a Hello with an HTTP 400 at once."""
    from aiohttp import web

    port, loop = free_ports(), LoopThread("doctor-http").start()
    runner = web.AppRunner(web.Application())
    loop.run(runner.setup(), 10)
    loop.run(web.TCPSite(runner, "127.0.0.1", port).start(), 10)
    try:
        fails = failures(pair({"side_channel_port": port}))
    finally:
        loop.run(runner.cleanup(), 10)
        loop.stop()
    assert any(f"side channel 127.0.0.1:{port}: this is an HTTP server, not a side channel: you gave an HTTP port"
               in f for f in fails), fails


def test_models_whose_layouts_differ_name_what_differs():
    fails = failures(pair(None, None, "--prefill-model", "qwen3-8b", "--decode-model", "minimax-m3"))
    line = next(f for f in fails if f.startswith("FAIL  model"))
    assert "prefill has 36 layers, decode 60" in line, line


def test_a_plan_that_cannot_build():
    fails = failures(pair(None, None, "--prefill-model", "qwen3-8b", "--decode-model", "qwen3-8b",
                          "--decode-layout", "tp=3,pp=1"))
    assert any(f.startswith("FAIL  plan") and "tp=3" in f for f in fails), fails


def test_ucx_on_loopback_across_nodes():
    fails = failures(pair({"side_channel_host": "10.11.12.13"}, None, "--multi-node", env={"UCX_NET_DEVICES": "lo"}))
    assert any("UCX_NET_DEVICES: lo: UCX cannot reach another node" in f for f in fails), fails


def test_tls_on_prefill_only():
    cert = str(ROOT / "tests" / "data" / "side-channel-cert.pem")
    key = str(ROOT / "tests" / "data" / "side-channel-key.pem")
    fails = failures(pair({"tls_cert_file": cert, "tls_key_file": key}))
    assert any("prefill serves TLS but decode has no tls_ca_file" in f for f in fails), fails


@pytest.fixture
def side_channel():
    """A real prefill side channel (the connector's ControlServer and handshake) for qwen3-8b, token TOKEN."""
    with prefill_side_channel(TOKEN, "doctor-side-channel") as got:
        yield got


def test_a_running_side_channel_is_probed_and_its_token_checked(side_channel):
    port, registered = side_channel
    out = pair({"side_channel_port": port}, None, "--prefill-model", "qwen3-8b", "--decode-model", "qwen3-8b")
    assert out.returncode == 0, out.stdout
    assert f"ok    side channel 127.0.0.1:{port}: a SparseKVConnector side channel (prefill engine " \
           f"prefill-under-test)" in out.stdout
    assert "prefill proved it holds decode's auth_token" in out.stdout
    fails = failures(pair({"side_channel_port": port, "auth_token": "another-token-of-32-characters!!"},
                          {"auth_token": "another-token-of-32-characters!!"}, "--decode-model", "qwen3-8b"))
    assert any(f"side channel 127.0.0.1:{port} auth: auth_token differs between prefill and decode" in f
               for f in fails), fails
    fails = failures(pair({"side_channel_port": port}, None, "--decode-model", "minimax-m3"))
    assert any("decode cannot pair with: model/layout fingerprint mismatch" in f and "prefill prefill-under-test "
               "has 36 layers, decode" in f and " 60 " in f for f in fails), fails
    assert registered == []
