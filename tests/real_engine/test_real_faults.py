"""Real engines when things go wrong: a decode leg after prefill's lease, a prefill process killed mid-request
under both kv_load_failure_policy values, and clients that hang up. Each request fails (or recovers) alone, and
both engines end with no request and no block held."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import threading
import time

import pytest

from sparse_kv_lab.pd import flows
from sparse_kv_lab.pd.client import RequestFailed, complete, completion_body, prompt_ids
from sparse_kv_lab.pd.servers import metric
from tests.real_engine.conftest import MAIN_LEASE_S, SPARE_CHUNK_TOKENS, SPARE_LEASE_S, fresh_salt
from tests.real_engine.test_real_pd import wait_for

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]


def idle(server) -> bool:
    """No request running or waiting, and no KV block held (prefix-cached blocks are free blocks)."""
    m = server.metrics()
    return (metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0
            and metric(m, "vllm:kv_cache_usage_perc") == 0)


def failed_request(exc: RequestFailed | None, out) -> bool:
    """vLLM ends a request whose KV failed to load (policy fail) with an error: an HTTP error, or a 200 whose
    choice says finish_reason "error"."""
    return exc is not None or (out is not None and out.finish_reason == "error")


def test_decode_leg_after_the_lease_expired_fails_cleanly_and_prefill_says_so(engines):
    spare, decode = engines.spare, engines.decode
    prompt = prompt_ids(300, seed=41)
    pre = complete(spare.url, completion_body(prompt, 1, cache_salt=fresh_salt()) | {
        "kv_transfer_params": {"do_remote_decode": True}})
    params = pre.kv_transfer_params
    assert params and params["prefill_addr"] == spare.side_channel and params["prefill_finished"] is True
    expired0 = metric(spare.server.metrics(), "vllm:sparse_kv_sends_expired_total")
    wait_for("the lease to expire", lambda: metric(spare.server.metrics(), "vllm:sparse_kv_sends_expired_total")
             > expired0, timeout_s=SPARE_LEASE_S + 15)
    assert "no decode ever registered for it" in spare.server.log_text()
    failed0 = metric(decode.metrics(), "vllm:sparse_kv_recvs_failed_total")
    exc, out = None, None
    started = time.monotonic()
    try:
        out = complete(decode.url, completion_body(prompt, cache_salt=fresh_salt()) | {"kv_transfer_params": params})
    except RequestFailed as e:
        exc = e
    assert failed_request(exc, out), f"a decode leg for expired KV must fail, got {out and out.token_ids}"
    assert time.monotonic() - started < 30  # refused at once, not after a lease (120 s) or a transfer timeout
    wait_for("decode's recvs_failed", lambda: metric(decode.metrics(), "vllm:sparse_kv_recvs_failed_total") > failed0)
    assert re.search(r"KV transfer failed: .*refused .*already finished, expired or was aborted", decode.log_text())
    wait_for("decode idle", lambda: idle(decode))
    # the engine keeps serving
    prompt = prompt_ids(200, seed=42)
    got = flows.concurrent(spare.url, spare.side_channel, decode.url, prompt, cache_salt=fresh_salt())
    assert got.token_ids == engines.reference(prompt)


def test_prefill_killed_mid_request_fails_or_recomputes_by_policy(engines):
    spare, fail_decode, recompute_decode = engines.spare, engines.decode, engines.decode_recompute
    decodes = {"fail": fail_decode, "recompute": recompute_decode}
    prompt = prompt_ids(4000, seed=51)
    # A thousand prefill steps of 4 tokens: seconds of compute, so a kill a moment after it starts is surely
    # mid-request (decode registered, the first chunks streamed) and never after the transfer finished.
    assert len(prompt) / SPARE_CHUNK_TOKENS >= 1000
    want = engines.reference(prompt)
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            results[name] = flows.concurrent(spare.url, spare.side_channel, decodes[name].url, prompt,
                                             cache_salt=fresh_salt(), timeout_s=120, require_prefill=False)
        except Exception as exc:  # noqa: BLE001 - judged below
            results[name] = exc

    # Frozen first, so both legs of both requests are in before prefill computes anything; then a short run.
    spare.server.signal(signal.SIGSTOP)
    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(name,)) for name in decodes]
    for t in threads:
        t.start()
    time.sleep(2.0)  # both decodes scheduled their requests and are connecting to the frozen prefill
    # Thaw, and kill 0.3 s later, from a small process of its own: done from this process (three busy threads) on
    # a loaded machine, the kill once came 6 s after the thaw, when prefill had already finished.
    thaw_then_kill = subprocess.run(
        ["sh", "-c", f"kill -CONT -{spare.server.pid}; sleep 0.3; kill -KILL -{spare.server.pid}; date +%s.%N"],
        capture_output=True, text=True, timeout=30, check=True)
    spare.server.kill()  # reap it
    killed = float(thaw_then_kill.stdout.strip()) - (time.time() - time.monotonic())
    timeline = f"killed {killed - started:.2f} s after the requests were sent (thawed 0.3 s before)"
    for t in threads:
        t.join(120)
    fail_result, recompute_result = results["fail"], results["recompute"]
    if isinstance(fail_result, Exception):
        assert isinstance(fail_result, RequestFailed), f"an HTTP error from decode, not {fail_result!r}"
    else:
        assert fail_result.finish_reason == "error", f"policy fail: the request must fail, got {fail_result!r}; " \
                                                     f"{timeline}"
    assert not isinstance(recompute_result, Exception), f"policy recompute: {recompute_result!r}"
    assert recompute_result.token_ids == want  # decode prefilled it itself
    for d in decodes.values():
        wait_for(f"{d.spec.name} idle", lambda d=d: idle(d))
        assert "KV transfer failed" in d.log_text()
        short = prompt_ids(100, seed=52)
        assert complete(d.url, completion_body(short, cache_salt=fresh_salt())).token_ids == engines.reference(short)


@pytest.mark.parametrize("hang_up_after_s", [0.05, 0.3, 1.0])
def test_client_that_disconnects_frees_the_blocks_on_both_engines(engines, proxy, hang_up_after_s):
    prompt = prompt_ids(2000, seed=60)
    body = completion_body(prompt, 1500, stream=True, cache_salt=fresh_salt())
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    time.sleep(hang_up_after_s)
    conn.sock.close()  # hang up mid-request, without reading
    conn.close()
    # Each side frees at once when it hears of the abort; a decode leg cut before it reached decode's engine
    # leaves prefill's KV to prefill's lease.
    for server in (engines.prefill.server, engines.decode):
        wait_for(f"{server.spec.name} idle after the client left", lambda s=server: idle(s),
                 timeout_s=MAIN_LEASE_S + 15)
    prompt = prompt_ids(500, seed=61)
    got = complete(proxy.url, completion_body(prompt, cache_salt=fresh_salt()))
    assert got.token_ids == engines.reference(prompt)
