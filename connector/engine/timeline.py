"""Per-request timelines: when each stage of a transfer happened, on each side, from timestamps the connector takes
anyway or at the cost of a `time.time()` call. Wall-clock seconds (time.time()), so the points of two engines on one
machine (or on NTP-synchronised nodes) line up: `bench-pd` joins them by transfer id (sparse_kv_lab.pd.timelines).

The stages, in order (README, "Where TTFT goes"):

  prefill scheduler  seen        vLLM asked about the request (it waits for a step from here)
                     scheduled   its first chunk reached the workers
  prefill rank       started     the rank's sender heard of it (the step that computes its first chunk)
                     first_layer its first layer (of the first chunk) was computed
                     computed    every token computed (the last chunk's sweep)
                     first_post / last_post   its first and last WRITE posted (any decode rank)
                     last_write  its last WRITE completed: the KV is in decode's blocks (staged: in the slot)
                     released    every decode rank completed (or failed)
  decode rank        registered  the rank asked prefill for the KV
                     landed      every prefill rank reported its share complete (the bytes are in place)
                     told        vLLM heard of it (its next get_finished)
  decode scheduler   learned     the scheduler heard of it (update_connector_output)
                     scheduled   the request was scheduled to compute its first token

Each side logs one line per transfer (`log_line`) and feeds a histogram per stage (`stage_samples`)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

LOG_PREFIX = "SparseKV timeline "
"""How a timeline log line starts (then one JSON object): what sparse_kv_lab.pd.timelines parses."""

STAGES = {
    # name: (side, from point, to point, what it is)
    "queue_seconds": ("prefill_scheduler", "seen", "scheduled", "prefill: the request waits for its first step"),
    "compute_seconds": ("prefill", "started", "computed", "prefill: computing the prompt"),
    "exposed_seconds": ("prefill", "computed", "last_write", "prefill: KV still moving after the prompt is computed"),
    "ack_seconds": ("prefill", "last_write", "released", "prefill: last WRITE to every decode rank's completion"),
    "recv_seconds": ("decode", "registered", "landed", "decode: registration to complete KV"),
    "tell_seconds": ("decode", "landed", "told", "decode: KV in place until vLLM asks (its next get_finished)"),
    "schedule_seconds": ("decode_scheduler", "learned", "scheduled", "decode: heard of the KV until scheduled"),
}
"""The per-stage histograms (vllm:sparse_kv_<name>): the time between two points of one side."""


def now() -> float:
    return time.time()


@dataclass
class Points:
    """The points of one side; 0.0 = not (yet) reached."""

    def mark(self, point: str, first: bool = True) -> None:
        """Set `point` to now: only once with `first`, else each time (the last one stays)."""
        if not first or not getattr(self, point):
            setattr(self, point, now())

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in asdict(self).items() if v}


@dataclass
class SendPoints(Points):
    started: float = 0.0
    first_layer: float = 0.0
    computed: float = 0.0
    first_post: float = 0.0
    last_post: float = 0.0
    last_write: float = 0.0
    released: float = 0.0


@dataclass
class ReceivePoints(Points):
    registered: float = 0.0
    landed: float = 0.0
    told: float = 0.0


@dataclass
class PrefillSchedulerPoints(Points):
    seen: float = 0.0
    scheduled: float = 0.0


@dataclass
class DecodeSchedulerPoints(Points):
    learned: float = 0.0
    scheduled: float = 0.0


SIDES = {"prefill": SendPoints, "decode": ReceivePoints, "prefill_scheduler": PrefillSchedulerPoints,
         "decode_scheduler": DecodeSchedulerPoints}


def stage_samples(side: str, points: Points) -> dict[str, float]:
    """This side's stages that both ends of reached, in seconds."""
    out = {}
    for name, (stage_side, start, end, _what) in STAGES.items():
        if stage_side == side:
            t0, t1 = getattr(points, start), getattr(points, end)
            if t0 and t1:
                out[name] = max(0.0, t1 - t0)
    return out


def close(logger: logging.Logger, side: str, transfer_id: str, points: Points, last: str, verbose: bool,
          samples: dict[str, list[float]] | Any | None, **extra: Any) -> None:
    """The end of one side's timeline of a transfer: mark `last`, add each stage to `samples` (a dict of lists, or
    an object with a deque per stage; None: not counted, e.g. a failed transfer) and log the line (INFO when
    `verbose`, the `log_timeline` setting, else DEBUG)."""
    points.mark(last)
    if samples is not None:
        for name, seconds in stage_samples(side, points).items():
            if isinstance(samples, dict):
                samples.setdefault(name, []).append(seconds)
            else:
                getattr(samples, name).append(seconds)
    log_line(logger, side, transfer_id, points, logging.INFO if verbose else logging.DEBUG, **extra)


def log_line(logger: logging.Logger, side: str, transfer_id: str, points: Points, level: int,
             **extra: Any) -> None:
    """One line with this side's points of one transfer (at `level`: DEBUG, or INFO with `log_timeline`)."""
    if logger.isEnabledFor(level):
        logger.log(level, "%s%s", LOG_PREFIX, json.dumps({"side": side, "transfer_id": transfer_id, **extra,
                                                          **points.as_dict()}, separators=(",", ":")))


def parse_line(line: str) -> dict[str, Any] | None:
    """The JSON object of a timeline log line, or None for any other line."""
    at = line.find(LOG_PREFIX)
    if at < 0:
        return None
    try:
        record = json.loads(line[at + len(LOG_PREFIX):])
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("side") in SIDES else None
