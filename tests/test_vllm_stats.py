"""SparseKVConnector's transfer metrics through vLLM 0.33's own stats machinery: KVConnectorLogging (the engine
core's periodic "KV Transfer metrics" line), KVOutputAggregator-style aggregation and KVConnectorProm (Prometheus).
The end-to-end numbers (bytes sent = bytes received = what decode asked for) are checked in test_vllm_e2e.py."""

from __future__ import annotations

import functools
import pickle

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm==0.33.0")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402

from connector.vllm import SparseKVConnector  # noqa: E402
from connector.vllm.stats import COUNTERS, SparseKVConnectorStats  # noqa: E402

pytestmark = pytest.mark.vllm


def _ktc() -> KVTransferConfig:
    return KVTransferConfig(kv_connector="SparseKVConnector", kv_role="kv_producer",
                            kv_connector_module_path="connector.vllm")


def _prefill_step(bytes_sent: int, streamed: int, ok: int = 0) -> SparseKVConnectorStats:
    s = SparseKVConnectorStats()
    s.add(bytes_sent=bytes_sent, bytes_sent_during_compute=streamed, writes=2, descriptors=10, sends_ok=ok)
    return s


def test_empty_and_reset():
    s = SparseKVConnectorStats()
    assert s.is_empty() and s.reduce() == {}
    s.add(recvs_failed=1)  # a step with only a failure is still reported
    assert not s.is_empty() and s.reduce()["recvs_failed"] == 1
    s.reset()
    assert s.is_empty()


def test_aggregate_sums_ranks_and_survives_the_process_boundary():
    # Two prefill TP ranks in one step, as vLLM's KVOutputAggregator merges them; the payload crosses processes.
    a, b = _prefill_step(1000, 600), _prefill_step(3000, 1400, ok=1)
    rebuilt = SparseKVConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(b.data)))
    merged = a.aggregate(rebuilt)
    assert merged.data["bytes_sent"] == 4000 and merged.data["sends_ok"] == 1 and merged.data["writes"] == 4
    assert merged.reduce() == {"sent_MB": 0.004, "streamed_pct": 50.0, "writes": 4, "descriptors": 20,
                               "sends_ok": 1, "sends_failed": 0}
    # The index pools' share appears in the line only for a model that has them (bytes by pool, both directions).
    sparse = _prefill_step(4_000_000, 0, ok=1)
    sparse.add(bytes_sent_kv=3_000_000, bytes_sent_index_k=800_000, bytes_sent_index_v=200_000,
               bytes_received=4_000_000, bytes_received_kv=3_000_000, bytes_received_index_k=800_000,
               bytes_received_index_v=200_000, recvs_ok=1)
    line = sparse.reduce()
    assert (line["sent_index_k_MB"], line["sent_index_v_MB"]) == (0.8, 0.2)
    assert (line["received_index_k_MB"], line["received_index_v_MB"]) == (0.8, 0.2)
    assert "sent_kv_MB" not in line
    expired = SparseKVConnector.build_kv_connector_stats({"sends_failed": 1, "sends_expired": 1})
    assert merged.aggregate(expired).reduce()["sends_expired"] == 1
    # a payload from a peer that lacks some keys still aggregates
    older = SparseKVConnector.build_kv_connector_stats({"bytes_received": 5, "recvs_ok": 1, "recv_seconds": [0.25]})
    assert older.reduce() == {"received_MB": 0.0, "recvs_ok": 1, "recvs_failed": 0, "recv_avg_ms": 250.0,
                              "recv_max_ms": 250.0}


def test_layer_signals_per_step_sum_over_ranks_and_per_layer():
    # M3 prefill TP2 (both ranks hold layers 0-59) on vLLM 0.33's hooks alone: 0-2 signalled, 3-59 swept.
    def rank_step(signalled, swept, repeated=0):
        s = SparseKVConnectorStats()
        s.count_step(signalled, swept, repeated)
        return s

    today = rank_step([0, 1, 2], list(range(3, 60))).aggregate(rank_step([0, 1, 2], list(range(3, 60))))
    assert today.data["send_steps"] == 2 and today.data["layers_signalled"] == [2, 2, 2]  # as long as needed
    assert today.reduce() == {"signalled_layers_per_step": 3.0, "swept_layers_per_step": 57.0}
    # With the installed methods every layer is signalled; a layer hooked twice in a step counts as a repeat.
    now = rank_step(list(range(60)), [], repeated=3)
    rebuilt = SparseKVConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(now.data)))
    merged = today.aggregate(rebuilt)
    assert merged.data["layers_signalled"] == [3, 3, 3] + [1] * 57
    assert merged.data["layers_swept"] == [0, 0, 0] + [2] * 57
    assert merged.reduce() == {"signalled_layers_per_step": 22.0, "swept_layers_per_step": 38.0,
                               "signals_repeated": 3}
    # PP: stages hold different layers, the lists line up by global layer id whatever their lengths.
    stage1 = rank_step([30, 31], [32])
    assert stage1.data["layers_signalled"] == [0] * 30 + [1, 1]
    assert rank_step([0], [1]).aggregate(stage1).data["layers_swept"] == [0, 1] + [0] * 30 + [1]
    assert not stage1.is_empty() and SparseKVConnectorStats().is_empty()
    older = SparseKVConnector.build_kv_connector_stats({"bytes_sent": 5})  # a peer without these keys
    assert older.data["layers_signalled"] == [] and older.aggregate(stage1).data["send_steps"] == 1


