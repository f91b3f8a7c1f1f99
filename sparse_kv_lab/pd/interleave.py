"""The pure half of `bench-pd`'s interleaving: which mode is asked when, and what the paired samples say.

Why interleave: run one mode after another and whatever the machine does between them (another job, a thermal
step, a page-cache flush) lands on one mode only and reads as that mode's cost; the same local engine took 2,964 ms
and 3,307 ms for 3,000 tokens in two runs minutes apart. Asked round by round, one request of every mode per round
on the same prompt, drift hits every mode alike, and the difference of two modes *within* a round cancels it. So an
overhead is the median of per-round differences against `local`, with the spread of those differences; it is called
within the run's noise when that spread reaches across 0, or when it is smaller than how much `local` itself moved
from round to round.

Why a balanced order: a request can leave something behind for the next one (a decode engine's shared-memory ring
polls for a while after each read; caches). Round r asks the modes in row r of a Williams design (a balanced Latin
square): over the design's rows each mode takes each position equally often and, within rounds, follows every
other mode equally often, so what one mode leaves behind is spread over all of them.

No I/O and no clocks here: tests/test_bench_pd_interleave.py checks it on made-up numbers."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from sparse_kv_lab.pd.timelines import percentile

LOW_PCT, HIGH_PCT = 10, 90
"""The spread every summary gives: p10..p90 (nearest rank, so with 10 samples or fewer it is the min..max)."""


def williams_rows(n: int) -> list[list[int]]:
    """A Williams design for n treatments: n rows (2n when n is odd), each a permutation of range(n); every index
    takes every position equally often, and every ordered pair (a, b), a != b, is adjacent (a right before b)
    equally often."""
    if n <= 0:
        return []
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows += [list(reversed(row)) for row in rows]
    return rows


def round_order(modes: Sequence[str], round_index: int, cycle: int = 1) -> list[str]:
    """The order in which round `round_index` asks `modes`. `cycle`: how many rounds the prompts take to repeat
    (bench-pd cycles its prompt lengths): round i uses design row (i // cycle + i % cycle), so every prompt length
    meets every row, where row i alone would give a length the same rows forever whenever the two periods share a
    factor (4 modes, 2 lengths: the 3,000-token rounds only ever saw rows 0 and 2)."""
    rows = williams_rows(len(modes))
    if not rows:
        return []
    row = round_index // max(1, cycle) + round_index % max(1, cycle)
    return [modes[i] for i in rows[row % len(rows)]]


def plan_batches(modes: Sequence[str], engines_by_mode: dict[str, int], engine_budget: int,
                 baseline: str = "local") -> list[list[str]]:
    """Which modes run at the same time. Every batch holds `baseline` (one set of its engines, kept up across the
    batches) and as many other modes, in their order, as fit in `engine_budget` engines together with it; one
    batch (all modes) when everything fits. Modes that share engines (`engines_by_mode` counts a shared pair once,
    on the first mode that needs it: 0 on the others) go in the same batch. A mode too big for any batch still gets
    one of its own (the machine then has to cope)."""
    rest = [m for m in modes if m != baseline]
    base = engines_by_mode.get(baseline, 0) if baseline in modes else 0
    batches: list[list[str]] = []
    current: list[str] = []
    used = base
    for mode in rest:
        need = engines_by_mode.get(mode, 0)
        if current and used + need > engine_budget and need > 0:
            batches.append(current)
            current, used = [], base
        current.append(mode)
        used += need
    if current or not batches:
        batches.append(current)
    return [([baseline] if baseline in modes else []) + b for b in batches]


@dataclass(frozen=True)
class Spread:
    """p50 and the p10..p90 interval of some samples, and how many (all NaN when there are none)."""
    p50_ms: float
    p10_ms: float
    p90_ms: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> "Spread":
        v = [x for x in values if x == x]  # NaN dropped
        return cls(percentile(v, 50), percentile(v, LOW_PCT), percentile(v, HIGH_PCT), len(v))

    @property
    def width_ms(self) -> float:
        return self.p90_ms - self.p10_ms

    def covers_zero(self) -> bool:
        return self.n > 0 and self.p10_ms <= 0.0 <= self.p90_ms

    def text(self, signed: bool = False) -> str:
        """`12.3 [10.1..15.0] n=6` (signed: `+12.3 [+10.1..+15.0] n=6`); `—` without samples."""
        if not self.n:
            return "—"
        f = "{:+.1f}" if signed else "{:.1f}"
        return f"{f.format(self.p50_ms)} [{f.format(self.p10_ms)}..{f.format(self.p90_ms)}] n={self.n}"


def paired_differences(samples_ms: Sequence[float], baseline_ms: Sequence[float]) -> list[float]:
    """Per-round differences sample - baseline (round i of one against round i of the other). The two must come
    from the same rounds."""
    if len(samples_ms) != len(baseline_ms):
        raise ValueError(f"paired samples of different lengths: {len(samples_ms)} vs {len(baseline_ms)}")
    return [a - b for a, b in zip(samples_ms, baseline_ms)]


def round_to_round_noise_ms(samples_ms: Sequence[float], groups: Sequence[int]) -> float:
    """How much one mode moved from round to round, its prompt length set aside: half the p10..p90 width of its
    samples' distances from the median of their own group (prompt length). Groups of one sample say nothing about
    movement and are left out; NaN when no group has two."""
    by_group: dict[int, list[float]] = defaultdict(list)
    for ms, g in zip(samples_ms, groups):
        by_group[g].append(ms)
    residuals = [ms - percentile(v, 50) for v in by_group.values() if len(v) >= 2 for ms in v]
    return Spread.of(residuals).width_ms / 2 if residuals else float("nan")


@dataclass(frozen=True)
class Overhead:
    """One mode against the baseline, from paired rounds."""
    diff: Spread
    """Per-round TTFT differences, mode minus baseline."""
    noise_ms: float
    """The baseline's own round-to-round movement (round_to_round_noise_ms; NaN: one round per prompt length)."""

    @property
    def within_noise(self) -> bool:
        """The run cannot tell this overhead from 0: its paired differences reach across 0, or its median is no
        bigger than how much the baseline moved by itself."""
        if not self.diff.n:
            return True
        return self.diff.covers_zero() or abs(self.diff.p50_ms) <= self.noise_ms  # (False for a NaN noise)

    def verdict(self) -> str:
        if not self.diff.n:
            return "no paired rounds"
        if not self.within_noise:
            return "above the run's noise" if self.diff.p50_ms > 0 else "below local, beyond the run's noise"
        why = "p10..p90 of the differences includes 0" if self.diff.covers_zero() else \
            f"|median| <= local's round-to-round noise {self.noise_ms:.1f} ms"
        return f"within the run's noise ({why})"


def overhead(samples_ms: Sequence[float], baseline_ms: Sequence[float], groups: Sequence[int]) -> Overhead:
    """`samples_ms` against `baseline_ms`, round by round; `groups` (the prompt length of each round) sets apart
    what the baseline's noise must not count."""
    return Overhead(Spread.of(paired_differences(samples_ms, baseline_ms)),
                    round_to_round_noise_ms(baseline_ms, groups))


def paired_by_group(samples_ms: Sequence[float], baseline_ms: Sequence[float],
                    groups: Sequence[int]) -> dict[int, float]:
    """Median per-round difference for each group (prompt length)."""
    by: dict[int, list[float]] = defaultdict(list)
    for d, g in zip(paired_differences(samples_ms, baseline_ms), groups):
        by[g].append(d)
    return {g: percentile(v, 50) for g, v in sorted(by.items())}
