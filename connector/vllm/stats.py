"""Transfer metrics for vLLM's KV-connector stats path: the worker returns one `SparseKVConnectorStats` per step
(`get_kv_connector_stats`), vLLM's KVOutputAggregator sums the ranks, the engine core's KVConnectorLogging logs
`reduce()` every interval ("KV Transfer metrics: ...") and KVConnectorProm feeds `SparseKVPromMetrics`.

Everything in `data` is a plain int or a list of floats, because vLLM ships it from the worker processes to the
engine core (msgpack) and rebuilds it with `SparseKVConnector.build_kv_connector_stats(data)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from connector.engine.stats import SenderStats, counter_names, series_names
from connector.engine.timeline import STAGES
from connector.vllm.specs import cache_of

RECEIVER_COUNTERS = (
    "bytes_received",              # decode: bytes its prefill sources report written
    "bytes_received_kv",           # ... of them the main KV cache's
    "bytes_received_index_k",      # ... the index keys'
    "bytes_received_index_v",      # ... the index values'
    "recvs_ok",                    # decode: transfers that completed
    "recvs_failed",                # decode: transfers that failed (aborted ones are neither)
)
WORKER_COUNTERS = (
    "send_steps",                  # prefill: steps in which a rank computed tokens of a request it sends
    "signals_repeated",            # ... per-layer signals dropped as a layer's second one in a step (sent once)
)
SCHEDULER_COUNTERS = (
    "role_mismatches",             # requests whose kv_transfer_params ask for the other role's work (swapped
                                   # roles or router URLs): they ran as plain requests, no KV moved
)
COUNTERS = counter_names(SenderStats) + RECEIVER_COUNTERS + WORKER_COUNTERS + SCHEDULER_COUNTERS
"""Prefill's are the engine's own counters, under the engine's own names (connector.engine.stats.SenderStats)."""
BY_CACHE = ("bytes_sent_by_cache", "bytes_received_by_cache")
"""Dicts pool -> bytes, every pool (the three first and each cache of its own pool, e.g. `self_attn.swa_cache`):
exported as `vllm:sparse_kv_<name>_total{cache=...}`."""
SERIES = series_names(SenderStats) + tuple(name for name in STAGES if name not in series_names(SenderStats))
"""Samples in seconds: per NIXL WRITE (post_seconds, transfer_seconds), and per transfer the stages of its timeline
(connector.engine.timeline.STAGES; recv_seconds: decode registration to the last source's completion)."""
WRITE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
RECV_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STAGE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
HISTOGRAMS = {
    "post_seconds": ("creating and posting one NIXL WRITE, seconds", WRITE_BUCKETS_S),
    "transfer_seconds": ("one NIXL WRITE from its post to its completion, seconds", WRITE_BUCKETS_S),
    **{name: (f"{what}, seconds (per transfer)", STAGE_BUCKETS_S) for name, (_side, _a, _b, what) in STAGES.items()},
    "recv_seconds": ("decode registration to complete KV, seconds", RECV_BUCKETS_S),  # (its own, longer buckets)
}
PER_LAYER = (
    "layers_signalled",            # prefill, per global layer: steps in which it was signalled on its own
                                   # (save_kv_layer or the method layer_signals installed), so it can stream
    "layers_swept",                # ... steps in which it got no signal and waited for the wait_for_save sweep
)
"""Lists indexed by global layer id: whether per-layer streaming happens, and for which layers. Ranks add up
(tensor-parallel ranks hold the same layers, pipeline stages different ones), like send_steps, so the per-step
figures in `reduce` are per rank."""


