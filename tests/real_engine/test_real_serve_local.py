"""`python -m connector serve-local` as a user runs it: a subprocess that starts prefill, decode and a router, checks
one request, prints a ready-to-paste one; the request through the router is token-equal to decode computing the
prompt alone; a plain OpenAI text body gets text; the first request after "ready" is about as fast as the next; no
log has a WARNING beyond vLLM's own start-up notices; the auth token, read from a file, is in no log; SIGTERM to the
launcher leaves no process of any group it started, and every port it used is free."""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparse_kv_lab.pd.client import complete
from sparse_kv_lab.pd.servers import group_members
from connector.transport.ports import free_ports
from tests.real_engine.conftest import ROOT, engine_python

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

READY_TIMEOUT_S = 700.0
TTFT_NOISE_S = 0.5
"""Slack on "the first request's TTFT within 2x the second's": on a shared 2-core machine the same request's TTFT
varies by more than 2x from one run to the next (0.36 s then 0.69 s; 1.7 s then 2.8 s on decode alone), while the
cost this catches, a first KV transfer paying for loading the peer, was seconds (9 s)."""


class Output:
    """The launcher's stdout, read line by line on a thread (a pipe's buffered lines never wake a select())."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, needle: str | None, timeout_s: float) -> str:
        """Everything printed up to the line holding `needle` (fails with what was printed), or with None until the
        launcher closed its stdout (or `timeout_s` passed)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if needle is not None and needle in line:
                return "\n".join(self.seen)
        if needle is None:
            return "\n".join(self.seen)
        raise AssertionError(f"no {needle!r} from serve-local within {timeout_s:.0f} s:\n" + "\n".join(self.seen))


VLLM_STARTUP_NOTICES = (
    # vLLM's own, logged while an engine starts on a CPU machine, whatever the connector does.
    ("system_utils.py", "Found ulimit of"),
    ("vllm.py", "Enforce eager set"),
    ("vllm.py", "Inductor compilation was disabled"),
    ("vllm.py", "Model Runner V2 requires Triton"),
    ("cpu.py", "Triton is not installed"),
    ("cpu_worker.py", "is not found in LD_PRELOAD"),
    ("base.py", "Initializing KVConnectorBase_V1. This API is experimental"),
    ("serving.py", "The chat template requires system-first ordering"),
    # On a CPU with AVX-512 BF16 (vllm/platforms/cpu.py, whatever the model: the tiny Llama has no SSM state).
    ("cpu.py", "Reset SSM cache type to float32"),
    # The API server of a one-rank engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, sparse_kv_lab.pd.servers'
    # one_process_worker): about an in-process engine seeding its launcher's RNG; the API server's engine core runs
    # in a process of its own all the same.
    ("arg_utils.py", "The global random seed is set to"),
)


def unexpected_warnings(log: str) -> list[str]:
    """WARNING (and worse) lines that are not vLLM's start-up notices above."""
    bad = []
    for line in log.splitlines():
        level = re.search(r"\b(WARNING|ERROR|CRITICAL)\b.*?\[([\w.]+):\d+\] (.*)", line)
        if level is None:
            if re.search(r"\bWARNING\b|Traceback", line):
                bad.append(line)
            continue
        if level.group(1) != "WARNING" or not any(level.group(2) == f and m in level.group(3)
                                                  for f, m in VLLM_STARTUP_NOTICES):
            bad.append(line)
    return bad


def text_ttft(url: str, prompt: str) -> tuple[float, str]:
    """(seconds to the first non-empty text, the whole text) of a plain streamed OpenAI text completion."""
    parts = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(parts[0], int(parts[1]), timeout=120)
    began, first, text = time.monotonic(), None, ""
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 8, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            piece = json.loads(line[5:])["choices"][0].get("text") or ""
            if piece and first is None:
                first = time.monotonic()
            text += piece
    finally:
        conn.close()
    assert first is not None, f"no text from {url}"
    return first - began, text


