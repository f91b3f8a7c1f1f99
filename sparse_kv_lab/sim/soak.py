"""Soak: many small requests back to back between a prefill process and a decode process on real NIXL, sampling
both processes as it goes, to show that nothing grows per request (tools/soak.py runs it long, tests/test_soak.py
short). Two kinds of run:

  one connection  every request over the decode rank's one side-channel connection (and one NIXL peer)
  churn           every `churn_every` requests the decode rank drops its peer: its connections closed (prefill
                  releases the peer and unloads its NIXL agent; the next request connects and loads it again), and
                  every `restart_every`-th time it restarts instead (a new NIXL agent and engine id, as a decode
                  instance that came back)

Each side samples itself (sparse_kv_lab.sim.soak_probe) every `sample_every` requests: RSS, fds, threads, live objects,
the engine's per-transfer tables. `summarize` compares the baseline (the first sample at or after `warmup`) with the
last: deltas, and least-squares slopes per 10,000 requests. Decode checks every transfer's byte count and, every
`verify_every` requests, its bytes against the pattern prefill wrote; failures are counted, never raised mid-run.

This module stays light (no torch, no NIXL at import): the parent imports it; the workers are sparse_kv_lab.sim.soak_side.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from connector.core.hf_config import model_from_config
from connector.core.layout import ModelLayout, ParallelLayout, blocks_for
from connector.engine.config import SideChannelConfig
from sparse_kv_lab.sim.env import apply_env
from sparse_kv_lab.sim.spec import RankSpec

log = logging.getLogger(__name__)

SOAK_MODEL = {
    # MiniMax-M3-shaped and small (12 layers, 1 KiB of KV per token per layer), with all three pools: layers 2-11
    # sparse (index keys), 4, 6 and 9 also keeping index values. Small requests keep the run about the connector's
    # per-request work, not the copy.
    "architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3", "num_hidden_layers": 12,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "hidden_size": 512,
    "torch_dtype": "bfloat16", "sparse_attention_config": {
        "sparse_attention_freq": [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        "sparse_disable_index_value": [0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 1], "sparse_index_dim": 64}}


def soak_model() -> ModelLayout:
    return model_from_config(SOAK_MODEL, "soak-m3")


@dataclass(frozen=True)
class SoakPlan:
    requests: int
    churn_every: int = 0
    """Drop the decode rank's peer every this many requests (0: one connection for the whole run)."""
    restart_every: int = 0
    """Every this-many-th churn restarts the decode rank (new NIXL agent) instead (0: never)."""
    sample_every: int = 1000
    """Requests between samples (make it a multiple of churn_every: every sample at the same point of the cycle)."""
    warmup: int = 1000
    """Requests before the baseline sample (allocator pools, caches and the first connection settle)."""
    tokens: int = 48
    """Tokens per request (a few blocks; a multiple of the block size, so every block is full)."""
    block_size: int = 16
    num_blocks: int = 64
    """Blocks per pool of each simulated cache: every request gets random ones out of these."""
    verify_every: int = 1
    """Decode compares the bytes of every this-many-th request with the pattern (the byte count: every request)."""
    timeout_s: float = 60.0
    """One request, and prefill's lease: a request not done by then counts as failed."""
    stall_s: float = 600.0
    """The parent gives up on a worker that sends nothing for this long."""
    released_max_ids: int | None = None
    """Override prefill's memory of released transfer ids (RecentIds.max_ids, 65536): a short run sized to pass it."""
    log_level: int = logging.WARNING

    def __post_init__(self) -> None:
        if self.tokens % self.block_size:
            raise ValueError(f"tokens={self.tokens} must be a multiple of block_size={self.block_size} (full blocks: "
                             f"the byte count of every transfer is then known)")
        if self.churn_every and self.sample_every % self.churn_every:
            raise ValueError(f"sample_every={self.sample_every} must be a multiple of churn_every="
                             f"{self.churn_every}, so every sample is taken at the same point of the churn cycle")


