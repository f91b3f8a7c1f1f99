"""The sparse test model's attention in plain torch: cache writes at vLLM's slot mapping, and MiniMax-M3-style
block-sparse attention that reads everything back from the caches. No vLLM import: unit tests run it directly.

Caches are vLLM 0.32/0.33's per-layer views `[blocks, heads, block_size, content]` (v1/kv_cache_interface.py
`create_kv_cache_views`): the main K/V cache has content K||V per (head, token), an index cache one vector per
token (one head).

Per query token at position p (MiniMax-M3's sparse attention, minimax_m3/common/indexer.py: score blocks, keep the
top-k plus the init and local blocks):
  1. index scores s[t] = max over index heads h of iq[h] . ik[t] / sqrt(D), for every visible token t <= p;
  2. a block's score is the max over its visible tokens; the query's own (local) block and the init blocks are
     always kept, and the `topk` best of the other visible blocks are added;
  3. the main attention (GQA, causal) reads K/V of the kept blocks only;
  4. on layers that keep an index value: softmax over the visible tokens of the index scores averaged over index
     heads, times the index values (added to the layer's output through its own projection).
Everything after the writes reads the caches, so a token whose K/V or index rows came from elsewhere (prefix
cache, a KV transfer) is used exactly as it is stored: zeroed index keys change the blocks read, zeroed index
values change the index-value term."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SparseParams:
    num_heads: int
    """Query heads of this rank."""
    num_kv_heads: int
    """KV heads of this rank."""
    head_dim: int
    index_heads: int
    index_dim: int
    topk_blocks: int
    block_size: int
    init_blocks: int = 0
    local_blocks: int = 1


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[block, :, offset] = rows for each token's slot (slot = block * block_size + offset); rows is
    [tokens, heads, content]. Negative slots (padding) are skipped."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, rows = slots[keep], rows[keep]
    block_size = cache.shape[2]
    cache[slots // block_size, :, slots % block_size] = rows.to(cache.dtype)


def read_rows(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens [0, length) of one request as [length, heads, content] in float32, from its block ids."""
    rows = cache[blocks]  # [nb, H, N, C]
    return rows.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:length].float()