def groups_alive(pgids: set[int]) -> list[int]:
    """Running processes whose process group is one of `pgids`."""
    return [pid for pgid in pgids for pid in group_members(pgid)]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_serve_local_answers_token_equal_and_sigterm_leaves_nothing(tmp_path):
    python = engine_python()
    chosen = {flag: free_ports() for flag in ("--port", "--prefill-port", "--side-channel-port", "--decode-port")}
    proc = subprocess.Popen([sys.executable, "-m", "connector", "serve-local", "--engine-python", str(python),
                             "--work-dir", str(tmp_path),
                             *(str(x) for kv in chosen.items() for x in kv)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = Output(proc)
    try:
        text = out.until("Ctrl-C or SIGTERM stops all three", READY_TIMEOUT_S)
        assert re.search(r"check: PD answer .* token-equal; decode received [1-9][0-9.]* MB", text), text
        groups = {int(pid) for pid in re.findall(r"(?:prefill|decode|router) (\d+)", text.split("process groups:")[1]
                                                 .splitlines()[0])}
        assert len(groups) == 3, text
        assert f"router   http://127.0.0.1:{chosen['--port']} " in text, text  # every port as chosen
        assert f"prefill  http://127.0.0.1:{chosen['--prefill-port']} " in text, text
        assert f"side channel 127.0.0.1:{chosen['--side-channel-port']} " in text, text
        assert f"decode   http://127.0.0.1:{chosen['--decode-port']} " in text, text
        ports = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)}
        router = re.search(r"router\s+(http://127\.0\.0\.1:\d+)", text).group(1)
        decode = re.search(r"decode\s+(http://127\.0\.0\.1:\d+)", text).group(1)
        curl = re.search(r"curl -s (\S+) .* -d @(\S+)", text)
        assert "warm-up: a text request through the router" in text, text
        assert curl and curl.group(1) == f"{router}/v1/completions", text
        # The first two requests after "ready" (a plain OpenAI text body, ~1,200 tokens each, different from the
        # first byte so no prefix is cached): text comes back, and the first is not the slow one.
        ttfts = [text_ttft(router, f"request {i}: " + "hello world " * 100) for i in (1, 2)]
        print(f"TTFT through the router after ready: first {ttfts[0][0]:.3f} s, second {ttfts[1][0]:.3f} s")
        assert all(text.strip() for _, text in ttfts), ttfts
        assert ttfts[0][0] <= 2 * ttfts[1][0] + TTFT_NOISE_S, ttfts
        assert "-d '{\"prompt\": \"hello world\", \"max_tokens\": 8}'" in text, text
        short = json.loads(subprocess.run(["curl", "-s", f"{router}/v1/completions", "-H",
                                           "Content-Type: application/json", "-d",
                                           '{"prompt": "hello world", "max_tokens": 8}'],
                                          capture_output=True, text=True, timeout=60).stdout)
        assert short["choices"][0]["text"].strip(), short
        body = json.loads(Path(curl.group(2)).read_text())
        assert len(body["prompt"]) == 600 and body["max_tokens"] == 8
        # The pasted request, through the router, against decode computing the prompt itself.
        pd = complete(router, body).token_ids
        alone = complete(decode, body | {"cache_salt": "computed-alone"}).token_ids
        assert len(pd) == 8 and pd == alone, (pd, alone)
        # The token came from a file: vLLM's "non-default args" line shows its path, no log shows the token.
        token = (tmp_path / "auth-token").read_text().strip()
        logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "logs").iterdir()}
        assert len(token) == 64 and not [name for name, log in logs.items() if token in log] and token not in text
        prefill_log = next(log for name, log in logs.items() if name.startswith("prefill"))
        assert "auth_token_file" in prefill_log and "auth token set" in prefill_log
        # So did the prefill key, and decode trusts only its public half: the answer above came through a handshake
        # that proved it.
        key = (tmp_path / "prefill.key").read_text().strip()
        assert len(key) == 64 and not [name for name, log in logs.items() if key in log] and key not in text
        decode_log = next(log for name, log in logs.items() if name.startswith("decode"))
        assert "prefill_key_file" in prefill_log and "trusted_prefill_keys" in decode_log
        assert groups_alive(groups), "the engines should be running before SIGTERM"
        # The happy path (start, check, warm-up, the requests above) logs no WARNING of its own anywhere.
        warned = {name: unexpected_warnings(log) for name, log in logs.items()}
        assert not any(warned.values()), warned
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    rest = out.until(None, 10)
    assert proc.returncode == 0, rest
    assert "SIGTERM: stopping prefill, decode and the router" in rest and "serve-local: stopped" in rest, rest
    assert groups_alive(groups | {proc.pid}) == []
    assert all(port_free(p) for p in ports), {p: port_free(p) for p in ports}
    # Each API server ran its own shutdown and stopped its engine core (no core died before it was told to). The one
    # ERROR allowed is vLLM's shutdown race, AsyncLLM's output handler logging EngineDeadError for the engine core it
    # just stopped (sparse_kv_lab.pd.servers, VllmServer.one_process_worker).
    for log_path in (tmp_path / "logs").glob("*.log"):
        if log_path.name.startswith("router"):
            continue
        log = log_path.read_text(errors="replace")
        assert "[shutdown] API server: shutdown triggered" in log, (log_path, log[-3000:])
        stopping = log[log.index("[shutdown] API server: shutdown triggered"):]
        assert "Application shutdown complete" in stopping and "exited unexpectedly" not in stopping, stopping
        errors = [line for line in stopping.splitlines()
                  if re.search(r"\b(ERROR|CRITICAL)\b", line) and "[async_llm.py:906]" not in line]
        assert not errors, (log_path, errors)
