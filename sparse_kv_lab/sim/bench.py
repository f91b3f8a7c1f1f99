"""`python -m connector bench`: one prefill and one decode process, the same blocks every run, measured five ways:
raw NIXL with the connector's descriptors (one per block range), raw NIXL with the same bytes in a few long
descriptors (`raw_coalesced`: one WRITE of them, which NIXL runs on the posting thread) and cut into medium pieces
(`raw_threaded`: enough descriptors for NIXL to spread the WRITE over its threads, the most it moves here), the
connector in bulk mode (everything after compute) and the connector streaming per layer while prefill computes at
a stated speed."""

from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Any

from connector.core.errors import ConnectorError
from connector.core.layout import ParallelLayout, blocks_for
from sparse_kv_lab.sim.cluster import Cluster, Scenario


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


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the two nearest ranks (with 5 runs, p99 is almost the worst)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def spread(values: list[float], digits: int = 2) -> str:
    """`p50 [min..max]` of a few runs: how far one run may be from another."""
    return f"{percentile(values, 50):.{digits}f} [{min(values):.{digits}f}..{max(values):.{digits}f}]"


def forward_costs(streams: list, bulks: list, idle: list) -> dict[str, Any]:
    """What the connector cost prefill's forward thread and its process (sparse_kv_lab.sim.costs), from the stream and
    bulk runs' chunks and the idle windows measured before and after them. `compute_stretch`: the simulated
    compute's length over its nominal one (1.0: the forward never waited). In bulk runs a decode rank is registered
    but no hook fires, so nothing is due until compute ends: their loop CPU is "computing, nothing due"."""
    hooks = [c for r in streams for c, _ in r.costs]
    wall = [ns / 1e3 for c in hooks for ns in c.wall_ns]
    floor = [ns / 1e3 for r in bulks for c, _ in r.costs for ns in c.wall_ns]  # a no-op, timed as the hook is
    cpu = [ns / 1e3 for c in hooks for ns in c.cpu_ns]

    def stretch(runs: list) -> list[float]:
        return [sum(c.layer_s) / max(sum(c.nominal_s), 1e-9) for r in runs for c, _ in r.costs]

    def per_s(runs: list, what: str) -> list[float]:
        return [w.per_s(getattr(w, what)) for r in runs for _, w in r.costs]

    out: dict[str, Any] = {
        "hook_us": round(percentile(wall, 50), 2) if wall else 0.0,
        "hook_us_p90": round(percentile(wall, 90), 2) if wall else 0.0,
        "hook_cpu_us": round(percentile(cpu, 50), 2) if cpu else 0.0,
        "hook_floor_us": round(percentile(floor, 50), 2) if floor else 0.0,
        "compute_stretch": round(percentile(stretch(streams), 50), 3),
        "compute_stretch_runs": spread(stretch(streams), 3),
        "compute_stretch_bulk": round(percentile(stretch(bulks), 50), 3),
        "loop_cpu_ms_per_s_streaming": round(percentile(per_s(streams, "loop_ns"), 50), 3),
        "other_cpu_ms_per_s_streaming": round(percentile(per_s(streams, "other_ns"), 50), 3),
        "loop_cpu_ms_per_s_nothing_due": round(percentile(per_s(bulks, "loop_ns"), 50), 3),
        "other_cpu_ms_per_s_nothing_due": round(percentile(per_s(bulks, "other_ns"), 50), 3),
        "loop_cpu_ms_per_s_idle": round(max(w.per_s(w.loop_ns) for w in idle), 3),
        "other_cpu_ms_per_s_idle": round(max(w.per_s(w.other_ns) for w in idle), 3),
    }
    return out


