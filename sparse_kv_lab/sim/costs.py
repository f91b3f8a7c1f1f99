"""What the connector costs the forward, measured inside a simulated prefill rank: the hook's wall and CPU time, the
simulated compute's stretch over its nominal length, and the CPU the process's other threads (the event loop, the
NIXL post, progress and poll threads) use while a request computes and while the rank is idle.

Why CPU per thread and not the hook's return: the connector's threads share the GIL with the forward. A hook that
returns in 3 us may still have handed the GIL to the loop, which then runs its Python for the layer before the
forward gets it back (measured: hook p50 1,185 us wall against 75 us of its own CPU, issue 32). The forward's wait
shows as the compute stretching past its nominal length; the connector's share of the machine shows as the other
threads' CPU.

Per-thread CPU comes from /proc/self/task/<tid>/schedstat (nanoseconds on CPU, per thread, Linux): the clock ticks
of /proc/.../stat are 10 ms, far too coarse for "1 ms per second". Elsewhere the numbers are empty."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

_TASKS = "/proc/self/task"


def thread_cpu_ns() -> dict[int, int]:
    """Native thread id -> nanoseconds it has run on a CPU, for every thread of this process ({} off Linux)."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/schedstat", "rb") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return out


@dataclass(frozen=True)
class CpuSplit:
    """CPU nanoseconds over one window, split by who used it."""

    wall_ns: int
    forward_ns: int
    """The thread that called the hooks (the simulated model)."""
    loop_ns: int
    """The connector's event loop thread."""
    other_ns: int
    """Every other thread of the process: NIXL's post, progress and poll threads, the loop's watchdog."""

    def per_s(self, ns: int) -> float:
        """`ns` as milliseconds of CPU per second of this window."""
        return ns / 1e6 / max(self.wall_ns / 1e9, 1e-9)


class CpuWindow:
    """`with CpuWindow(loop_tid) as w: ...` then `w.split`: the CPU each group of threads used inside the block.
    The forward is the thread that opened the window."""

    def __init__(self, loop_tid: int | None) -> None:
        self.loop_tid = loop_tid
        self.split: CpuSplit | None = None

    def __enter__(self) -> "CpuWindow":
        self.forward_tid = threading.get_native_id()
        self._t0, self._cpu0 = time.perf_counter_ns(), thread_cpu_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        cpu1, wall = thread_cpu_ns(), time.perf_counter_ns() - self._t0
        used = {tid: ns - self._cpu0.get(tid, 0) for tid, ns in cpu1.items()}
        forward = used.pop(self.forward_tid, 0)
        loop = used.pop(self.loop_tid, 0) if self.loop_tid is not None else 0
        self.split = CpuSplit(wall, forward, loop, sum(used.values()))


@dataclass
class HookCosts:
    """Per hook call: its wall time and the CPU its own thread used (the difference is time waiting, mostly for the
    GIL); per layer: how long the layer took against its nominal length."""

    wall_ns: list[int] = field(default_factory=list)
    cpu_ns: list[int] = field(default_factory=list)
    layer_s: list[float] = field(default_factory=list)
    """Each layer's compute, hook included, start to start."""
    nominal_s: list[float] = field(default_factory=list)
    """What it would take with nothing else in the process: max(layer_ms, the layer's fill measured alone)."""

    def time_hook(self, fn, *args) -> None:  # noqa: ANN001 - any hook
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        fn(*args)
        self.wall_ns.append(time.perf_counter_ns() - t0)
        self.cpu_ns.append(time.thread_time_ns() - c0)