@dataclass
class SoakResult:
    plan: SoakPlan
    samples: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per side, its end: requests done, failures and the first of them."""
    elapsed_s: float = 0.0

    def side(self, name: str) -> list[dict[str, Any]]:
        return [s for s in self.samples if s["side"] == name]

    @property
    def failures(self) -> int:
        return sum(d["failures"] for d in self.done.values())


def run_soak(plan: SoakPlan, on_sample: Callable[[dict[str, Any]], None] = lambda s: None) -> SoakResult:
    """Run `plan` in two worker processes (ended by PID when it is over, however it ends); `on_sample` hears every
    sample as it comes. Raises RuntimeError naming the side if a worker fails or goes silent for `plan.stall_s`."""
    apply_env()
    model = soak_model()
    parallel = ParallelLayout.build(model.num_layers, 1, 1)
    run_id = uuid.uuid4().hex[:6]
    if blocks_for(plan.tokens, plan.block_size) > plan.num_blocks:
        raise ValueError(f"num_blocks={plan.num_blocks} cannot hold {plan.tokens} tokens")
    ctx = mp.get_context("spawn")
    from sparse_kv_lab.sim import soak_side  # noqa: PLC0415 - light at import, like rank_process

    procs: dict[str, tuple[Any, Any]] = {}
    result = SoakResult(plan)
    started = time.monotonic()
    try:
        for side in ("prefill", "decode"):
            spec = RankSpec(side=side, rank=(0, 0), model=model, prefill=parallel, decode=parallel,
                            block_size=plan.block_size, num_blocks=plan.num_blocks, run_id=f"soak{run_id}",
                            timeout_s=plan.timeout_s, log_level=plan.log_level,
                            side_channel=SideChannelConfig(dead_after_s=30.0))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=soak_side.run, args=(child, side, plan, spec), name=f"soak-{side}",
                               daemon=True)
            proc.start()
            child.close()
            procs[side] = (proc, parent)
        ready = {side: _reply(conn, side, plan.stall_s) for side, (_p, conn) in procs.items()}
        procs["decode"][1].send(("go", ready["prefill"][1]))
        _collect(procs, result, plan.stall_s, on_sample)
    finally:
        _end(procs)
    result.elapsed_s = time.monotonic() - started
    return result


def _reply(conn: Any, side: str, timeout: float) -> tuple:
    if not conn.poll(timeout):
        raise RuntimeError(f"soak {side} worker sent nothing within {timeout:g} s (stuck starting its rank?)")
    try:
        msg = conn.recv()
    except EOFError:
        raise RuntimeError(f"soak {side} worker exited while starting; its log is on stderr") from None
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    return msg


def _collect(procs: dict[str, tuple[Any, Any]], result: SoakResult, stall_s: float,
             on_sample: Callable[[dict[str, Any]], None]) -> None:
    """Samples from both workers until each has sent its end."""
    side_of = {conn: side for side, (_p, conn) in procs.items()}
    last_heard = {side: time.monotonic() for side in procs}
    while len(result.done) < len(procs):
        live = [conn for conn, side in side_of.items() if side not in result.done]
        for conn in mp.connection.wait(live, timeout=5.0):
            side = side_of[conn]
            try:
                msg = conn.recv()
            except EOFError:
                raise RuntimeError(f"soak {side} worker exited (code {procs[side][0].exitcode}) before it finished; "
                                   f"its log is on stderr") from None
            last_heard[side] = time.monotonic()
            if msg[0] == "sample":
                result.samples.append(msg[1])
                on_sample(msg[1])
            elif msg[0] == "done":
                result.done[side] = msg[1]
            elif msg[0] == "error":
                raise RuntimeError(msg[1])
        for side, at in last_heard.items():
            if side not in result.done and time.monotonic() - at > stall_s:
                raise RuntimeError(f"soak {side} worker sent nothing for {stall_s:g} s (raise stall_s, or lower "
                                   f"sample_every, if a sample interval really takes that long)")


def _end(procs: dict[str, tuple[Any, Any]]) -> None:
    """Ask each worker to be done (they exit after their last message), then end the stragglers by PID."""
    for proc, _conn in procs.values():
        proc.join(timeout=30)
    for proc, _conn in procs.values():
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


# ---- the summary ------------------------------------------------------------------------------------------------
METRICS = ("rss_bytes", "rss_anon_bytes", "fds", "threads", "gc_objects")


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than two distinct x)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def _values(sample: dict[str, Any]) -> dict[str, float]:
    out = {m: sample[m] for m in METRICS}
    out.update({f"types.{k}": v for k, v in sample["types"].items()})
    out.update({f"tables.{k}": v for k, v in sample["tables"].items()})
    return out


def summarize(result: SoakResult) -> dict[str, Any]:
    """Per side: the baseline sample (the first at or after the warm-up) and the last, each metric's change between
    them and its slope per 10,000 requests over every sample from the baseline on; the request rate; failures."""
    plan = result.plan
    out: dict[str, Any] = {"plan": {k: getattr(plan, k) for k in plan.__dataclass_fields__},
                           "elapsed_s": round(result.elapsed_s, 1), "failures": result.failures,
                           "first_failures": [f for d in result.done.values() for f in d.get("first_failures", [])]}
    for side in ("prefill", "decode"):
        samples = result.side(side)
        warm = [s for s in samples if s["requests"] >= plan.warmup] or samples[-1:]
        if not warm:
            continue
        first, last = warm[0], warm[-1]
        before, after = _values(first), _values(last)
        series = {k: [(s["requests"], _values(s)[k]) for s in warm] for k in after}
        span = last["requests"] - first["requests"]
        out[side] = {
            "baseline_at": first["requests"], "last_at": last["requests"],
            "requests_per_s": round(span / (last["t_s"] - first["t_s"]), 1) if last["t_s"] > first["t_s"] else None,
            "first": {k: before.get(k) for k in after}, "last": after,
            "delta": {k: after[k] - before.get(k, 0) for k in after},
            "per_10k_requests": {k: round(slope(v) * 10_000, 1) for k, v in series.items()},
            "grown_types": last.get("grown", {}),
        }
        out[side]["rss_bytes_per_request"] = round(slope(series["rss_bytes"]), 1)
    return out