def threaded_piece_bytes(nbytes: int) -> int:
    """Piece size of the threaded baseline: the largest (4 KiB multiple) that still makes at least 4096 pieces; never
    under 64 KiB, where the cost per descriptor would start to show. NIXL spreads a WRITE over its threads from 1024
    descriptors (`split_batch_size`); measured here, 1074 pieces moved no faster than 177 long descriptors, 2148 went
    1.2x and 4296 1.5x faster, so 4096 keeps its 4 threads busy."""
    return max(64 << 10, nbytes // 4096 // 4096 * 4096)


def bench(sc: Scenario, progress: bool = False, repeats: int = 5, compute: tuple[float, float] | None = None,
          plot: str | None = None, checksum: bool = False) -> dict[str, Any]:
    """Medians (and p99 of the exposed times) over `repeats` runs of each kind, interleaved so machine noise hits
    them alike. Prefill computes `sc.layer_ms` per layer or, with `compute = (active parameters, TFLOPS)`, what that
    model takes for `sc.tokens` at that speed. `plot`: a PNG of one bulk and one stream run's per-layer timeline.
    `checksum`: a sixth kind, bulk runs decode verifies end to end (kv_checksum), and what that costs."""
    one = ParallelLayout.build(sc.model.num_layers, 1, 1)
    sc = dataclasses.replace(sc, prefill=one, decode=one, chunks=1, prefix_tokens=0, late_register=False,
                             fill_ahead=True)  # the compute is sleep alone: its stretch is the connector's
    layer_ms = sc.layer_ms
    if compute is not None:
        from sparse_kv_lab.sim.compute import prefill_ms  # noqa: PLC0415

        layer_ms = round(prefill_ms(int(compute[0]), sc.tokens, compute[1]) / sc.model.num_layers, 3)
    bar = _Progress(progress, 2 + (5 if checksum else 4) * repeats)
    raws, coalesced, threaded, bulks, streams, seq = [], [], [], [], [], iter(range(1_000_000))
    summed: list = []
    with Cluster(sc) as cluster:
        bar.step("processes up")
        cluster.run_request(next(seq), seed=0, mode="bulk", layer_ms=0.0)   # warm-up: handshakes, page faults
        bar.step("warm-up")
        _, prefill_conn = cluster.prefill[(0, 0)]
        cluster.ask(cluster.decode[(0, 0)][1], ("scratch", sc.tokens), sc.timeout_s, "decode (0, 0)")

        def raw(packed: bool, piece_bytes: int = 0) -> tuple[float, int, int]:
            _, seconds, nbytes, count = cluster.ask(
                prefill_conn, ("raw", 0, sc.tokens, cluster.registered, packed, piece_bytes), sc.timeout_s,
                "prefill (0, 0)")
            return seconds, nbytes, count

        idle = [cluster.ask(prefill_conn, ("idle", 1.0), sc.timeout_s, "prefill (0, 0)")[1]]
        hooks_before = len(cluster.hook_ns)
        for _ in range(repeats):
            raws.append(raw(False))
            coalesced.append(raw(True))
            threaded.append(raw(True, threaded_piece_bytes(raws[0][1])))
            bar.step("raw NIXL")
            bulks.append(cluster.run_request(next(seq), seed=0, mode="bulk", layer_ms=layer_ms))
            bar.step("connector bulk")
            streams.append(cluster.run_request(next(seq), seed=0, mode="stream", layer_ms=layer_ms))
            bar.step("connector stream")
            if checksum:
                summed.append(cluster.run_request(next(seq), seed=0, mode="bulk", layer_ms=layer_ms, checksum=True))
                bar.step("connector bulk, checksums")
        hook_ns = cluster.hook_ns[hooks_before:]
        idle.append(cluster.ask(prefill_conn, ("idle", 1.0), sc.timeout_s, "prefill (0, 0)")[1])
    raw_bytes, raw_descs = raws[0][1], raws[0][2]
    raw_gbps = raw_bytes / statistics.median(r[0] for r in raws) / 1e9
    coalesced_gbps = coalesced[0][1] / statistics.median(r[0] for r in coalesced) / 1e9
    threaded_gbps = threaded[0][1] / statistics.median(r[0] for r in threaded) / 1e9
    bulk_ms = [r.exposed_s * 1e3 for r in bulks]
    stream_ms = [r.exposed_s * 1e3 for r in streams]
    connector_gbps = bulks[0].bytes / max(1e-9, statistics.median(r.exposed_s for r in bulks)) / 1e9
    out = {
        "model": sc.model.name, "tokens": sc.tokens, "block_size": sc.block_size, "device": sc.device,
        "repeats": repeats, "run_blocks": sc.run_blocks, "bytes": raw_bytes, "descriptors": raw_descs,
        "coalesced_descriptors": coalesced[0][2], "blocks_per_layer": blocks_for(sc.tokens, sc.block_size),
        "raw_gbps": round(raw_gbps, 3), "raw_coalesced_gbps": round(coalesced_gbps, 3),
        "connector_gbps": round(connector_gbps, 3), "connector_vs_raw": round(connector_gbps / raw_gbps, 3),
        "connector_vs_coalesced": round(connector_gbps / coalesced_gbps, 3),
        "raw_threaded_descriptors": threaded[0][2], "raw_threaded_gbps": round(threaded_gbps, 3),
        "connector_vs_threaded": round(connector_gbps / threaded_gbps, 3),
        "compute_tflops": compute[1] if compute is not None else None,
        "active_params_b": round(compute[0] / 1e9, 2) if compute is not None else None,
        "layer_ms": layer_ms,
        "compute_ms": round(statistics.median((r.compute_end - r.compute_start) * 1e3 for r in streams), 2),
        "bulk_exposed_ms": round(percentile(bulk_ms, 50), 2), "bulk_exposed_ms_p99": round(percentile(bulk_ms, 99), 2),
        "stream_exposed_ms": round(percentile(stream_ms, 50), 2),
        "stream_exposed_ms_p99": round(percentile(stream_ms, 99), 2),
        "stream_vs_bulk_exposed": round(percentile(stream_ms, 50) / max(percentile(bulk_ms, 50), 1e-9), 3),
        "streamed_pct": round(100.0 * statistics.median(r.streamed_bytes / max(1, r.bytes) for r in streams), 1),
        **forward_costs(streams, bulks, idle),
        "staging_mb": sc.staging,
        "staged_chunks": bulks[0].staged_chunks,
        "nixl_descriptors_bulk": bulks[0].nixl_descriptors,
        "nixl_descriptors_stream": statistics.median(r.nixl_descriptors for r in streams),
        "verified": all(r.verified for r in bulks + streams + summed),
        "problems": [p for r in bulks + streams + summed for p in r.problems],
    }
    if summed:
        summed_ms = percentile([r.exposed_s * 1e3 for r in summed], 50)
        out["checksum_exposed_ms"] = round(summed_ms, 2)
        out["checksum_cost_ms"] = round(summed_ms - percentile(bulk_ms, 50), 2)
        out["checksummed_blocks"] = summed[0].checksummed_blocks
        out["verified"] = out["verified"] and all(r.checksummed_blocks > 0 for r in summed)
    if plot:
        from sparse_kv_lab.sim.plot import plot_timeline  # noqa: PLC0415 - matplotlib is an optional extra

        pick = lambda runs: sorted(runs, key=lambda r: r.exposed_s)[len(runs) // 2]  # noqa: E731 - the median run
        try:
            plot_timeline(plot, {"bulk": pick(bulks), "stream": pick(streams)}, out)
        except (OSError, ConnectorError) as exc:  # the measured run is still reported
            out["plot_error"] = f"--plot {plot}: {exc}"
    return out

