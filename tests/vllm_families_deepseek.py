"""vLLM 0.33's DeepSeek-lineage families for tests.vllm_families: deepseek_v32 (whose MLA and indexer helpers the
other MLA families use), deepseek_v4, hy_v4 and deepseek_v41; each family's specs built as its code builds them,
cited per family. Paths are inside the vllm package of vLLM 0.33.0."""

from __future__ import annotations

import functools

import torch
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import (CircularBufferSpec, MLAAttentionSpec, SlidingWindowMLASpec, SparseCacheRole,
                                        get_kv_quant_mode)

from tests.vllm_family_harness import _Ctx, _Family, _bf16_mla_dtype, _family


# ---------------------------------------------------------------------------------------------------------------
# deepseek_v32: models/deepseek_v32 (CUDA: nvidia/model.py; DeepseekV32Attention, attention.py:122-219)
#   model.layers.{i}.self_attn.indexer.k_cache    DeepseekV32IndexerCache (attention.py:94-99; spec
#                                                 model_executor/models/deepseek_v2.py:658-666): MLAAttentionSpec 1
#                                                 head, max_tp_shards 1, head index_head_dim + index_head_dim//128*4
#                                                 uint8, cache_role INDEXER. Backend DeepseekV32IndexerBackend. Built
#                                                 unless the layer skips top-k (index_topk_freq/pattern, :165-191).
#   model.layers.{i}.self_attn.attn               MLAAttention (attention.py:197-214; spec mla_attention.py:1371-1400):
#                                                 MLAAttentionSpec 1 head, max_tp_shards 1, head kv_lora_rank +
#                                                 qk_rope_head_dim in the kv-cache dtype, topk_buffer_width =
#                                                 index_topk (the shared buffer, nvidia/model.py:192-197),
#                                                 is_index_group_leader = has an indexer. Backend: see
#                                                 _sparse_mla_backend.
#   "fp8": FLASHMLA_SPARSE, canonicalised to fp8_ds_mla (mla_attention.py:359-376): uint8, C 656.

def _dsa_skip_topk(hf, layer_id: int) -> bool:
    """deepseek_v32/attention.py:165-176."""
    freq = getattr(hf, "index_topk_freq", 1)
    pattern = getattr(hf, "index_topk_pattern", None)
    offset = getattr(hf, "index_skip_topk_offset", 2)
    if pattern is None:
        return max(layer_id - offset + 1, 0) % freq != 0
    if 0 <= layer_id < len(pattern):
        return pattern[layer_id] == "S"
    return False