def test_vllm_logging_prints_the_interval_summary():
    logging_ = KVConnectorLogging(_ktc())
    assert logging_.connector_cls is SparseKVConnector
    lines: list[str] = []
    logging_.observe(_prefill_step(2_000_000, 500_000).data)
    logging_.observe(_prefill_step(2_000_000, 1_500_000, ok=1).data)
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: sent_MB=4.0, streamed_pct=50.0, writes=4, descriptors=20, sends_ok=1, "
                     "sends_failed=0"]
    logging_.log(lambda fmt, *args: lines.append(fmt % args))  # reset after logging: nothing new, no line
    assert len(lines) == 1


def test_prometheus_counters_and_histogram(monkeypatch):
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    monkeypatch.setattr(KVConnectorProm, "_counter_cls", types[Counter])
    monkeypatch.setattr(KVConnectorProm, "_gauge_cls", types[Gauge])
    monkeypatch.setattr(KVConnectorProm, "_histogram_cls", types[Histogram])

    class _Cfg:
        kv_transfer_config = _ktc()

    prom = KVConnectorProm(_Cfg(), ["model_name", "engine"], {0: ["m3", "0"], 1: ["m3", "1"]})
    assert prom.prom_metrics is not None
    step = _prefill_step(4096, 1024, ok=1)
    step.add(recvs_ok=1)
    step.data["recv_seconds"] += [0.02, 0.3]
    prom.observe(step.data, engine_idx=1)
    prom.observe(_prefill_step(4096, 0).data, engine_idx=1)

    def value(name, suffix="_total", **extra):
        return registry.get_sample_value(name + suffix, {"model_name": "m3", "engine": "1", **extra})

    assert value("vllm:sparse_kv_bytes_sent") == 8192
    assert value("vllm:sparse_kv_bytes_sent_during_compute") == 1024
    assert value("vllm:sparse_kv_sends_ok") == 1 and value("vllm:sparse_kv_recvs_ok") == 1
    assert value("vllm:sparse_kv_recv_seconds", "_count") == 2
    assert value("vllm:sparse_kv_recv_seconds", "_bucket", le="0.025") == 1
    assert registry.get_sample_value("vllm:sparse_kv_bytes_sent_total", {"model_name": "m3", "engine": "0"}) == 0
    assert {f"vllm:sparse_kv_{k}" for k in COUNTERS} <= {m.name for m in registry.collect()}
    layers = SparseKVConnectorStats()
    layers.count_step([0, 2], [1], 0)
    layers.count_step([0], [1, 2], 1)
    prom.observe(layers.data, engine_idx=0)
    assert value("vllm:sparse_kv_send_steps", engine="0") == 2
    assert value("vllm:sparse_kv_signals_repeated", engine="0") == 1
    assert [value("vllm:sparse_kv_layers_signalled", engine="0", layer=str(i)) for i in range(3)] == [2, None, 1]
    assert [value("vllm:sparse_kv_layers_swept", engine="0", layer=str(i)) for i in range(3)] == [None, 2, 1]


def test_staged_chunks_and_write_timings_are_exported(monkeypatch):
    """staged_chunks is a counter like the others; the per-WRITE post and transfer times are histograms (as vLLM's
    NIXL connector exports its own), and the interval line shows them only where they apply."""
    registry = CollectorRegistry()
    for name, cls in (("_counter_cls", Counter), ("_gauge_cls", Gauge), ("_histogram_cls", Histogram)):
        monkeypatch.setattr(KVConnectorProm, name, functools.partial(cls, registry=registry))

    class _Cfg:
        kv_transfer_config = _ktc()

    step = _prefill_step(4096, 0, ok=1)
    step.add(staged_chunks=3)
    step.extend(post_seconds=[0.0002, 0.0004], transfer_seconds=[0.002, 0.02])
    reduced = step.reduce()
    assert (reduced["staged_chunks"], reduced["post_avg_ms"], reduced["transfer_avg_ms"]) == (3, 0.3, 11.0)
    assert "staged_chunks" not in _prefill_step(4096, 0).reduce()
    prom = KVConnectorProm(_Cfg(), ["model_name", "engine"], {0: ["m3", "0"]})
    prom.observe(step.data, engine_idx=0)

    def sample(name, **labels):
        return registry.get_sample_value(name, {"model_name": "m3", "engine": "0", **labels})

    assert sample("vllm:sparse_kv_staged_chunks_total") == 3
    assert sample("vllm:sparse_kv_post_seconds_count") == 2
    assert sample("vllm:sparse_kv_post_seconds_bucket", le="0.0005") == 2
    assert sample("vllm:sparse_kv_transfer_seconds_bucket", le="0.005") == 1
    assert sample("vllm:sparse_kv_transfer_seconds_sum") == pytest.approx(0.022)

