"""`bench-pd`'s results and how they are printed: the per-mode record, the tables, the JSON a run saves and reads
back (`--json`, `--report`).

A run that interleaved its modes (sparse_kv_lab.pd.bench) keeps, for every other mode, the local engine's TTFT of the
same rounds (`local_ms`), so its overhead is the median of per-round differences (sparse_kv_lab.pd.interleave) and the
table says when that is within the run's noise. A run saved before interleaving has no `local_ms`: its overhead is
then the difference of the two p50s, as it was printed then, and the table says it is unpaired."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from sparse_kv_lab.pd import interleave, timelines
from sparse_kv_lab.pd.interleave import Spread
from sparse_kv_lab.pd.timelines import percentile

@dataclass
class ModeResult:
    mode: str
    requests: int
    token_equal: int
    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    """The prompt length of each `ttft_ms` sample."""
    breakdown: dict[int, dict[str, tuple[float, float, int]]] = field(default_factory=dict)
    """SparseKVConnector modes: prompt tokens -> stage -> (p50 ms, p99 ms, requests), from both engines' timeline
    lines (sparse_kv_lab.pd.timelines)."""
    kv_bytes_per_request: float | None = None
    """SparseKVConnector modes: bytes prefill wrote per measured request (its `bytes_sent` counter)."""
    sent_during_compute: float | None = None
    """The share of those bytes whose WRITE was posted while prefill still computed the request."""
    local_ms: list[float] = field(default_factory=list)
    """Interleaved runs, modes other than local: local's TTFT in the same round as each `ttft_ms` sample (same
    prompt, moments apart), what the overhead is paired against. Empty in runs saved before interleaving."""
    compute_ms: list[float | None] = field(default_factory=list)
    """Interleaved runs, SparseKVConnector modes: prefill's compute stage of each `ttft_ms` sample (None where the
    timelines lack it)."""
    rounds: list[int] = field(default_factory=list)
    """Interleaved runs: the round of each `ttft_ms` sample."""

    @property
    def p50_ms(self) -> float:
        return percentile(self.ttft_ms, 50)

    @property
    def p99_ms(self) -> float:
        return percentile(self.ttft_ms, 99)

    @property
    def paired(self) -> bool:
        return bool(self.local_ms) and len(self.local_ms) == len(self.ttft_ms)

    def ttft(self) -> Spread:
        return Spread.of(self.ttft_ms)

    def compute(self) -> Spread:
        return Spread.of(c for c in self.compute_ms if c is not None)

    def outside_compute(self) -> Spread:
        """TTFT minus prefill's compute stage, per request: what the PD path adds around the compute."""
        return Spread.of(t - c for t, c in zip(self.ttft_ms, self.compute_ms) if c is not None)

    def overhead(self) -> interleave.Overhead | None:
        """Against local, from paired rounds; None for local and for unpaired (old) runs."""
        if self.mode == "local" or not self.paired:
            return None
        return interleave.overhead(self.ttft_ms, self.local_ms, self.prompt_tokens)

    def p50_by_length(self) -> dict[int, float]:
        """TTFT p50 per prompt length."""
        return {n: percentile([t for t, m in zip(self.ttft_ms, self.prompt_tokens) if m == n], 50)
                for n in sorted(set(self.prompt_tokens))}

    def overhead_by_length(self, base: "ModeResult") -> dict[int, float]:
        """Overhead per prompt length: the median paired difference, or (unpaired runs) the difference of p50s."""
        if self.paired:
            return interleave.paired_by_group(self.ttft_ms, self.local_ms, self.prompt_tokens)
        base_by = base.p50_by_length()
        return {n: ms - base_by[n] for n, ms in self.p50_by_length().items() if n in base_by}


def _overhead_cell(r: ModeResult, base: ModeResult) -> str:
    if r.mode == "local":
        return "—"
    over = r.overhead()
    if over is None:  # a run saved before interleaving: p50 against p50, as printed then
        return f"{r.p50_ms - base.p50_ms:+.1f} ms ({100 * (r.p50_ms / base.p50_ms - 1):+.0f}%)"
    return f"{over.diff.text(signed=True)} ms paired ({100 * over.diff.p50_ms / base.p50_ms:+.0f}%)"


