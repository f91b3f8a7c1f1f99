"""The sequential flow of the routers PD deployments already run (vLLM's proxy pattern, llm-d): prefill first
with only `{"do_remote_decode": true}`, then decode with the `kv_transfer_params` of prefill's response, unchanged.
examples/sequential_router.py is such a router; it knows nothing of SparseKVConnector."""

from __future__ import annotations

import pytest

from sparse_kv_lab.pd import flows
from sparse_kv_lab.pd.client import complete, completion_body, prompt_ids
from tests.real_engine.conftest import fresh_salt
from tests.real_engine.test_real_pd import counters, received_bytes, wait_for

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_sequential_router_is_token_equal_and_moves_the_kv(engines, router, stream):
    for n in (250, 800):
        prompt = prompt_ids(n, seed=300 + n)
        recv0 = counters(engines.decode, "bytes_received", "recvs_ok")
        got = complete(router.url, completion_body(prompt, stream=stream, cache_salt=fresh_salt()))
        assert got.token_ids == engines.reference(prompt)
        recv = wait_for("decode's recvs_ok", lambda: (c := counters(engines.decode, "bytes_received", "recvs_ok"))
                        ["recvs_ok"] > recv0["recvs_ok"] and c)
        assert recv["bytes_received"] - recv0["bytes_received"] == received_bytes(n)  # not prefilled locally


def test_sequential_control_run_decode_follows_prefills_kv(engines):
    prompt = prompt_ids(700, seed=310)
    changed = list(prompt)
    changed[3] = 3 + (changed[3] - 2) % 31997
    want_changed = engines.reference(changed)
    assert want_changed != engines.reference(prompt)
    got = flows.sequential(engines.prefill.url, engines.decode.url, prompt, prefill_prompt=changed,
                           cache_salt=fresh_salt())
    assert got.kv_transfer_params["transfer_id"] and got.kv_transfer_params["prefill_addr"] == \
        engines.prefill.side_channel
    assert got.token_ids == want_changed


def test_sequential_flow_from_tp2_and_pp2_prefills(engines):
    for p in (engines.prefill_tp2, engines.prefill_pp2):
        prompt = prompt_ids(600, seed=320)
        got = flows.sequential(p.url, engines.decode.url, prompt, cache_salt=fresh_salt())
        assert got.token_ids == engines.reference(prompt)


RANKS = (1, 2, 1, 1)
"""Worker ranks of prefill, prefill_tp2, decode and decode_recompute: vLLM sums its workers' sends_ok, one per rank
and request."""


def test_two_prefills_and_two_decodes_behind_one_router(engines):
    # N:M: the router takes the prefills and the decodes round-robin, so four requests use every (prefill, decode)
    # pairing; each decode loads from the prefill that served its request (the prefill_addr in that prefill's
    # response), and every engine's counters show its share.
    prefills, decodes = [engines.prefill, engines.prefill_tp2], [engines.decode, engines.decode_recompute]
    router = engines.shared("sequential_router.py", [a for p in prefills for a in ("--prefill", p.url)] +
                            [a for d in decodes for a in ("--decode", d.url)])
    before = [counters(p.server, "sends_ok")["sends_ok"] for p in prefills] + \
        [counters(d, "recvs_ok")["recvs_ok"] for d in decodes]
    for i in range(4):
        prompt = prompt_ids(300 + 100 * i, seed=330 + i)
        got = complete(router.url, completion_body(prompt, cache_salt=fresh_salt()))
        assert got.token_ids == engines.reference(prompt), f"request {i}"

    def shares():
        now = [counters(p.server, "sends_ok")["sends_ok"] for p in prefills] + \
            [counters(d, "recvs_ok")["recvs_ok"] for d in decodes]
        # per request: vLLM sums its workers' counters, and each of prefill_tp2's two ranks finishes sending
        return [(a - b) / ranks for a, b, ranks in zip(now, before, RANKS)]
    try:
        wait_for("two transfers on each engine", lambda: shares() == [2, 2, 2, 2])
    except AssertionError as exc:
        raise AssertionError(f"{exc}: transfers per engine {shares()} (prefill, prefill_tp2, decode, "
                             f"decode_recompute)") from None


def vllm_router(engines, prefills, decodes):
    """vllm-router 0.1.17 in PD mode as vLLM's docs run it for NixlConnector (`--kv-connector nixl`, its default):
    it sends prefill `do_remote_decode` and decode the kv_transfer_params of prefill's response."""
    return engines.shared("vllm-router", ["--vllm-pd-disaggregation", "--kv-connector", "nixl",
                                          "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
                                          *[a for p in prefills for a in ("--prefill", p.url)],
                                          *[a for d in decodes for a in ("--decode", d.url)]])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_vllm_router_is_token_equal_and_moves_the_kv(engines, stream):
    router = vllm_router(engines, [engines.prefill], [engines.decode])
    for n in (300, 900):
        prompt = prompt_ids(n, seed=340 + n)
        recv0 = counters(engines.decode, "bytes_received", "recvs_ok")
        got = complete(router.url, completion_body(prompt, stream=stream, cache_salt=fresh_salt()))
        assert got.token_ids == engines.reference(prompt), f"{n}-token prompt"
        recv = wait_for("decode's recvs_ok", lambda: (c := counters(engines.decode, "bytes_received", "recvs_ok"))
                        ["recvs_ok"] > recv0["recvs_ok"] and c)
        assert recv["bytes_received"] - recv0["bytes_received"] == received_bytes(n)  # not prefilled locally


def test_vllm_router_with_two_prefills_and_two_decodes(engines):
    prefills, decodes = [engines.prefill, engines.prefill_tp2], [engines.decode, engines.decode_recompute]
    router = vllm_router(engines, prefills, decodes)
    engines_of = [p.server for p in prefills] + decodes
    names = ["sends_ok"] * 2 + ["recvs_ok"] * 2
    before = [counters(s, n)[n] for s, n in zip(engines_of, names)]
    for i in range(4):
        prompt = prompt_ids(350 + 100 * i, seed=360 + i)
        got = complete(router.url, completion_body(prompt, cache_salt=fresh_salt()))
        assert got.token_ids == engines.reference(prompt), f"request {i}"

    def shares():
        return [(counters(s, n)[n] - b) / ranks for s, n, b, ranks in zip(engines_of, names, before, RANKS)]
    # every engine took part, and every request moved its KV once (4 sends, 4 receives)
    try:
        final = wait_for("four transfers", lambda: (s := shares()) and sum(s[:2]) == sum(s[2:]) == 4 and s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: transfers per engine {shares()} (prefill, prefill_tp2, decode, "
                             f"decode_recompute)") from None
    assert all(share >= 1 for share in final), final
