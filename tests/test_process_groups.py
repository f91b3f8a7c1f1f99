"""sparse_kv_lab.pd.servers without vLLM: start_all names the first server that exits while another is still loading
(at once, with its log's tail, not after the other's timeout) and stops the others; a process group is stopped
whole, children included. The servers here are small python processes standing in for `vllm serve`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from connector.core.errors import ServerError
from sparse_kv_lab.pd.servers import ProcessGroup, group_members, start_all

pytestmark = [pytest.mark.timeout(60)]


class Stand(ProcessGroup):
    """A process group running `code`, 'healthy' once `ready_file` exists."""

    def __init__(self, name: str, code: str, log_dir: Path) -> None:
        self.name, self.code = name, code
        self.log_path = log_dir / f"{name}.log"
        self.ready_file = log_dir / f"{name}.ready"
        self.proc = None

    def start(self) -> "Stand":
        self._popen([sys.executable, "-c", self.code], dict(os.environ))
        return self

    def healthy(self) -> bool:
        return self.ready_file.exists()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_first_server_to_die_is_named_at_once_and_the_others_are_stopped(tmp_path):
    slow = Stand("prefill", "import time; time.sleep(120)", tmp_path)
    dead = Stand("decode", "import sys; print('decode: bad config'); sys.exit(3)", tmp_path)
    began = time.monotonic()
    with pytest.raises(ServerError) as err:
        start_all([slow, dead], timeout_s=60)
    assert time.monotonic() - began < 15
    assert str(err.value).startswith("decode exited with 3 before it was healthy; log ") and \
        "decode: bad config" in str(err.value)
    assert slow.proc.poll() is not None  # stopped, not left loading


def test_a_startup_error_quotes_the_first_traceback_when_the_tail_is_another(tmp_path):
    """vLLM's engine core prints its root cause first; the API server's own traceback then fills the log's tail."""
    code = ("import sys\n"
            "print('Traceback (most recent call last):')\n"
            "print('OSError: [Errno 98] side channel port 5555 in use')\n"
            "for i in range(100): print(f'api server line {i}')\n"
            "sys.exit(1)\n")
    with pytest.raises(ServerError) as err:
        start_all([Stand("prefill", code, tmp_path)], timeout_s=30)
    message = str(err.value)
    assert "first traceback:\nTraceback (most recent call last):\nOSError: [Errno 98] side channel port 5555" in message
    assert message.endswith("last lines:\n" + "\n".join(f"api server line {i}" for i in range(60, 100)))


def test_a_server_not_healthy_in_time_is_named(tmp_path):
    slow = Stand("prefill", "import time; print('loading'); time.sleep(120)", tmp_path)
    ok = Stand("decode", f"import pathlib, time; pathlib.Path({str(tmp_path / 'decode.ready')!r}).touch(); "
                         f"time.sleep(120)", tmp_path)
    with pytest.raises(ServerError, match="^prefill not healthy within 2 s; log .*prefill.log, last lines:\nloading"):
        start_all([slow, ok], timeout_s=2)
    assert slow.proc.poll() is not None and ok.proc.poll() is not None


def test_stop_ends_the_whole_group_children_included(tmp_path):
    child_pid = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time, pathlib\n"
            f"c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            f"signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\n"
            f"pathlib.Path({str(child_pid)!r}).write_text(str(c.pid))\n"
            f"time.sleep(120)\n")
    group = Stand("router", code, tmp_path).start()
    deadline = time.monotonic() + 20
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline, group.log_tail()
        time.sleep(0.1)
    child = int(child_pid.read_text())
    assert sorted(group_members(group.pid)) == sorted([group.pid, child])
    group.stop(timeout_s=2)  # the child ignores SIGTERM: SIGKILL to the group ends it
    # stop() returns once nothing of the group runs, the child (not the group leader's to reap) included
    assert not alive(child) and group.proc.poll() is not None and group_members(group.pid) == []


def test_stop_waits_for_the_group_to_end_by_itself_before_any_sigkill(tmp_path):
    """What vLLM's API server does on SIGTERM: it exits, and its engine core ends a moment later."""
    code = ("import subprocess, sys, time, signal\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import signal, sys, time; "
            "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0))); print(\\'ready\\', flush=True); "
            "time.sleep(120)'])\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
            "print(c.pid, flush=True)\n"
            "time.sleep(120)\n")
    group = Stand("engine", code, tmp_path).start()
    deadline = time.monotonic() + 20
    while "ready" not in group.log_tail():  # the child's SIGTERM handler is in place (else it dies at once)
        assert time.monotonic() < deadline
        time.sleep(0.1)
    child = int(group.log_tail().split()[0])
    began = time.monotonic()
    group.stop(timeout_s=10)
    assert 0.5 < time.monotonic() - began < 8  # the child's second of shutdown, not the 10 s timeout
    assert not alive(child) and group_members(group.pid) == []


@pytest.mark.parametrize("tie_to_parent", [False, True])
def test_one_rank_engines_run_the_uni_executor_serve_locals_too(tmp_path, tie_to_parent):
    """serve-local's engines (tie_to_parent) are no exception: the EngineDeadError their API servers may log at the
    stop is vLLM's shutdown race, with either executor (VllmServer.one_process_worker)."""
    from sparse_kv_lab.pd.servers import ServerSpec, VllmServer

    def env(**spec) -> dict[str, str]:
        return VllmServer(ServerSpec("x", tmp_path, 1, **spec), sys.executable, tmp_path,
                          tie_to_parent=tie_to_parent).one_process_worker()

    assert env() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert env(tp=2) == {} and env(pp=2) == {}
    assert env(extra_args=("--data-parallel-size", "2")) == {}
