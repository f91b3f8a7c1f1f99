"""`python -m connector serve-local` as a user runs it: a subprocess that starts prefill, decode and a router, checks
one request, prints a ready-to-paste one; the request through the router is token-equal to decode computing the
prompt alone; the auth token, read from a file, is in no log; SIGTERM to the launcher leaves no process of any group
it started, and every port it used is free."""

from __future__ import annotations

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

from connector.pd.client import complete
from connector.pd.servers import group_members
from tests.real_engine.conftest import ROOT, engine_python

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

READY_TIMEOUT_S = 700.0


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
    proc = subprocess.Popen([sys.executable, "-m", "connector", "serve-local", "--engine-python", str(python),
                             "--work-dir", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = Output(proc)
    try:
        text = out.until("Ctrl-C or SIGTERM stops all three", READY_TIMEOUT_S)
        assert re.search(r"check: PD answer .* token-equal; decode received [1-9][0-9.]* MB", text), text
        groups = {int(pid) for pid in re.findall(r"(?:prefill|decode|router) (\d+)", text.split("process groups:")[1]
                                                 .splitlines()[0])}
        assert len(groups) == 3, text
        ports = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)}
        router = re.search(r"router\s+(http://127\.0\.0\.1:\d+)", text).group(1)
        decode = re.search(r"decode\s+(http://127\.0\.0\.1:\d+)", text).group(1)
        curl = re.search(r"curl -s (\S+) .* -d @(\S+)", text)
        assert curl and curl.group(1) == f"{router}/v1/completions", text
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
