"""Per-request timelines (connector.engine.timeline): the points each side marks, the stages between them, and the
log line bench-pd parses."""

from __future__ import annotations

import logging

from connector.engine.stats import SenderStats
from connector.engine.timeline import (LOG_PREFIX, STAGES, SIDES, ReceivePoints, SendPoints, close, parse_line,
                                       stage_samples)


def test_first_marks_stay_and_last_marks_move():
    p = SendPoints()
    p.mark("first_post")
    first = p.first_post
    p.mark("first_post")
    p.mark("last_post", first=False)
    p.last_post -= 1.0  # an earlier post ...
    p.mark("last_post", first=False)  # ... and a later one moves it
    assert p.first_post == first and p.last_post >= first and "computed" not in p.as_dict()


def test_stages_need_both_ends_and_never_go_negative():
    p = SendPoints(started=10.0, computed=10.5, last_write=10.25, released=10.75)
    assert stage_samples("prefill", p) == {"compute_seconds": 0.5, "exposed_seconds": 0.0, "ack_seconds": 0.5}
    assert stage_samples("decode", ReceivePoints(registered=1.0, landed=2.0)) == {"recv_seconds": 1.0}  # not told
    assert {side for side, *_ in STAGES.values()} <= set(SIDES)


def test_close_counts_the_stages_and_logs_one_parsable_line(caplog):
    logger = logging.getLogger("connector.test_timeline")
    stats = SenderStats()
    p = SendPoints(started=100.0, computed=100.2, last_write=100.25)
    with caplog.at_level(logging.INFO, logger="connector.test_timeline"):
        close(logger, "prefill", "t1", p, "released", verbose=True, samples=stats, rank=[0, 1], ok=True)
        close(logger, "prefill", "t2", SendPoints(started=1.0, computed=2.0), "released", verbose=False,
              samples=None)  # DEBUG: not at INFO
    assert abs(stats.exposed_seconds[0] - 0.05) < 1e-9
    assert len(stats.ack_seconds) == 1 and len(stats.compute_seconds) == 1
    [record] = caplog.records
    line = parse_line(f"INFO 12-02 01:02:03 [sender.py:1] {record.getMessage()}")
    assert line["side"] == "prefill" and line["transfer_id"] == "t1" and line["rank"] == [0, 1]
    assert line["started"] == 100.0 and line["released"] >= 100.25
    samples: dict[str, list[float]] = {}
    close(logger, "decode", "t3", ReceivePoints(registered=5.0, landed=5.5), "told", False, samples)
    assert list(samples) == ["recv_seconds", "tell_seconds"] and samples["recv_seconds"] == [0.5]
    assert samples["tell_seconds"][0] >= 0


def test_other_lines_are_not_timelines():
    assert parse_line("INFO something else") is None
    assert parse_line(LOG_PREFIX + "{not json") is None
    assert parse_line(LOG_PREFIX + '{"side": "elsewhere"}') is None


