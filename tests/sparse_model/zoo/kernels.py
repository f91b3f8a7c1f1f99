"""The zoo models' attention in plain torch: each cache written where its vLLM spec says, and every term of the
output read back from the caches. No vLLM import: tests/test_zoo_models.py runs it directly.

Caches are vLLM's per-layer views `[blocks, heads, states, content]` (v1/kv_cache_interface.py
`create_kv_cache_views`), one head each here. A layer holds any of four caches (`KINDS`), each with its own term
of the layer's output (the vLLM layer projects each term back to the hidden size and sums them):

  full        FullAttentionSpec: K||V per token at vLLM's slot mapping; causal attention over every token.
  swa         SlidingWindowMLASpec: one latent per token at the slot mapping (head_size_v 0), read as key and value
              only within the last `window` positions (vLLM frees the blocks before that).
  ring        CircularBufferSpec: the request's ONE block, capacity R = its block size; token p's row K||V goes to
              row p % R (no slot mapping). The term attends over the ring's current lap, positions R * (p // R)
              .. p (a tail buffer, as GLM-5-next's tail ring): rows of earlier steps are read from the ring before
              this step's rows overwrite them. A lap starts empty at every multiple of R, where vLLM's prefix-cache
              hits land (multiples of 32 or 128 tokens here): so a hit needs nothing from the ring, which is why
              vLLM leaves rings out of prefix caching (CircularBufferSpec.prefix_cacheable is False).
  compressed  MLAAttentionSpec with tokens_per_state T: group g (tokens gT .. gT+T-1) becomes one state, written
              when its last token is computed: the mean of the group's ring rows times `comp_weight` (so a layer
              with a compressed cache has a ring: a group that spans two steps finds its earlier rows there, as
              DeepSeek-V4.1's compressor; T divides R, so a group lies in one lap). State g lives in block
              gT // (block tokens), row g % (states per block).
              The term attends over the completed groups (g with gT+T-1 <= p), plus a zero "sink" state so a query
              with none completed gets zeros.

Every write is a function of the tokens' own rows, so recomputing a token (a decode that recomputes the last
prompt token after a KV transfer) writes the same bytes again."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.sparse_model.attention import Batch

KINDS = ("full", "swa", "ring", "compressed")


@dataclass(frozen=True)
class ZooDims:
    """Head counts and widths of the caches (one KV head/latent each; TP1)."""

    full_heads: int = 4
    full_dim: int = 32
    swa_heads: int = 2
    swa_dim: int = 256
    window: int = 64
    ring_heads: int = 2
    ring_dim: int = 256
    """K and V width of a ring row (a row is K||V, 2 * ring_dim)."""
    comp_heads: int = 2
    comp_dim: int = 192
    tokens_per_state: int = 4

    def proj_widths(self, kind: str) -> tuple[int, ...]:
        """The per-token projections a kind takes from the hidden state, in order."""
        return {"full": (self.full_heads * self.full_dim, self.full_dim, self.full_dim),
                "swa": (self.swa_heads * self.swa_dim, self.swa_dim),
                "ring": (self.ring_heads * self.ring_dim, self.ring_dim, self.ring_dim),
                "compressed": (self.comp_heads * self.comp_dim,)}[kind]

    def out_width(self, kind: str) -> int:
        return {"full": self.full_heads * self.full_dim, "swa": self.swa_heads * self.swa_dim,
                "ring": self.ring_heads * self.ring_dim, "compressed": self.comp_heads * self.comp_dim}[kind]


def spans(batch: Batch):
    """(request, first row, end row, first position, sequence length) of each request with query tokens."""
    loc = batch.query_start_loc
    for r in range(len(loc) - 1):
        start, end = loc[r], loc[r + 1]
        if end > start:
            yield r, start, end, batch.seq_lens[r] - (end - start), batch.seq_lens[r]


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slot // N, 0, slot % N] = row (N: tokens per block); negative slots (padding) skipped."""
    keep = slots >= 0
    slots, rows = slots[keep], rows[keep]
    n = cache.shape[2]
    cache[slots // n, 0, slots % n] = rows.to(cache.dtype)


def read_positions(cache: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows [len, content] (float32) of token positions from a per-token cache, through the request's block ids."""
    n = cache.shape[2]
    return cache[blocks[positions // n].long(), 0, positions % n].float()


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
              sink: bool = False) -> torch.Tensor:
    """q [T, H, D], keys [L, D], values [L, Dv] (one KV head), visible [T, L] -> [T, H * Dv]. With `sink`, a zero
    key and value that every query sees (so no row is empty)."""
    scores = torch.einsum("thd,ld->thl", q, keys) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    if sink:
        scores = torch.cat([scores.new_zeros(*scores.shape[:2], 1), scores], dim=-1)
        values = torch.cat([values.new_zeros(1, values.shape[-1]), values])
    return torch.einsum("thl,lv->thv", scores.softmax(dim=-1), values).reshape(q.shape[0], -1)


def full_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, batch: Batch,
              dims: ZooDims) -> torch.Tensor:
    n, d = batch.num_tokens, dims.full_dim
    write_slots(cache, batch.slot_mapping[:n].long(), torch.cat([k[:n], v[:n]], dim=-1))
    out = q.new_zeros(q.shape[0], dims.out_width("full"), dtype=torch.float32)
    for r, start, end, first, length in spans(batch):
        rows = read_positions(cache, batch.block_table[r], torch.arange(length))
        positions = torch.arange(first, length)
        visible = torch.arange(length)[None, :] <= positions[:, None]
        out[start:end] = attention(q[start:end].float().view(-1, dims.full_heads, d), rows[:, :d], rows[:, d:],
                                   visible)
    return out


def swa_step(q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, batch: Batch, dims: ZooDims) -> torch.Tensor:
    n = batch.num_tokens
    write_slots(cache, batch.slot_mapping[:n].long(), latent[:n])
    out = q.new_zeros(q.shape[0], dims.out_width("swa"), dtype=torch.float32)
    for r, start, end, first, length in spans(batch):
        lo = max(0, first - dims.window + 1)
        kept = torch.arange(lo, length)
        rows = read_positions(cache, batch.block_table[r], kept)
        positions = torch.arange(first, length)
        visible = (kept[None, :] <= positions[:, None]) & (kept[None, :] > positions[:, None] - dims.window)
        out[start:end] = attention(q[start:end].float().view(-1, dims.swa_heads, dims.swa_dim), rows, rows, visible)
    return out


def ring_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: torch.Tensor, batch: Batch, dims: ZooDims,
              comp_q: torch.Tensor | None = None, comp_cache: torch.Tensor | None = None,
              comp_batch: Batch | None = None,
              comp_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ring term, and with a compressed cache the compressed term (its compressor reads the ring). Per request:
    read the ring rows of the earlier steps in the current lap, attend, compress the groups this step completes,
    attend over the compressed states, then write this step's rows into the ring."""
    cap, d = ring.shape[2], dims.ring_dim
    if cap % dims.tokens_per_state:
        raise ValueError(f"ring capacity {cap} is not a multiple of {dims.tokens_per_state} tokens per state")
    out = q.new_zeros(q.shape[0], dims.out_width("ring"), dtype=torch.float32)
    comp_out = q.new_zeros(q.shape[0], dims.out_width("compressed"), dtype=torch.float32) \
        if comp_cache is not None else None
    new_rows = torch.cat([k, v], dim=-1).float()
    for r, start, end, first, length in spans(batch):
        block = batch.block_table[r, 0].long()
        lo = first - first % cap  # the lap of the step's first token
        old = ring[block, 0, torch.arange(lo, first) % cap].float()
        rows = torch.cat([old, new_rows[start:end]])  # positions lo .. length - 1
        kept = torch.arange(lo, length)
        positions = torch.arange(first, length)
        visible = (kept[None, :] <= positions[:, None]) & (kept[None, :] >= (positions - positions % cap)[:, None])
        out[start:end] = attention(q[start:end].float().view(-1, dims.ring_heads, d), rows[:, :d], rows[:, d:],
                                   visible)
        if comp_cache is not None:
            comp_out[start:end] = compress_and_attend(comp_q[start:end], rows, lo, first, length, comp_cache,
                                                      comp_batch.block_table[r], comp_weight, dims)
        tail = torch.arange(max(first, length - cap), length)
        ring[block, 0, tail % cap] = rows[tail - lo].to(ring.dtype)
    return out, comp_out


def compress_and_attend(q: torch.Tensor, rows: torch.Tensor, lo: int, first: int, length: int, cache: torch.Tensor,
                        blocks: torch.Tensor, weight: torch.Tensor, dims: ZooDims) -> torch.Tensor:
    """One request: write the states of the groups whose last token is in [first, length) (from `rows`, the ring
    rows of positions lo..), then attend over every completed group."""
    tps, per_block = dims.tokens_per_state, cache.shape[2]
    block_tokens = per_block * tps
    done = torch.arange(first // tps, length // tps)  # the groups whose last token is in [first, length)
    if len(done):
        group_rows = torch.stack([rows[g * tps - lo: g * tps - lo + tps] for g in done.tolist()])
        states = group_rows.mean(dim=1) @ weight.float().t()
        cache[blocks[(done * tps) // block_tokens].long(), 0, done % per_block] = states.to(cache.dtype)
    groups = torch.arange(length // tps)
    states = cache[blocks[(groups * tps) // block_tokens].long(), 0, groups % per_block].float()
    positions = torch.arange(first, length)
    visible = groups[None, :] < ((positions + 1) // tps)[:, None]
    return attention(q.float().view(-1, dims.comp_heads, dims.comp_dim), states, states, visible, sink=True)


def layer_step(proj: dict[str, tuple[torch.Tensor, ...]], caches: dict[str, torch.Tensor],
               batches: dict[str, Batch], dims: ZooDims,
               comp_weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One layer's step: `proj[kind]` the kind's projections (dims.proj_widths), `caches[kind]` its cache view,
    `batches[kind]` its group's step metadata. Returns each kind's term [T, dims.out_width(kind)] (float32; rows
    past batch.num_tokens zero)."""
    out = {}
    if "full" in caches:
        out["full"] = full_step(*proj["full"], caches["full"], batches["full"], dims)
    if "swa" in caches:
        out["swa"] = swa_step(*proj["swa"], caches["swa"], batches["swa"], dims)
    if "compressed" in caches and "ring" not in caches:
        raise ValueError("a compressed cache needs a ring on its layer (its compressor reads the ring)")
    if "ring" in caches:
        comp = "compressed" in caches
        out["ring"], comp_out = ring_step(*proj["ring"], caches["ring"], batches["ring"], dims,
                                          proj["compressed"][0] if comp else None, caches.get("compressed"),
                                          batches.get("compressed"), comp_weight)
        if comp:
            out["compressed"] = comp_out
    return out
