"""What good looks like next to each number of `demo` and `bench` (sparse_kv_lab.cli.yardsticks): the share of the
transfer hidden behind compute against raw NIXL's rate on the same bytes, the verdict, and the zeros that are
expected (bulk mode, late registration, no compute). One small demo end to end prints all of it."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from sparse_kv_lab.cli.yardsticks import bench_lines, bench_verdict, demo_lines, hidden_pct, with_yardsticks
from sparse_kv_lab.sim.cluster import DemoResult


def result(**kw) -> DemoResult:
    fields = dict(verified=True, mode="stream", bytes=100 * 10**6, descriptors=1000, transfer_gbps=1.0,
                  compute_ms=200.0, exposed_ms=2.0, ranks={"prefill": 1, "decode": 1}, hook_us=2.0,
                  nixl_descriptors=1000, streamed_pct=98.0, raw_gbps=5.0)
    return DemoResult(**(fields | kw))


def scenario(**kw) -> SimpleNamespace:
    return SimpleNamespace(**({"mode": "stream", "late_register": False, "layer_ms": 2.0} | kw))


def test_hidden_share_is_against_the_same_bytes_at_raw_nixls_rate():
    assert hidden_pct(2.0, 100 * 10**6, 5.0) == pytest.approx(90.0)  # 100 MB at 5 GB/s: 20 ms, 2 ms showed
    assert hidden_pct(30.0, 100 * 10**6, 5.0) == 0.0
    assert hidden_pct(1.0, 0, 5.0) is None and hidden_pct(1.0, 10, 0.0) is None


def test_a_good_stream_run_says_so_with_its_yardsticks():
    lines = demo_lines(result(), scenario())
    text = "\n".join(lines)
    assert "yardstick: those bytes after compute at raw NIXL's 5.0 GB/s take 20.0 ms, so 90% of the transfer was " \
           "hidden" in text
    assert "(good: 90% or more in stream mode; 0% means nothing overlapped)" in text
    assert lines[-1] == "  verdict: good: 98.0% of the bytes left while prefill computed, 2.0 ms showed after it"


@pytest.mark.parametrize("sc, reason", [
    (scenario(mode="bulk"), "0% is expected in bulk mode: everything moves after compute"),
    (scenario(late_register=True), "0% is expected with --late-register: decode registered after prefill finished"),
    (scenario(layer_ms=0.0), "0% is expected with --layer-ms 0: there is no compute to hide behind"),
])
def test_expected_zeros_are_explained(sc, reason):
    text = "\n".join(demo_lines(result(streamed_pct=0.0, exposed_ms=25.0), sc))
    assert reason in text and "verdict: as expected: " in text and "FAILED" not in text


def test_a_stream_run_that_hid_little_and_a_failed_one():
    assert "little was hidden (10.0% streamed)" in demo_lines(result(streamed_pct=10.0), scenario())[-1]
    assert demo_lines(result(verified=False), scenario())[-1] == "  verdict: FAILED: some bytes differ on decode"
    assert bench_verdict({"verified": False}).startswith("FAILED")
    assert bench_verdict({"verified": True, "connector_vs_raw": 1.1, "stream_vs_bulk_exposed": 0.05}).startswith(
        "good: ")
    assert bench_verdict({"verified": True, "connector_vs_raw": 0.3, "stream_vs_bulk_exposed": 0.05}).startswith(
        "NOT GOOD (connector_vs_raw;")


@pytest.mark.parametrize("name, value", [("hook_us", 1021.37), ("compute_stretch", 2.4),
                                         ("loop_cpu_ms_per_s_nothing_due", 14.5), ("streamed_pct", 40.0)])
def test_every_yardstick_the_bench_prints_is_in_its_verdict(name, value):
    """A bad hook, a stretched compute or a loop that polls while nothing is due is not 'good' (the verdict used to
    read two numbers only, and said good beside a 1,021 us hook)."""
    fine = {"verified": True, "connector_vs_raw": 1.0, "stream_vs_bulk_exposed": 0.05, "streamed_pct": 98.0,
            "layer_ms": 8.0, "hook_us": 3.0, "compute_stretch": 1.01, "loop_cpu_ms_per_s_nothing_due": 0.9,
            "loop_cpu_ms_per_s_idle": 0.5}
    assert bench_verdict(fine).startswith("good: ")
    verdict = bench_verdict(fine | {name: value})
    assert verdict.startswith(f"NOT GOOD ({name};") and "(not good)" in verdict


def test_the_demo_verdict_reads_the_hook():
    assert demo_lines(result(hook_us=1021.37), scenario())[-1].startswith("  verdict: NOT GOOD: 98.0% of the bytes")
    assert "layer_ready took 1021.37 us" in demo_lines(result(hook_us=1021.37), scenario())[-1]


@pytest.mark.slow
def test_a_small_demo_prints_its_yardsticks():
    out = subprocess.run([sys.executable, "-m", "connector", "demo", "--model", "qwen3-8b", "--tokens", "128"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "yardstick: those bytes after compute at raw NIXL's" in out.stdout
    assert "  verdict: " in out.stdout and "VERIFIED" in out.stdout


def test_the_bench_gets_the_hidden_share_and_a_verdict():
    out = with_yardsticks({"bytes": 100 * 10**6, "raw_gbps": 5.0, "stream_exposed_ms": 2.0,
                           "stream_vs_bulk_exposed": 0.1, "streamed_pct": 98.0, "verified": True,
                           "connector_vs_raw": 1.0})
    assert list(out) == ["bytes", "raw_gbps", "stream_exposed_ms", "stream_vs_bulk_exposed", "stream_hidden_pct",
                         "streamed_pct", "verified", "connector_vs_raw", "verdict"]
    assert out["stream_hidden_pct"] == 90.0 and out["verdict"].startswith("good: bulk at 1.00x raw NIXL")
    lines = bench_lines(out)
    assert "# the share of the transfer (its bytes at raw_gbps) streaming hid behind compute; good: 50 or more" in \
        next(line for line in lines if "stream_hidden_pct" in line)
    assert lines[-1].strip().startswith("verdict: good: bulk at")
