"""The sequential flow of the routers PD deployments already run (vLLM's proxy pattern, llm-d): prefill first
with only `{"do_remote_decode": true}`, then decode with the `kv_transfer_params` of prefill's response, unchanged.
examples/sequential_router.py is such a router; it knows nothing of SparseKVConnector."""

from __future__ import annotations

import pytest

from connector.pd import flows
from connector.pd.client import complete, completion_body, prompt_ids
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
