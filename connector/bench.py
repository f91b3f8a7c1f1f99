"""`python -m connector bench`: raw NIXL vs connector bulk vs connector stream, one prefill and one decode
process, the same blocks and the same descriptors in every run."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from connector.demo import Cluster, RequestResult, Scenario
from connector.layout import ParallelLayout


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


def bench(sc: Scenario, progress: bool = False) -> dict[str, Any]:
    one = ParallelLayout.build(sc.model.num_layers, 1, 1)
    sc = dataclasses.replace(sc, prefill=one, decode=one, chunks=1, prefix_tokens=0, late_register=False,
                             requests=4)
    bar = _Progress(progress, 5)
    with Cluster(sc) as cluster:
        bar.step("processes up")
        cluster.run_request(0, seed=0, mode="bulk", layer_ms=0.0)          # warm-up: handshakes, page faults
        bar.step("warm-up")
        _, prefill_conn = cluster.prefill[(0, 0)]
        _, seconds, raw_bytes, raw_descs = cluster.ask(prefill_conn, ("raw", 0, sc.tokens, cluster.registered),
                                                      sc.timeout_s, "prefill (0, 0)")
        bar.step("raw NIXL")
        layer_ms = sc.layer_ms or round(1.5 * seconds * 1e3 / sc.model.num_layers, 3)
        bulk = cluster.run_request(1, seed=0, mode="bulk", layer_ms=layer_ms)
        bar.step("connector bulk")
        hooks_before = len(cluster.hook_ns)
        stream = cluster.run_request(2, seed=0, mode="stream", layer_ms=layer_ms)
        bar.step("connector stream")
        hook_ns = sorted(cluster.hook_ns[hooks_before:])
    bulk_s = bulk.last_complete - bulk.compute_end

    def exposed(r: RequestResult) -> float:
        return round(max(0.0, r.last_complete - r.compute_end) * 1e3, 2)

    return {
        "model": sc.model.name, "tokens": sc.tokens, "block_size": sc.block_size, "device": sc.device,
        "bytes": raw_bytes, "descriptors": raw_descs, "blocks_per_layer": -(-sc.tokens // sc.block_size),
        "raw_gbps": round(raw_bytes / seconds / 1e9, 3),
        "connector_gbps": round(bulk.bytes / bulk_s / 1e9, 3),
        "connector_vs_raw": round((bulk.bytes / bulk_s) / (raw_bytes / seconds), 3),
        "layer_ms": layer_ms, "compute_ms": round((stream.compute_end - stream.compute_start) * 1e3, 2),
        "bulk_exposed_ms": exposed(bulk), "stream_exposed_ms": exposed(stream),
        "stream_vs_bulk_exposed": round(exposed(stream) / max(exposed(bulk), 1e-9), 3),
        "hook_us": round(hook_ns[len(hook_ns) // 2] / 1e3, 2) if hook_ns else 0.0,
        "verified": bulk.verified and stream.verified,
        "problems": bulk.problems + stream.problems,
    }
