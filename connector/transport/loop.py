"""One asyncio event loop per process, in its own thread. Framework threads (vLLM's model runner, the demo's
compute loop) hand work to it without blocking: a save hook must return in microseconds.

Every task has an owner: `OwnedTasks` for the tasks an object starts on the loop, `LoopThread.spawn` for work a
framework thread starts and does not wait for. Neither drops an error: a failure is logged when the task ends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time
import traceback
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


STALL_WARN_S = 2.0
"""A loop that runs no callback for this long is reported, with what its thread is doing: every peer wait and
heartbeat of the process stops meanwhile, so a stall must never go unexplained."""


class LoopThread:
    def __init__(self, name: str = "sparse-kv-loop") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("LoopThread is not started: call start() first")
        return self._loop

    def start(self) -> "LoopThread":
        if self._thread is not None:
            return self
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            ready.set()
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"event loop thread {self._name} did not start within 10 s")
        self._stopping.clear()
        self._watchdog = threading.Thread(target=self._watch, name=f"{self._name}-watchdog", daemon=True)
        self._watchdog.start()
        return self

    def _watch(self) -> None:
        """Ping the loop every half second; if a ping waits more than STALL_WARN_S, log the loop thread's stack
        (once per stall) and, when it recovers, how long it was blocked."""
        loop, thread = self._loop, self._thread
        assert loop is not None and thread is not None
        while not self._stopping.wait(0.5):
            answered = threading.Event()
            sent = time.monotonic()
            try:
                loop.call_soon_threadsafe(answered.set)
            except RuntimeError:  # loop closed
                return
            if answered.wait(STALL_WARN_S) or self._stopping.is_set():
                continue
            log.warning("event loop %s has run nothing for %.1f s; its thread is at:\n%s%s", self._name,
                        time.monotonic() - sent, _stack_of(thread), _other_threads(thread))
            while not answered.wait(1.0):
                if self._stopping.is_set():
                    return
            log.warning("event loop %s ran again after %.1f s blocked", self._name, time.monotonic() - sent)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop thread soon; returns at once (FIFO with other calls)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def submit(self, coro: Awaitable[T]) -> "concurrent.futures.Future[T]":
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def spawn(self, coro: Awaitable[T], what: str) -> "concurrent.futures.Future[T]":
        """`submit` for work nobody waits for: its failure is logged (naming `what`), never dropped."""
        fut = self.submit(coro)
        fut.add_done_callback(lambda f: _log_failure(f, what))
        return fut

    def run(self, coro: Awaitable[T], timeout: float) -> T:
        """Run `coro` on the loop and wait for it from this (non-loop) thread, at most `timeout` s."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"{getattr(coro, '__qualname__', coro)} did not finish within {timeout} s") from None

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None:
            return
        self._stopping.set()
        loop = self._loop

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout)
        except Exception as exc:  # noqa: BLE001 - shutting down; say what was left
            log.warning("event loop %s: tasks did not stop cleanly: %r", self._name, exc)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout)
        self._thread = None
        if self._watchdog is not None:
            self._watchdog.join(timeout)
            self._watchdog = None


def _stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"


def _other_threads(loop_thread: threading.Thread) -> str:
    """The innermost frames of every other thread: a loop thread waiting in its selector while nothing runs was
    held off by another thread holding the GIL (a C call that does not release it), which is then among these."""
    me, names = threading.get_ident(), {t.ident: t.name for t in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        if ident in (me, loop_thread.ident):
            continue
        frames = reversed(traceback.extract_stack(frame, limit=3))
        where = " < ".join(f"{f.name} ({f.filename}:{f.lineno})" for f in frames)
        lines.append(f"  {names.get(ident, ident)}: {where}")
    return "\nother threads, innermost frames first:\n" + "\n".join(sorted(lines)) if lines else ""


async def wait_out(fut: Any) -> None:
    """Wait until `fut` is done, even when the waiting task is cancelled meanwhile: the cancellation is raised only
    once it is (memory a NIXL WRITE or a copy thread still uses must not be handed back before). Its outcome is
    not raised; read it from `fut`."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def _log_failure(fut: Any, what: str) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("%s failed", what, exc_info=fut.exception())


class OwnedTasks:
    """The tasks one object runs on its loop. Each task's failure is logged when it ends (none is dropped), and
    `aclose()` cancels and awaits every task still running. Not a TaskGroup on purpose: one failed task (one
    decode rank's WRITE, one connection's reader) must not cancel its siblings."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        _log_failure(task, f"{self.owner}: task {task.get_name()}")

    async def cancel(self, tasks: "set[asyncio.Task[Any]] | list[asyncio.Task[Any]]", timeout_s: float) -> None:
        """Cancel `tasks` (never the caller's own) and wait, at most `timeout_s`, until they have ended."""
        others = [t for t in tasks if t is not asyncio.current_task() and not t.done()]
        for task in others:
            task.cancel()
        if others:
            _, late = await asyncio.wait(others, timeout=timeout_s)
            if late:
                log.warning("%s: %d task(s) still running %.0f s after cancel", self.owner, len(late), timeout_s)

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Cancel and await every task, also those that cancelled ones start on their way out (a few rounds)."""
        for _ in range(5):
            if not self._tasks - {asyncio.current_task()}:
                return
            await self.cancel(set(self._tasks), timeout_s)
