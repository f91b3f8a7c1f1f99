"""The model's layout from what vLLM built, not from an architecture table: each KV-cache layer's spec in the
`KVCacheConfig` vLLM gives the connector says which pool and global layer it is and how large a token of it is.

A pipeline stage sees only its own layers' specs (vLLM builds a `KVCacheConfig` per worker, and the scheduler's is
worker 0's: v1/core/kv_cache_utils.py `generate_scheduler_kv_cache_config`), so the stages of one engine exchange
theirs once at start-up (`gather_stages`, over vLLM's pipeline-parallel group) and every rank then holds the whole
model's `ModelLayout`, the same one on every rank of both engines when their models match (its fingerprint is what
the handshake compares).

What moves, by spec (vllm/v1/kv_cache_interface.py):
  FullAttentionSpec, SlidingWindowSpec (and the other attention specs that keep K||V per token and head):
      pool `kv`, K and V, heads sharded over TP as vLLM shards them (total = the model's KV heads);
  MLAAttentionSpec: pool `kv`, the MLA latent, one head on every TP rank;
  MLAAttentionSpec with cache_role INDEXER: pool `index_k` (or `index_v` when the layer's name says index values),
      one head on every TP rank.
Anything else (a Mamba state, cross or encoder-only attention, ring buffers) is refused at start-up by name, never
moved wrongly."""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec
from vllm.v1.kv_cache_interface import (AttentionSpec, CrossAttentionSpec, EncoderOnlyAttentionSpec, KVCacheConfig,
                                        KVCacheSpec, MLAAttentionSpec, SparseCacheRole, UniformTypeKVCacheSpecs)

from connector.core.errors import LayoutError
from connector.core.layout import POOLS, ModelLayout, PoolSpec

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_INDEX_VALUE_RE = re.compile(r"index_v(alue)?")


def global_layer_of(layer_name: str) -> int:
    """`model.layers.31.self_attn.attn` -> 31 (vLLM names layers by their global index on every PP stage)."""
    match = _LAYER_RE.search(layer_name)
    if match is None:
        raise LayoutError(f"cannot find a layer index in KV-cache layer name {layer_name!r}: expected "
                          f"'...layers.<N>....'")
    return int(match.group(1))


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
    """Heads over the whole model (all TP ranks)."""
    bytes_per_token_per_head: int
    """All parts (K and V) together."""
    num_parts: int
    sharded: bool
    spec: str
    """The spec's class name, for messages."""

    def pool_spec(self, layers: tuple[int, ...]) -> PoolSpec:
        return PoolSpec(name=self.pool, layers=layers, num_heads=self.num_heads,
                        bytes_per_token_per_head=self.bytes_per_token_per_head, num_parts=self.num_parts,
                        sharded=self.sharded)

    def sizes(self) -> tuple[int, int, int, bool]:
        return (self.num_heads, self.bytes_per_token_per_head, self.num_parts, self.sharded)


def _refusal(name: str, spec: KVCacheSpec) -> str | None:
    what = type(spec).__name__
    if isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
        return (f"KV-cache layer {name} is {what}: an encoder's cache is not prefill/decode state; serve the model "
                f"without SparseKVConnector")
    if not isinstance(spec, AttentionSpec):
        return (f"KV-cache layer {name} is a {what}, a state SparseKVConnector cannot move block by block (it moves "
                f"attention caches: full, sliding-window, MLA and sparse-index): serve this model with a connector "
                f"that supports its state, or without disaggregation")
    if getattr(spec, "tokens_per_state", 1) != 1:
        return (f"KV-cache layer {name} is a {what} storing {spec.tokens_per_state} tokens per state; "
                f"SparseKVConnector moves one state per token")
    return None


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


def cache_facts(name: str, spec: KVCacheSpec, group: int, total_kv_heads: int, layer: int | None = None) -> CacheFacts:
    """What one layer's spec says; raises LayoutError for a cache the connector cannot move."""
    refusal = _refusal(name, spec)
    if refusal:
        raise LayoutError(refusal)
    layer = global_layer_of(name) if layer is None else layer
    per_head = spec.state_content_size_bytes
    if isinstance(spec, MLAAttentionSpec):
        role = getattr(spec, "cache_role", None)
        if role == SparseCacheRole.INDEXER:
            pool = "index_v" if _INDEX_VALUE_RE.search(name) else "index_k"
        else:
            pool = "kv"
        return CacheFacts(name, pool, layer, group, spec.block_size, 1, per_head, 1, False, type(spec).__name__)
    # K and V of each (token, head); vLLM shards the KV heads over TP (replicating them past the head count).
    return CacheFacts(name, "kv", layer, group, spec.block_size, max(total_kv_heads, spec.num_heads), per_head, 2,
                      True, type(spec).__name__)


def stage_caches(kv_cache_config: KVCacheConfig, total_kv_heads: int, draft: frozenset[str] = frozenset(),
                 num_hidden_layers: int = 0) -> list[CacheFacts]:
    """Every transferable KV-cache layer of this rank (groups vLLM rebuilds itself are not); `draft`: the draft
    model's layers (draft_layer_names), numbered after the `num_hidden_layers`."""
    out = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue  # ephemeral replicas vLLM rebuilds itself from a transferable group
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            # vLLM 0.33 also marks a draft layer's own spec (is_draft); a group's shared spec may not show it
            drafts = draft | {name} if getattr(spec, "is_draft", False) else draft
            out.append(cache_facts(name, spec, group_id, total_kv_heads, layer_id(name, drafts, num_hidden_layers)))
    return sorted(out, key=lambda c: (c.layer, POOLS.index(c.pool), c.name))


@dataclass(frozen=True)
class ModelNames:
    name: str
    dtype: str
    kv_cache_dtype: str


def model_from_caches(caches: list[CacheFacts], num_layers: int, names: ModelNames) -> ModelLayout:
    """The whole model's layout from every stage's caches (`num_layers`: at least the model's hidden layers; draft
    layers of a speculative model come after them). Every layer of one pool must have the same sizes."""
    by_pool: dict[str, list[CacheFacts]] = {pool: [] for pool in POOLS}
    seen: dict[tuple[str, int], str] = {}
    for c in caches:
        if (c.pool, c.layer) in seen and seen[(c.pool, c.layer)] != c.name:
            raise LayoutError(f"two KV-cache layers are {c.pool} of layer {c.layer}: {seen[(c.pool, c.layer)]} and "
                              f"{c.name}")
        seen[(c.pool, c.layer)] = c.name
        by_pool[c.pool].append(c)
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
