"""The framework-thread -> loop hand-off (connector.engine.inbox): which calls wake the loop, and that every call
runs once, in order, whoever woke it."""

import asyncio
import sys
import threading

import pytest

from connector.engine.inbox import Inbox


class CountingLoop:
    """Stands in for the event loop on the framework thread's side: counts the wakes asked for."""

    def __init__(self) -> None:
        self.wakes = 0

    def call_soon_threadsafe(self, fn, *args):  # noqa: ANN001, ANN201
        self.wakes += 1


def test_layer_hooks_wake_the_loop_only_while_their_transfer_streams():
    loop = CountingLoop()
    box = Inbox(loop, "test")  # type: ignore[arg-type]
    ran = []

    def note(*args):  # noqa: ANN002, ANN202
        ran.append(args)

    box.put_layer("a", note, 0)  # nobody registered for "a": nothing to send, no wake
    box.put_layer("a", note, 1)
    assert loop.wakes == 0 and len(box) == 2
    box.streaming.add("a")
    box.put_layer("a", note, 2)
    box.put_layer("b", note, 3)  # another transfer, not streaming
    assert loop.wakes == 1
    box.put(note, "end", wake=True)  # a wake is on its way and nothing drained since: it covers this call too
    box.put_layer("a", note, 4)
    assert loop.wakes == 1
    box.drain()
    assert ran == [("a", 0), ("a", 1), ("a", 2), ("b", 3), ("end",), ("a", 4)] and len(box) == 0
    box.put(note, "next", wake=True)  # drained: the next call that wakes sends a wake again
    assert loop.wakes == 2


def test_within_the_layer_gap_a_layer_goes_with_the_next_wake(monkeypatch: pytest.MonkeyPatch) -> None:
    """SenderConfig.layer_wake_gap_us: a streaming layer wakes the loop only if no layer did within the gap; the
    layers between are queued, in order, and run with the next wake (a later layer past the gap, or the end of the
    step, which always wakes)."""
    now = [10_000_000_000]
    monkeypatch.setattr("connector.engine.inbox.time.monotonic_ns", lambda: now[0])
    loop = CountingLoop()
    box = Inbox(loop, "test", layer_gap_us=2000)  # type: ignore[arg-type]
    ran = []

    def note(*args):  # noqa: ANN002, ANN202
        ran.append(args)

    box.streaming.add("a")
    box.put_layer("a", note, 0)  # the first layer wakes
    assert loop.wakes == 1
    box.drain()
    now[0] += 1_000_000  # 1 ms later: within the gap
    box.put_layer("a", note, 1)
    now[0] += 900_000
    box.put_layer("a", note, 2)
    assert loop.wakes == 1 and len(box) == 2  # queued, nobody woken
    now[0] += 100_000  # 2 ms after the last wake: this one wakes, and the drain runs the ones before it too
    box.put_layer("a", note, 3)
    assert loop.wakes == 2
    box.drain()
    assert ran == [("a", 0), ("a", 1), ("a", 2), ("a", 3)]
    now[0] += 500_000
    box.put_layer("a", note, 4)  # within the gap again: waits...
    assert loop.wakes == 2
    box.put(note, "end of step", wake=True)  # ...for the end of its step, which always wakes
    assert loop.wakes == 3
    box.drain()
    assert ran[-2:] == [("a", 4), ("end of step",)] and len(box) == 0


def test_every_call_runs_once_in_order_on_the_loop_with_wakes_and_without():
    """Calls queued from another thread run on the loop: those that wake at once, those that did not wake when the
    next wake comes (the registration's drain, or a later hook), and a failing call does not stop the rest."""
    loop = asyncio.new_event_loop()
    ran: list = []
    on_loop: set = set()

    def record(*args):  # noqa: ANN002, ANN202
        on_loop.add(threading.get_ident())
        ran.append(args)
        if args == ("boom",):
            raise RuntimeError("one bad call")

    async def main() -> None:
        box = Inbox(loop, "test")
        task = loop.create_task(box.run())

        def framework() -> None:
            for i in range(50):
                box.put_layer("t", record, i)  # no wake: "t" is not streaming
            box.put(record, "boom", wake=True)
            box.put(record, "after", wake=True)

        thread = threading.Thread(target=framework)
        thread.start()
        thread.join()
        async with asyncio.timeout(10):
            while len(ran) < 52:
                await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    loop.run_until_complete(main())
    loop.close()
    assert ran == [("t", i) for i in range(50)] + [("boom",), ("after",)]
    assert on_loop == {threading.get_ident()}  # the loop ran here, in this thread


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


HOOK_LINES = [(code, line) for code in (Inbox.put_layer.__code__, Inbox._kick.__code__)
              for line in sorted({ln for _s, _e, ln in code.co_lines() if ln is not None and ln > code.co_firstlineno})]
"""Every line a layer hook runs (put_layer and the wake it may send): the points where the registration can cut in."""


