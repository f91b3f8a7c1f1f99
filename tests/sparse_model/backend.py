"""The attention backend of the sparse test model's own layers (its sparse main attention and its index caches):
what vLLM 0.32/0.33 needs to allocate their caches and build their per-step metadata. The metadata is the step's
batch layout on the CPU (tests.sparse_model.attention.Batch), built from vLLM's CommonAttentionMetadata; the
kernels are plain torch (tests.sparse_model.attention)."""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionImplBase, AttentionMetadataBuilder,
                                       CommonAttentionMetadata, MultipleOf)

from vllm.v1.kv_cache_layout import KVCacheLayout

from tests.sparse_model.attention import Batch


class TinySparseImpl(AttentionImplBase):
    """Nothing: the layers run tests.sparse_model.attention themselves (vLLM only asks a backend for its impl
    class; it builds impls only for its own Attention layers)."""


class TinySparseMetadataBuilder(AttentionMetadataBuilder[Batch]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:  # noqa: ANN001 - vLLM's types
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Batch:
        m = common_attn_metadata
        return Batch(query_start_loc=m.query_start_loc_cpu[:m.num_reqs + 1].tolist(),
                     seq_lens=m.seq_lens[:m.num_reqs].cpu().tolist(),
                     block_table=m.block_table_tensor[:m.num_reqs].cpu(),
                     slot_mapping=m.slot_mapping[:m.num_actual_tokens].cpu(), num_tokens=m.num_actual_tokens)


class TinySparseBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float32", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "TINY_SPARSE_TEST"

    @staticmethod
    def get_impl_cls() -> type[AttentionImplBase]:
        return TinySparseImpl

    @staticmethod
    def get_builder_cls() -> type[TinySparseMetadataBuilder]:
        return TinySparseMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # The kernels read logical [B, H, N, C] views, so any layout would do; but vLLM asserts that every worker
        # reports the same set (v1/attention/backends/utils.py resolve_kv_cache_layout), and a PP stage with only
        # sparse layers would report more than a stage with a dense layer (CPU_ATTN: LBHNC only).
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:  # noqa: ANN001
        # MiniMax-M3 scores whole KV-cache blocks, so a kernel block is a manager block: any size, never split.
        return [MultipleOf(1)]