def _sparse_mla_backend(cache_dtype: str):
    """Sparse MLA on sm90: FLASH_ATTN_MLA_SPARSE for bf16, FLASHMLA_SPARSE for fp8 (platforms/cuda.py:140-155).
    Both declare [MultipleOf(64)] kernel blocks, no layouts, and customize_spec = align_blocks_to_rows for bf16
    (flashattn_mla_sparse.py:50-55, flashmla_sparse.py:157-175); the FA one does not import without CUDA, so the
    FlashMLA class stands in for it."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    return FlashMLASparseBackend


def _mla_spec(ctx: _Ctx, head_size: int, cache_dtype: str, **extra) -> MLAAttentionSpec | SlidingWindowMLASpec:
    """MLAAttention.get_kv_cache_spec (mla_attention.py:1371-1400)."""
    common = dict(block_size=ctx.block_size, num_kv_heads=1, max_tp_shards=1, head_size=head_size,
                  dtype=_bf16_mla_dtype(ctx, cache_dtype), cache_dtype_str=cache_dtype,
                  kv_quant_mode=get_kv_quant_mode(cache_dtype),
                  state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(cache_dtype))
    if extra.get("sliding_window") is not None:
        return SlidingWindowMLASpec(**common, sliding_window=extra["sliding_window"])
    extra.pop("sliding_window", None)
    return MLAAttentionSpec(**common, **extra)


def _dsv32_build(ctx: _Ctx):
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    hf = ctx.hf
    cache_dtype = ctx.cache.cache_dtype
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"model.layers.{i}.self_attn"
        indexer = not _dsa_skip_topk(hf, i)
        if indexer:
            out.append((f"{p}.indexer.k_cache", MLAAttentionSpec(  # deepseek_v2.py:658-666
                block_size=ctx.block_size, num_kv_heads=1, max_tp_shards=1,
                head_size=hf.index_head_dim + hf.index_head_dim // 128 * 4, dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER), DeepseekV32IndexerBackend))
        out.append((f"{p}.attn", _mla_spec(ctx, hf.kv_lora_rank + hf.qk_rope_head_dim, cache_dtype,
                                            topk_buffer_width=hf.index_topk, is_index_group_leader=indexer,
                                            non_causal_multi_token_decode=False), _sparse_mla_backend(cache_dtype)))
    return out


def _dsv32_backends(ctx: _Ctx):
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    return [DeepseekV32IndexerBackend, _sparse_mla_backend(ctx.cache.cache_dtype)]


_family(_Family(
    name="deepseek_v32",
    config={"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "torch_dtype": "bfloat16",
            "num_hidden_layers": 6, "first_k_dense_replace": 1, "hidden_size": 256, "intermediate_size": 256,
            "moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
            "topk_group": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
            "kv_lora_rank": 128, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "index_head_dim": 128, "index_n_heads": 4, "index_topk": 64, "vocab_size": 1024,
            "max_position_embeddings": 4096, "rope_scaling": None},
    layers=lambda c: c["num_hidden_layers"], kv_heads=lambda c: c["num_key_value_heads"],
    build=_dsv32_build, backends=_dsv32_backends))


@functools.cache
def _flash_attn_mla_backend() -> type[AttentionBackend]:
    """FLASH_ATTN_MLA: sm90's first dense-MLA choice (platforms/cuda.py:149-155; valid on capability 9,
    v1/attention/backends/mla/flashattn_mla.py:69-87). Its module needs the CUDA flash-attention extension, so on
    CPU a stand-in with its declarations: MLACommonBackend's customize_spec (mla_attention.py:1598-1612), kernel
    blocks [MultipleOf(16)] (flashattn_mla.py:49-50), no layout preference."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
    from vllm.v1.attention.backend import MultipleOf

    class FlashAttnMLABackend(MLACommonBackend):
        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            return [MultipleOf(16)]

        @staticmethod
        def get_name() -> str:
            return "FLASH_ATTN_MLA"

    return FlashAttnMLABackend


# ---------------------------------------------------------------------------------------------------------------
# deepseek_v4: models/deepseek_v4 (CUDA: nvidia/model.py, DeepseekV4FlashMLAAttention on sm90, model.py:537-568)
#   model.layers.{i}.attn                         DeepseekV4Attention (attention.py:201), ratio = max(1,
#                                                 compress_rates[layer_types[i]]) (:239-240). Spec only for ratio > 1
#                                                 (:860-884): MLAAttentionSpec 1 head, max_tp_shards 1, head 512,
#                                                 uint8, tokens_per_state ratio, alignment 576, model_version
#                                                 "deepseek_v4", C 584 (fp8_ds_mla). Backend DeepseekV4FlashMLABackend
#                                                 (nvidia/flashmla.py:54). Registered at :360-363.
#   ...attn.swa_cache                             DeepseekV4SWACache (:349-356; v1/attention/backends/mla/sparse_swa.py:
#                                                 77-147): SlidingWindowMLASpec block 64, window config.sliding_window,
#                                                 C 584, alignment 576, model_version "deepseek_v4". Backend
#                                                 DeepseekSparseSWAFlashMLABackend (nvidia/flashmla.py:55).
#   ...attn.compressor.state_cache                ratio > 1 (:369-378): CompressorStateCache (compressor.py:139-192):
#                                                 SlidingWindowMLASpec, head 2*coff*512 fp32 (coff = 2 for ratio 4,
#                                                 1 for 128), window coff*ratio, block 4 (ratio 4) / 8 (ratio 128),
#                                                 alignment 576. Backend CompressorBackend.
#   ...attn.indexer.k_cache                       ratio 4 only (:302-320, :1030-1036, :886-925): MLAAttentionSpec
#                                                 head 128 + 128 // 128 * 4 = 132 uint8 (fp8 indexer, default
#                                                 indexer_kv_dtype), tokens_per_state 4, alignment 576, cache_role
#                                                 left SPARSE. Backend DeepseekV4IndexerBackend ([256], BLHNC/BLNHC).
#   ...attn.indexer.compressor.state_cache        ratio 4 only (:1037-1046): compressor state of head_dim 128.
# Registration order per layer: indexer.k_cache, indexer.compressor.state_cache (built inside the indexer, :302),
# swa_cache (:349), attn (:363), compressor.state_cache (:369).
# cache dtype: FlashMLA's fp8_ds_mla layout (use_fp8_ds_mla_layout, :152) turns "auto" into "fp8_ds_mla" and writes
# it back onto cache_config (_resolve_dsv4_kv_cache_dtype, :94-123). head_dim 512 / index_head_dim 128 are the only
# sizes the fused compressor kernels take (compressor.py:293-314), so the tiny config keeps them.