def kept_blocks(scores: torch.Tensor, positions: torch.Tensor, p: SparseParams) -> torch.Tensor:
    """[queries, blocks] bool: the blocks each query reads. `scores` is [queries, context] with -inf where a token
    is not visible."""
    length = scores.shape[1]
    num_blocks = -(-length // p.block_size)
    token_block = torch.arange(length) // p.block_size
    block_scores = torch.full((scores.shape[0], num_blocks), float("-inf"), dtype=scores.dtype)
    block_scores = block_scores.scatter_reduce(1, token_block.expand_as(scores), scores, "amax")
    own = positions // p.block_size
    block_ids = torch.arange(num_blocks)
    visible = block_ids[None, :] <= own[:, None]
    forced = (block_ids[None, :] < p.init_blocks) | ((own[:, None] - block_ids[None, :]) < p.local_blocks)
    forced &= visible
    # The index rows are a function of the token id, so two blocks whose best token is the same id tie exactly
    # (a 1,000-token prompt repeats some ids): a tie goes to the later block, whatever order topk returns ties in
    # for the batch's shape.
    tie_break = block_ids.to(block_scores.dtype) * 1e-9
    candidates = (block_scores + tie_break).masked_fill(forced | ~visible, float("-inf"))
    k = min(p.topk_blocks, num_blocks)
    picked = torch.zeros_like(visible)
    if k:
        picked.scatter_(1, candidates.topk(k, dim=1).indices, True)
    return forced | (picked & visible)


def request_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                      iv: torch.Tensor | None, positions: torch.Tensor,
                      p: SparseParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One request: q [Tq, Hq, d], k/v [L, Hkv, d], iq [Tq, Hi, D], ik/iv [L, D], positions [Tq] (of the queries).
    Returns the attention output [Tq, Hq, d] and the index-value term [Tq, D] (None without index values)."""
    length = k.shape[0]
    causal = torch.arange(length)[None, :] <= positions[:, None]  # [Tq, L]
    # float64: the same scores, to the last bit that matters, whatever the batch shape (a chunk of a prompt or all
    # of it) makes the matmul kernel do, so the top-k choice cannot flip on rounding.
    index_scores = torch.einsum("thd,ld->thl", iq.double(), ik.double()) * p.index_dim ** -0.5  # [Tq, Hi, L]
    block_choice = index_scores.amax(dim=1).masked_fill(~causal, float("-inf"))
    kept = kept_blocks(block_choice, positions, p)  # [Tq, nb]
    mask = causal & kept[:, torch.arange(length) // p.block_size]
    group = p.num_heads // p.num_kv_heads
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, d]
    scores = torch.einsum("thd,lhd->thl", q, keys) * p.head_dim ** -0.5
    probs = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(dim=-1)
    out = torch.einsum("thl,lhd->thd", probs, values)
    if iv is None:
        return out, None
    weights = index_scores.mean(dim=1).masked_fill(~causal, float("-inf")).softmax(dim=-1)  # [Tq, L]
    return out, weights.float() @ iv


@dataclass(frozen=True)
class Batch:
    """What the attention needs of one step (from vLLM's CommonAttentionMetadata), on the CPU."""

    query_start_loc: list[int]
    """[num_reqs + 1]: request r's query tokens are rows [query_start_loc[r], query_start_loc[r + 1])."""
    seq_lens: list[int]
    """Tokens of each request in the cache after this step (its computed tokens plus this step's)."""
    block_table: torch.Tensor
    """[num_reqs, max_blocks] block ids."""
    slot_mapping: torch.Tensor
    """[num_tokens] cache slot of each query token (-1: padding)."""
    num_tokens: int


def write_caches(k: torch.Tensor, v: torch.Tensor, index_kv: torch.Tensor, kv_cache: torch.Tensor,
                 index_k_cache: torch.Tensor, index_v_cache: torch.Tensor | None, batch: Batch,
                 p: SparseParams) -> None:
    """Write this step's main K/V and index rows at their slots: k/v [T, Hkv*d], index_kv [T, D (+ D)] (the index
    key, then the index value on layers that keep one)."""
    n, d, big_d = batch.num_tokens, p.head_dim, p.index_dim
    slots = batch.slot_mapping[:n].long()
    kv = torch.cat([k[:n].reshape(n, p.num_kv_heads, d), v[:n].reshape(n, p.num_kv_heads, d)], dim=-1)
    write_rows(kv_cache, slots, kv)
    write_rows(index_k_cache, slots, index_kv[:n, None, :big_d])
    if index_v_cache is not None:
        write_rows(index_v_cache, slots, index_kv[:n, None, big_d:])


def attend(q: torch.Tensor, index_q: torch.Tensor, out: torch.Tensor, index_out: torch.Tensor | None,
           kv_cache: torch.Tensor, index_k_cache: torch.Tensor, index_v_cache: torch.Tensor | None, batch: Batch,
           p: SparseParams) -> None:
    """Attend every request of the step from the caches: q [T, Hq*d], index_q [T, Hi*D]; `out` [T, Hq*d] and
    `index_out` [T, D] are written in place (rows past batch.num_tokens, padding, are zeroed)."""
    n, d, big_d = batch.num_tokens, p.head_dim, p.index_dim
    q3 = q[:n].reshape(n, p.num_heads, d).float()
    iq = index_q[:n].reshape(n, p.index_heads, big_d).float()
    out.zero_()
    if index_out is not None:
        index_out.zero_()
    loc = batch.query_start_loc
    for r in range(len(loc) - 1):
        start, end, length = loc[r], loc[r + 1], batch.seq_lens[r]
        if end <= start:
            continue
        blocks = batch.block_table[r, :-(-length // p.block_size)].long()
        kv = read_rows(kv_cache, blocks, length)
        ivals = read_rows(index_v_cache, blocks, length)[:, 0] if index_v_cache is not None else None
        positions = torch.arange(length - (end - start), length)
        o, io = request_attention(q3[start:end], kv[..., :d], kv[..., d:], iq[start:end],
                                  read_rows(index_k_cache, blocks, length)[:, 0], ivals, positions, p)
        out[start:end] = o.reshape(end - start, -1).to(out.dtype)
        if index_out is not None:
            index_out[start:end] = io.to(index_out.dtype)
