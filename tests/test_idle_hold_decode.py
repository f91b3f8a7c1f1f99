"""Pacing the empty steps of a decode engine whose only work is requests waiting for KV (connector.vllm.idle_hold,
SchedulerSide._pacing): the decision, as pure logic and in vLLM 0.33's real Scheduler. No test here times a wait."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from connector.vllm import idle_hold
from connector.vllm.idle_hold import HoldPacer, decode_wait_s
from connector.vllm.scheduler import SchedulerSide

EMPTY = SimpleNamespace(total_num_scheduled_tokens=0)


class RecordingPacer(HoldPacer):
    """Records what each wait was asked (and the wait it would have made), waits for nothing."""

    def __init__(self, interval_s: float = 30.0) -> None:
        super().__init__(None, interval_s)
        self.asked: list[dict] = []

    def wait(self, until: float | None = None, kv_since: float | None = None, holding: bool = True) -> None:
        self.asked.append({"until": until, "kv_since": kv_since, "holding": holding})
        self.streak += 1


def decoding(request_id: str, tid: str, prompt: int = 40) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, num_prompt_tokens=prompt, num_computed_tokens=0,
                           kv_transfer_params={"do_remote_prefill": True, "transfer_id": tid,
                                               "prefill_addr": "127.0.0.1:5600"})


def register(side: SchedulerSide, req: SimpleNamespace) -> None:
    """What vLLM does for a new decode request: match, allocate, then the step that ships its registration."""
    count, load_async = side.get_num_new_matched_tokens(req, 0)
    assert load_async and count == req.num_prompt_tokens - 1
    side.decode.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([1, 2, 3],))
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), count)
    meta = side.build_connector_meta(EMPTY)
    assert req.request_id in meta.recvs


# ---- the wait, as a function of how long the youngest request has waited --------------------------------------
def test_decode_waits_are_short_at_first_then_a_share_of_the_wait_so_far_up_to_a_bound():
    first, share, longest = idle_hold.DECODE_FIRST_WAIT_S, idle_hold.DECODE_WAIT_SHARE, idle_hold.DECODE_LONGEST_WAIT_S
    assert decode_wait_s(0.0, 30.0) == first  # a KV that arrives at once is collected after a few ms
    assert decode_wait_s(-1.0, 30.0) == first  # (a clock that went backwards)
    assert decode_wait_s(20.0, 30.0) == pytest.approx(20.0 * share)  # TTFT grows by at most this share
    assert decode_wait_s(1e6, 30.0) == longest
    assert decode_wait_s(1e6, 0.5) == 0.5  # never past holding_step_interval_s
    waits = [decode_wait_s(t, 30.0) for t in (0, 0.01, 0.1, 1, 5, 10, 30, 60, 300)]
    assert waits == sorted(waits)


def test_the_pacer_combines_prefill_holding_decode_waiting_and_the_lease():
    pacer = HoldPacer(None, 30.0)
    now = 1000.0
    assert pacer.wait_s(now, holding=True) == idle_hold.FIRST_WAIT_S  # prefill only: its growing waits
    assert pacer.wait_s(now, kv_since=now - 20.0, holding=False) == decode_wait_s(20.0, 30.0)  # decode only
    assert pacer.wait_s(now, kv_since=now, holding=False) == idle_hold.DECODE_FIRST_WAIT_S
    pacer.streak = 20  # prefill's waits reached the interval; a decode request just registered: the shorter wins
    assert pacer.wait_s(now, kv_since=now - 1.0, holding=True) == decode_wait_s(1.0, 30.0)
    assert pacer.wait_s(now, until=now - 5.0, kv_since=now - 300.0, holding=True) == 0.0  # a lease ran out
    assert pacer.wait_s(now, until=now, holding=True) == idle_hold.LEASE_SLACK_S


# ---- which steps wait (SchedulerSide._pacing) -------------------------------------------------------------------
def test_a_decode_engine_waits_only_while_every_request_is_registered_and_waits_for_kv():
    side = SchedulerSide("kv_consumer", "d", pacer=RecordingPacer())
    side.build_connector_meta(EMPTY)
    assert side.pacer.asked == []  # nothing waits: vLLM parks the engine itself
    d1 = decoding("d1", "t1")
    register(side, d1)
    assert side.pacer.asked == []  # the step that registers d1 goes out at once
    side.build_connector_meta(EMPTY)
    since = side.decode.only_waiting_since()
    assert since is not None and side.pacer.asked == [{"until": None, "kv_since": since, "holding": False}]
    d2 = decoding("d2", "t2")
    assert side.get_num_new_matched_tokens(d2, 0)[1]
    side.build_connector_meta(EMPTY)  # d2 matched, not placed (no blocks yet): vLLM's pace
    assert len(side.pacer.asked) == 1
    side.decode.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([4],))
    side.update_state_after_alloc(d2, None, 39)
    assert "d2" in side.build_connector_meta(EMPTY).recvs and len(side.pacer.asked) == 1
    side.build_connector_meta(EMPTY)
    assert side.pacer.asked[-1]["kv_since"] >= since  # the youngest request's age bounds the wait
    side.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"d1", "d2"}))
    side.build_connector_meta(EMPTY)
    assert len(side.pacer.asked) == 2  # every KV is in: the next step schedules them


def test_a_decode_abort_or_a_step_that_computes_does_not_wait():
    side = SchedulerSide("kv_consumer", "d", pacer=RecordingPacer())
    d1 = decoding("d1", "t1")
    register(side, d1)
    side.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=5))
    assert side.pacer.asked == []  # another request decodes
    side.request_finished(d1)  # aborted while waiting for its KV: the abort ships in the next step
    meta = side.build_connector_meta(EMPTY)
    assert meta.aborts == {"d1": "t1"} and side.pacer.asked == []
    side.build_connector_meta(EMPTY)
    assert side.pacer.asked == []  # d1 waits no more for KV, only for the workers' goodbye: vLLM's pace


def test_kv_both_waits_for_holding_and_waiting_together_but_not_while_a_request_is_placed():
    side = SchedulerSide("kv_both", "b", pacer=RecordingPacer())
    side.prefill._held["p1"] = 100.0  # a finished prefill request's KV, held for decode
    side.build_connector_meta(EMPTY)
    assert side.pacer.asked[-1] == {"until": side.prefill.first_expiry(), "kv_since": None, "holding": True}
    register(side, decoding("d1", "t1"))
    assert len(side.pacer.asked) == 1
    side.build_connector_meta(EMPTY)
    assert side.pacer.asked[-1]["holding"] and side.pacer.asked[-1]["kv_since"] is not None
    assert side.get_num_new_matched_tokens(decoding("d2", "t2"), 0)[1]
    side.build_connector_meta(EMPTY)
    side.build_connector_meta(EMPTY)  # d2 still matched, not placed: vLLM's pace (as before this pacing)
    assert len(side.pacer.asked) == 2


def test_the_pacer_is_off_without_an_engine_input_queue_or_with_interval_zero():
    assert not HoldPacer(None, 30.0).enabled and not HoldPacer(__import__("queue").Queue(), 0.0).enabled
    HoldPacer(None, 30.0).wait(kv_since=0.0, holding=False)  # returns at once: vLLM's own pace


@pytest.mark.parametrize("parallel, on", [(dict(pipeline_parallel_size=2), False),
                                          (dict(data_parallel_size=2), False), ({}, True)])
def test_the_pacer_is_off_with_pipeline_or_data_parallelism(monkeypatch, parallel, on):
    """PP: vLLM keeps steps in flight, whose results (finished_sending) a wait would hold up (a PP2 prefill kept a
    sent request's blocks ~30 s, tests/real_engine/test_real_zoo_pd.py); DP: idle ranks step in lockstep."""
    import queue
    import types

    from connector.vllm import idle_hold
    from connector.vllm.config import ConnectorSettings

    monkeypatch.setattr(idle_hold, "engine_input_queue", lambda: queue.Queue())
    monkeypatch.setattr(idle_hold, "StepWake", lambda found: None)
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=2, **parallel))
    assert idle_hold.pacer(ConnectorSettings(holding_step_interval_s=30.0), config).enabled is on


