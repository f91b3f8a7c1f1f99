"""What good looks like, next to each number `demo` and `bench` print: the raw NIXL rate on the same bytes, the
share of the transfer hidden behind prefill's compute, a one-line verdict, and why some zeros are expected.

Thresholds (GOOD_*) are what this machine's measured runs show when nothing is wrong (docs/performance.md): streamed
98%, stream exposed 5% of bulk, the connector at 0.9-1.4x raw NIXL on its own descriptors, the compute stretched
1.02x (1.01x without hooks), the loop idle while nothing is due. The hook measured 28 us on this 2-vCPU VM (its wake of the
loop thread is a cross-CPU wakeup there), over GOOD_HOOK_US: the verdict says so."""

from __future__ import annotations

from typing import Any

GOOD_STREAMED_PCT = 90.0
GOOD_HIDDEN_PCT = 50.0
GOOD_VS_RAW = 0.8
GOOD_HOOK_US = 20.0
GOOD_HOOK_OVER_FLOOR_US = 5.0
"""`bench`: the hook at most this much over a no-op timed the same way after the same sleep (hook_floor_us). On this
2-vCPU VM the no-op alone measures about 10 us after an 8 ms sleep (0.9 us after 0.5 ms): cold caches and the vCPU's
wakeup, not the connector."""
GOOD_STRETCH = 1.05
"""The simulated compute at most 5% over its nominal length: the forward hardly waited for the connector."""
GOOD_LOOP_MS_PER_S = 1.0
"""The loop thread's CPU while a request computes and nothing is due: at most this much over idle (ms per s)."""

BENCH_NOTES = {
    "raw_gbps": "raw NIXL on the connector's own block ranges, one WRITE: the yardstick for connector_gbps",
    "raw_coalesced_gbps": "the same bytes in a few long descriptors: what NIXL moves when nothing is scattered",
    "raw_threaded_gbps": "the same bytes in 4,096+ pieces over NIXL's threads: the most NIXL moves here",
    "connector_gbps": "the connector in bulk mode: bytes over the time exposed after compute",
    "connector_vs_raw": f"1.0 = raw NIXL on the same descriptors; good: {GOOD_VS_RAW} or more",
    "connector_vs_coalesced": "below 1 on scattered blocks is the price of scattered blocks, not of the connector "
                              "(compare raw_gbps with raw_coalesced_gbps)",
    "connector_vs_threaded": "the same, against NIXL's best on this machine",
    "bulk_exposed_ms": "the whole transfer after compute: what a connector without streaming adds to TTFT",
    "stream_exposed_ms": "what streaming leaves after compute; good: a small fraction of bulk_exposed_ms",
    "stream_vs_bulk_exposed": "good: 0.2 or less (the share of bulk's exposed time streaming leaves)",
    "stream_hidden_pct": f"the share of the transfer (its bytes at raw_gbps) streaming hid behind compute; good: "
                         f"{GOOD_HIDDEN_PCT:g} or more",
    "streamed_pct": f"bytes in decode's blocks before compute ended (stream runs); good: {GOOD_STREAMED_PCT:g} or "
                    f"more; 0 is expected with --layer-ms 0 (no compute to hide behind)",
    "hook_us": f"the per-layer hook's median wall time (it only queues the layer); good: under {GOOD_HOOK_US:g}",
    "hook_us_p90": "its 90th percentile: a hook that hands the GIL to the loop shows here (up to 5,000 us)",
    "hook_cpu_us": "the CPU the hook's own thread used; the rest of hook_us was waiting (for the GIL)",
    "hook_floor_us": f"a no-op timed as the hook is, after the same sleep (bulk runs): what this machine charges any "
                     f"call; good: hook_us at most {GOOD_HOOK_OVER_FLOOR_US:g} over it",
    "compute_stretch": f"stream runs' simulated compute over its nominal length (1.0: the forward never waited for "
                       f"the connector); good: {GOOD_STRETCH:g} or less",
    "compute_stretch_runs": "p50 [min..max] over the stream runs: the run-to-run noise",
    "compute_stretch_bulk": "the same in bulk runs (no hooks): what this machine's noise alone stretches",
    "loop_cpu_ms_per_s_streaming": "the event loop thread's CPU per second of compute while layers stream",
    "other_cpu_ms_per_s_streaming": "NIXL's threads (post, progress, poll) meanwhile: the copies themselves on DRAM",
    "loop_cpu_ms_per_s_nothing_due": f"the loop while a registered request computes with no layer due (bulk runs); "
                                     f"good: within {GOOD_LOOP_MS_PER_S:g} of idle",
    "other_cpu_ms_per_s_nothing_due": "NIXL's threads meanwhile",
    "loop_cpu_ms_per_s_idle": "the loop with nothing at all to do (the worse of one second before and after)",
    "other_cpu_ms_per_s_idle": "NIXL's threads and the watchdog, idle",
    "staging_mb": "0 on CPU memory is the default (staging pays off on GPU memory only)",
    "staged_chunks": "0 whenever staging is off or the blocks come in long runs: expected",
    "layer_ms": "prefill's simulated compute per layer (from compute_tflops unless --layer-ms)",
    "checksum_exposed_ms": "bulk runs decode verified end to end (kv_checksum): compare with bulk_exposed_ms",
    "checksum_cost_ms": "what kv_checksum adds after compute: prefill's digest before Complete, then decode's",
    "checksummed_blocks": "(route, block) digests decode compared per request, all equal",
}