@dataclass
class SparseKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # rebuilt from another process's payload: tolerate keys an older peer did not send
            for key in COUNTERS:
                self.data.setdefault(key, 0)
            for key in (*SERIES, *PER_LAYER):
                self.data.setdefault(key, [])
            for key in BY_CACHE:
                self.data.setdefault(key, {})

    def reset(self) -> None:
        self.data = {**{key: 0 for key in COUNTERS}, **{key: [] for key in (*SERIES, *PER_LAYER)},
                     **{key: {} for key in BY_CACHE}}

    def add(self, **counts: Any) -> None:
        """Counters by name; `bytes_sent_by_cache` / `bytes_received_by_cache` as dicts pool -> bytes."""
        for key, n in counts.items():
            if key in BY_CACHE:
                _add_by_cache(self.data[key], n)
            else:
                self.data[key] += int(n)

    def extend(self, **samples: list[float]) -> None:
        for key, values in samples.items():
            self.data[key].extend(values)
    def count_step(self, signalled: list[int], swept: list[int], repeated: int) -> None:
        """One prefill step of one rank: the global layers signalled on their own, those left to the sweep, and the
        signals dropped as repeats."""
        self.data["send_steps"] += 1
        self.data["signals_repeated"] += int(repeated)
        for key, layers in (("layers_signalled", signalled), ("layers_swept", swept)):
            _add_per_layer(self.data[key], {layer: 1 for layer in layers})

    def aggregate(self, other: KVConnectorStats) -> "SparseKVConnectorStats":
        for key in COUNTERS:
            self.data[key] += int(other.data.get(key, 0))
        for key in SERIES:
            self.data[key].extend(other.data.get(key, ()))
        for key in PER_LAYER:
            _add_per_layer(self.data[key], dict(enumerate(other.data.get(key, ()))))
        for key in BY_CACHE:
            _add_by_cache(self.data[key], other.data.get(key, {}))
        return self

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in COUNTERS) and not any(self.data[key] for key in SERIES) \
            and not any(any(self.data[key]) for key in PER_LAYER) and not any(self.data[key] for key in BY_CACHE)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        if d["writes"] or d["sends_ok"] or d["sends_failed"] or d["sends_expired"]:
            out.update({
                "sent_MB": round(d["bytes_sent"] / 1e6, 3),
                **_index_mb(d, "sent"),
                # how much of the KV left while prefill was still computing: the point of streaming
                "streamed_pct": round(100.0 * d["bytes_sent_during_compute"] / d["bytes_sent"], 1)
                if d["bytes_sent"] else 0.0,
                "writes": d["writes"],
                "descriptors": d["descriptors"],
                "sends_ok": d["sends_ok"],
                "sends_failed": d["sends_failed"],
            })
            if d["sends_expired"]:  # KV nobody fetched: worth a word in the log line, only when it happens
                out["sends_expired"] = d["sends_expired"]
            # Only where they apply, so a plain deployment's line stays short.
            if d["staged_chunks"]:
                out["staged_chunks"] = d["staged_chunks"]
            for key, name in (("post_seconds", "post_avg_ms"), ("transfer_seconds", "transfer_avg_ms")):
                if d[key]:
                    out[name] = round(1e3 * sum(d[key]) / len(d[key]), 3)
        if d["recvs_ok"] or d["recvs_failed"]:
            waits = sorted(d["recv_seconds"])
            out.update({
                "received_MB": round(d["bytes_received"] / 1e6, 3),
                **_index_mb(d, "received"),
                "recvs_ok": d["recvs_ok"],
                "recvs_failed": d["recvs_failed"],
                "recv_avg_ms": round(1e3 * sum(waits) / len(waits), 2) if waits else 0.0,
                "recv_max_ms": round(1e3 * waits[-1], 2) if waits else 0.0,
            })
        if d["role_mismatches"]:
            out["role_mismatches"] = d["role_mismatches"]
        if d["send_steps"]:
            # Per rank and step: how many layers were signalled on their own, how many waited for the sweep.
            # With vLLM 0.33's hooks alone MiniMax-M3 shows 3 and 57, DeepSeek-V3.2 0 and 61.
            out["signalled_layers_per_step"] = round(sum(d["layers_signalled"]) / d["send_steps"], 1)
            out["swept_layers_per_step"] = round(sum(d["layers_swept"]) / d["send_steps"], 1)
            if d["signals_repeated"]:
                out["signals_repeated"] = d["signals_repeated"]
        return out


def _index_mb(d: dict[str, Any], verb: str) -> dict[str, float]:
    """The index pools' share of `<verb>_MB` (sent or received), named only when a model has them."""
    return {f"{verb}_{pool}_MB": round(d[f"bytes_{verb}_{pool}"] / 1e6, 3)
            for pool in ("index_k", "index_v") if d[f"bytes_{verb}_{pool}"]}


def _add_by_cache(totals: dict[str, int], gains: Any) -> None:
    """Per cache: the pieces of a state split over TP (connector.vllm.specs.pieces_of) count as their state."""
    for pool, n in dict(gains).items():
        cache = cache_of(str(pool))
        totals[cache] = totals.get(cache, 0) + int(n)


def _add_per_layer(counts: list[int], increments: dict[int, int]) -> None:
    """counts[layer] += n for each (layer, n), growing the list as needed."""
    for layer, n in increments.items():
        if layer >= len(counts):
            counts.extend([0] * (layer + 1 - len(counts)))
        counts[layer] += int(n)


class SparseKVPromMetrics(KVConnectorPromMetrics):
    """Counters `vllm:sparse_kv_<counter>` (exported as ..._total), the per-layer counters
    `vllm:sparse_kv_layers_signalled` / `..._layers_swept` with a `layer` label (global layer id), and the histograms
    `vllm:sparse_kv_<series>`, one child per engine (and layer)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for key in COUNTERS:
            metric = self._counter_cls(name=f"vllm:sparse_kv_{key}", labelnames=labelnames,
                                       documentation=f"SparseKVConnector: {key.replace('_', ' ')}")
            self.counters[key] = {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}
        self.histograms = {}
        for key, (what, buckets) in HISTOGRAMS.items():
            hist = self._histogram_cls(name=f"vllm:sparse_kv_{key}", labelnames=labelnames, buckets=list(buckets),
                                       documentation=f"SparseKVConnector: {what}")
            self.histograms[key] = {idx: hist.labels(*values) for idx, values in per_engine_labelvalues.items()}
        self.per_layer = {key: self._counter_cls(name=f"vllm:sparse_kv_{key}", labelnames=[*labelnames, "layer"],
                                                 documentation=f"SparseKVConnector: {key.replace('_', ' ')}, steps "
                                                               f"per global layer")
                          for key in PER_LAYER}
        self.by_cache = {key: self._counter_cls(name=f"vllm:sparse_kv_{key}", labelnames=[*labelnames, "cache"],
                                                documentation=f"SparseKVConnector: {key.replace('_', ' ')} (a pool: "
                                                              f"kv, index_k, index_v or a cache's own name)")
                         for key in BY_CACHE}
        self._engine_labels = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key in COUNTERS:
            n = int(transfer_stats_data.get(key, 0))
            if n:
                self.counters[key][engine_idx].inc(n)
        for key in SERIES:
            for seconds in transfer_stats_data.get(key, ()):
                self.histograms[key][engine_idx].observe(seconds)
        for key, metric in self.per_layer.items():
            for layer, n in enumerate(transfer_stats_data.get(key, ())):
                if n:
                    metric.labels(*self._engine_labels[engine_idx], str(layer)).inc(int(n))
        for key, metric in self.by_cache.items():
            for pool, n in dict(transfer_stats_data.get(key, {})).items():
                if n:
                    metric.labels(*self._engine_labels[engine_idx], str(pool)).inc(int(n))