def table(results: list[ModeResult]) -> str:
    base = results[0]
    lines = ["| mode | requests | token-equal | TTFT p50 ms | TTFT p99 ms | p50 overhead over local | p50 by prompt "
             "length (overhead) | KV per request | posted during compute |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        over_by = {} if r.mode == "local" else r.overhead_by_length(base)
        by = ", ".join(f"{n}: {ms:.1f}" + ("" if n not in over_by else f" ({over_by[n]:+.1f})")
                       for n, ms in r.p50_by_length().items())
        kv = "—" if r.kv_bytes_per_request is None else f"{r.kv_bytes_per_request / 2**20:.1f} MiB"
        during = "—" if r.sent_during_compute is None else f"{100 * r.sent_during_compute:.0f}%"
        lines.append(f"| {r.mode} | {r.requests} | {r.token_equal}/{r.requests} | {r.p50_ms:.1f} | {r.p99_ms:.1f} "
                     f"| {_overhead_cell(r, base)} | {by} | {kv} | {during} |")
    return "\n".join(lines)


def spread_table(results: list[ModeResult]) -> str:
    """Interleaved runs: each mode's TTFT, prefill's compute stage and the rest, as p50 [p10..p90] n, and its
    paired overhead with the verdict on noise. Empty when no mode is paired (runs saved before interleaving)."""
    if not any(r.paired for r in results):
        return ""
    lines = ["| mode | TTFT ms p50 [p10..p90] n | compute ms | TTFT outside compute ms | overhead vs local ms "
             "(median of per-round differences [p10..p90] n) | local's round-to-round noise ms | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        over = r.overhead()
        diff, noise, verdict = ("—", "—", "baseline") if over is None else (
            over.diff.text(signed=True), "—" if over.noise_ms != over.noise_ms else f"±{over.noise_ms:.1f}",
            over.verdict())
        lines.append(f"| {r.mode} | {r.ttft().text()} | {r.compute().text()} | {r.outside_compute().text()} "
                     f"| {diff} | {noise} | {verdict} |")
    return "\n".join(lines)


def verdict_lines(results: list[ModeResult]) -> list[str]:
    """One sentence per paired mode: its overhead, and whether the run can tell it from noise."""
    out = []
    for r in results:
        over = r.overhead()
        if over is not None:
            out.append(f"{r.mode}: overhead {over.diff.p50_ms:+.1f} ms (p10..p90 {over.diff.p10_ms:+.1f}.."
                       f"{over.diff.p90_ms:+.1f} over {over.diff.n} paired rounds): {over.verdict()}")
    return out


def to_json(results: list[ModeResult], config: Any = None) -> dict[str, Any]:  # config: pd.bench.BenchConfig
    base = results[0]
    about = {} if config is None else {"model": config.model, "max_model_len": config.max_model_len,
                                       "load_average": os.getloadavg(), "interleaved": True}
    modes = []
    for r in results:
        entry = asdict(r) | {"p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "overhead_p50_ms": r.p50_ms - base.p50_ms,
                             "p50_ms_by_prompt_tokens": r.p50_by_length()}
        ttft, compute = r.ttft(), r.compute()
        entry |= {"ttft_p10_ms": ttft.p10_ms, "ttft_p90_ms": ttft.p90_ms}
        if compute.n:
            entry |= {"compute_p50_ms": compute.p50_ms, "compute_p10_ms": compute.p10_ms,
                      "compute_p90_ms": compute.p90_ms, "compute_n": compute.n}
        over = r.overhead()
        if over is not None:
            entry |= {"overhead_paired_p50_ms": over.diff.p50_ms, "overhead_paired_p10_ms": over.diff.p10_ms,
                      "overhead_paired_p90_ms": over.diff.p90_ms, "overhead_paired_n": over.diff.n,
                      "local_noise_ms": over.noise_ms, "within_noise": over.within_noise}
        modes.append(entry)
    return {"date": time.strftime("%Y-%m-%d"), **about, "modes": _finite(modes)}


def _finite(value: Any) -> Any:
    """NaN (a spread of nothing) as null: the saved file stays strict JSON."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def from_json(run: dict[str, Any]) -> list[ModeResult]:
    """The results of a saved `bench-pd --json` run (to print its tables again: `bench-pd --report`). Fields a run
    saved by an older bench-pd lacks keep their defaults (no `local_ms`: an unpaired run)."""
    names = {f.name for f in dataclasses.fields(ModeResult)}
    out = []
    for m in run["modes"]:
        r = ModeResult(**{k: v for k, v in m.items() if k in names})
        r.breakdown = {int(n): {stage: tuple(v) for stage, v in stages.items()} for n, stages in r.breakdown.items()}
        r.local_ms, r.compute_ms, r.rounds = list(r.local_ms or []), list(r.compute_ms or []), list(r.rounds or [])
        out.append(r)
    return out


def dump(results: list[ModeResult], as_json: bool, config: Any = None) -> str:
    if as_json:
        return json.dumps(to_json(results, config))
    parts = [table(results)]
    spreads = spread_table(results)
    if spreads:
        parts += [spreads, "\n".join(verdict_lines(results))]
    parts += [timelines.table(r.mode, r.breakdown) for r in results if r.breakdown]
    return "\n\n".join(parts)
