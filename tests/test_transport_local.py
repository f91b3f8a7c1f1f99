"""Transport calls that need no peer process: unknown peers, close, the byte gate, descriptor arrays (real NIXL agents
in this process; tests/test_transport.py covers WRITEs between processes)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from connector.core.errors import TransportError
from connector.transport.nixl import Transport, TransportConfig, descs_array
from sparse_kv_lab.sim.env import apply_env
from tests.helpers import KiB, agent_name, pattern

apply_env()  # this process hosts agents (NIXL loads with the first one)


async def test_unknown_peer_raises_transport_error() -> None:
    src = pattern(8 * KiB, 7)
    async with Transport(TransportConfig(agent_name("u"))) as a:
        a.register(src)
        with pytest.raises(TransportError, match="nobody.*add_peer"):
            await a.write("nobody", [(src.ctypes.data, 4096)], [(0x1000, 4096)])
        # descriptor validation comes first: ValueError even for an unknown peer
        with pytest.raises(ValueError):
            await a.write("nobody", [(src.ctypes.data, 4096)], [])
        assert a.stats.posts == 0


async def test_close_is_idempotent_and_releases_everything() -> None:
    src = pattern(8 * KiB, 8)
    a = Transport(TransportConfig(agent_name("c")))
    async with Transport(TransportConfig(agent_name("other"))) as other:
        other.register(src)
        async with a:
            a.register(src)
            peer = a.add_peer(other.metadata)  # add_peer connects eagerly: the peer must be alive
            await a.write(peer, [(src.ctypes.data, 4096)], [(src.ctypes.data + 4096, 4096)])
            assert a.metadata and a.agent is not None and a.peers == {other.name} and a.open_handles == 0
        await a.aclose()
    await asyncio.gather(a.aclose(), a.aclose())
    assert a._agent is None and a.open_handles == 0 and not a._regs and not a.peers
    assert a._poller is not None and not a._poller.is_alive()
    with pytest.raises(TransportError, match="closed"):
        await a.write("x", [(src.ctypes.data, 8)], [(0, 8)])
    with pytest.raises(TransportError, match="closed"):
        a.register(src)


async def test_byte_gate_is_fifo_admits_oversize_alone_and_survives_cancel() -> None:
    from connector.transport.nixl.settings import ByteGate as _ByteGate, TransportStats

    stats = TransportStats()
    gate = _ByteGate(100, stats)
    await gate.acquire(60)
    order: list[str] = []

    async def take(tag: str, n: int) -> None:
        await gate.acquire(n)
        order.append(tag)

    big = asyncio.create_task(take("big", 500))  # larger than the cap: waits until nothing is in flight
    small = asyncio.create_task(take("small", 10))  # would fit, but FIFO keeps it behind `big`
    doomed = asyncio.create_task(take("doomed", 10))
    await asyncio.sleep(0)
    assert order == [] and gate.inflight == 60
    doomed.cancel()
    await asyncio.sleep(0)
    gate.release(60)
    await asyncio.sleep(0)
    assert order == ["big"] and gate.inflight == 500
    gate.release(500)
    await asyncio.wait_for(small, 1)
    assert order == ["big", "small"] and gate.inflight == 10 and stats.peak_inflight_bytes == 500
    assert doomed.cancelled()


def test_descs_array_shapes() -> None:
    a = descs_array([(1, 2), (3, 4)], device=5)
    assert a.dtype == np.uint64 and a.tolist() == [[1, 2, 5], [3, 4, 5]]
    assert descs_array(np.array([[1, 2, 0]], dtype=np.int64)).tolist() == [[1, 2, 0]]
    assert descs_array([]).shape == (0, 3)
    with pytest.raises(ValueError):
        descs_array([(1, 2, 3, 4)])
    with pytest.raises(ValueError):
        TransportConfig("x", progress_delay_us=0)
    with pytest.raises(ValueError, match="nixl_threads must be within 0..64, not 65"):
        TransportConfig("x", nixl_threads=65)


def test_the_nixl_transport_is_what_the_engines_type_it_as() -> None:
    """connector.transport.base.KVTransport (the engines' type for a transport) and the NIXL Transport agree on
    every member: same kind (property or method), same signature."""
    import inspect

    from connector.transport.base import KVTransport

    members = [n for n, v in vars(KVTransport).items() if not n.startswith("_") and (callable(v) or
                                                                                    isinstance(v, property))]
    assert sorted(members) == ["add_peer", "metadata", "name", "remove_peer", "write"]
    for name in members:
        want, got = inspect.getattr_static(KVTransport, name), inspect.getattr_static(Transport, name)
        if isinstance(want, property):
            assert isinstance(got, property), name
        else:
            assert inspect.signature(got, eval_str=True) == inspect.signature(want, eval_str=True), name
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name
