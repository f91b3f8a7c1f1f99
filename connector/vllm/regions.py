"""vLLM's world -> ours: which pool and global layer each KV-cache tensor is, from the KVCacheConfig vLLM gives the
connector, and where each block of it lives, from the tensor's own shape and strides."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, SparseCacheRole, UniformTypeKVCacheSpecs

from connector.core.errors import LayoutError
from connector.core.layout import POOLS, ModelLayout, RankLayout, Region

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def global_layer_of(layer_name: str) -> int:
    """`model.layers.31.self_attn.attn` -> 31 (vLLM names layers by their global index on every PP stage)."""
    match = _LAYER_RE.search(layer_name)
    if match is None:
        raise LayoutError(f"cannot find a layer index in KV-cache layer name {layer_name!r}: expected "
                          f"'...layers.<N>....'")
    return int(match.group(1))


@dataclass(frozen=True)
class LayerInfo:
    name: str
    pool: str
    layer: int
    group: int
    block_size: int


def classify_layers(kv_cache_config: KVCacheConfig) -> dict[str, LayerInfo]:
    """Layer name -> (pool, global layer, KV-cache group). An INDEXER-role spec is an index pool (index_v when the
    layer name says it holds index values, otherwise index_k); everything else is the main `kv` pool."""
    out: dict[str, LayerInfo] = {}
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue  # ephemeral replicas vLLM rebuilds itself from a transferable group
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            role = getattr(spec, "cache_role", None)
            if role == SparseCacheRole.INDEXER:
                pool = "index_v" if re.search(r"index_v(alue)?", name) else "index_k"
            else:
                pool = "kv"
            out[name] = LayerInfo(name, pool, global_layer_of(name), group_id, spec.block_size)
    return out


def _dense_span(t: torch.Tensor) -> bool:
    """The tensor's elements form one gap-free run of memory (any dim order)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1)
    return span == t.numel()


def region_of(info: LayerInfo, tensor: torch.Tensor, rank: RankLayout, num_blocks: int) -> Region:
    """Geometry of one layer tensor: vLLM 0.33's [blocks, heads, tokens, content] (K||V in the content), or the
    older 5-d [2, blocks, ...] / [blocks, 2, ...] with K and V as separate parts; any physical stride order inside
    a block, as long as one block of one part is a gap-free run."""
    elt = tensor.element_size()
    # Only the older 5-d layouts carry K/V as a dim of 2; vLLM 0.33's [B, H, N, C] packs K||V in C, and there a
    # dim 1 of size 2 is two heads.
    if tensor.dim() == 5 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
        parts, part_stride, block_stride, block = 2, tensor.stride(0), tensor.stride(1), tensor[0, 0]
    elif tensor.dim() == 5 and tensor.shape[0] == num_blocks and tensor.shape[1] == 2:
        parts, part_stride, block_stride, block = 2, tensor.stride(1), tensor.stride(0), tensor[0, 0]
    elif tensor.shape[0] == num_blocks:
        parts, part_stride, block_stride, block = 1, 0, tensor.stride(0), tensor[0]
    else:
        raise LayoutError(f"KV-cache tensor {info.name} has shape {tuple(tensor.shape)}: expected {num_blocks} "
                          f"blocks in dim 0 (or dim 1 after a K/V dim of 2)")
    if not _dense_span(block):
        raise LayoutError(f"KV-cache tensor {info.name}: one block (shape {tuple(block.shape)}, strides "
                          f"{block.stride()}) is not one run of memory; this layout cannot be transferred by block")
    heads = rank.heads(info.pool)
    n_heads = heads[1] - heads[0]
    spec = rank.model.pools[info.pool]
    # K and V may be separate parts or packed in the content dim (vLLM 0.33's [B, H, N, C]): bytes decide.
    expect = info.block_size * n_heads * spec.bytes_per_token_per_head // parts
    if block.numel() * elt != expect:
        raise LayoutError(f"KV-cache tensor {info.name} holds {block.numel() * elt} B per block and part, "
                          f"but the model config says {expect} B for {info.pool} layer "
                          f"{info.layer} ({n_heads} head(s), block size {info.block_size}): the config does not "
                          f"match the running model")
    return Region(pool=info.pool, layer=info.layer, slot=rank.slot(info.pool, info.layer),
                  base_addr=tensor.data_ptr(), num_blocks=num_blocks, bytes_per_block=block.numel() * elt,
                  block_stride=block_stride * elt, heads=heads, num_parts=parts, part_stride=part_stride * elt,
                  device_id=tensor.device.index or 0, group=info.group,
                  head_major=n_heads == 1 or _head_major(block, n_heads, info.block_size))


