"""The Transport's threads: an idle agent must not spin a core (NIXL's progress thread is patched), and close() must
end the agent's native threads even while the Transport object is still referenced. Linux (/proc/self/task)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from sparse_kv_lab.sim.env import apply_env
from connector.transport.nixl import Transport, TransportConfig
from tests.helpers import agent_name, cpu_ticks

apply_env()  # this process hosts agents (NIXL loads with the first one)


def _thread_cpu_ticks() -> dict[str, int]:
    """utime+stime (clock ticks) of every thread of this process, by thread id (Linux /proc)."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        got = cpu_ticks(f"/proc/self/task/{tid}/stat")
        if got is not None:  # (None: the thread ended meanwhile)
            ticks[tid] = got[1]
    return ticks


async def test_idle_agent_does_not_spin_a_core() -> None:
    # Only this transport's threads (those born after it was entered) and the loop thread are counted: threads
    # that other tests in this pytest process left behind must not decide this test (CI once measured 26 %).
    before = set(_thread_cpu_ticks())
    main_tid = str(threading.get_native_id())
    async with Transport(TransportConfig(agent_name("idle"))):
        await asyncio.sleep(0.2)
        mine = (set(_thread_cpu_ticks()) - before) | {main_tid}
        assert len(mine) > 1, "the transport started no threads of its own; the measurement would be empty"
        t0, w0 = _thread_cpu_ticks(), time.monotonic()
        await asyncio.sleep(2.0)
        t1, wall = _thread_cpu_ticks(), time.monotonic() - w0
    used = sum(t1[t] - t0[t] for t in mine if t in t0 and t in t1) / os.sysconf("SC_CLK_TCK")
    assert used / wall < 0.25, f"idle transport used {used / wall:.0%} of a core"  # ~5 % measured; stock: 100 %


async def test_close_ends_the_agents_native_threads() -> None:
    """close() must destroy the nixl_agent (its progress and UCX threads) even while the Transport object lives."""
    async with Transport(TransportConfig(agent_name("warm"))):  # the first agent may start process-wide UCX threads
        pass
    base = len(_thread_cpu_ticks())
    kept = []
    for i in range(6):
        t = Transport(TransportConfig(agent_name(f"threads{i}")))
        async with t:
            assert len(_thread_cpu_ticks()) > base
        kept.append(t)
    # each leaked agent keeps at least one native thread (+6 here); slack of 2 for unrelated pool threads
    after = len(_thread_cpu_ticks())
    assert after <= base + 2, f"closed transports still hold native threads: {base} -> {after} (agent not destroyed)"