# ---- bench-pd's breakdown (sparse_kv_lab.pd.timelines) -------------------------------------------------------------
def test_a_request_breaks_down_from_both_engines_lines_and_the_clients_clock(tmp_path):
    from sparse_kv_lab.pd import timelines

    prefill_log, decode_log = tmp_path / "prefill.log", tmp_path / "decode.log"
    t = 1000.0

    def line(side, **points):
        import json
        return f"INFO 12-02 [x.py:1] {LOG_PREFIX}" + json.dumps({"side": side, "transfer_id": "t1", **points})

    prefill_log.write_text("\n".join([
        "INFO an unrelated line",
        line("prefill_scheduler", seen=t + 0.010, scheduled=t + 0.012),
        line("prefill", rank=[0, 0], started=t + 0.013, computed=t + 0.100, last_write=t + 0.104, released=t + 0.105,
             loop_cpu_ms=1.25),
        line("prefill", rank=[0, 1], started=t + 0.014, computed=t + 0.102, last_write=t + 0.103, released=t + 0.105,
             loop_cpu_ms=0.5),
    ]))
    decode_log.write_text("\n".join([
        line("decode", rank=[0, 0], registered=t + 0.011, landed=t + 0.105, told=t + 0.106),
        line("decode_scheduler", learned=t + 0.107, scheduled=t + 0.108),
    ]))
    records = timelines.read_logs([prefill_log, decode_log, tmp_path / "missing.log"])
    req = timelines.ClientRequest("t1", 600, sent_at=t, first_token_at=t + 0.130)
    got = timelines.breakdown(req, records["t1"])
    want = {"to_prefill": 10.0, "queue": 2.0, "compute": 89.0, "exposed": 2.0, "registered_after": -91.0,
            "landed_after": 3.0, "tell": 1.0, "schedule": 1.0, "first_token": 22.0, "ttft": 130.0, "loop_cpu": 1.75}
    assert got.keys() == want.keys() and all(abs(got[k] - v) < 1e-6 for k, v in want.items()), got
    summary = timelines.summarize([(600, got), (600, got | {"ttft": 150.0}), (900, {"ttft": 1.0})])
    assert summary[600]["ttft"] == (130.0, 150.0, 2) and summary[900] == {"ttft": (1.0, 1.0, 1)}
    table = timelines.table("sparse-concurrent", summary)
    assert table.splitlines()[0].startswith("| sparse-concurrent: prompt tokens | to_prefill |")
    assert "| 600 | 10.0 / 10.0 |" in table and "| 900 | — |" in table


def test_bench_pd_reports_ttft_and_its_overhead_per_prompt_length():
    import json

    from sparse_kv_lab.pd.bench import ModeResult, dump

    local = ModeResult("local", 4, 4, [10.0, 11.0, 20.0, 21.0], [600, 600, 1500, 1500])
    pd = ModeResult("sparse-concurrent", 4, 4, [12.0, 13.0, 25.0, 26.0], [600, 600, 1500, 1500],
                    breakdown={600: {"ttft": (12.0, 13.0, 2)}})
    text = dump([local, pd], as_json=False)
    assert "| sparse-concurrent | 4 | 4/4 | 13.0 | 26.0 |" in text and "600: 12.0 (+2.0), 1500: 25.0 (+5.0)" in text
    assert "| sparse-concurrent: prompt tokens |" in text  # the breakdown follows
    modes = json.loads(dump([local, pd], as_json=True))["modes"]
    assert modes[1]["p50_ms_by_prompt_tokens"] == {"600": 12.0, "1500": 25.0}


def test_a_saved_bench_pd_run_prints_the_same_tables_again(tmp_path, capsys):
    """`bench-pd --report FILE` renders a saved `--json` run (the README's table comes from one), bytes included."""
    import json

    from connector.cli.main import main
    from sparse_kv_lab.pd.bench import BenchConfig, ModeResult, dump

    local = ModeResult("local", 2, 2, [10.0, 20.0], [600, 1500])
    pd = ModeResult("sparse-concurrent", 2, 2, [12.0, 25.0], [600, 1500],
                    breakdown={600: {"ttft": (12.0, 12.0, 1)}, 1500: {"compute": (9.0, 9.5, 1)}},
                    kv_bytes_per_request=3 * 2**20, sent_during_compute=0.5)
    saved = tmp_path / "run.json"
    saved.write_text(dump([local, pd], True, BenchConfig(model="deep", max_model_len=8192)))
    assert main(["bench-pd", "--report", str(saved)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("date ") and "model deep, max_model_len 8192" in out
    assert dump([local, pd], False) in out and "| 3.0 MiB | 50% |" in out
    assert json.loads(saved.read_text())["modes"][1]["sent_during_compute"] == 0.5
    saved.write_text("{}")
    assert main(["bench-pd", "--report", str(saved)]) == 2
    assert "not a saved `bench-pd --json` run" in capsys.readouterr().err
