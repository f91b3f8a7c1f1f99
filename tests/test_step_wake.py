"""The workers' wake of a paced empty step (connector.vllm.idle_hold.StepWake / WakeSender): a receive that
completes, or a send that ends, ends the scheduler side's wait at once instead of at its bound, also when the wake
comes between a step and its wait; a worker that cannot reach the socket changes nothing."""

from __future__ import annotations

import queue
import threading

from connector.vllm.idle_hold import HoldPacer, StepWake, WakeSender

LONG_S = 60.0
"""A wait no test lets run out: each returns only if the wake ends it (the join below bounds the test)."""


def paced(q: queue.Queue) -> tuple[HoldPacer, StepWake]:
    wake = StepWake(q)
    return HoldPacer(q, LONG_S, wake), wake


def test_a_worker_datagram_ends_the_wait() -> None:
    q: queue.Queue = queue.Queue()
    pacer, wake = paced(q)
    started, done = threading.Event(), threading.Event()

    def step() -> None:
        started.set()
        pacer.wait(kv_since=None, holding=True)  # holding: the growing waits, capped at LONG_S
        done.set()

    pacer.streak = 30  # a long quiet spell: the wait would be LONG_S
    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    assert started.wait(10)
    sender = WakeSender()
    sender.to = wake.name
    for _ in range(200):  # (a datagram sent before the wait began is kept as `pending`, so one is enough;
        sender.wake()       # repeating covers nothing but the test's own start-up)
        if done.wait(0.05):
            break
    thread.join(10)
    assert not thread.is_alive() and q.empty() and wake.wakes >= 1
    sender.close()
    wake.close()


def test_a_wake_between_the_step_and_its_wait_is_not_slept_through() -> None:
    q: queue.Queue = queue.Queue()
    pacer, wake = paced(q)
    sender = WakeSender()
    sender.to = wake.name
    sender.wake()  # the KV landed after this step's get_finished, before the scheduler side began to wait
    for _ in range(200):  # the wake thread has read it once `pending` is set
        if wake.pending:
            break
        threading.Event().wait(0.01)
    assert wake.pending
    done = threading.Event()
    pacer.streak = 30
    thread = threading.Thread(target=lambda: (pacer.wait(holding=True), done.set()), daemon=True)
    thread.start()
    thread.join(10)
    assert done.is_set() and not wake.pending  # returned at once, and the next wait waits again
    sender.close()
    wake.close()


def test_a_worker_that_cannot_reach_the_wake_changes_nothing() -> None:
    sender = WakeSender()
    sender.wake()  # no name yet: nothing sent, no error
    sender.to = "sparse-kv-wake-nobody-listens-here"
    sender.wake()  # ECONNREFUSED: dropped (the wait's bound covers it)
    sender.close()


def test_once_every_worker_reaches_the_wake_a_wait_is_the_whole_interval() -> None:
    """A decode wait is bounded by 10% of the request's wait so far only while some worker might not be able to end
    it; once all of them said hello, it is the whole interval (and so is a holding wait from the start)."""
    q: queue.Queue = queue.Queue()
    wake = StepWake(q)
    pacer = HoldPacer(q, 30.0, wake, workers=2)
    assert pacer.wait_s(100.0, kv_since=99.0, holding=False) == 0.1  # 10% of 1 s waited: one worker unheard
    senders = [WakeSender(), WakeSender()]
    senders[0].to = wake.name
    for _ in range(500):
        if wake.reached:
            break
        threading.Event().wait(0.01)
    assert len(wake.reached) == 1 and not pacer.woken_by_every_worker
    senders[1].to = wake.name
    senders[1].to = wake.name  # (the same name again: no second hello)
    for _ in range(500):
        if len(wake.reached) == 2:
            break
        threading.Event().wait(0.01)
    assert pacer.woken_by_every_worker
    assert pacer.wait_s(100.0, kv_since=99.0, holding=False) == 30.0
    assert pacer.wait_s(100.0, holding=True) == 30.0
    assert pacer.wait_s(100.0, until=105.0, holding=True) == 5.5  # a lease still ends it (LEASE_SLACK_S after)
    for s in senders:
        s.close()
    wake.close()


def test_close_ends_the_wake_thread() -> None:
    before = set(threading.enumerate())
    wake = StepWake(queue.Queue())
    (thread,) = [t for t in threading.enumerate() if t not in before and t.name == "sparse-kv-step-wake"]
    wake.close()
    thread.join(10)
    assert not thread.is_alive()
