"""Builders for tests: model layouts made directly (no config files), a rank's Hello and an accepted decode peer
for pure tests of the engines' rules (no NIXL, no memory), and demo scenarios; CPU time of processes and threads from
/proc."""

from __future__ import annotations

import itertools
import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from connector.core.layout import ModelLayout, ParallelLayout, PoolSpec, RankLayout, Region
from connector.engine.peers import PeerInfo
from connector.protocol.handshake import accept_peer, layout_wire
from connector.protocol.messages import Hello
from sparse_kv_lab.sim.cluster import Scenario
from connector.transport.side_channel import SideChannelConfig

KiB, MiB = 1 << 10, 1 << 20
POOL_GROUP = {"kv": 0, "index_k": 1, "index_v": 1}
"""KV-cache group per pool (as sparse_kv_lab.sim.buffers lays them out)."""


def make_model(kinds: str, kv_heads: int = 4, mla: bool = False, head_dim: int = 128,
               index_dim: int = 128, name: str = "test") -> ModelLayout:
    """`kinds` has one letter per layer: d = dense, k = sparse K-only, v = sparse with an index value."""
    n = len(kinds)
    if mla:
        kv = PoolSpec("kv", tuple(range(n)), 1, 1152, 1, False)
    else:
        kv = PoolSpec("kv", tuple(range(n)), kv_heads, 2 * head_dim * 2, 2, True)
    index_k = PoolSpec("index_k", tuple(i for i, c in enumerate(kinds) if c in "kv"), 1, index_dim * 2, 1, False)
    index_v = PoolSpec("index_v", tuple(i for i, c in enumerate(kinds) if c == "v"), 1, index_dim * 2, 1, False)
    return ModelLayout(name=name, num_layers=n, pools={"kv": kv, "index_k": index_k, "index_v": index_v})


def m3_like() -> ModelLayout:
    return make_model("ddd" + "k" * 57, kv_heads=4, name="minimax-m3-like")


def side(model: ModelLayout, spec: str) -> ParallelLayout:
    """`tp=T,pp=P[,layers=a:b:c]` -> ParallelLayout (the CLI's format)."""
    fields = dict(item.split("=") for item in spec.split(","))
    counts = [int(c) for c in fields["layers"].split(":")] if "layers" in fields else None
    return ParallelLayout.build(model.num_layers, int(fields.get("tp", 1)), int(fields.get("pp", 1)), counts)


def scenario(model: ModelLayout, prefill: str = "tp=1,pp=1", decode: str = "tp=1,pp=1", **kw: Any) -> Scenario:
    """A demo Scenario; small and quick unless told otherwise (100 tokens, no simulated compute, 60 s timeouts)."""
    kw.setdefault("tokens", 100)
    kw.setdefault("layer_ms", 0.0)
    kw.setdefault("timeout_s", 60.0)
    return Scenario(model=model, prefill=side(model, prefill), decode=side(model, decode), **kw)


def cpu_ticks(stat_path: str) -> tuple[str, int] | None:
    """(name, user + system clock ticks) from a Linux `/proc/<pid>/stat` or `/proc/<pid>/task/<tid>/stat` file;
    None when that process or thread has ended."""
    try:
        with open(stat_path) as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses: split after its last ")"
    return stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]) + int(fields[12])


def rank_regions(model: ModelLayout, parallel: ParallelLayout, rank: tuple[int, int], num_blocks: int,
                 block_size: int) -> list[Region]:
    """The regions rank `rank` holds, at made-up addresses 1 GiB apart (nothing is read or written through them)."""
    lay = RankLayout(model, parallel, *rank)
    out = []
    for pool in model.pools:
        spec, heads = model.pools[pool], lay.heads(pool)
        per_block = (heads[1] - heads[0]) * spec.bytes_per_token_per_head * block_size // spec.num_parts
        for slot, layer in enumerate(lay.layers(pool)):
            out.append(Region(pool=pool, layer=layer, slot=slot, base_addr=(1 + len(out)) << 30,
                              num_blocks=num_blocks, bytes_per_block=per_block, block_stride=per_block, heads=heads,
                              num_parts=spec.num_parts, part_stride=num_blocks * per_block,
                              group=POOL_GROUP[pool]))
    return out


