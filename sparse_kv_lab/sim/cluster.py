"""Multi-process demo: one OS process per prefill rank and per decode rank, real NIXL between them, on 127.0.0.1 or
with each side on a "node" of its own (a network namespace: `Scenario.prefill_node` / `decode_node`).

The parent only coordinates over pipes (which request, which chunk, when a PP stage may start); all KV bytes move
prefill -> decode through NIXL WRITEs posted by the stream engine. Decode ranks verify every byte they hold.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from connector.core.layout import ModelLayout, ParallelLayout, blocks_for
from connector.core.plan import Rank
from connector.engine.config import SideChannelConfig, default_staging_mb
from connector.protocol.addressing import PrefillAddress
from sparse_kv_lab.sim import rank_process
from sparse_kv_lab.sim.env import apply_env
from sparse_kv_lab.sim.spec import Placement, RankSpec
from connector.transport.ports import free_ports

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scenario:
    model: ModelLayout
    prefill: ParallelLayout
    decode: ParallelLayout
    tokens: int = 1024
    block_size: int = 16
    decode_block_size: int = 0         # decode ranks' block size (0: block_size): one a multiple of the other
    layer_ms: float = 0.0
    mode: str = "stream"               # stream: layer_ready after each layer; bulk: only the end-of-chunk sweep
    device: str = "cpu"
    chunks: int = 1                    # chunked prefill: the prompt in this many forwards
    prefix_tokens: int = 0             # decode prefix-cache hit (block-aligned): not transferred
    late_register: bool = False        # decode registers only after prefill finished (bulk fallback path)
    hook_layers: str = "all"           # all | even: which layers get layer_ready (the rest are swept)
    fill_ahead: bool = False           # write the content before compute: a layer is layer_ms of sleep alone
    run_blocks: int = 1                # block allocation: runs of this many consecutive ids (1 = scattered)
    staging_mb: int | None = None      # per rank staging buffer (connector.engine.staging); 0 = direct WRITEs
                                       # only; None = the default for the device (connector.engine.config)
    requests: int = 1
    timeout_s: float = 120.0
    seed: int = 0
    prefill_node: Placement = Placement()   # where the prefill ranks run; its host is the side-channel address
    decode_node: Placement = Placement()
    side_channel: SideChannelConfig = SideChannelConfig()
    tcp_user_timeout_s: float | None = RankSpec.__dataclass_fields__["tcp_user_timeout_s"].default
    nixl_threads: int = RankSpec.__dataclass_fields__["nixl_threads"].default
    write_timeout_s: float | None = None   # None: timeout_s
    auth_token: str = ""               # the side channel's shared secret, on every rank
    sender_config: Any = None          # prefill ranks' engine settings (connector.engine.config.SenderConfig)
    kv_checksum: bool = False          # decode ranks verify every transfer end to end (ReceiverConfig.kv_checksum)

    @property
    def staging(self) -> int:
        """MiB of staging buffer per rank, the default resolved."""
        return default_staging_mb(self.device.startswith("cuda")) if self.staging_mb is None else self.staging_mb

    @property
    def num_blocks(self) -> int:
        """Blocks per pool of each simulated cache: room for every request twice over, so blocks can be random."""
        return blocks_for(self.tokens, min(self.block_size, self.decode_block_size or self.block_size)) \
            * self.requests * 2 + 8

    def rank_spec(self, side: Literal["prefill", "decode"], rank: Rank, base_port: int = 0,
                  run_id: str = "sim") -> RankSpec:
        return RankSpec(side=side, rank=rank, model=self.model, prefill=self.prefill, decode=self.decode,
                        block_size=self.decode_block_size or self.block_size if side == "decode" else self.block_size,
                        num_blocks=self.num_blocks, device=self.device,
                        run_blocks=self.run_blocks, staging_mb=self.staging, base_port=base_port, run_id=run_id,
                        timeout_s=self.timeout_s, log_level=logging.getLogger().level or logging.WARNING,
                        placement=self.prefill_node if side == "prefill" else self.decode_node,
                        side_channel=self.side_channel, tcp_user_timeout_s=self.tcp_user_timeout_s,
                        nixl_threads=self.nixl_threads,
                        write_timeout_s=self.write_timeout_s,
                        auth_token=self.auth_token, sender_config=self.sender_config, kv_checksum=self.kv_checksum)


@dataclass
class RequestResult:
    transfer_id: str
    verified: bool
    problems: list[str]
    bytes: int
    descriptors: int
    staged_chunks: int
    compute_start: float
    compute_end: float
    first_post: float
    last_complete: float
    nixl_posts: int = 0
    """NIXL WRITE requests the connector posted for this request (all prefill ranks)."""
    nixl_descriptors: int = 0
    """Descriptors in them: one per staged chunk, one per byte range of a direct WRITE."""
    layer_computed: dict[int, float] = field(default_factory=dict)
    """Global layer -> when prefill finished computing it (its last chunk; time.time())."""
    timeline: list[tuple] = field(default_factory=list)
    """Every batch the prefill ranks posted: (layers, bytes, posted, written, landed, staged chunks), time.time()."""
    checksummed_blocks: int = 0
    """`kv_checksum`: (route, block) digests the decode ranks compared with prefill's, all equal."""
    costs: list[tuple] = field(default_factory=list)
    """Per prefill chunk: (sparse_kv_lab.sim.costs.HookCosts, CpuSplit) of the rank that computed it."""

    @property
    def exposed_s(self) -> float:
        """From the end of prefill's compute to the last decode rank's completion."""
        return max(0.0, self.last_complete - self.compute_end)

    @property
    def streamed_bytes(self) -> int:
        """Bytes in decode's blocks before prefill finished computing."""
        return sum(t[1] for t in self.timeline if t[4] <= self.compute_end)


