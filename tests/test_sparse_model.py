"""The sparse test model's attention (tests.sparse_model.attention), in plain torch: what the real-engine sparse
tests rely on. Its block choice must not depend on how a prompt is batched (chunked prefill, another TP or PP
layout), and each index pool must change the output when it changes."""

from __future__ import annotations

import pytest
import torch

from tests.sparse_model.attention import (Batch, SparseParams, attend, kept_blocks, read_rows, request_attention,
                                          write_caches)

P = SparseParams(num_heads=4, num_kv_heads=2, head_dim=16, index_heads=2, index_dim=8, topk_blocks=2, block_size=8)
BLOCKS = 12


def caches(index_value: bool = True):
    kv = torch.zeros(BLOCKS, P.num_kv_heads, P.block_size, 2 * P.head_dim)
    ik = torch.zeros(BLOCKS, 1, P.block_size, P.index_dim, dtype=torch.bfloat16)
    iv = torch.zeros_like(ik) if index_value else None
    return kv, ik, iv


def step_inputs(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, P.num_heads * P.head_dim, generator=gen),
            torch.randn(tokens, P.num_kv_heads * P.head_dim, generator=gen),
            torch.randn(tokens, P.num_kv_heads * P.head_dim, generator=gen),
            torch.randn(tokens, P.index_heads * P.index_dim, generator=gen) * 4,
            torch.randn(tokens, 2 * P.index_dim, generator=gen))