def rank_hello(model: ModelLayout, role: str, parallel: ParallelLayout, rank: tuple[int, int] = (0, 0), *,
               engine: str = "", block_size: int = 16, num_blocks: int = 64, staging_bytes: int = 0) -> Hello:
    """A rank's Hello with its memory, as LocalRank.hello builds it (agent name and metadata made up)."""
    engine = engine or f"{role}-engine"
    regions = rank_regions(model, parallel, rank, num_blocks, block_size) if role == "decode" else []
    return Hello(role=role, engine_id=engine, pp_rank=rank[0], tp_rank=rank[1], pp_size=parallel.pp,
                 tp_size=parallel.tp, fingerprint=model.fingerprint(), layout=layout_wire(model),
                 num_layers=model.num_layers, block_size=block_size, agent_name=f"{engine}-{rank[0]}-{rank[1]}",
                 agent_metadata=b"meta", regions=regions,
                 stages=[tuple(st) for st in parallel.stages], staging_addr=0x5000_0000 if staging_bytes else 0,
                 staging_bytes=staging_bytes)


def accepted_decode_peer(own: Hello, model: ModelLayout, decode: Hello) -> PeerInfo:
    """A decode rank as a prefill rank's PeerTable admits it (plan, regions, routes; no NIXL agent loaded)."""
    info = PeerInfo(None, decode)
    info.accepted = accept_peer(decode, own, model)
    info.layer_routes = info.accepted.plan.layer_routes((own.pp_rank, own.tp_rank), info.key[1:])
    return info


def bare_side_channel(**fields: Any) -> SideChannelConfig:
    """The side channel as a raw test client or server speaks it: no heartbeats and no dead-peer timeout unless
    given (the engines' defaults send one every 2 s and drop a peer silent for 15 s)."""
    return SideChannelConfig(**{"heartbeat_interval_s": None, "dead_after_s": None, **fields})


_agent_ids = itertools.count()


class QuietHandler:
    """A side-channel server's handler (connector.transport.control.ControlHandler) that accepts every Hello with no
    session and ignores every message, close and refusal: a test overrides only what it looks at."""

    def peek(self, hello: Hello) -> None:
        return None

    def on_hello(self, peer: Hello) -> Any:
        return None

    async def on_message(self, conn: Any, msg: Any) -> None:
        return None

    def on_closed(self, conn: Any) -> None:
        return None

    def on_refused(self, hello: Hello, reason: str, address: str, came_for: Any) -> None:
        return None

    def on_refusal(self, kind: str) -> None:
        return None


def agent_name(tag: str) -> str:
    """A NIXL agent name no other agent of this test run has (tag, pid, counter)."""
    return f"tt-{tag}-{os.getpid()}-{next(_agent_ids)}"


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """`nbytes` seeded random bytes: what a WRITE moves, to be checked at the other end."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@contextmanager
def log_records(name: str) -> Iterator[list[logging.LogRecord]]:
    """Log records of logger `name` at INFO and above, whether or not it propagates (once connector.vllm is imported,
    vLLM's handlers have adopted the `connector` loggers and caplog sees nothing)."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = got.append
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield got
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextmanager
def prefill_side_channel(token: str, name: str = "probe-target") -> Iterator[tuple[int, list]]:
    """A real prefill side channel (the connector's ControlServer and handshake) for qwen3-8b with auth token
    `token`, on a free port of 127.0.0.1: (port, the peers that got past the handshake). For the probes of doctor and
    examples/proxy.py, which must never get that far."""
    from connector.core.hf_config import load_model
    from connector.transport.control import ControlServer
    from connector.transport.loop import LoopThread
    from connector.transport.ports import free_ports

    model = load_model("qwen3-8b")
    layout = ParallelLayout.build(model.num_layers, 1, 1)
    hello = Hello(role="prefill", engine_id="prefill-under-test", pp_rank=0, tp_rank=0, pp_size=1, tp_size=1,
                  fingerprint=model.fingerprint(), block_size=16, agent_name="prefill-agent",
                  stages=[tuple(s) for s in layout.stages], layout=layout_wire(model), num_layers=model.num_layers)
    registered: list = []

    class Probed(QuietHandler):
        async def on_hello(self, peer: Any) -> None:
            registered.append(peer)

        async def on_message(self, conn: Any, msg: Any) -> None:
            raise AssertionError("a probe sends no message after the handshake")

    loop = LoopThread(name).start()
    server = ControlServer(hello, Probed(), bare_side_channel(auth_token=token), port=free_ports())
    loop.run(server.start(), 10)
    try:
        yield server.port, registered
    finally:
        loop.run(server.aclose(), 10)
        loop.stop()