def with_yardsticks(out: dict[str, Any]) -> dict[str, Any]:
    """The bench's results with the derived yardsticks: stream_hidden_pct (after stream_vs_bulk_exposed) and the
    verdict (last)."""
    hidden = hidden_pct(out.get("stream_exposed_ms", 0.0), out.get("bytes", 0), out.get("raw_gbps", 0.0))
    derived = {"stream_hidden_pct": round(hidden, 1) if hidden is not None else None}
    keys = list(out)
    at = keys.index("stream_vs_bulk_exposed") + 1 if "stream_vs_bulk_exposed" in keys else len(keys)
    items = list(out.items())
    return dict(items[:at] + list(derived.items()) + items[at:]) | {"verdict": bench_verdict(out)}


def bench_lines(out: dict[str, Any]) -> list[str]:
    """`key: value   # what good looks like` for each result (with_yardsticks' output: the verdict last)."""
    lines = []
    for key, value in out.items():
        note = BENCH_NOTES.get(key)
        lines.append(f"{key:>24}: {value}" + (f"   # {note}" if note else ""))
    return lines


def bench_checks(out: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(yardstick, good?, what it says) for every yardstick the bench printed (those absent are skipped)."""
    checks = []
    if "connector_vs_raw" in out:
        vs_raw = out["connector_vs_raw"]
        checks.append(("connector_vs_raw", vs_raw >= GOOD_VS_RAW,
                       f"bulk at {vs_raw:.2f}x raw NIXL on the same descriptors"))
    if "stream_vs_bulk_exposed" in out:
        ratio = out["stream_vs_bulk_exposed"]
        checks.append(("stream_vs_bulk_exposed", ratio <= 0.2,
                       f"streaming leaves {ratio:.0%} of bulk's exposed time after compute"))
    if out.get("streamed_pct") is not None and out.get("layer_ms"):
        checks.append(("streamed_pct", out["streamed_pct"] >= GOOD_STREAMED_PCT,
                       f"{out['streamed_pct']}% streamed during compute"))
    if out.get("stream_hidden_pct") is not None:
        checks.append(("stream_hidden_pct", out["stream_hidden_pct"] >= GOOD_HIDDEN_PCT,
                       f"{out['stream_hidden_pct']}% of the transfer hidden"))
    if out.get("hook_us") and out.get("hook_floor_us"):
        over = out["hook_us"] - out["hook_floor_us"]
        checks.append(("hook_us", over <= GOOD_HOOK_OVER_FLOOR_US,
                       f"hook {out['hook_us']} us, {over:+.1f} over a no-op's {out['hook_floor_us']} us"))
    elif out.get("hook_us"):
        checks.append(("hook_us", out["hook_us"] <= GOOD_HOOK_US, f"hook {out['hook_us']} us"))
    if out.get("compute_stretch"):
        checks.append(("compute_stretch", out["compute_stretch"] <= GOOD_STRETCH,
                       f"compute stretched {out['compute_stretch']}x"))
    if "loop_cpu_ms_per_s_nothing_due" in out and "loop_cpu_ms_per_s_idle" in out:
        over = out["loop_cpu_ms_per_s_nothing_due"] - out["loop_cpu_ms_per_s_idle"]
        checks.append(("loop_cpu_ms_per_s_nothing_due", over <= GOOD_LOOP_MS_PER_S,
                       f"the loop uses {over:+.2f} ms/s over idle while nothing is due"))
    return checks


def bench_verdict(out: dict[str, Any]) -> str:
    """`good: ...` when every yardstick is good, else `NOT GOOD (the ones that are not): ...`: each says its number."""
    if not out.get("verified"):
        return "FAILED: some bytes differ on decode (see problems)"
    checks = bench_checks(out)
    bad = [name for name, ok, _ in checks if not ok]
    said = "; ".join(f"{text} ({'good' if ok else 'not good'})" for _name, ok, text in checks)
    if not bad:
        return f"good: {said}"
    return f"NOT GOOD ({', '.join(bad)}; a busy machine shows here too: run again to tell): {said}"


def hidden_pct(exposed_ms: float, nbytes: int, raw_gbps: float) -> float | None:
    """Share of the transfer (its bytes at raw NIXL's rate) that did not show after compute."""
    if raw_gbps <= 0 or nbytes <= 0:
        return None
    whole_ms = nbytes / raw_gbps / 1e6
    return max(0.0, 100.0 * (1.0 - exposed_ms / whole_ms))


def demo_lines(r: Any, sc: Any) -> list[str]:
    """The demo's summary (r: sparse_kv_lab.sim.cluster.DemoResult of scenario sc), each number with its yardstick."""
    staged = (f"{r.staged_chunks} staged chunks, " if r.staged_chunks else "") + \
        f"{r.nixl_descriptors} NIXL descriptors posted"
    whole_ms = r.bytes / r.raw_gbps / 1e6 if r.raw_gbps else 0.0
    hidden = hidden_pct(r.exposed_ms, r.bytes, r.raw_gbps)
    lines = [
        f"  moved {r.bytes / 2**20:.1f} MiB ({r.descriptors} block ranges; {staged}, staging {r.staging_mb} MiB); "
        f"{r.ranks['prefill']} prefill + {r.ranks['decode']} decode processes",
        f"  exposed after compute: {r.exposed_ms} ms (prefill computed {r.compute_ms} ms)" +
        (f"   yardstick: those bytes after compute at raw NIXL's {r.raw_gbps} GB/s take {whole_ms:.1f} ms, so "
         f"{hidden:.0f}% of the transfer was hidden" if hidden is not None else ""),
        f"  streamed: {r.streamed_pct}% of the bytes were in decode's blocks before compute ended   "
        f"(good: {GOOD_STREAMED_PCT:g}% or more in stream mode; {zero_reason(sc) or '0% means nothing overlapped'})",
        f"  rate while transferring: {r.transfer_gbps} GB/s   (raw NIXL on the same block ranges: {r.raw_gbps} GB/s; "
        f"while streaming, layers leave as they are computed, so the exposed time is the measure, not this rate)",
        f"  layer_ready median {r.hook_us} us   (good: under {GOOD_HOOK_US:g} us: it queues the layer and, while a "
        f"decode waits for it, wakes the loop)"
        if sc.mode != "bulk" else "  layer_ready: not called in bulk mode (the whole request goes after compute)",
        f"  verdict: {demo_verdict(r, sc, hidden)}",
    ]
    return lines


def zero_reason(sc: Any) -> str:
    """Why 0% streamed is expected in this run, or ""."""
    if sc.mode == "bulk":
        return "0% is expected in bulk mode: everything moves after compute"
    if sc.late_register:
        return "0% is expected with --late-register: decode registered after prefill finished"
    if not sc.layer_ms:
        return "0% is expected with --layer-ms 0: there is no compute to hide behind"
    return ""


def demo_verdict(r: Any, sc: Any, hidden: float | None) -> str:
    if not r.verified:
        return "FAILED: some bytes differ on decode"
    hook_bad = sc.mode != "bulk" and r.hook_us > GOOD_HOOK_US
    hook_note = (f"; but layer_ready took {r.hook_us} us of the forward's time per layer (over {GOOD_HOOK_US:g} us; "
                 f"bench's hook_cpu_us and compute_stretch say how much was the hook itself)") if hook_bad else ""
    why = zero_reason(sc)
    if why:
        return f"as expected: {why.split(': ', 1)[1]} (the exposed time is the whole transfer); --mode stream " \
               f"with compute shows what streaming hides{hook_note}"
    if r.streamed_pct >= GOOD_STREAMED_PCT and (hidden is None or hidden >= GOOD_HIDDEN_PCT) and not hook_bad:
        return f"good: {r.streamed_pct}% of the bytes left while prefill computed, {r.exposed_ms} ms showed after it"
    if r.streamed_pct >= GOOD_STREAMED_PCT and (hidden is None or hidden >= GOOD_HIDDEN_PCT):
        return f"NOT GOOD: {r.streamed_pct}% of the bytes left while prefill computed{hook_note}"
    return (f"little was hidden ({r.streamed_pct}% streamed): per-layer compute shorter than a layer's transfer, "
            f"or a machine too busy to overlap them (--layer-ms sets the compute){hook_note}")
