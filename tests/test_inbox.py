"""The framework-thread -> loop hand-off (connector.engine.inbox): which calls wake the loop, and that every call
runs once, in order, whoever woke it."""

import asyncio
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
    box = Inbox(loop, 0.01, "test")  # type: ignore[arg-type]
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
    box.put(note, "end", wake=True)  # per-step calls always wake
    assert loop.wakes == 2
    box.drain()
    assert ran == [("a", 0), ("a", 1), ("a", 2), ("b", 3), ("end",)] and len(box) == 0


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
        box = Inbox(loop, 0.01, "test")
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
