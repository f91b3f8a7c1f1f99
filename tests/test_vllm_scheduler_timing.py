"""The connector's timing in vLLM 0.33's real Scheduler: the pacing of the empty steps of an engine that only holds
KV for decode (connector.vllm.idle_hold), and the scheduler sides' part of each transfer's timeline
(connector.engine.timeline)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm==0.33.0")

from tests import vllm_harness as H  # noqa: E402
from tests.test_vllm_scheduler import build, m3_dir  # noqa: E402,F401 - the fixture, shared

from connector.vllm.idle_hold import HoldPacer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]


# ---- pacing the empty steps of an engine that only holds KV (connector.vllm.idle_hold) ---------------------------
class CountingPacer(HoldPacer):
    def __init__(self) -> None:
        super().__init__(None, 5.0)
        self.asked = 0

    def wait(self, until: float | None = None, kv_since: float | None = None, holding: bool = True) -> None:
        self.asked += 1


def test_only_the_empty_steps_of_an_engine_that_holds_kv_wait(m3_dir):
    sched = build(m3_dir, "kv_producer", max_num_batched_tokens=64)
    pacer = sched.connector._scheduler.pacer = CountingPacer()
    req = H.make_request("p1", 100, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t1"},
                         max_tokens=1)
    sched.add_request(req)
    while not req.is_finished():
        H.run_step(sched)
    assert pacer.asked == 0  # every step so far computed something
    H.run_step(sched)
    H.run_step(sched)
    assert pacer.asked == 2  # empty steps while p1's KV is held
    other = H.make_request("p2", 40, max_tokens=3)
    sched.add_request(other)
    H.run_step(sched)
    assert pacer.asked == 2  # p2 computes
    while not other.is_finished():
        H.run_step(sched)
    H.run_step(sched, finished_sending={"p1"})
    before = pacer.asked
    H.run_step(sched)
    assert pacer.asked == before  # nothing held: vLLM parks the engine itself


def test_the_pacer_waits_on_the_engine_input_queue_and_wakes_for_a_request():
    import queue
    import threading
    import time

    from connector.vllm import idle_hold

    class FakeEngineCoreProc:
        def __init__(self) -> None:
            self.input_queue = queue.Queue()
            self.found = idle_hold.engine_input_queue()

    core = FakeEngineCoreProc()
    assert core.found is core.input_queue and idle_hold.engine_input_queue() is None
    pacer = HoldPacer(core.input_queue, 30.0)
    waits = []
    for streak in range(10):
        pacer.streak = streak
        waits.append(pacer.next_wait_s())
    assert waits[:3] == [0.1, 0.2, 0.4] and waits[-1] == 30.0  # doubling, up to holding_step_interval_s
    pacer.activity()
    assert pacer.next_wait_s() == idle_hold.FIRST_WAIT_S
    pacer.streak = 9  # a 30 s wait, which a request cuts short
    threading.Timer(0.3, core.input_queue.put, args=(("add", "r1"),)).start()
    started = time.monotonic()
    pacer.wait()
    assert pacer.waits == 1 and time.monotonic() - started < 10.0, "a new request did not wake the engine"
    core.input_queue.get_nowait()
    started = time.monotonic()
    pacer.wait(until=started)  # a held request's lease runs out now: wake just after it, not 30 s later
    assert time.monotonic() - started < idle_hold.LEASE_SLACK_S + 5.0
    core.input_queue.put(("add", "r1"))
    assert core.input_queue.get_nowait() == ("add", "r1")  # the pacer takes nothing out of vLLM's queue


def test_an_empty_step_with_a_request_waiting_for_blocks_does_not_wait():
    """KV full of held blocks, a new request waiting for them: vLLM tried to schedule it (it asked the connector
    first) and could not, so the step is empty; waiting here would keep that request waiting for the blocks."""
    from types import SimpleNamespace

    from connector.vllm.scheduler import SchedulerSide

    side = SchedulerSide("kv_producer", "e", pacer=CountingPacer())
    side.prefill._held["p1"] = 0.0  # a finished request's KV, held for decode
    empty = SimpleNamespace(total_num_scheduled_tokens=0)
    side.build_connector_meta(empty)
    assert side.pacer.asked == 1
    waiting = SimpleNamespace(request_id="p2", kv_transfer_params=None, num_prompt_tokens=40)
    assert side.get_num_new_matched_tokens(waiting, 0) == (0, False)
    side.build_connector_meta(empty)
    assert side.pacer.asked == 1  # p2 could not be scheduled: vLLM's pace
    side.build_connector_meta(empty)
    assert side.pacer.asked == 2  # nothing waits any more


# ---- the scheduler sides' part of each transfer's timeline (connector.engine.timeline) ---------------------------
def test_prefill_and_decode_schedulers_time_their_stages_and_log_one_line_each(m3_dir, caplog):
    import logging

    from connector.engine.timeline import parse_line

    def samples(sched) -> dict[str, list[float]]:
        """What the scheduler side hands vLLM each step (vLLM takes it in update_from_output), gathered."""
        side, got = sched.connector._scheduler, {}
        take = side.take_stats

        def gathered():
            out = take()
            for key, values in (out.data.items() if out is not None else ()):
                if isinstance(values, list):
                    got.setdefault(key, []).extend(values)
            return out

        side.take_stats = gathered
        return got

    pre = build(m3_dir, "kv_producer", max_num_batched_tokens=64)
    dec = build(m3_dir, "kv_consumer")
    pre_samples, dec_samples = samples(pre), samples(dec)
    req = H.make_request("p1", 100, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t1"}, max_tokens=1)
    want = H.make_request("d1", 40, kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t1",
                                                        "prefill_addr": "127.0.0.1:5600"})
    with caplog.at_level(logging.DEBUG, logger="connector"):
        pre.add_request(req)
        H.run_step(pre)
        dec.add_request(want)
        H.run_step(dec)
        H.run_step(dec, finished_recving={"d1"})
        H.run_step(dec)
    assert len(pre_samples["queue_seconds"]) == 1 and pre_samples["queue_seconds"][0] >= 0
    assert len(dec_samples["schedule_seconds"]) == 1
    lines = [parse_line(r.getMessage()) for r in caplog.records]
    by_side = {line["side"]: line for line in lines if line}
    assert by_side["prefill_scheduler"]["transfer_id"] == "t1" and \
        by_side["prefill_scheduler"]["seen"] <= by_side["prefill_scheduler"]["scheduled"]
    assert by_side["decode_scheduler"]["request_id"] == "d1" and \
        by_side["decode_scheduler"]["learned"] <= by_side["decode_scheduler"]["scheduled"]