@pytest.mark.parametrize("pause", range(len(HOOK_LINES) + 1), ids=lambda i: f"before-line-{i}")
def test_a_hook_racing_the_registration_runs_without_any_timer(pause: int) -> None:
    """The race the 10 ms backstop used to cover: a layer hook on the framework thread, and a registration that
    makes its transfer stream on the loop. The hook is stopped before each of its lines in turn (the last case: after
    all of them), the registration runs then, and the hook goes on: its layer must reach the loop through a wake or
    the registration's drain, with no timer in the loop (the inbox has none)."""
    loop = asyncio.new_event_loop()
    ran: list = []
    target = HOOK_LINES[pause] if pause < len(HOOK_LINES) else None
    reached, go = threading.Event(), threading.Event()

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202
        if target is None or frame.f_code is not target[0]:
            return None

        def local(frame, event, arg):  # noqa: ANN001, ANN202
            if event == "line" and frame.f_lineno == target[1] and not reached.is_set():
                reached.set()
                go.wait(10)
            return local
        return local

    async def main() -> None:
        box = Inbox(loop, "test")
        task = loop.create_task(box.run())
        await asyncio.sleep(0)  # run() watches its wakes now

        def framework() -> None:
            sys.settrace(tracer)
            try:
                box.put_layer("t", lambda *args: ran.append(args), 7)
            finally:
                sys.settrace(None)
                reached.set()  # (the line was not run, e.g. a wake not sent: the hook simply finished)

        hook = threading.Thread(target=framework)
        hook.start()
        assert await asyncio.to_thread(reached.wait, 10)
        box.stream("t")  # the registration: from now on "t" has a decode rank to write to
        await asyncio.sleep(0)
        go.set()
        await asyncio.to_thread(hook.join, 10)
        async with asyncio.timeout(5):  # (this wait polls `ran`, not the inbox: only a wake or a drain runs it)
            while not ran:
                await asyncio.sleep(0.001)
        await stop(task)
        assert len(box) == 0

    loop.run_until_complete(main())
    loop.close()
    assert ran == [("t", 7)]


def test_a_burst_of_hooks_sends_one_wake_per_drain() -> None:
    """While a wake is on its way, further hooks of a streaming transfer add no syscall; every call still runs."""
    loop = asyncio.new_event_loop()
    ran: list = []

    async def main() -> None:
        box = Inbox(loop, "test")
        task = loop.create_task(box.run())
        box.stream("t")
        await asyncio.sleep(0)

        def framework() -> None:
            for i in range(100):
                box.put_layer("t", lambda *args: ran.append(args), i)

        await asyncio.to_thread(framework)
        async with asyncio.timeout(5):
            while len(ran) < 100:
                await asyncio.sleep(0.001)
        await stop(task)
        assert 1 <= box.wakes < 100

    loop.run_until_complete(main())
    loop.close()
    assert ran == [("t", i) for i in range(100)]


class Clocks:
    """The wall clock the hooks read and the loop thread's CPU clock, both in ns, moved by hand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now_ns, self.cpu_ns = 10_000_000_000, 0
        monkeypatch.setattr("connector.engine.inbox.time.monotonic_ns", lambda: self.now_ns)


def _layers(box: Inbox, loop: CountingLoop, clocks: Clocks, count: int, layer_ms: float, wake_cpu_us: int) -> int:
    """`count` layer hooks `layer_ms` apart; each wake they send is answered by the loop's turn, which costs the loop
    `wake_cpu_us` of CPU. Returns how many woke the loop."""
    woke = 0
    for _ in range(count):
        clocks.now_ns += int(layer_ms * 1e6)
        before = loop.wakes
        box.put_layer("a", lambda *_: None, 0)
        if loop.wakes > before:
            woke += 1
            box._on_wake()  # the turn the wake starts: paces, then drains
            clocks.cpu_ns += wake_cpu_us * 1000
    return woke


def test_the_layer_gap_widens_until_a_wake_costs_at_most_its_share_of_the_loop(monkeypatch: pytest.MonkeyPatch):
    """SenderConfig.layer_wake_cpu_share: the loop measures its CPU from one wake to the next while layers stream
    and widens the gap between layer wakes to cost / share, between layer_wake_gap_us and layer_wake_gap_max_us.
    Where a wake is cheap the floor holds; idle time between requests is never counted as a wake's cost."""
    clocks, loop = Clocks(monkeypatch), CountingLoop()
    box = Inbox(loop, "test", layer_gap_us=2000, cpu_share=0.02, layer_gap_max_us=50_000,  # type: ignore[arg-type]
                cpu_clock=lambda: clocks.cpu_ns)
    box.streaming.add("a")
    assert _layers(box, loop, clocks, 2, 8, wake_cpu_us=600) == 2  # 8 ms layers, a 2 ms floor: each wakes
    assert box.cpu_per_wake_ns == 600_000 and box.layer_gap_us == 30_000  # 0.6 ms / 2% = 30 ms
    assert _layers(box, loop, clocks, 12, 8, wake_cpu_us=600) == 3  # one wake per 4 layers of 8 ms now
    assert box.layer_gap_us == 30_000

    _layers(box, loop, clocks, 40, 8, wake_cpu_us=5_000)  # a wake costs 5 ms: the gap stops at the maximum
    assert box.layer_gap_us == 50_000
    _layers(box, loop, clocks, 400, 8, wake_cpu_us=20)  # 20 us a wake (a fast host): back to the floor
    assert box.layer_gap_us == 2000

    cost = box.cpu_per_wake_ns
    box.streaming.discard("a")  # between requests: the loop's CPU meanwhile is no wake's cost
    box.put(lambda: None, wake=True)
    box._on_wake()
    clocks.cpu_ns += 1_000_000_000
    box.streaming.add("a")
    _layers(box, loop, clocks, 1, 8, wake_cpu_us=20)  # its first wake only marks the clock
    assert box.cpu_per_wake_ns == cost

    every = Inbox(loop, "test", layer_gap_us=0, cpu_share=0.02, layer_gap_max_us=50_000,  # type: ignore[arg-type]
                  cpu_clock=lambda: clocks.cpu_ns)
    every.streaming.add("a")
    assert _layers(every, loop, clocks, 10, 8, wake_cpu_us=5_000) == 10  # gap 0: every layer wakes, no pacing