def _dsv4_compressor_state(ratio: int, head_dim: int, cache_dtype: str) -> SlidingWindowMLASpec:
    coff = 1 + (ratio == 4)  # compressor.py:239-240 (overlap for ratio 4)
    block_size = {4: 4, 128: 8}[ratio]  # compressor.py:168-173
    return SlidingWindowMLASpec(  # compressor.py:183-192
        block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=2 * coff * head_dim, dtype=torch.float32,
        sliding_window=coff * ratio, alignment=576 if cache_dtype == "fp8_ds_mla" else 512)


def _dsv4_build(ctx: _Ctx):
    from vllm.models.deepseek_v4.compressor import CompressorBackend
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekSparseSWAFlashMLABackend
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLABackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV4IndexerBackend
    hf, bs = ctx.hf, ctx.block_size
    cache_dtype = ctx.cache.cache_dtype
    packed = cache_dtype == "fp8_ds_mla"
    kv_dtype = torch.uint8 if packed else _bf16_mla_dtype(ctx, cache_dtype)
    index_bytes = hf.index_head_dim + hf.index_head_dim // 128 * 4  # attention.py:1019-1028
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"model.layers.{i}.attn"
        ratio = max(1, hf.compress_rates.get(hf.layer_types[i], 0))
        if ratio == 4:
            out.append((f"{p}.indexer.k_cache", MLAAttentionSpec(  # attention.py:911-925
                block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=index_bytes, dtype=torch.uint8,
                tokens_per_state=ratio, alignment=576 if packed else 512), DeepseekV4IndexerBackend))
            out.append((f"{p}.indexer.compressor.state_cache",
                        _dsv4_compressor_state(ratio, hf.index_head_dim, cache_dtype), CompressorBackend))
        out.append((f"{p}.swa_cache", SlidingWindowMLASpec(  # sparse_swa.py:128-147
            bounded_replay=False, block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=hf.head_dim,
            dtype=kv_dtype, sliding_window=hf.sliding_window, cache_dtype_str=cache_dtype,
            state_content_bytes=584 if packed else None, alignment=576 if packed else 512,
            block_stride_alignment=None, model_version="deepseek_v4", kv_quant_mode=get_kv_quant_mode(cache_dtype)),
            DeepseekSparseSWAFlashMLABackend))
        main = None if ratio <= 1 else MLAAttentionSpec(  # attention.py:869-884
            block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=hf.head_dim, dtype=kv_dtype,
            tokens_per_state=ratio, cache_dtype_str=cache_dtype, alignment=576 if packed else 512,
            model_version="deepseek_v4", kv_quant_mode=get_kv_quant_mode(cache_dtype),
            state_content_bytes=584 if packed else None)
        out.append((p, main, DeepseekV4FlashMLABackend))
        if ratio > 1:
            out.append((f"{p}.compressor.state_cache", _dsv4_compressor_state(ratio, hf.head_dim, cache_dtype),
                        CompressorBackend))
    return out


def _dsv4_backends(ctx: _Ctx):
    from vllm.models.deepseek_v4.compressor import CompressorBackend
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekSparseSWAFlashMLABackend
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLABackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV4IndexerBackend
    return [DeepseekV4IndexerBackend, CompressorBackend, DeepseekSparseSWAFlashMLABackend, DeepseekV4FlashMLABackend]