@dataclass
class DemoResult:
    verified: bool
    mode: str
    bytes: int
    descriptors: int
    transfer_gbps: float
    compute_ms: float
    exposed_ms: float
    ranks: dict[str, int]
    hook_us: float
    staged_chunks: int = 0
    """Gathered chunks the descriptors went in (0: every descriptor was its own NIXL descriptor)."""
    nixl_descriptors: int = 0
    """Descriptors posted to NIXL: `staged_chunks` plus the byte ranges written directly."""
    streamed_pct: float = 0.0
    """Share of the bytes that were in decode's memory before prefill finished computing."""
    staging_mb: int = 0
    raw_gbps: float = 0.0
    """The yardstick: raw NIXL on the last request's block ranges, one WRITE per rank pair, one pair at a time, no
    compute (what NIXL itself moves of those bytes on this machine)."""
    checksummed_blocks: int = 0
    """`kv_checksum`: (route, block) digests the decode ranks compared with prefill's, all equal."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Cluster:
    """The worker processes of one demo/bench run; ends them by PID on exit."""

    def __init__(self, sc: Scenario, spawn: tuple[str, ...] = ("prefill", "decode")) -> None:
        """`spawn`: which sides run as worker processes (tests play the other side in-process)."""
        apply_env()
        self.sc = sc
        self.ctx = mp.get_context("spawn")
        self.base_port = free_ports(sc.prefill.pp * sc.prefill.tp)
        self.run_id = uuid.uuid4().hex[:6]
        self.hook_ns: list[int] = []
        self.registered: dict[tuple[int, int], list[list[int]]] = {}
        self.prefill: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.decode: dict[tuple[int, int], tuple[Any, Any]] = {}
        for side, parallel, table in (("prefill", sc.prefill, self.prefill), ("decode", sc.decode, self.decode)):
            for rank in parallel.ranks() if side in spawn else ():
                parent, child = self.ctx.Pipe()
                spec = sc.rank_spec(side, rank, self.base_port, self.run_id)
                proc = self.ctx.Process(target=rank_process.run, args=(child, spec),
                                        name=f"{side}-{rank[0]}-{rank[1]}", daemon=True)
                proc.start()
                child.close()
                table[rank] = (proc, parent)

    @property
    def prefill_address(self) -> PrefillAddress:
        """Where decode finds prefill rank (0, 0)'s side channel."""
        return PrefillAddress(self.sc.prefill_node.host, self.base_port)

    def all(self) -> list[tuple[tuple[str, tuple[int, int]], Any, Any]]:
        return [(("prefill", r), p, c) for r, (p, c) in self.prefill.items()] + \
               [(("decode", r), p, c) for r, (p, c) in self.decode.items()]

    def ask(self, conn: Any, msg: tuple, timeout: float, who: Any) -> Any:
        conn.send(msg)
        return self.reply(conn, timeout, who)

    def reply(self, conn: Any, timeout: float, who: Any) -> Any:
        if not conn.poll(timeout):
            raise TimeoutError(f"{who} did not answer within {timeout:.0f} s")
        answer = conn.recv()
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise RuntimeError(f"{who} failed: {answer[1]}")
        return answer

    def wait_ready(self) -> None:
        for who, _proc, conn in self.all():
            self.reply(conn, self.sc.timeout_s, who)

    def close(self) -> None:
        for _who, proc, conn in self.all():
            try:
                conn.send(("quit",))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 15
        for _who, proc, conn in self.all():
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("worker %s (pid %s) did not exit; killing it", proc.name, proc.pid)
                proc.kill()
                proc.join(5)
            conn.close()

    def __enter__(self) -> "Cluster":
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- one request -------------------------------------------------------------------------------------------
    def run_request(self, seq: int, seed: int | None = None, mode: str | None = None,
                    layer_ms: float | None = None, checksum: bool | None = None) -> RequestResult:
        """One request end to end. `seed` picks the block ids (same seed = same blocks and descriptors); `checksum`:
        decode verifies it end to end (None: the scenario's kv_checksum)."""
        sc, tid, t = self.sc, f"{self.run_id}-req{seq}", self.sc.timeout_s
        seed = seq if seed is None else seed
        mode = mode or sc.mode
        layer_ms = sc.layer_ms if layer_ms is None else layer_ms
        if not sc.late_register:
            self._register(tid, seed, checksum)
        for rank, (_p, conn) in self.prefill.items():
            self.ask(conn, ("start", tid, sc.tokens, seed), t, ("prefill", rank))
        bounds = [round(sc.tokens * (c + 1) / sc.chunks) for c in range(sc.chunks)]
        t0, starts, ends, hooks, computed, costs = 0, [], [], [], {}, []
        for t1 in bounds:
            for stage in range(sc.prefill.pp):
                ranks = [r for r in self.prefill if r[0] == stage]
                for r in ranks:
                    self.prefill[r][1].send(("chunk", tid, t0, t1, layer_ms, mode, sc.hook_layers, sc.fill_ahead))
                for r in ranks:
                    _, start, end, hook_ns, layer_done, cost = self.reply(self.prefill[r][1], t, ("prefill", r))
                    costs.append(cost)
                    starts.append(start)
                    ends.append(end)
                    hooks += hook_ns
                    computed.update(layer_done)
            t0 = t1
        if sc.late_register:
            self._register(tid, seed, checksum)
        prefill_stats = [self.ask(conn, ("finish", tid), t, ("prefill", r)) for r, (_p, conn) in self.prefill.items()]
        decode_out = [self.ask(conn, ("collect", tid), t, ("decode", r)) for r, (_p, conn) in self.decode.items()]
        problems = [f"decode {r}: {p}" for r, out in zip(self.decode, decode_out) for p in out[1]]
        problems += [f"prefill {r}: transfer not finished cleanly" for r, s in zip(self.prefill, prefill_stats)
                     if not s[1]]
        self.hook_ns += hooks
        posts = [s[2] for s in prefill_stats if s[2]]
        nixl = [s[4] for s in prefill_stats]
        return RequestResult(
            transfer_id=tid, verified=not problems, problems=problems,
            bytes=sum(out[2] for out in decode_out), descriptors=sum(out[3] for out in decode_out),
            staged_chunks=sum(out[5] for out in decode_out), compute_start=min(starts), compute_end=max(ends),
            first_post=min(posts) if posts else max(ends), last_complete=max(out[4] for out in decode_out),
            nixl_posts=sum(n[0] for n in nixl), nixl_descriptors=sum(n[1] for n in nixl), layer_computed=computed,
            timeline=[t for s in prefill_stats for t in s[3]], checksummed_blocks=sum(out[6] for out in decode_out),
            costs=costs)

    def raw_gbps(self, seed: int) -> float:
        """Raw NIXL's rate on request `seed`'s block ranges into the blocks decode registered last (written over
        after they were verified), every prefill rank in turn."""
        seconds = nbytes = 0
        for rank, (_p, conn) in self.prefill.items():
            _, s, b, _n = self.ask(conn, ("raw", seed, self.sc.tokens, self.registered), self.sc.timeout_s,
                                   ("prefill", rank))
            seconds, nbytes = seconds + s, nbytes + b
        return round(nbytes / seconds / 1e9, 3) if seconds else 0.0

    def _register(self, tid: str, seed: int, checksum: bool | None = None) -> None:
        addr = str(self.prefill_address)
        self.registered = {}
        for rank, (_p, conn) in self.decode.items():
            reply = self.ask(conn, ("receive", tid, self.sc.tokens, self.sc.prefix_tokens, addr, seed, checksum),
                             self.sc.timeout_s, ("decode", rank))
            self.registered[rank] = reply[1]


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: the time at least one of them was running."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def run_scenario(sc: Scenario) -> DemoResult:
    with Cluster(sc) as cluster:
        results = [cluster.run_request(i) for i in range(sc.requests)]
        hook_ns = cluster.hook_ns
        raw_gbps = cluster.raw_gbps(sc.requests - 1)
    total = sum(r.bytes for r in results)
    # The transfer's own active time: while some batch was between its post and its landing in decode's blocks
    # (bytes over the whole compute time would mostly measure how long prefill computed).
    busy = busy_seconds([(t[2], t[4]) for r in results for t in r.timeline]) or 1e-9
    moved = sum(t[1] for r in results for t in r.timeline) or 1
    return DemoResult(
        verified=all(r.verified for r in results), mode=sc.mode, bytes=total,
        descriptors=sum(r.descriptors for r in results), transfer_gbps=round(moved / busy / 1e9, 3),
        compute_ms=round(sum(r.compute_end - r.compute_start for r in results) * 1e3, 2),
        exposed_ms=round(sum(r.exposed_s for r in results) * 1e3, 2),
        ranks={"prefill": sc.prefill.pp * sc.prefill.tp, "decode": sc.decode.pp * sc.decode.tp},
        hook_us=round(statistics.median(hook_ns) / 1e3, 2) if hook_ns else 0.0,
        staged_chunks=sum(r.staged_chunks for r in results),
        nixl_descriptors=sum(r.nixl_descriptors for r in results),
        streamed_pct=round(100.0 * sum(r.streamed_bytes for r in results) / moved, 1), staging_mb=sc.staging,
        raw_gbps=raw_gbps, checksummed_blocks=sum(r.checksummed_blocks for r in results),
        requests=[asdict(r) for r in results], problems=[p for r in results for p in r.problems])