def run(block_ids: list[int], length: int, chunk: int, seed: int = 0, index_value: bool = True):
    """Prefill one request of `length` tokens into `block_ids`, `chunk` tokens a step; returns each step's
    (attention output, index-value output) stacked, and the caches."""
    q, k, v, iq, ikv = step_inputs(length, seed)
    kv, ik, iv = caches(index_value)
    table = torch.tensor([block_ids])
    outs, index_outs = [], []
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        slots = torch.tensor([block_ids[t // P.block_size] * P.block_size + t % P.block_size
                              for t in range(start, end)])
        batch = Batch([0, end - start], [end], table, slots, end - start)
        out, index_out = torch.zeros(end - start, P.num_heads * P.head_dim), torch.zeros(end - start, P.index_dim)
        write_caches(k[start:end], v[start:end], ikv[start:end], kv, ik, iv, batch, P)
        attend(q[start:end], iq[start:end], out, index_out if iv is not None else None, kv, ik, iv, batch, P)
        outs.append(out)
        index_outs.append(index_out)
    return torch.cat(outs), torch.cat(index_outs), (kv, ik, iv)


def test_rows_land_at_their_slots_and_read_back_in_token_order():
    kv, ik, _ = caches()
    blocks = [5, 2, 9]
    _, k, v, _, ikv = step_inputs(20)
    slots = torch.tensor([blocks[t // 8] * 8 + t % 8 for t in range(20)] + [-1])  # -1: a padding row
    batch = Batch([0, 21], [20], torch.tensor([blocks]), slots, 21)
    pad = torch.zeros(1, k.shape[1])
    write_caches(torch.cat([k, pad]), torch.cat([v, pad]), torch.cat([ikv, ikv[:1]]), kv, ik, None, batch, P)
    back = read_rows(kv, torch.tensor(blocks), 20)
    assert torch.equal(back[..., :P.head_dim].reshape(20, -1), k)
    assert torch.equal(back[..., P.head_dim:].reshape(20, -1), v)
    assert torch.equal(read_rows(ik, torch.tensor(blocks), 20)[:, 0], ikv[:, :P.index_dim].bfloat16().float())
    assert not kv[[i for i in range(BLOCKS) if i not in blocks]].any()  # nothing outside the request's blocks


def test_each_query_keeps_its_own_block_and_the_top_k_of_the_earlier_ones():
    positions = torch.tensor([3, 30, 47])
    scores = torch.full((3, 48), float("-inf"), dtype=torch.float64)
    for row, p in enumerate(positions.tolist()):
        scores[row, :p + 1] = torch.arange(p + 1, dtype=torch.float64) % 7  # ties between blocks on purpose
    kept = kept_blocks(scores, positions, P)
    assert kept[0].tolist() == [True] + [False] * 5  # position 3: block 0 only, its own
    assert kept[1].nonzero().flatten().tolist() == [1, 2, 3]  # own block 3; of 0-2 (all score 6): the later two
    assert kept[2].nonzero().flatten().tolist() == [3, 4, 5]  # own block 5; of 0-4 (all tie): the later two


def test_with_every_block_kept_it_is_causal_attention():
    wide = SparseParams(**{**P.__dict__, "topk_blocks": BLOCKS})
    q, k, v = torch.randn(5, 4, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    positions = torch.arange(35, 40)
    out, _ = request_attention(q, k, v, torch.randn(5, 2, 8), torch.randn(40, 8), None, positions, wide)
    keys, values = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("thd,lhd->thl", q, keys) / 4
    scores = scores.masked_fill(torch.arange(40)[None, None, :] > positions[:, None, None], float("-inf"))
    assert torch.allclose(out, torch.einsum("thl,lhd->thd", scores.softmax(-1), values), atol=1e-6)


@pytest.mark.parametrize("chunk", [7, 16, 33])
def test_chunking_a_prompt_changes_nothing_the_tokens_see(chunk):
    # vLLM's chunked prefill (and the engines' other layouts) attend the same prompt in other batch shapes: the
    # block choice and the index-value weights come from float64 scores and cannot flip on rounding.
    blocks = [3, 7, 1, 10, 4, 0, 8]
    whole, whole_index, _ = run(blocks, 50, 50)
    chunked, chunked_index, _ = run(blocks, 50, chunk)
    assert torch.allclose(whole, chunked, atol=1e-5) and torch.allclose(whole_index, chunked_index, atol=1e-5)


@pytest.mark.parametrize("pool", ["index_k", "index_v"])
def test_a_zeroed_index_pool_changes_what_later_queries_get(pool):
    blocks = [3, 7, 1, 10, 4, 0, 8]
    _, _, (kv, ik, iv) = run(blocks, 50, 50)
    q, _, _, iq, _ = step_inputs(1, seed=9)
    batch = Batch([0, 1], [51], torch.tensor([blocks]), torch.tensor([blocks[6] * 8 + 2]), 1)
    k1, v1 = torch.randn(1, 32), torch.randn(1, 32)

    def decode_step(index_k, index_v):
        out, index_out = torch.zeros(1, 64), torch.zeros(1, P.index_dim)
        kv_copy = kv.clone()
        write_caches(k1, v1, torch.randn(1, 16, generator=torch.Generator().manual_seed(3)), kv_copy, index_k,
                     index_v, batch, P)
        attend(q, iq, out, index_out, kv_copy, index_k, index_v, batch, P)
        return out, index_out

    out, index_out = decode_step(ik.clone(), iv.clone())
    wiped = {"index_k": (torch.zeros_like(ik), iv.clone()), "index_v": (ik.clone(), torch.zeros_like(iv))}[pool]
    out2, index_out2 = decode_step(*wiped)
    assert not torch.allclose(index_out, index_out2)
    if pool == "index_k":  # the index keys also decide which blocks the main attention reads
        assert not torch.allclose(out, out2)


# ---- the DeepSeek-V3.2-shaped model's indexer (tests.sparse_model.indexer_fp8) ----------------------------------

def test_indexer_keys_sit_in_vllms_byte_layout_and_read_back_within_fp8_precision():
    from tests.sparse_model.indexer_fp8 import quantize, read_keys, row_bytes, write_keys

    cache = torch.zeros(6, 1, 16, row_bytes(128), dtype=torch.uint8)  # vLLM's [B, H=1, N, 132] view
    keys = torch.randn(20, 128)
    blocks = [4, 1]
    slots = torch.tensor([blocks[t // 16] * 16 + t % 16 for t in range(20)] + [-1])
    write_keys(cache, slots, torch.cat([keys, keys[:1]]))
    # block 4 holds tokens 0-15: their 16 x 128 fp8 values first, then their 16 fp32 scales
    fp8, scales = quantize(keys[:16])
    block = cache[4].flatten()
    assert torch.equal(block[:16 * 128], fp8.flatten())
    assert torch.equal(block[16 * 128:].view(torch.float32), scales.flatten())
    back = read_keys(cache, torch.tensor(blocks), 20, 128)
    assert torch.allclose(back.float(), keys, rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits
    assert not cache[[0, 2, 3, 5]].any()


def test_indexer_term_is_the_same_in_any_batch_shape_and_changes_with_zeroed_keys():
    from tests.sparse_model.indexer_fp8 import indexer_step, row_bytes

    gen = torch.Generator().manual_seed(4)
    iq, ik = torch.randn(80, 2 * 128, generator=gen) * 4, torch.randn(80, 128, generator=gen)
    blocks = [7, 2, 5, 0, 9]

    def run(chunk: int, zero_after: bool = False) -> torch.Tensor:
        cache = torch.zeros(10, 1, 16, row_bytes(128), dtype=torch.uint8)
        outs = []
        for start in range(0, 80, chunk):
            end = min(80, start + chunk)
            if zero_after and start:
                cache.zero_()  # every earlier key lost
            slots = torch.tensor([blocks[t // 16] * 16 + t % 16 for t in range(start, end)])
            out = torch.zeros(end - start, 128)
            indexer_step(iq[start:end], ik[start:end], out, cache, Batch([0, end - start], [end],
                                                                         torch.tensor([blocks]), slots, end - start),
                         index_heads=2, topk=12)
            outs.append(out)
        return torch.cat(outs)

    whole = run(80)
    assert torch.allclose(whole, run(13), atol=1e-6)
    assert not torch.allclose(whole[40:], run(40, zero_after=True)[40:])
