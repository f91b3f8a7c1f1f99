"""Task ownership (connector.transport.loop): no task outlives its owner's aclose(), and no failure goes unheard."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from connector.transport.loop import LoopThread, OwnedTasks

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