_DSV4_TYPES = ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
               "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention", "sliding_attention"]

_family(_Family(
    name="deepseek_v4",
    config={"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
            "num_hidden_layers": len(_DSV4_TYPES), "layer_types": _DSV4_TYPES, "hidden_size": 256,
            "vocab_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 512,
            "q_lora_rank": 64, "o_lora_rank": 64, "o_groups": 2, "moe_intermediate_size": 64,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
            "sliding_window": 128, "index_n_heads": 4, "index_head_dim": 128, "index_topk": 64},
    layers=lambda c: c["num_hidden_layers"], kv_heads=lambda c: c["num_key_value_heads"],
    build=_dsv4_build, backends=_dsv4_backends, cache_dtype="fp8_ds_mla"))


# ---------------------------------------------------------------------------------------------------------------
# hy_v4: models/hy_v4 (nvidia/model.py: HYV4DecoderLayer :110-124, HYV4MLAAttention nvidia/attention.py:275-530)
#   model.layers.{i}.self_attn.indexer.k_cache    sparse layers (layer_types[i] in _SPARSE_LAYER_TYPES, :51-56,
#                                                 :320-327) that do not share another layer's top-k
#                                                 (compute_skip_topk_layers, :61-113): DeepseekV32IndexerCache
#                                                 (:186-191), as deepseek_v32's.
#   model.layers.{i}.self_attn.attn               MLAAttention (:508-524): spec mla_attention.py:1371-1400, head
#                                                 kv_lora_rank + qk_rope_head_dim, topk_buffer_width = index_topk
#                                                 (buffer of every layer, nvidia/model.py:224-233),
#                                                 is_index_group_leader = has an indexer. learnable_sink (config
#                                                 default True) binds HYV4FlashMLASparseBackend (:546-635,
#                                                 nvidia/flashmla_sparse.py) on sparse layers; dense layers
#                                                 (use_sparse False) get sm90's dense MLA (FLASH_ATTN_MLA).

