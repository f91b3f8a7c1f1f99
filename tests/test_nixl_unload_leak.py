"""Sockets of unloaded decode agents come back once the decode process is gone (issue 33, item 1).

NIXL 1.5.1 closes a removed peer's UCX endpoints in flush mode and UCX keeps them, one TCP socket per UCX worker
(1 + nixl_threads), while the peer lives; when the peer exits only a progressed worker closes them, and NIXL's
thread-pool workers are progressed only while they run a large WRITE. Without the Transport's sweeps
(TransportConfig.unload_sweep_s) prefill kept 4 sockets (CLOSE_WAIT) per unload for as long as it ran
(tools/nixl_unload_leak.py prints the tables). Real NIXL between two OS processes: this one ("prefill") and a
"decode" child that the tool starts.
"""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "nixl_unload_leak.py"
CYCLES = 10
THREADS = 4
SWEEP_S = 0.2


def _tool():
    spec = importlib.util.spec_from_file_location("nixl_unload_leak", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("nixl_unload_leak", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
async def test_unloaded_agents_sockets_are_closed_once_the_decode_process_is_gone():
    from sparse_kv_lab.sim.env import apply_env

    apply_env()  # UCX_NET_DEVICES=lo, before NIXL loads
    import os

    from connector.transport.nixl.agent import Transport
    from connector.transport.nixl.settings import TransportConfig

    tool = _tool()
    decode = tool.Decode(f"unload-leak-decode-{os.getpid()}", THREADS, dict(os.environ))
    try:
        config = TransportConfig(name=f"unload-leak-prefill-{os.getpid()}", nixl_threads=THREADS,
                                 unload_sweep_s=SWEEP_S)
        async with Transport(config) as t:
            src = np.arange(4096, dtype=np.uint64).view(np.uint8)[:4096].copy()
            t.register(src)
            baseline = tool.fd_kinds()
            for i in range(CYCLES):
                peer = t.add_peer(decode.metadata)
                await t.write(peer, [(src.ctypes.data, 1024)], [(decode.addr + 1024 * (i % 4), 1024)])
                t.remove_peer(peer)
            loaded = tool.fd_kinds()
            # UCX keeps them while the decode lives (NIXL 1.5.1: no force close): one per UCX worker per unload.
            assert tool._sockets(loaded) - tool._sockets(baseline) >= CYCLES * (1 + THREADS) // 2, (baseline, loaded)
            peer = t.add_peer(decode.metadata)  # a real transfer still works after all that, byte-exact
            await t.write(peer, [(src.ctypes.data, 4096)], [(decode.addr, 4096)])
            assert decode.ask_sum()["sum"] == int(src.sum(dtype=np.uint64))
            t.remove_peer(peer)
            decode.stop()
            after = tool.fd_kinds()
            for _ in range(50):  # the sweeps run every SWEEP_S; a sweep may miss a worker, the next reaches it
                await asyncio.sleep(SWEEP_S)
                after = tool.fd_kinds()
                if tool._sockets(after) <= tool._sockets(baseline):
                    break
            assert tool._sockets(after) <= tool._sockets(baseline), (
                f"prefill kept {tool._sockets(after) - tool._sockets(baseline)} sockets of an unloaded decode agent "
                f"after the decode process exited: {dict(baseline)} -> {dict(after)}")
            assert sum(after.values()) <= sum(baseline.values()), (dict(baseline), dict(after))
            assert t.stats.unloads == CYCLES + 1 and t.stats.sweeps > 0
    finally:
        decode.stop()
