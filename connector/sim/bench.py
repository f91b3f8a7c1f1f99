"""`python -m connector bench`: raw NIXL vs connector bulk vs connector stream, one prefill and one decode
process, the same blocks and the same descriptors in every run."""

from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Any

from connector.core.layout import ParallelLayout, blocks_for
from connector.sim.cluster import Cluster, RequestResult, Scenario


class _Progress:
    def __init__(self, enabled: bool, steps: int) -> None:
        self.enabled, self.steps, self.done = enabled, steps, 0

    def step(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / self.steps)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.steps} {what:<28}")
            sys.stderr.flush()
            if self.done == self.steps:
                sys.stderr.write("\n")


def bench(sc: Scenario, progress: bool = False, repeats: int = 5) -> dict[str, Any]:
    """Medians over `repeats` runs of each: raw NIXL, connector bulk, connector stream (same blocks each time)."""
    one = ParallelLayout.build(sc.model.num_layers, 1, 1)
    sc = dataclasses.replace(sc, prefill=one, decode=one, chunks=1, prefix_tokens=0, late_register=False)
    bar = _Progress(progress, 3 + 3 * repeats)
    raw_s, bulks, streams, seq = [], [], [], iter(range(1_000_000))
    with Cluster(sc) as cluster:
        bar.step("processes up")
        cluster.run_request(next(seq), seed=0, mode="bulk", layer_ms=0.0)   # warm-up: handshakes, page faults
        bar.step("warm-up")
        _, prefill_conn = cluster.prefill[(0, 0)]

        def raw() -> tuple[float, int, int]:
            _, seconds, nbytes, count = cluster.ask(prefill_conn, ("raw", 0, sc.tokens, cluster.registered),
                                                    sc.timeout_s, "prefill (0, 0)")
            return seconds, nbytes, count

        first_raw, raw_bytes, raw_descs = raw()
        bar.step("raw NIXL (sizing)")
        layer_ms = sc.layer_ms or round(1.5 * first_raw * 1e3 / sc.model.num_layers, 3)
        hooks_before = len(cluster.hook_ns)
        # Interleaved, so machine noise hits the three kinds alike.
        for _ in range(repeats):
            raw_s.append(raw()[0])
            bar.step("raw NIXL")
            bulks.append(cluster.run_request(next(seq), seed=0, mode="bulk", layer_ms=layer_ms))
            bar.step("connector bulk")
            streams.append(cluster.run_request(next(seq), seed=0, mode="stream", layer_ms=layer_ms))
            bar.step("connector stream")
        hook_ns = cluster.hook_ns[hooks_before:]
    raw_median = statistics.median(raw_s)

    def exposed(r: RequestResult) -> float:
        return max(0.0, r.last_complete - r.compute_end) * 1e3

    bulk_s = statistics.median(max(1e-9, r.last_complete - r.compute_end) for r in bulks)
    bulk_bytes = bulks[0].bytes
    return {
        "model": sc.model.name, "tokens": sc.tokens, "block_size": sc.block_size, "device": sc.device,
        "repeats": repeats, "bytes": raw_bytes, "descriptors": raw_descs,
        "blocks_per_layer": blocks_for(sc.tokens, sc.block_size),
        "raw_gbps": round(raw_bytes / raw_median / 1e9, 3),
        "connector_gbps": round(bulk_bytes / bulk_s / 1e9, 3),
        "connector_vs_raw": round((bulk_bytes / bulk_s) / (raw_bytes / raw_median), 3),
        "layer_ms": layer_ms,
        "compute_ms": round(statistics.median((r.compute_end - r.compute_start) * 1e3 for r in streams), 2),
        "bulk_exposed_ms": round(statistics.median(exposed(r) for r in bulks), 2),
        "stream_exposed_ms": round(statistics.median(exposed(r) for r in streams), 2),
        "stream_vs_bulk_exposed": round(statistics.median(exposed(r) for r in streams)
                                        / max(statistics.median(exposed(r) for r in bulks), 1e-9), 3),
        "hook_us": round(statistics.median(hook_ns) / 1e3, 2) if hook_ns else 0.0,
        "staging_mb": sc.staging_mb,
        "staged_chunks": bulks[0].staged_chunks,  # NIXL posts the bulk run needed instead of `descriptors`
        "verified": all(r.verified for r in bulks + streams),
        "problems": [p for r in bulks + streams for p in r.problems],
    }