def _hyv4_build(ctx: _Ctx):
    from vllm.models.hy_v4.nvidia.attention import _SPARSE_LAYER_TYPES, compute_skip_topk_layers
    from vllm.models.hy_v4.nvidia.flashmla_sparse import HYV4FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    hf = ctx.hf
    cache_dtype = ctx.cache.cache_dtype
    skip = compute_skip_topk_layers(hf)
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"model.layers.{i}.self_attn"
        sparse = hasattr(hf, "index_topk") and hf.layer_types[i] in _SPARSE_LAYER_TYPES
        indexer = sparse and i not in skip
        if indexer:
            out.append((f"{p}.indexer.k_cache", MLAAttentionSpec(
                block_size=ctx.block_size, num_kv_heads=1, max_tp_shards=1,
                head_size=hf.index_head_dim + hf.index_head_dim // 128 * 4, dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER), DeepseekV32IndexerBackend))
        backend = (HYV4FlashMLASparseBackend if getattr(hf, "learnable_sink", False) else
                   _sparse_mla_backend(cache_dtype)) if sparse else _flash_attn_mla_backend()
        out.append((f"{p}.attn", _mla_spec(ctx, hf.kv_lora_rank + hf.qk_rope_head_dim, cache_dtype,
                                            topk_buffer_width=hf.index_topk if hasattr(hf, "index_topk") else None,
                                            is_index_group_leader=indexer, non_causal_multi_token_decode=False),
                    backend))
    return out


def _hyv4_backends(ctx: _Ctx):
    from vllm.models.hy_v4.nvidia.attention import _SPARSE_LAYER_TYPES
    from vllm.models.hy_v4.nvidia.flashmla_sparse import HYV4FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    hf = ctx.hf
    out = [DeepseekV32IndexerBackend,
           HYV4FlashMLASparseBackend if getattr(hf, "learnable_sink", False) else _sparse_mla_backend("auto")]
    if any(t not in _SPARSE_LAYER_TYPES for t in hf.layer_types):
        out.append(_flash_attn_mla_backend())
    return out


_family(_Family(
    name="hy_v4",
    config={"architectures": ["HYV4ForCausalLM"], "model_type": "hy_v4", "torch_dtype": "bfloat16",
            "num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 64,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "num_attention_heads": 4,
            "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 128, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64, "v_head_dim": 32, "index_head_dim": 128, "index_n_heads": 4,
            "index_topk": 64, "vocab_size": 1024, "max_position_embeddings": 4096, "hc_mult": 2,
            "layer_types": ["full_attention"] + ["indexed_attention"] * 5,
            "indexer_types": ["full", "full", "shared", "full", "shared", "full"]},
    layers=lambda c: c["num_hidden_layers"], kv_heads=lambda c: c["num_key_value_heads"],
    build=_hyv4_build, backends=_hyv4_backends))


# ---------------------------------------------------------------------------------------------------------------
# deepseek_v41: models/deepseek_v41 (CUDA: nvidia/vl_model.py wraps the LM under "language_model", :173-177;
# sm90 -> DeepseekV4FlashMLAAttention, nvidia/model.py:201-240). P = language_model.model.layers.{i}.attn
# (DeepseekV4Attention, attention.py:283-640). Per layer: compress_ratio = compress_ratios[i] in {0, 1, 2}
# (:316-331); kv sources (kv_source_layer_ids) own the compressed cache and the compressor, index sources
# (index_source_layer_ids) run an indexer whose K cache the kv source owns; other layers read the latest source
# at or below them (:332-360), which must sit on the same PP stage (:457-469, :600-614 raise otherwise).
# FlashMLA's packed format: "auto" -> fp8_ds_mla written back onto cache_config (_resolve_dsv4_kv_cache_dtype,
# :141-171); off SM100 the records are 584 B, alignment 576 (_use_v41_mxfp8_kv_record, :137, :521-537).
# Registration order: P (:430-436, before its indexer), P.indexer.k_cache (:446-455), P.swa_cache (:562-580),
# P.compressor.state_cache (:588-597, compressor.py:306-312).
#   P                           kv sources only (:1206-1231): MLAAttentionSpec 1 head (no max_tp_shards), head 512,
#                               uint8, tokens_per_state = ratio, alignment 576, model_version "deepseek_v4", C 584.
#                               Backend DeepseekV4FlashMLABackend (sparse_mla.py:260, nvidia/flashmla.py:58).
#   P.indexer.k_cache           index sources that are kv sources: DeepseekV4IndexerCache (:1243-1323):
#                               MLAAttentionSpec head 132 uint8 (fp8 indexer), tokens_per_state = ratio, alignment
#                               576, block_stride_alignment None (indexer_sparse_logits off). DeepseekV41IndexerBackend.
#   P.swa_cache                 every layer: DeepseekV4SWACache (sparse_swa.py:77-147) block 32, C 584, alignment
#                               576, bounded_replay = cache_config.swa_bounded_replay with model runner V2 (:538-580).
#   P.compressor.state_cache    kv sources with ratio > 1: CompressorStateCache (compressor.py:206-237):
#                               CircularBufferSpec block max(8, pow2 >= num_spec + 2), 1 head, head 2 * 512 fp32,
#                               head_size_v 0. Backend CompressorBackend.

def _dsv41_build(ctx: _Ctx):
    from vllm.models.deepseek_v41.compressor import CompressorBackend
    from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekSparseSWAFlashMLABackend
    from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLABackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend
    hf, cfg = ctx.hf, ctx.vllm_config
    cache_dtype = ctx.cache.cache_dtype
    packed = cache_dtype in ("fp8_ds_mla", "nvfp4_ds_mla")
    kv_dtype = torch.uint8 if packed else _bf16_mla_dtype(ctx, cache_dtype)
    swa_bytes = 584  # 528 with the SM100 MXFP8 record (:521-522)
    compressed_bytes = 288 if cache_dtype == "nvfp4_ds_mla" else swa_bytes
    alignment = 576 if packed else 512
    bounded = bool(ctx.cache.swa_bounded_replay and not cfg._get_v2_model_runner_unsupported_features()
                   and not (cfg.parallel_config.prefill_context_parallel_size > 1
                            and not ctx.cache.enable_prefix_caching))
    kv_sources, index_sources = set(hf.kv_source_layer_ids), set(hf.index_source_layer_ids)
    ring = max(8, 1 << (ctx.num_spec + 2 - 1).bit_length())  # compressor.py:221-223
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"language_model.model.layers.{i}.attn"
        ratio = int(hf.compress_ratios[i])
        if ratio > 0:  # the layer's sources must be built on this stage (attention.py:457-469, :600-614)
            src = max(s for s in kv_sources if s <= i)
            if src < ctx.lo:
                raise NotImplementedError(
                    f"Compressed-KV source {p.replace(f'.{i}.', f'.{src}.')} not found on this rank; PP splits "
                    "inside a v4.1 kv-sharing group are not supported.")
        is_kv_source = i in kv_sources and i < hf.num_hidden_layers
        out.append((p, None if not is_kv_source else MLAAttentionSpec(  # attention.py:1216-1231
            block_size=ctx.block_size, num_kv_heads=1, head_size=hf.head_dim, dtype=kv_dtype, tokens_per_state=ratio,
            cache_dtype_str=cache_dtype, alignment=alignment, model_version="deepseek_v4",
            kv_quant_mode=get_kv_quant_mode(cache_dtype), state_content_bytes=compressed_bytes if packed else None),
            DeepseekV4FlashMLABackend))
        if i in index_sources and is_kv_source:
            out.append((f"{p}.indexer.k_cache", MLAAttentionSpec(  # attention.py:1287-1310
                block_size=ctx.block_size, num_kv_heads=1, head_size=hf.index_head_dim + hf.index_head_dim // 128 * 4,
                dtype=torch.uint8, tokens_per_state=ratio, alignment=576 if packed else 512,
                block_stride_alignment=None), DeepseekV41IndexerBackend))
        out.append((f"{p}.swa_cache", SlidingWindowMLASpec(  # sparse_swa.py:128-147 with attention.py:562-580
            bounded_replay=bounded, block_size=32, num_kv_heads=1, max_tp_shards=1, head_size=hf.head_dim,
            dtype=kv_dtype, sliding_window=hf.sliding_window, cache_dtype_str=cache_dtype,
            state_content_bytes=swa_bytes if packed else None, alignment=alignment if packed else 512,
            block_stride_alignment=None, model_version="deepseek_v4", kv_quant_mode=get_kv_quant_mode(cache_dtype)),
            DeepseekSparseSWAFlashMLABackend))
        if is_kv_source and ratio > 1:
            out.append((f"{p}.compressor.state_cache", CircularBufferSpec(  # compressor.py:229-237
                block_size=ring, num_kv_heads=1, head_size=2 * hf.head_dim, head_size_v=0, dtype=torch.float32),
                CompressorBackend))
    return out


def _dsv41_backends(ctx: _Ctx):
    from vllm.models.deepseek_v41.compressor import CompressorBackend
    from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekSparseSWAFlashMLABackend
    from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLABackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend
    return [DeepseekV4FlashMLABackend, DeepseekV41IndexerBackend, DeepseekSparseSWAFlashMLABackend, CompressorBackend]


_family(_Family(
    name="deepseek_v41",
    config={"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "torch_dtype": "bfloat16",
            "text_config": {
                "num_hidden_layers": 8, "hidden_size": 256, "vocab_size": 1024, "num_attention_heads": 8,
                "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 64,
                "o_lora_rank": 64, "o_groups": 2, "moe_intermediate_size": 64, "n_routed_experts": 4,
                "num_experts_per_tok": 2, "max_position_embeddings": 4096, "sliding_window": 128,
                "index_n_heads": 4, "index_head_dim": 128, "index_topk": 64, "rms_norm_eps": 1e-6,
                "compress_ratios": [0, 2, 2, 1, 0, 2, 2, 1], "kv_source_layer_ids": [1, 3, 5, 7],
                "index_source_layer_ids": [1, 3, 5, 7], "torch_dtype": "bfloat16"}},
    layers=lambda c: c["text_config"]["num_hidden_layers"], kv_heads=lambda c: c["text_config"]["num_key_value_heads"],
    build=_dsv41_build, backends=_dsv41_backends, cache_dtype="fp8_ds_mla"))