# ---- in vLLM 0.33's real Scheduler -----------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.timeout(120)
def test_in_vllms_scheduler_the_registration_step_never_waits_and_the_kv_wait_does(m3_dir):
    pytest.importorskip("vllm", reason="needs vllm==0.33.0")
    from tests import vllm_harness as H
    from tests.test_vllm_scheduler import build

    sched = build(m3_dir, "kv_consumer")
    pacer = sched.connector._scheduler.pacer = RecordingPacer()
    req = H.make_request("d1", 40, kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t1",
                                                       "prefill_addr": "127.0.0.1:5600"})
    sched.add_request(req)
    so, _ = H.run_step(sched)
    assert "d1" in so.kv_connector_metadata.recvs and pacer.asked == []  # registered in the step that placed it
    H.run_step(sched)
    H.run_step(sched)
    assert len(pacer.asked) == 2 and all(a["kv_since"] is not None and not a["holding"] for a in pacer.asked)
    other = H.make_request("d2", 40, kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t2",
                                                         "prefill_addr": "127.0.0.1:5600"})
    sched.add_request(other)  # arrives during a wait (the input queue wakes it): the next step registers it
    so, _ = H.run_step(sched)
    assert "d2" in so.kv_connector_metadata.recvs and len(pacer.asked) == 2
    H.run_step(sched, finished_recving={"d1", "d2"})
    assert len(pacer.asked) == 3  # that step was still empty: the KV is collected at its end
    so, _ = H.run_step(sched)
    assert so.total_num_scheduled_tokens > 0 and len(pacer.asked) == 3  # both are scheduled at once


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    pytest.importorskip("vllm", reason="needs vllm==0.33.0")
    from tests import vllm_harness as H

    return H.write_m3_config(tmp_path_factory.mktemp("m3"), num_layers=6, dense_layers=2)