def _head_major(block: torch.Tensor, n_heads: int, block_size: int) -> bool:
    """In one block of one part, is each head's data contiguous (HND)? vLLM 0.33's logical per-block order is
    [H, N, C] (older backends: [N, H, C]); the physical order shows in the strides."""
    if block.dim() != 3:
        return False
    heads_dim, tokens_dim = (0, 1) if tuple(block.shape[:2]) == (n_heads, block_size) else (1, 0)
    return block.stride(heads_dim) >= block.stride(tokens_dim) * block.shape[tokens_dim]


def build_regions(kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig,
                  rank: RankLayout) -> list[Region]:
    """Every (pool, global layer) of this rank, after checking it is exactly what the model config says the rank
    holds; a mismatch names the pool and layers."""
    infos = classify_layers(kv_cache_config)
    regions: dict[tuple[str, int], Region] = {}
    for name, tensor in kv_caches.items():
        info = infos.get(name)
        if info is None:
            continue  # not transferable (or not in any group): nothing of ours
        if (info.pool, info.layer) in regions:
            raise LayoutError(f"two KV-cache tensors map to {info.pool} layer {info.layer} (one is {name})")
        regions[(info.pool, info.layer)] = region_of(info, tensor, rank, kv_cache_config.num_blocks)
    who = f"rank pp{rank.pp_rank},tp{rank.tp_rank}"
    for pool in POOLS:
        have = {layer for p, layer in regions if p == pool}
        want = set(rank.layers(pool))
        if have != want:
            extra, missing = sorted(have - want), sorted(want - have)
            if pool == "index_v" and not have:
                # vLLM 0.33's MiniMax-M3 assumes sparse_disable_index_value is set on every sparse layer and never
                # builds an index-value cache; moving the rest would hand decode a state the config says is partial.
                raise LayoutError(
                    f"{who}: config.json keeps an index value on sparse layers {missing} "
                    f"(sparse_attention_config.sparse_disable_index_value is 0 there) but this vLLM built no "
                    f"index-value cache for them (vLLM 0.33's MiniMax-M3 never does), so their index_v state "
                    f"cannot be transferred: serve a config whose sparse layers all set sparse_disable_index_value "
                    f"to 1, or a vLLM whose model registers the index-value cache")
            raise LayoutError(
                f"{who}: vLLM's KV caches have {pool} for layers {extra or '{}'} the model config does not, and "
                f"lack it for layers {missing or '{}'} that the config has: the model config and the running "
                f"model differ")
    return sorted(regions.values(), key=lambda r: (POOLS.index(r.pool), r.layer))


def model_layout_from_vllm(vllm_config) -> ModelLayout:  # noqa: ANN001 - VllmConfig
    """The whole model's layout (all PP stages) from vLLM's own hf_config and cache dtype."""
    from connector.core.hf_config import model_from_config

    hf = vllm_config.model_config.hf_config
    config = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    indexer = str(getattr(getattr(vllm_config, "attention_config", None), "indexer_kv_dtype", "auto") or "auto")
    name = str(getattr(vllm_config.model_config, "served_model_name", None) or vllm_config.model_config.model)
    return model_from_config(config, name.rsplit("/", 1)[-1], "fp8" if cache_dtype.startswith("fp8") else "auto",
                             indexer_kv_dtype="fp8" if indexer.startswith("fp8") else "auto",
                             model_dtype=str(vllm_config.model_config.dtype))
