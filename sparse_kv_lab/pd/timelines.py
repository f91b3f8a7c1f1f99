"""Where each request's time to first token went, from both engines' timeline lines (`log_timeline`,
connector.engine.timeline) and the client's own clock, joined by transfer id: the breakdown `bench-pd` prints.

All points are wall-clock seconds on one machine (the engines and the client share its clock). Per request:

  to_prefill        client sent the request -> prefill's scheduler saw it (HTTP, the API server, the engine queue)
  queue             prefill's scheduler saw it -> its first chunk went to the workers
  compute           prefill's ranks heard of it -> computed every prompt token (the slowest rank)
  exposed           computed -> the last WRITE completed (what streaming did not hide; the slowest rank; 0 when
                    every WRITE completed before the sweep that marks the prompt computed)
  registered_after  computed -> decode registered (negative: decode registered while prefill computed, as the
                    concurrent flow does; the sequential flow's router hop shows here)
  landed_after      computed -> every decode rank had all its KV
  tell              the KV in place -> decode's vLLM heard of it (its next get_finished; the slowest rank)
  schedule          decode's scheduler heard of it -> scheduled the request
  first_token       decode scheduled it -> the client read the first token (decode's forward, sampling, HTTP)
  ttft              the client's time to first token
  loop_cpu          CPU the prefill connector's event loop thread used from the request's start until its prompt
                    was computed (its `loop_cpu_ms`, summed over prefill's ranks): the Python the connector ran
                    beside the forward for it, not a span of time
  wake_gap          the gap between layer wakes prefill's loop had reached when the request was released (its
                    `wake_gap_ms`, the widest over prefill's ranks; SenderConfig.layer_wake_cpu_share): not a span
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from connector.engine.timeline import parse_line

COLUMNS = ("to_prefill", "queue", "compute", "exposed", "registered_after", "landed_after", "tell", "schedule",
           "first_token", "ttft", "loop_cpu", "wake_gap")


@dataclass(frozen=True)
class ClientRequest:
    transfer_id: str
    prompt_tokens: int
    sent_at: float
    """time.time() the client sent the request."""
    first_token_at: float


def read_logs(paths: Iterable[Path]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """transfer id -> side -> its timeline records (one per rank), from the engines' log files."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            record = parse_line(line)
            if record is not None:
                out[str(record["transfer_id"])][record["side"]].append(record)
    return out


def _latest(records: list[dict[str, Any]], point: str) -> float | None:
    values = [r[point] for r in records if point in r]
    return max(values) if values else None


def _earliest(records: list[dict[str, Any]], point: str) -> float | None:
    values = [r[point] for r in records if point in r]
    return min(values) if values else None


def breakdown(req: ClientRequest, sides: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """One request's stages in milliseconds (a stage whose points are missing is left out)."""
    pre, pre_s = sides.get("prefill", []), sides.get("prefill_scheduler", [])
    dec, dec_s = sides.get("decode", []), sides.get("decode_scheduler", [])
    points = {
        "sent": req.sent_at, "first_token_at": req.first_token_at,
        "seen": _earliest(pre_s, "seen"), "scheduled": _earliest(pre_s, "scheduled"),
        "started": _earliest(pre, "started"), "computed": _latest(pre, "computed"),
        "last_write": _latest(pre, "last_write"), "registered": _earliest(dec, "registered"),
        "landed": _latest(dec, "landed"), "told": _latest(dec, "told"),
        "learned": _earliest(dec_s, "learned"), "d_scheduled": _latest(dec_s, "scheduled"),
    }
    spans = {"to_prefill": ("sent", "seen"), "queue": ("seen", "scheduled"), "compute": ("started", "computed"),
             "exposed": ("computed", "last_write"), "registered_after": ("computed", "registered"),
             "landed_after": ("computed", "landed"), "tell": ("landed", "told"), "schedule": ("learned", "d_scheduled"),
             "first_token": ("d_scheduled", "first_token_at"), "ttft": ("sent", "first_token_at")}
    out = {}
    for name, (a, b) in spans.items():
        if points[a] is not None and points[b] is not None:
            ms = (points[b] - points[a]) * 1e3
            # Only registered_after has a sign. Elsewhere a point a hair "early" is the same moment: the last
            # layers' WRITEs can complete before the loop processes the sweep that marks the prompt computed.
            out[name] = round(ms if name == "registered_after" else max(0.0, ms), 3)
    loop_cpu = [r["loop_cpu_ms"] for r in pre if isinstance(r.get("loop_cpu_ms"), (int, float))]
    if loop_cpu:
        out["loop_cpu"] = round(float(sum(loop_cpu)), 3)
    gaps = [r["wake_gap_ms"] for r in pre if isinstance(r.get("wake_gap_ms"), (int, float))]
    if gaps:
        out["wake_gap"] = round(float(max(gaps)), 3)
    return out


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (p99 of 30 samples is the largest); NaN of nothing."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), -(-len(ordered) * pct // 100)))
    return ordered[int(rank) - 1]


def summarize(rows: list[tuple[int, dict[str, float]]]) -> dict[int, dict[str, tuple[float, float, int]]]:
    """prompt tokens -> stage -> (p50 ms, p99 ms, requests with that stage)."""
    by_len: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for tokens, stages in rows:
        for name, ms in stages.items():
            by_len[tokens][name].append(ms)
    return {tokens: {name: (percentile(v, 50), percentile(v, 99), len(v)) for name, v in stages.items()}
            for tokens, stages in sorted(by_len.items())}


def table(mode: str, summary: dict[int, dict[str, tuple[float, float, int]]]) -> str:
    """A markdown table: one row per prompt length, `p50 / p99` ms per stage."""
    lines = [f"| {mode}: prompt tokens | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for tokens, stages in summary.items():
        cells = [f"{stages[c][0]:.1f} / {stages[c][1]:.1f}" if c in stages else "—" for c in COLUMNS]
        lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
