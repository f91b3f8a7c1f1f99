"""bench-pd's interleaving and paired statistics (sparse_kv_lab.pd.interleave, sparse_kv_lab.pd.results): the order each
round asks the modes in, which modes run at once, and what paired rounds say about an overhead. Made-up numbers
only: no engine runs and nothing here is timed."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from sparse_kv_lab.pd import interleave
from sparse_kv_lab.pd.bench import engines_needed, ordered_modes
from sparse_kv_lab.pd.interleave import Spread, plan_batches, round_order, williams_rows
from sparse_kv_lab.pd.results import ModeResult, dump, from_json


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_williams_rows_balance_positions_and_predecessors(n):
    rows = williams_rows(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(r) == list(range(n)) for r in rows)
    for position in range(n):  # every mode takes every position equally often
        counts = Counter(r[position] for r in rows)
        assert set(counts) == set(range(n)) and len(set(counts.values())) == 1
    pairs = Counter((r[i], r[i + 1]) for r in rows for i in range(n - 1))
    if n > 1:  # every mode follows every other equally often
        assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(pairs.values())) == 1


def test_round_order_rotates_every_mode_through_every_position():
    modes = ["local", "sparse-concurrent", "sparse-sequential"]
    orders = [round_order(modes, r) for r in range(6)]
    assert all(sorted(o) == sorted(modes) for o in orders)
    assert {o[0] for o in orders} == set(modes)
    assert round_order(modes, 6) == orders[0]  # the design repeats
    assert round_order([], 3) == []


@pytest.mark.parametrize("modes, lengths", [(4, 2), (3, 2), (3, 3), (2, 2), (5, 3), (4, 1)])
def test_every_prompt_length_meets_every_order(modes, lengths):
    names = [f"m{i}" for i in range(modes)]
    rows = {tuple(r) for r in williams_rows(modes)}
    for length in range(lengths):
        rounds = range(length, len(rows) * lengths * 2, lengths)  # the rounds that use this prompt length
        assert {tuple(int(m[1:]) for m in round_order(names, i, cycle=lengths)) for i in rounds} == rows


def test_modes_sharing_a_pair_count_its_engines_once_and_land_in_one_batch():
    modes = ordered_modes(("sparse-concurrent", "nixl", "sparse-sequential", "local"))
    assert modes == ["local", "sparse-concurrent", "sparse-sequential", "nixl"]
    need = engines_needed(modes)
    assert need == {"local": 1, "sparse-concurrent": 2, "sparse-sequential": 0, "nixl": 2}
    assert plan_batches(modes, need, engine_budget=7) == [modes]  # everything fits: one batch
    assert plan_batches(modes, need, engine_budget=3) == [
        ["local", "sparse-concurrent", "sparse-sequential"], ["local", "nixl"]]
    everything = ordered_modes(("local", "sparse-concurrent", "sparse-sequential", "nixl", "nixl-clamped"))
    batches = plan_batches(everything, engines_needed(everything), engine_budget=5)
    assert batches == [["local", "sparse-concurrent", "sparse-sequential", "nixl"], ["local", "nixl-clamped"]]
    assert plan_batches(["local"], {"local": 1}, 3) == [["local"]]


def test_spread_is_p50_and_p10_p90_by_nearest_rank():
    s = Spread.of(float(x) for x in range(1, 21))
    assert (s.p50_ms, s.p10_ms, s.p90_ms, s.n) == (10.0, 2.0, 18.0, 20)
    small = Spread.of([3.0, 1.0, 2.0, float("nan")])  # NaN dropped; ten or fewer samples: min..max
    assert (small.p10_ms, small.p50_ms, small.p90_ms, small.n) == (1.0, 2.0, 3.0, 3)
    assert Spread.of([]).text() == "—" and Spread.of([]).n == 0
    assert Spread.of([-1.0, 2.0]).covers_zero() and not Spread.of([1.0, 2.0]).covers_zero()
    assert Spread.of([1.0, 2.5]).text(signed=True) == "+1.0 [+1.0..+2.5] n=2"


def test_a_shared_drift_cancels_in_paired_differences():
    """Both modes slow down by the same 300 ms halfway through: the paired overhead stays the true +10 ms, and
    clear of the noise; the difference of p50s would not separate cost from drift this way."""
    drift = [0.0, 0.0, 0.0, 300.0, 300.0, 300.0]
    local = [100.0 + d + e for d, e in zip(drift, [0.0, 1.0, -1.0, 0.5, -0.5, 0.0])]
    pd = [x + 10.0 + e for x, e in zip(local, [0.5, -0.5, 0.0, 0.2, -0.2, 0.0])]
    over = interleave.overhead(pd, local, [600] * 6)
    assert over.diff.p50_ms == pytest.approx(10.0, abs=0.6) and over.diff.n == 6
    assert over.noise_ms > 100  # local moved by the drift itself
    assert over.within_noise  # |10| is below what local moved round to round: the run cannot tell it
    assert "within the run's noise" in over.verdict()


def test_noise_is_measured_within_a_prompt_length_and_a_clear_overhead_is_above_it():
    local = [100.0, 101.0, 99.0, 400.0, 402.0, 398.0]  # two lengths, each steady
    lengths = [600, 600, 600, 3000, 3000, 3000]
    assert interleave.round_to_round_noise_ms(local, lengths) == pytest.approx(2.0)
    lone = interleave.overhead([120.0, 420.0], [100.0, 400.0], [600, 3000])  # one round per length: no noise
    assert lone.noise_ms != lone.noise_ms and not lone.within_noise
    assert interleave.round_to_round_noise_ms([1.0, 5.0, 9.0], [600, 600, 3000]) == pytest.approx(2.0)
    over = interleave.overhead([x + 20.0 for x in local], local, lengths)
    assert not over.within_noise and over.verdict() == "above the run's noise"
    faster = interleave.overhead([x - 20.0 for x in local], local, lengths)
    assert not faster.within_noise and "below local" in faster.verdict()
    mixed = interleave.overhead([x + d for x, d in zip(local, [5, -5, 6, -6, 7, -7])], local, lengths)
    assert mixed.diff.covers_zero() and mixed.within_noise and "includes 0" in mixed.verdict()
    assert interleave.paired_by_group([x + 20.0 for x in local], local, lengths) == {600: 20.0, 3000: 20.0}
    with pytest.raises(ValueError, match="different lengths"):
        interleave.paired_differences([1.0], [1.0, 2.0])


def _paired_run() -> list[ModeResult]:
    lengths = [600, 3000, 600, 3000]
    local = ModeResult("local", 4, 4, [100.0, 400.0, 101.0, 401.0], lengths, rounds=[0, 1, 2, 3])
    pd = ModeResult("sparse-concurrent", 4, 4, [130.0, 440.0, 131.0, 441.0], lengths,
                    breakdown={600: {"compute": (90.0, 91.0, 2)}}, kv_bytes_per_request=2**20,
                    sent_during_compute=1.0, local_ms=list(local.ttft_ms), compute_ms=[90.0, 380.0, 91.0, None],
                    rounds=[0, 1, 2, 3])
    return [local, pd]


def test_the_tables_give_spread_paired_overhead_and_verdict():
    text = dump(_paired_run(), as_json=False)
    assert "| sparse-concurrent | 4 | 4/4 | 131.0 | 441.0 | +30.0 [+30.0..+40.0] n=4 ms paired (+30%) |" in text
    assert "600: 130.0 (+30.0), 3000: 440.0 (+40.0)" in text
    assert "| sparse-concurrent | 131.0 [130.0..441.0] n=4 | 91.0 [90.0..380.0] n=3 | 40.0 [40.0..60.0] n=3 " \
           "| +30.0 [+30.0..+40.0] n=4 | ±0.5 | above the run's noise |" in text
    assert "sparse-concurrent: overhead +30.0 ms (p10..p90 +30.0..+40.0 over 4 paired rounds): above the run's " \
           "noise" in text


def test_json_round_trips_and_runs_saved_before_interleaving_still_render():
    results = _paired_run()
    saved = json.loads(dump(results, as_json=True))
    pd = saved["modes"][1]
    assert pd["overhead_paired_p50_ms"] == 30.0 and pd["within_noise"] is False and pd["compute_n"] == 3
    assert pd["compute_ms"][3] is None and "overhead_paired_p50_ms" not in saved["modes"][0]
    assert dump(from_json(saved), as_json=False) == dump(results, as_json=False)
    # an old run: no local_ms, compute_ms, rounds, nor any of the new summary keys
    old = {"modes": [{k: v for k, v in m.items() if k not in ("local_ms", "compute_ms", "rounds")}
                     for m in saved["modes"]]}
    text = dump(from_json(old), as_json=False)
    assert "| +30.0 ms (+30%) |" in text  # p50 against p50, as printed then
    assert "paired" not in text and "verdict" not in text
    assert json.loads(dump(from_json(old), as_json=True))["modes"][1]["overhead_p50_ms"] == 30.0


class _FakeServer:
    """Stands in for a VllmServer: records the signals bench-pd sends its process group."""

    def __init__(self, name: str, log) -> None:
        self.name, self.log, self.log_path = name, log, None

    def signal(self, sig: int) -> None:
        self.log.append((self.name, sig))


def test_rounds_ask_every_mode_once_in_the_balanced_order_and_pair_each_with_local(monkeypatch):
    """The runner without engines: fake endpoints answer with a made-up TTFT that drifts with the request count,
    so the pairing (same round) and the bookkeeping can be checked; nothing is timed."""
    import signal

    from sparse_kv_lab.pd import bench
    from sparse_kv_lab.pd.client import Completion

    config = bench.BenchConfig(requests=4, warmup=1, prompt_lengths=(5, 7), settle_ms=0.0)
    runner = bench.PdBench.__new__(bench.PdBench)
    runner.config, runner.log, runner.reference = config, lambda line: None, {}
    runner.prompts = [[3] * config.prompt_lengths[i % 2] for i in range(config.warmup + config.requests)]
    asked: list[tuple[str, int]] = []
    signals: list[tuple[str, int]] = []
    monkeypatch.setattr(bench, "bytes_sent", lambda server: (100.0 * len(asked), 50.0 * len(asked)))

    def endpoint(mode: str, extra_ms: float, spins: bool = False) -> bench.Endpoint:
        def ask(prompt: list[int]) -> Completion:
            asked.append((mode, len(prompt)))
            drift_ms = 10.0 * len(asked)  # the machine slows down request by request
            wrong = (mode, 3) == ("sparse-sequential", sum(m == mode for m, _ in asked))  # its 2nd measured answer
            return Completion([9] if wrong else [len(prompt)], (len(prompt) + drift_ms + extra_ms) / 1e3, 1.0,
                              kv_transfer_params={"transfer_id": f"t{len(asked)}"})
        return bench.Endpoint(mode, [_FakeServer(mode, signals)], ask, spins=spins)

    modes = ["local", "sparse-sequential", "nixl"]
    endpoints = {"local": endpoint("local", 0.0), "sparse-sequential": endpoint("sparse-sequential", 5.0),
                 "nixl": endpoint("nixl", 50.0, spins=True)}
    tallies = {m: bench._Tally(ModeResult(m, 0, 0)) for m in modes}
    runner._run_batch(modes, endpoints, tallies, count_local=True)

    rounds = [asked[i:i + 3] for i in range(0, len(asked), 3)]
    assert [[m for m, _ in r] for r in rounds] == [round_order(modes, i, cycle=2) for i in range(5)]
    assert all({n for _, n in r} == {len(runner.prompts[i])} for i, r in enumerate(rounds))  # one prompt a round
    local, seq, nixl = (tallies[m].result for m in modes)
    assert local.requests == seq.requests == nixl.requests == 4 and local.rounds == [0, 1, 2, 3]
    assert local.local_ms == [] and seq.local_ms == local.ttft_ms == nixl.local_ms
    assert seq.prompt_tokens == [7, 5, 7, 5] and seq.token_equal == 3  # one answer had other tokens
    # each paired difference is the mode's cost plus the drift between its request and local's in that round
    # (at most 2 requests apart: 20 ms): never the drift accumulated since the first round (up to 150 ms)
    for r, cost_ms in ((seq, 5.0), (nixl, 50.0)):
        assert all(abs(d - cost_ms) <= 20.0 for d in interleave.paired_differences(r.ttft_ms, r.local_ms))
    assert [s for _, s in signals] == [signal.SIGCONT, signal.SIGSTOP] * 5  # nixl runs only for its own turns
    assert tallies["sparse-sequential"].counted_bytes and tallies["nixl"].bytes_sent == 0.0
    assert [a.transfer_id for a in tallies["sparse-sequential"].asked] == [
        f"t{i * 3 + round_order(modes, i, cycle=2).index('sparse-sequential') + 1}" for i in range(1, 5)]
    assert tallies["nixl"].asked == [None] * 4  # NixlConnector logs no timeline: nothing to join
