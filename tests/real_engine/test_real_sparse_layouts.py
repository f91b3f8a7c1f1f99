"""The parallel layouts the connector is for, on real engines with index K and index V (the MiniMax-M3-shaped
test model, tests.real_engine.sparse_engines):

  prefill TP2 -> decode TP1         the main KV merged from one head per prefill rank; index K/V one copy
  prefill TP1 -> decode TP2 x PP2   the main KV split by head; index K/V replicated to both decode TP ranks;
                                    decode's 2:4 split puts every index cache on its stage 1
  prefill PP2 -> decode TP1         prefill stage 1's index_k slots 0-2 are decode's 1-3; stage 1 has no index_v
  prefill PP2 -> decode TP2 x PP2   both sides pipelined, with different splits (3:3 and 2:4)

Each is token-equal to one engine, follows prefill in a control run, and moves exactly each pool's bytes."""

from __future__ import annotations

import pytest

from sparse_kv_lab.pd import flows
from sparse_kv_lab.pd.client import prompt_ids
from tests.real_engine.test_real_sparse import changed, expected_pool_bytes, pd_with_metrics, salt

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

LAYOUTS = [("prefill_tp2", "decode", 1), ("prefill", "decode_tp2_pp2", 2), ("prefill_pp2", "decode", 1),
           ("prefill_pp2", "decode_tp2_pp2", 2)]


@pytest.mark.parametrize("prefill, decode, decode_tp", LAYOUTS,
                         ids=["tp2-to-tp1", "tp1-to-tp2xpp2", "pp2-to-pp1", "pp2-to-tp2xpp2"])
def test_layout_is_token_equal_and_moves_each_pool_once(sparse_m3, prefill, decode, decode_tp):
    p, d = getattr(sparse_m3, prefill), getattr(sparse_m3, decode)
    for n in (400, 1000):
        prompt = prompt_ids(n, seed=900 + n)
        want = sparse_m3.reference(prompt)
        got, sent, recv = pd_with_metrics(p, d, prompt)
        assert got.token_ids == want, f"{n}-token prompt"
        assert sent == recv == expected_pool_bytes(n, decode_tp), f"{n}-token prompt"
    prompt = prompt_ids(1000, seed=950)
    control = flows.concurrent(p.url, p.side_channel, d.url, prompt, prefill_prompt=changed(prompt),
                               cache_salt=salt())
    assert control.token_ids == sparse_m3.reference(changed(prompt)) != sparse_m3.reference(prompt)
