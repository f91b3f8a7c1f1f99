"""vLLM's world -> ours: which pool and global layer each KV-cache tensor is (connector.vllm.specs, from the
KVCacheConfig vLLM gives the connector), and where each block of it lives, from the tensor's own shape and strides."""

from __future__ import annotations

import logging
from typing import Callable

import msgspec
import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from connector.core.errors import LayoutError
from connector.core.layout import ModelLayout, RankLayout, Region
from connector.vllm.specs import CacheFacts, pieces_of, stage_caches
from connector.vllm.states import StateSplit

log = logging.getLogger(__name__)


def classify_layers(kv_cache_config: KVCacheConfig, total_kv_heads: int = 1, draft: frozenset[str] = frozenset(),
                    num_hidden_layers: int = 0, mla_model: bool = False,
                    split: StateSplit | None = None) -> dict[str, CacheFacts]:
    """Layer name -> what its spec says (pool, global layer, KV-cache group, sizes); raises LayoutError for a cache
    the connector cannot move. `total_kv_heads` (the model's) sizes the sharded main KV; `draft` names the draft
    model's layers, numbered after the `num_hidden_layers` (connector.vllm.specs.layer_id); `split`: how Mamba/GDN
    states split over TP (connector.vllm.states.state_split_of)."""
    return {c.name: c for c in stage_caches(kv_cache_config, total_kv_heads, draft, num_hidden_layers, mla_model,
                                            split)}


def _dense_span(t: torch.Tensor) -> bool:
    """The tensor's elements form one gap-free run of memory (any dim order)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1)
    return span == t.numel()


def region_of(info: CacheFacts, tensor: torch.Tensor, rank: RankLayout, num_blocks: int) -> Region:
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
    if info.offset >= 0:  # a piece of a state page: a run of this rank's units at an offset of each block
        return _piece_region(info, tensor, rank, num_blocks, block_stride * elt, block.numel() * elt)
    heads = rank.heads(info.pool)
    n_heads = heads[1] - heads[0]
    spec = rank.model.pools[info.pool]
    # K and V may be separate parts or packed in the content dim (vLLM 0.33's [B, H, N, C]): bytes decide. A
    # cache of its own pool holds whole pages: its content, or vLLM's padded page when the view spans it.
    per_head = spec.bytes_per_block_per_head or info.block_size * spec.bytes_per_token_per_head
    expect = {n_heads * per_head // parts}
    if info.page_bytes:
        expect.add(info.page_bytes // parts)
    if block.numel() * elt not in expect:
        raise LayoutError(f"KV-cache tensor {info.name} holds {block.numel() * elt} B per block and part, "
                          f"but its spec ({info.spec}) says {' or '.join(map(str, sorted(expect)))} B for "
                          f"{info.pool} layer {info.layer} ({n_heads} head(s), block size {info.block_size}): vLLM "
                          f"allocated another layout than its spec describes (a backend that repacks its cache?)")
    return Region(pool=info.pool, layer=info.layer, slot=rank.slot(info.pool, info.layer),
                  base_addr=tensor.data_ptr(), num_blocks=num_blocks, bytes_per_block=block.numel() * elt,
                  block_stride=block_stride * elt, heads=heads, num_parts=parts, part_stride=part_stride * elt,
                  device_id=tensor.device.index or 0, group=info.group,
                  head_major=n_heads == 1 or _head_major(block, n_heads, info.block_size),
                  block_size=info.block_size, per_request=spec.per_request, scratch_blocks=info.scratch_blocks,
                  overshoot_tokens=info.overshoot_tokens)


def _piece_region(info: CacheFacts, tensor: torch.Tensor, rank: RankLayout, num_blocks: int, block_stride: int,
                  page_bytes: int) -> Region:
    """A piece of a state page (connector.core.state_split): this rank's units of it, contiguous at its offset."""
    heads = rank.heads(info.pool)
    nbytes = (heads[1] - heads[0]) * rank.model.pools[info.pool].bytes_per_block_per_head
    if info.offset + nbytes > page_bytes:
        raise LayoutError(f"KV-cache tensor {info.name}: {info.pool} takes bytes {info.offset}..{info.offset + nbytes} "
                          f"of a {page_bytes} B page: vLLM allocated another layout than its spec describes")
    return Region(pool=info.pool, layer=info.layer, slot=rank.slot(info.pool, info.layer),
                  base_addr=tensor.data_ptr() + info.offset, num_blocks=num_blocks, bytes_per_block=nbytes,
                  block_stride=block_stride, heads=heads, device_id=tensor.device.index or 0, group=info.group,
                  block_size=info.block_size, per_request=True, scratch_blocks=info.scratch_blocks)


