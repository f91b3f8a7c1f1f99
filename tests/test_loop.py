"""Task ownership (connector.transport.loop): no task outlives its owner's aclose(), and no failure goes unheard."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from connector.transport.loop import LoopThread, OwnedTasks, wait_out

pytestmark = pytest.mark.timeout(20)


async def test_owned_tasks_log_failures_and_aclose_awaits_every_task(caplog):
    tasks = OwnedTasks("test owner")
    stopped: list[str] = []

    async def fails() -> None:
        raise RuntimeError("boom")

    async def runs_until_cancelled(tag: str) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.append(tag)
            tasks.spawn(on_the_way_out(tag))  # a task started while closing is owned and awaited too

    async def on_the_way_out(tag: str) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.append(f"{tag} cleanup")

    with caplog.at_level(logging.ERROR, logger="connector.transport.loop"):
        await asyncio.wait([tasks.spawn(fails(), name="fails")])
    assert "test owner: task fails failed" in caplog.text and "boom" in caplog.text
    for tag in ("a", "b"):
        tasks.spawn(runs_until_cancelled(tag))
    await asyncio.sleep(0)
    await tasks.aclose(timeout_s=5)
    assert sorted(stopped) == ["a", "a cleanup", "b", "b cleanup"]
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


def test_loop_thread_spawn_logs_a_failure_nobody_waits_for(caplog):
    async def fails() -> None:
        raise ValueError("nobody is waiting for me")

    lt = LoopThread("test-loop").start()
    try:
        with caplog.at_level(logging.ERROR, logger="connector.transport.loop"):
            fut = lt.spawn(fails(), "abort of transfer t1")
            deadline = time.monotonic() + 5
            while "abort of transfer t1 failed" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.01)
        assert fut.done() and "nobody is waiting for me" in caplog.text
    finally:
        lt.stop()


async def test_wait_out_holds_a_cancelled_waiter_until_the_future_is_done():
    """Memory an abandoned WRITE still uses is handed back only after it settled, even when its waiter is cancelled
    (twice, here) meanwhile; the cancellation is raised then."""
    settled = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(wait_out(settled))
    await asyncio.sleep(0.01)
    for _ in range(2):
        waiter.cancel()
        await asyncio.sleep(0.01)
        assert not waiter.done()
    settled.set_exception(RuntimeError("the WRITE failed"))  # its outcome is the owner's to read, not raised here
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert isinstance(settled.exception(), RuntimeError)


async def test_wait_out_returns_when_the_future_is_done():
    done = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, done.set_result, 7)
    await asyncio.wait_for(wait_out(done), 5)
    assert done.result() == 7
