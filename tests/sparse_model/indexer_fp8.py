"""The DeepSeek-V3.2-shaped test model's indexer in plain torch: its key cache in vLLM's real byte layout, and the
top-k token term the model adds to each layer's output. No vLLM import: unit tests run it directly.

The cache (vLLM 0.32/0.33 `DeepseekV32IndexerCache`, `<layer>.self_attn.indexer.k_cache`): uint8, one head,
`index_head_dim + index_head_dim // 128 * 4` bytes per token. Each key is quantized to fp8 e4m3 with one fp32 scale
per 128 values, and a block keeps all its tokens' fp8 values first, then all their scales
(`indexer_k_quant_and_cache`, v1/attention/ops/rocm_aiter_mla_sparse.py: "the first portion as kv cache value and
second portion as kv cache scale"; its tile shuffle inside the value portion is left out here).

The choice, per query token at position p: scores s[t] = sum over index heads of relu(q_h . k_t) / sqrt(D) for the
visible tokens t <= p (DeepSeek-V3.2's indexer), in float64 from the dequantized keys; the `topk` best tokens (ties
to the later token); the term is their softmax-weighted dequantized keys. Zeroed keys (values and scales) change
both the choice (every score 0: the latest tokens are kept) and the sum."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tests.sparse_model.attention import Batch

FP8_MAX = 448.0
QUANT_BLOCK = 128


def row_bytes(head_dim: int) -> int:
    return head_dim + head_dim // QUANT_BLOCK * 4


def quantize(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, D] float -> (fp8 bytes [T, D] uint8, fp32 scales [T, D // 128])."""
    t, d = keys.shape
    groups = keys.float().reshape(t, d // QUANT_BLOCK, QUANT_BLOCK)
    scales = (groups.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-10)
    values = (groups / scales[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(t, d)
    return values, scales


def _portions(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B, N, D] uint8, scales [B, N, D // 128 * 4] uint8) as views of the cache's own bytes; `cache` is
    vLLM's [B, 1, N, row_bytes] view (one block of one head is one run of memory in every block-compact layout)."""
    blocks, _, tokens, row = cache.shape
    assert row == row_bytes(head_dim), (row, head_dim)
    block_stride = cache.stride(0)
    values = cache.as_strided((blocks, tokens, head_dim), (block_stride, head_dim, 1), cache.storage_offset())
    scale_bytes = row - head_dim
    scales = cache.as_strided((blocks, tokens, scale_bytes), (block_stride, scale_bytes, 1),
                              cache.storage_offset() + tokens * head_dim)
    return values, scales


def write_keys(cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """Quantize `keys` [T, D] into the cache at their slots (negative slots, padding, skipped)."""
    keep = slots >= 0
    slots, keys = slots[keep], keys[keep]
    values, scales = _portions(cache, keys.shape[1])
    fp8, scale = quantize(keys)
    tokens = cache.shape[2]
    values[slots // tokens, slots % tokens] = fp8
    scales[slots // tokens, slots % tokens] = scale.contiguous().view(torch.uint8)


def read_keys(cache: torch.Tensor, blocks: torch.Tensor, length: int, head_dim: int) -> torch.Tensor:
    """Tokens [0, length) of one request, dequantized to float64 [length, D]."""
    values, scales = _portions(cache, head_dim)
    fp8 = values[blocks].reshape(-1, head_dim)[:length].contiguous().view(torch.float8_e4m3fn).double()
    scale = scales[blocks].reshape(-1, head_dim // QUANT_BLOCK * 4)[:length].contiguous().view(torch.float32)
    return (fp8.reshape(length, -1, QUANT_BLOCK) * scale.double()[..., None]).reshape(length, head_dim)


def topk_tokens(iq: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """[Tq, L] bool: the `topk` visible tokens each query keeps (all of them when fewer are visible). iq [Tq, Hi, D],
    keys [L, D] float64 (dequantized), positions [Tq] of the queries. Scores are float64, ties go to the later
    token: the same choice whatever batch shape computes it."""
    length, head_dim = keys.shape
    scores = torch.einsum("thd,ld->thl", iq.double(), keys).relu().sum(dim=1) * head_dim ** -0.5  # [Tq, L]
    causal = torch.arange(length)[None, :] <= positions[:, None]
    ranked = (scores + torch.arange(length, dtype=torch.float64) * 1e-9).masked_fill(~causal, float("-inf"))
    chosen = torch.zeros_like(causal)
    chosen.scatter_(1, ranked.topk(min(topk, length), dim=1).indices, True)
    return chosen & causal


def topk_term(iq: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """The indexer's own term for each query: its chosen tokens' dequantized keys, weighted by the softmax of their
    scores. iq [Tq, Hi, D], keys [L, D] float64 -> [Tq, D] float32."""
    head_dim = keys.shape[1]
    scores = torch.einsum("thd,ld->thl", iq.double(), keys).relu().sum(dim=1) * head_dim ** -0.5
    chosen = topk_tokens(iq, keys, positions, topk)
    return (scores.masked_fill(~chosen, float("-inf")).softmax(dim=-1) @ keys).float()


def indexer_step(index_q: torch.Tensor, index_k: torch.Tensor, out: torch.Tensor, cache: torch.Tensor,
                 batch: "Batch", index_heads: int, topk: int) -> None:
    """Write this step's index keys [T, D] at their slots, then each query's top-k term into `out` [T, D] (padding
    rows zeroed). index_q is [T, Hi * D]."""
    n, head_dim = batch.num_tokens, index_k.shape[1]
    write_keys(cache, batch.slot_mapping[:n].long(), index_k[:n])
    out.zero_()
    block_size = cache.shape[2]
    loc = batch.query_start_loc
    for r in range(len(loc) - 1):
        start, end, length = loc[r], loc[r + 1], batch.seq_lens[r]
        if end <= start:
            continue
        blocks = batch.block_table[r, :-(-length // block_size)].long()
        iq = index_q[start:end].reshape(end - start, index_heads, head_dim)
        positions = torch.arange(length - (end - start), length)
        out[start:end] = topk_term(iq, read_keys(cache, blocks, length, head_dim), positions, topk).to(out.dtype)
