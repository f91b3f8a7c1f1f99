"""The hand-off from the framework's thread (vLLM's forward) to the sender's event loop.

Hook calls only append to a deque (atomic under the GIL), drained FIFO on the loop, so their order is kept. The loop
sleeps until there is work: no timer, no poll. A wake is paid only where the loop has something to do at once: per
step (start, end of chunk, abort), and per layer only while the request has a decode rank to write to
(`streaming`). Until a decode registers, a computed layer can go nowhere, so its hook wakes nobody: the
registration drains the deque first.

How a hook wakes the loop without handing it the GIL. `loop.call_soon_threadsafe` writes to the loop's self-pipe
with `socket.send`, which releases the GIL around the syscall: the loop thread, woken by that very write, takes the
GIL and runs its Python for the layer (bookkeeping, descriptors, the post) while the forward waits to get it back,
up to CPython's 5 ms switch interval. Measured (issue 32, `bench --model minimax-m3 --tokens 2048`): hook wall p50
1,185 us and p90 5,033 us against 75 us of its own CPU, the simulated compute 2.4x its nominal length. Here the hook
writes to an eventfd through `ctypes.PyDLL`, which keeps the GIL across the call (an 8-byte eventfd write never
blocks): the loop wakes in the kernel but runs only once the forward lets the GIL go by itself (a CUDA sync, a
sleep, a torch op that releases it), and at most one wake is outstanding (`_kicked`), so a burst of layers costs
one syscall. Where that is not available (not Linux), `call_soon_threadsafe`.

How often a layer wakes the loop: at most once per gap. A layer that finishes sooner after the last wake only
appends; it goes out with the next wake, at the latest the end of its forward step (`end_chunk` always wakes), and
the sender pumps once per turn (StreamSender._pump_soon), so the layers one wake drains leave as one WRITE per
decode rank. The gap starts at `layer_gap_us` (SenderConfig.layer_wake_gap_us, 2 ms), which bounds the wakes of
short layers. It then follows what a wake costs: the loop reads its own CPU clock once per wake while layers stream,
and sets the gap to that cost over `cpu_share` (SenderConfig.layer_wake_cpu_share, 2% of a core), up to
`layer_gap_max_us` (20 ms; `_pace`). A wake is a fixed sum of syscalls and Python whatever it carries (the drain, the
WRITE's post, its completion), and the forward pays it where it shares the core or the GIL. Measured on vLLM's CPU
engine here (deep model, 16 layers of 3-20 ms, prefill on one core): 0.5-0.7 ms of the loop's CPU per wake, so a
wake per layer made the compute stage 27% (600 tokens) and 7% (3,000) longer than the sequential flow's; paced, the
gap reaches its 20 ms and that is 5% and 4% (docs/performance.md). Where a wake costs 40 us the gap stays at its
2 ms floor.
Short layers at the floor (`bench --model qwen3-8b --tokens 256 --layer-ms 1`, 36 layers of 1 ms, two runs each):
the loop's CPU while layers stream 152-161 ms/s against 235-240 with a wake per layer, the hook p50 6.5-9.3 us
against 12-14. A wake every 4th layer by count (tried before) stretched M3's 8 ms layers (1.062-1.069x against
1.027-1.028x) in a bench whose simulated forward then ran torch's spinning OpenMP pool beside NIXL's copy; with the
forward on one thread, a 20 ms gap gives 1.017-1.020x against 1.020-1.022x at 2 ms. `os.eventfd_write` instead of
the ctypes write: hook p50 38-41 us against 50-65, but p90 586-959 us against 70-90 (the woken loop took the GIL
while the write had let it go) and the compute 1.040-1.065x. On this VM a no-op timed the same way after a layer's
sleep costs 2-5 us (`hook_floor_us`); on M3's 8 ms layers a hook that wakes the loop costs 33-42 us, nearly all its
own CPU (the wake of a sleeping thread), one that only appends 8-15 us (its code cold after the layer's fill).

The one race, closed without a timer. A hook appends first, then reads `streaming`; the loop adds a transfer to
`streaming` first (`stream`), then drains on its next turn. A hook whose append came before the add is drained by
that turn; one whose append came after sees the transfer streaming and wakes the loop (or, within the layer gap,
goes with the next wake, which the end of its step sends at the latest). (The loop used to wait with a
10 ms timeout while anything streamed, to cover a hook that read `streaming` before the add and appended after the
drain: 100 wakes a second, 4-5.7 ms of prefill's CPU per 250 ms for as long as a request computed.)"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
import weakref
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)

_ONE = ctypes.c_uint64(1)


def _gil_keeping_write() -> Callable[[int], Any] | None:
    """libc's write(fd, &1, 8) called with the GIL held (ctypes.PyDLL), or None where there is no eventfd."""
    if not hasattr(os, "eventfd"):
        return None
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return None
    write.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    pointer = ctypes.addressof(_ONE)
    return lambda fd: write(fd, pointer, 8)