LayoutOf = Callable[[str, torch.Tensor, Region], tuple[tuple[tuple[int, int], ...], str]]
"""(layer name, its tensor, its region) -> (how its backend lays tokens out in a block, or () and why not)."""


def with_token_layout(region: Region, name: str, tensor: torch.Tensor, rank: RankLayout,
                      layout_of: LayoutOf | None) -> Region:
    """`region` with the token layout `layout_of` finds, for a plain per-token cache (the only kind that may be cut
    into sub-blocks) whose tensor holds its blocks in dim 0, where the layout covers a slab of the block exactly."""
    spec = rank.model.pools[region.pool]
    if layout_of is None or spec.per_request or spec.bytes_per_block_per_head or region.num_parts != 1 \
            or tensor.shape[0] != region.num_blocks:
        return region
    layout, _ = layout_of(name, tensor, region)
    if not layout:
        return region
    covered = sum(runs * nbytes for runs, nbytes in layout) * region.block_size
    if covered != region.slab_bytes:
        log.warning("SparseKVConnector: %s: its backend's token layout %s covers %d B of a %d B slab of a block; "
                    "left unknown (different block sizes are refused for it)", name, layout, covered,
                    region.slab_bytes)
        return region
    return msgspec.structs.replace(region, token_layout=layout)


def _head_major(block: torch.Tensor, n_heads: int, block_size: int) -> bool:
    """In one block of one part, is each head's data contiguous (HND)? vLLM 0.33's logical per-block order is
    [H, N, C] (older backends: [N, H, C]); the physical order shows in the strides."""
    if block.dim() != 3:
        return False
    heads_dim, tokens_dim = (0, 1) if tuple(block.shape[:2]) == (n_heads, block_size) else (1, 0)
    return block.stride(heads_dim) >= block.stride(tokens_dim) * block.shape[tokens_dim]


def build_regions(kv_caches: dict[str, torch.Tensor], infos: dict[str, CacheFacts], num_blocks: int,
                  rank: RankLayout, layout_of: LayoutOf | None = None) -> list[Region]:
    """Every (pool, global layer) of this rank, after checking each tensor holds what its spec says and that the
    rank holds exactly what the model layout gives it; a mismatch names the pool and layers."""
    regions: dict[tuple[str, int], Region] = {}
    for name, tensor in kv_caches.items():
        whole = infos.get(name)
        if whole is None:
            continue  # not transferable (or not in any group): nothing of ours
        for info in pieces_of(whole):
            if (info.pool, info.layer) in regions:
                raise LayoutError(f"two KV-cache tensors map to {info.pool} layer {info.layer} (one is {name})")
            region = region_of(info, tensor, rank, num_blocks)
            regions[(info.pool, info.layer)] = with_token_layout(region, name, tensor, rank, layout_of)
    who = f"rank pp{rank.pp_rank},tp{rank.tp_rank}"
    for pool in rank.model.pool_names:
        have = {layer for p, layer in regions if p == pool}
        want = set(rank.layers(pool))
        if have != want:
            extra, missing = sorted(have - want), sorted(want - have)
            raise LayoutError(
                f"{who}: vLLM's KV caches have {pool} for layers {extra or '{}'} the model layout does not, and "
                f"lack it for layers {missing or '{}'} that the layout has (vLLM registered no tensor for a cache "
                f"its KVCacheConfig lists?)")
    order = {pool: i for i, pool in enumerate(rank.model.pool_names)}
    return sorted(regions.values(), key=lambda r: (order[r.pool], r.layer))


def model_layout_from_hf(vllm_config) -> ModelLayout:  # noqa: ANN001 - VllmConfig
    """The whole model's layout as the Hugging Face config describes it (connector.core.hf_config): the cross-check
    of the layout vLLM's specs give, for the architectures the parser knows."""
    from connector.core.hf_config import model_from_config

    hf = vllm_config.model_config.hf_config
    config = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    indexer = str(getattr(getattr(vllm_config, "attention_config", None), "indexer_kv_dtype", "auto") or "auto")
    name = str(getattr(vllm_config.model_config, "served_model_name", None) or vllm_config.model_config.model)
    return model_from_config(config, name.rsplit("/", 1)[-1], "fp8" if cache_dtype.startswith("fp8") else "auto",
                             indexer_kv_dtype="fp8" if indexer.startswith("fp8") else "auto",
                             model_dtype=str(vllm_config.model_config.dtype))
