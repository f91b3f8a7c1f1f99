"""The bench's own arithmetic (sparse_kv_lab.sim.compute, percentiles, the transfer's active time, the plot's per-layer
times) and one small bench run end to end: every field the README and tools/gpu-check.sh read is there."""

from __future__ import annotations

import sys

import pytest

from sparse_kv_lab.cli.yardsticks import bench_lines, with_yardsticks
from sparse_kv_lab.sim.compute import active_params, prefill_ms
from connector.core.errors import CliError, LayoutError
from connector.core.hf_config import load_config
from sparse_kv_lab.sim.bench import bench, percentile
from sparse_kv_lab.sim.cluster import RequestResult, busy_seconds
from sparse_kv_lab.sim.plot import check_plotting, layer_times, plot_timeline
from tests.helpers import scenario


def test_active_params_match_the_published_non_embedding_counts():
    # Qwen3-8B's model card: 6.95B non-embedding parameters; DeepSeek-V3.x: 37B activated (with embeddings).
    assert active_params(load_config("qwen3-8b")[0]) / 1e9 == pytest.approx(6.95, abs=0.05)
    assert 35 < active_params(load_config("deepseek-v3.2")[0]) / 1e9 < 38
    assert 15 < active_params(load_config("minimax-m3")[0]) / 1e9 < 30
    with pytest.raises(LayoutError, match="--layer-ms"):
        active_params({"hidden_size": 8})


def test_prefill_time_is_two_flops_per_parameter_per_token():
    assert prefill_ms(10**9, 1000, 2.0) == pytest.approx(1000.0)  # 2e12 FLOPs at 2 TFLOPS: one second
    with pytest.raises(ValueError, match="must be positive"):
        prefill_ms(1, 1, 0.0)


def test_percentile_and_active_time():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    # overlapping and disjoint intervals: the union, not the sum, and not first start to last end
    assert busy_seconds([(0.0, 1.0), (0.5, 2.0), (5.0, 6.0)]) == pytest.approx(3.0)
    assert busy_seconds([]) == 0.0


def _result(timeline, computed) -> RequestResult:
    return RequestResult(transfer_id="t", verified=True, problems=[], bytes=300, descriptors=3, staged_chunks=0,
                         compute_start=10.0, compute_end=10.5, first_post=10.1, last_complete=10.6,
                         layer_computed=computed, timeline=timeline)


def test_layer_times_from_first_post_to_last_landing_and_streamed_bytes():
    run = _result([([0, 1], 200, 10.1, 10.2, 10.25, 1), ([1], 100, 10.4, 10.5, 10.55, 0)], {0: 10.05, 1: 10.3})
    times = layer_times(run)
    assert times[0] == pytest.approx((50.0, 100.0, 250.0))
    assert times[1] == pytest.approx((300.0, 100.0, 550.0))  # in two batches: first post, last landing
    assert run.streamed_bytes == 200 and run.exposed_s == pytest.approx(0.1)


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    """The package is not on PyPI, so the hint is matplotlib itself; and --plot is refused before a run starts."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(CliError, match="^--plot needs matplotlib: pip install matplotlib \\(or run without --plot\\)$"):
        plot_timeline(str(tmp_path / "x.png"), {}, {})
    with pytest.raises(CliError, match="--plot needs matplotlib"):
        check_plotting()


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    run = _result([([0], 100, 10.1, 10.2, 10.25, 1)], {0: 10.05})
    out = tmp_path / "t.png"
    plot_timeline(str(out), {"bulk": run, "stream": run}, {"model": "m", "tokens": 1, "device": "cpu",
                                                            "staging_mb": 0, "layer_ms": 1.0})
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_small_bench_reports_every_field_and_verifies(m3_index_v):
    out = bench(scenario(m3_index_v, tokens=256, staging_mb=4), repeats=2,
                compute=(active_params(load_config("minimax-m3")[0]), 400.0), checksum=True)
    assert out["verified"], out["problems"]
    # --checksum: bulk runs decode verified end to end, every (route, block) of the request
    assert out["checksummed_blocks"] > 0 and out["checksum_exposed_ms"] > 0 and "checksum_cost_ms" in out
    for key in ("raw_gbps", "raw_coalesced_gbps", "connector_gbps", "connector_vs_raw", "connector_vs_coalesced",
                "raw_threaded_gbps", "connector_vs_threaded",
                "bulk_exposed_ms", "bulk_exposed_ms_p99", "stream_exposed_ms", "stream_exposed_ms_p99",
                "streamed_pct", "hook_us", "nixl_descriptors_bulk", "nixl_descriptors_stream"):
        assert out[key] is not None and out[key] >= 0, key
    assert out["coalesced_descriptors"] < out["descriptors"]
    # the threaded baseline: the same bytes in pieces, 4096 of them (enough for NIXL's 4 threads) or 64 KiB each
    assert min(4096, out["bytes"] >> 16) <= out["raw_threaded_descriptors"] <= out["descriptors"]
    assert out["bulk_exposed_ms"] <= out["bulk_exposed_ms_p99"]
    assert out["layer_ms"] == pytest.approx(prefill_ms(int(out["active_params_b"] * 1e9), 256, 400.0)
                                            / m3_index_v.num_layers, rel=0.01)
    # scattered blocks went as staged chunks: fewer NIXL descriptors than block ranges
    assert 0 < out["staged_chunks"] <= out["nixl_descriptors_bulk"] < out["descriptors"]
    # every number with what good looks like, and the verdict (sparse_kv_lab.cli.yardsticks)
    out = with_yardsticks(out)
    assert 0 <= out["stream_hidden_pct"] <= 100 and list(out)[-1] == "verdict"
    lines = bench_lines(out)
    assert any(line.strip().startswith("stream_hidden_pct:") and "hid behind compute" in line for line in lines)
    assert any(line.strip().startswith("connector_vs_raw:") and "# 1.0 = raw NIXL on the same descriptors" in line
               for line in lines)
    assert lines[-1].strip().startswith("verdict: ") and "streaming leaves" in lines[-1]  # good or not: a busy machine