class Inbox:
    def __init__(self, loop: asyncio.AbstractEventLoop, name: str, layer_gap_us: int = 0, cpu_share: float = 0.0,
                 layer_gap_max_us: int = 0, cpu_clock: Callable[[], int] = time.thread_time_ns) -> None:
        """`layer_gap_us`: a streaming layer's hook wakes the loop only if no layer hook did in the last this many
        microseconds (0: every streaming layer wakes); a layer that does not wake goes out with the next wake, at
        the latest the end of its chunk (`put(..., wake=True)`). `cpu_share` > 0: the gap grows, up to
        `layer_gap_max_us`, until the loop's CPU per wake while layers stream is at most this share of the time
        between wakes (`_pace`); `cpu_clock`, the loop thread's CPU clock, is for tests."""
        self.loop, self.name = loop, name
        self._gap_floor_ns = layer_gap_us * 1000
        self._layer_gap_ns = self._gap_floor_ns
        self._cpu_share = cpu_share if layer_gap_us else 0.0  # (gap 0: every layer wakes, as asked)
        self._gap_max_ns = max(layer_gap_max_us * 1000, self._gap_floor_ns)
        self._cpu_clock = cpu_clock
        self._cpu_mark_ns: int | None = None
        """The loop's CPU clock at the last wake while something streamed (None: none since streaming began)."""
        self.cpu_per_wake_ns = 0
        """What a wake costs the loop while layers stream: its CPU from one wake to the next (that wake's drain, the
        WRITE it posts and the WRITE's completion), averaged over recent wakes."""
        self._last_layer_wake_ns = 0
        self._calls: deque = deque()
        self.streaming: set[str] = set()
        """Transfers still computing that have a decode rank to write to: their layer hooks wake the loop (changed
        on the loop through `stream`/`unstream`, read from the framework thread: a set's membership test is atomic
        under the GIL)."""
        self._kicked = False
        """A wake is on its way and the loop has not started the drain it causes: further hooks need not wake."""
        self._write = _gil_keeping_write()
        self._efd = -1
        if self._write is not None:
            # Open for as long as this object lives, never closed under a hook that may still write to it (a closed
            # number could be reused by another file by then).
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            weakref.finalize(self, os.close, self._efd)
        self._reading = False
        """The loop watches the eventfd (between `run`'s start and end)."""
        self.wakes = 0
        """Wakes the framework thread sent (tests, the bench)."""

    def __len__(self) -> int:
        return len(self._calls)

    # ---- framework thread ----------------------------------------------------------------------------------------
    def put(self, fn: Callable[..., Any], *args: Any, wake: bool) -> None:
        self._calls.append((fn, *args))
        if wake:
            self._kick()

    def put_layer(self, transfer_id: str, fn: Callable[..., Any], *args: Any) -> None:
        """A layer hook: wakes the loop only if `transfer_id` has somewhere to send the layer now. Append first,
        then check: the order `stream` relies on."""
        self._calls.append((fn, transfer_id, *args))
        if transfer_id in self.streaming and not self._kicked:  # (a wake on its way covers this layer: no clock)
            if self._layer_gap_ns:  # (set by the loop: one int, read atomically)
                now = time.monotonic_ns()
                if now - self._last_layer_wake_ns < self._layer_gap_ns:
                    return  # a layer woke the loop a moment ago: this one goes with the next wake
                self._last_layer_wake_ns = now
            self._kick()

    def _kick(self) -> None:
        if self._kicked:
            return  # the loop has not drained since the last wake: it will see this call too
        self._kicked = True
        self.wakes += 1
        if self._reading:
            self._write(self._efd)
        else:  # not Linux, or the loop does not watch the eventfd (not started, or stopped)
            self.loop.call_soon_threadsafe(self._on_wake)

    # ---- loop ----------------------------------------------------------------------------------------------------
    def stream(self, transfer_id: str) -> None:
        """(loop) `transfer_id`'s layer hooks wake the loop from now on; hooks queued before are drained on the
        loop's next turn (see the module docstring for why that closes the race)."""
        if transfer_id not in self.streaming:
            self.streaming.add(transfer_id)
            self.loop.call_soon(self.drain)

    def unstream(self, transfer_id: str) -> None:
        self.streaming.discard(transfer_id)

    async def run(self) -> None:
        """Drain on every wake, until cancelled. Waits on nothing but the wakes: no timer."""
        if self._efd >= 0:
            self.loop.add_reader(self._efd, self._on_wake)
            self._reading = True
        try:
            await asyncio.get_running_loop().create_future()  # forever: the reader does the work
        finally:
            if self._reading:
                self._reading = False
                self.loop.remove_reader(self._efd)

    @property
    def layer_gap_us(self) -> float:
        """The gap between layer wakes now (the floor, or what `_pace` raised it to)."""
        return self._layer_gap_ns / 1000

    def _on_wake(self) -> None:
        if self._efd >= 0:
            try:
                os.eventfd_read(self._efd)
            except BlockingIOError:  # read already (two wakes, one drain): nothing to consume
                pass
        if self._cpu_share:
            self._pace()
        self.drain()

    def _pace(self) -> None:
        """(loop, each wake) Sets the layer gap from what a wake costs the loop here: its CPU since the previous
        wake while layers streamed, averaged (1/4 new), over `cpu_share`, between the floor and the maximum (why and
        what it measured: the module docstring). Also counted: whatever else the loop ran between the two wakes (the
        receiver's work where one loop serves both roles), which only widens the gap. Reads the thread's CPU clock
        once per wake, never in a hook."""
        if not self.streaming:
            self._cpu_mark_ns = None  # idle between requests is not a wake's cost
            return
        cpu = self._cpu_clock()
        if self._cpu_mark_ns is not None:
            spent = cpu - self._cpu_mark_ns
            self.cpu_per_wake_ns = spent if not self.cpu_per_wake_ns else (3 * self.cpu_per_wake_ns + spent) // 4
            gap = int(self.cpu_per_wake_ns / self._cpu_share)
            self._layer_gap_ns = min(max(gap, self._gap_floor_ns), self._gap_max_ns)
        self._cpu_mark_ns = cpu

    def drain(self) -> None:
        """Run the queued calls, in order (on the loop)."""
        self._kicked = False  # before the drain: a call queued during it wakes the loop again
        while self._calls:
            fn, *args = self._calls.popleft()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one bad call must not stop the engine
                log.exception("%s: %s%r failed", self.name, fn.__name__, tuple(args))
