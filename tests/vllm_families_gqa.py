"""vLLM 0.33's GQA and hybrid families for tests.vllm_families: minimax_m3, inkling, flint, muse_spark, qwen4_exp and
step5; each family's specs built as its code builds them, cited per family. Paths are inside the vllm package of
vLLM 0.33.0."""

from __future__ import annotations

import functools
import json
import math
import tempfile
from dataclasses import replace

import torch
from vllm.utils.math_utils import round_up
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import (CircularBufferSpec, FullAttentionSpec, MambaSpec, MLAAttentionSpec,
                                        SlidingWindowSpec, SparseCacheRole, get_kv_quant_mode)

from tests import vllm_harness as H

from tests.vllm_family_harness import (ENGINE_REFUSALS, PLANNING_LIMITS, _CHECKPOINT_ALIGNMENT, _Ctx, _Family, _family,
                                       _generic_attention_spec, _heads)


# ---------------------------------------------------------------------------------------------------------------
# minimax_m3: models/minimax_m3 (CUDA: nvidia/model.py; the checkpoint's MiniMaxM3SparseForConditionalGeneration
# wraps the LM under "language_model", :1174). P = language_model.model.layers.{i}.self_attn.attn
#   dense  layers (sparse_attention_freq[i] == 0): generic Attention (:356): FullAttentionSpec kv heads / TP
#          (replicated past the head count, :315), head_dim, bf16 (layers/attention/attention.py:675-682),
#          FLASH_ATTN.
#   sparse layers: P.index_cache  MiniMaxM3IndexerCache (common/indexer.py:145-153, registered inside the indexer
#          built at nvidia/model.py:536-550, before the main layer): MLAAttentionSpec 1 head (no max_tp_shards),
#          sparse_index_dim, bf16 (indexer_kv_dtype "bf16", :507), cache_role INDEXER, MiniMaxM3IndexerBackend;
#          P  MiniMaxM3SparseAttention (:556-572): FullAttentionSpec kv heads / TP (:429), head_dim, bf16;
#          sm90 selects the Triton impl -> MiniMaxM3SparseBackend (common/sparse_attention.py:527-570).
# (tests/vllm_harness.layer_specs builds the same for its M3 configs.)

def _m3_build(ctx: _Ctx):
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerBackend
    from vllm.models.minimax_m3.common.sparse_attention import MiniMaxM3SparseBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    hf = ctx.hf
    sparse_cfg = hf.sparse_attention_config
    freq = sparse_cfg["sparse_attention_freq"]
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    dtype = kv_cache_dtype_str_to_dtype(ctx.cache.cache_dtype, ctx.vllm_config.model_config)
    main = FullAttentionSpec(block_size=ctx.block_size, num_kv_heads=_heads(hf.num_key_value_heads, ctx.tp),
                             head_size=head_dim, head_size_v=head_dim, dtype=dtype,
                             kv_quant_mode=get_kv_quant_mode(ctx.cache.cache_dtype))
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"language_model.model.layers.{i}.self_attn.attn"
        if freq[i]:
            out.append((f"{p}.index_cache", MLAAttentionSpec(
                block_size=ctx.block_size, num_kv_heads=1, head_size=sparse_cfg["sparse_index_dim"],
                dtype=torch.bfloat16, cache_role=SparseCacheRole.INDEXER), MiniMaxM3IndexerBackend))
            out.append((p, main, MiniMaxM3SparseBackend))
        else:
            out.append((p, main, FlashAttentionBackend))
    return out


def _m3_backends(ctx: _Ctx):
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerBackend
    from vllm.models.minimax_m3.common.sparse_attention import MiniMaxM3SparseBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    return [FlashAttentionBackend, MiniMaxM3IndexerBackend, MiniMaxM3SparseBackend]


def _m3_config() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads((H.write_m3_config(tmp, num_layers=6, dense_layers=2) / "config.json").read_text())


_family(_Family(
    name="minimax_m3", config=_m3_config(),
    layers=lambda c: c["text_config"]["num_hidden_layers"], kv_heads=lambda c: c["text_config"]["num_key_value_heads"],
    build=_m3_build, backends=_m3_backends))


# ---------------------------------------------------------------------------------------------------------------
# inkling: models/inkling/nvidia (InklingForCausalLM, P = model.layers.{i}; InklingDecoderLayer model.py:126-170)
#   P.conv_state  InklingConvState (sconv_swa_attn.py:121-193), built first: SlidingWindowSpec block = window =
#                 sconv_kernel_size, num_kv_heads = layer kv heads // tp (asserts tp <= heads), head_size = next
#                 power of two of 2*head_dim + 2*(hidden_size // kv heads) (K|V|attn-out|mlp-out packed), head_size_v
#                 0, model dtype (bf16). Backend InklingSconvBackend.
#   P.attn        InklingAttention (attention.py:68-199): local layers (local_layer_ids) SlidingWindowSpec(cache
#                 block, kv heads max(1, swa_num_key_value_heads // tp), swa_head_dim, window sliding_window_size),
#                 others FullAttentionSpec(num_key_value_heads, head_dim); FlashAttentionBackend (:180-181).

def _inkling_build(ctx: _Ctx):
    from vllm.models.inkling.nvidia.sconv_swa_attn import InklingSconvBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    hf = ctx.hf
    dtype = kv_cache_dtype_str_to_dtype(ctx.cache.cache_dtype, ctx.vllm_config.model_config)
    local = set(hf.local_layer_ids)
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"model.layers.{i}"
        is_local = i in local
        kv = hf.swa_num_key_value_heads if is_local else hf.num_key_value_heads
        head_dim = hf.swa_head_dim if is_local else hf.head_dim
        assert ctx.tp <= kv, "sconv SWA cache supports tp_size <= num_kv_heads"  # sconv_swa_attn.py:142-145
        raw = 2 * head_dim + 2 * (hf.hidden_size // kv)
        out.append((f"{p}.conv_state", SlidingWindowSpec(  # sconv_swa_attn.py:185-193
            block_size=hf.sconv_kernel_size, num_kv_heads=kv // ctx.tp, head_size=1 << (raw - 1).bit_length(),
            head_size_v=0, dtype=ctx.vllm_config.model_config.dtype, sliding_window=hf.sconv_kernel_size),
            InklingSconvBackend))
        heads = _heads(kv, ctx.tp)
        spec = (SlidingWindowSpec(block_size=ctx.block_size, num_kv_heads=heads, head_size=head_dim, dtype=dtype,
                                  sliding_window=hf.sliding_window_size) if is_local else
                FullAttentionSpec(block_size=ctx.block_size, num_kv_heads=heads, head_size=head_dim, dtype=dtype))
        out.append((f"{p}.attn", spec, FlashAttentionBackend))
    return out


def _inkling_backends(ctx: _Ctx):
    from vllm.models.inkling.nvidia.sconv_swa_attn import InklingSconvBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    return [InklingSconvBackend, FlashAttentionBackend]


_family(_Family(
    name="inkling",
    config={"architectures": ["InklingForCausalLM"], "model_type": "inkling_model", "torch_dtype": "bfloat16",
            "num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
            "swa_head_dim": 64, "local_layer_ids": [0, 1, 3, 4], "sliding_window_size": 128,
            "use_sconv": True, "sconv_kernel_size": 4, "vocab_size": 1024, "max_position_embeddings": 4096,
            "d_rel": 16, "rel_extent": 256},
    layers=lambda c: c["num_hidden_layers"], kv_heads=lambda c: c["num_key_value_heads"],
    build=_inkling_build, backends=_inkling_backends))


# ---------------------------------------------------------------------------------------------------------------
# flint: models/flint/model.py (FlintForCausalLM, P = model.layers.{i}.self_attn)
#   P.attn  generic Attention (:297-307): kv heads max(1, num_key_value_heads // tp) (:259), head_dim,
#           per_layer_sliding_window = sliding_window on "sliding_attention" layers (:295, :304), sinks; the layer
#           asserts FlashInfer (:311-318) -> FlashInferBackend. Spec: _generic_attention_spec.

def _flint_build(ctx: _Ctx):
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend
    hf = ctx.hf
    return [(f"model.layers.{i}.self_attn.attn", _generic_attention_spec(
        ctx, FlashInferBackend, num_kv_heads=_heads(hf.num_key_value_heads, ctx.tp), head_size=hf.head_dim,
        sliding_window=hf.sliding_window if hf.layer_types[i] == "sliding_attention" else None), FlashInferBackend)
        for i in range(ctx.lo, ctx.hi)]


def _flashinfer_backends(ctx: _Ctx):
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend
    return [FlashInferBackend]


_family(_Family(
    name="flint",
    config={"architectures": ["FlintForCausalLM"], "model_type": "flint", "torch_dtype": "bfloat16",
            "num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 128,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "no_rope_layer_indices": [2, 5], "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
            "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1024, "max_position_embeddings": 4096},
    layers=lambda c: c["num_hidden_layers"], kv_heads=lambda c: c["num_key_value_heads"],
    build=_flint_build, backends=_flashinfer_backends))


# ---------------------------------------------------------------------------------------------------------------
# muse_spark: models/muse_spark/nvidia (MuseSparkForConditionalGeneration IS the LM with omni towers mixed in,
# multimodal.py:15-21, so P = model.layers.{i}.self_attn)
#   P.attn  generic Attention (model.py:1127-1135): kv heads max(1, num_key_value_heads // tp) (:986-991),
#           head_dim, sliding_window on "sliding_attention" layers (:1101-1110); no backend pinned -> sm90's
#           FLASH_ATTN. Spec: _generic_attention_spec.

def _muse_build(ctx: _Ctx):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    hf = ctx.hf
    return [(f"model.layers.{i}.self_attn.attn", _generic_attention_spec(
        ctx, FlashAttentionBackend, num_kv_heads=_heads(hf.num_key_value_heads, ctx.tp), head_size=hf.head_dim,
        sliding_window=hf.sliding_window if hf.layer_types[i] == "sliding_attention" else None),
        FlashAttentionBackend) for i in range(ctx.lo, ctx.hi)]


def _flash_attn_backends(ctx: _Ctx):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    return [FlashAttentionBackend]


_MUSE_TYPES = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 2

_family(_Family(
    name="muse_spark",
    config={"architectures": ["MuseSparkForConditionalGeneration"], "model_type": "muse_spark",
            "torch_dtype": "bfloat16", "projector_hidden_size": 128, "out_hidden_size": 256,
            "text_config": {
                "model_type": "muse_spark_text", "torch_dtype": "bfloat16", "num_hidden_layers": len(_MUSE_TYPES),
                "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 64, "hidden_act": "silu", "attention_bias": False, "sliding_window": 128,
                "layer_types": _MUSE_TYPES, "mlp_layer_types": ["dense"] + ["sparse"] * (len(_MUSE_TYPES) - 1),
                "layer_rope_theta": [10000.0] * len(_MUSE_TYPES),
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "num_shared_experts": 0,
                "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
            "vision_config": {"model_type": "muse_spark_vision", "hidden_size": 64, "merge_size": 2,
                              "hidden_act": "gelu", "num_hidden_layers": 1, "layer_types": ["full_attention"],
                              "rope_parameters": {"rope_type": "axial"}},
            "audio_config": {"model_type": "muse_spark_audio", "hidden_act": "gelu", "num_hidden_layers": 1,
                             "patch_sizes": [4], "depths": [1], "hidden_sizes": [64], "out_hidden_size": 256}},
    layers=lambda c: c["text_config"]["num_hidden_layers"], kv_heads=lambda c: c["text_config"]["num_key_value_heads"],
    build=_muse_build, backends=_flash_attn_backends))


# ---------------------------------------------------------------------------------------------------------------
# qwen4_exp: models/qwen4_exp/nvidia (Qwen4ExpForConditionalGeneration wraps the LM under "language_model",
# model.py:1028-1032). P = language_model.model.layers.{i}; Qwen4ExpDecoderLayer model.py:191-256.
#   P.ple                  layers with (i + 1) in ple_layer_ids (:210-224), built first: Qwen4ExpPLELayer
#                          (ple_layer.py:74-221): MambaBase spec of short_conv_state_shape(tp_world_size=1,
#                          hidden_size * hc_count, (ple_conv_kernel_size - 1) * ngram_size + 1, num_spec),
#                          short_conv dtype, mamba_type SHORT_CONV, tp_replicated True (:178-185); in align mode 1
#                          prefill checkpoint block at the checkpoint grid (:202-221).
#   P.linear_attn          "linear_attention" layers (:227-233): QwenGatedDeltaNetAttention
#                          (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:544-760): gated_delta_net state
#                          shape/dtype per TP rank, GDN_ATTN; FlashInfer GDN prefill on sm90 (:148-200) in align mode
#                          exports checkpoints (alignment 64, gdn_attn.py:34) when every Mamba layer can: then 1
#                          checkpoint block at get_mamba_prefill_checkpoint_grid (:739-760).
#   QSA layers ("indexed_attention", :235-255): Qwen4ExpQSAAttention (qsa.py:337-560) builds its QSAIndexer first
#   (indexer_qsa.py:116-181; caches in common/qsa_cache.py, backend QSAStateBackend, layouts BLNHC/BLHNC):
#     P.self_attn.indexer.raw_key_cache         QSAKeyStateCache: CircularBufferSpec capacity round_up(ratio +
#                                               num_spec, ratio), 1 head, indexer_head_dim (+ int64 MRoPE positions
#                                               when the model uses MRoPE), head_size_v 0, bf16 (:842-860).
#     P.self_attn.indexer.compressed_key_cache  QSACompressedKeyCache: MLAAttentionSpec 1 head (no max_tp_shards),
#                                               indexer_head_dim, indexer dtype (bf16 default), tokens_per_state
#                                               ratio, role SPARSE (:866-874).
#     P.self_attn.attn                          main: FullAttentionSpec kv heads max(1, kv // tp), head_dim (qsa.py:
#                                               552-560), Qwen4ExpQSAFlashAttentionBackend (:146).

def _qwen4_checkpoint_alignment(ctx: _Ctx) -> int | None:
    """Every Mamba layer's get_prefill_checkpoint_alignment: GDN 64 (align mode + FlashInfer, qwen_gdn_linear_attn.py
    :689-696), PLE 1 (align mode, ple_layer.py:202-203); None unless all declare one."""
    from vllm.v1.attention.backends.gdn_attn import FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
    hf = ctx.hf
    if ctx.cache.mamba_cache_mode != "align":
        return None
    values = []
    if "linear_attention" in hf.layer_types:
        values.append(FLASHINFER_GDN_CHECKPOINT_ALIGNMENT)
    if hf.ple_layer_ids:
        values.append(1)
    return math.lcm(*values) if values else None


_CHECKPOINT_ALIGNMENT["qwen4_exp"] = _qwen4_checkpoint_alignment


# model_executor/models/config.py:1041-1046 (Qwen4ExpForConditionalGenerationConfig.verify_and_update_config), raised
# while the VllmConfig is built: PP is refused whenever ple_layer_ids is set, as in the tiny config (and the real one).
for _stage in ("pp2-stage0", "pp2-stage1"):
    PLANNING_LIMITS["qwen4_exp", _stage] = (
        "Qwen4Exp N-gram PLE embedding requires pipeline_parallel_size=1 because non-first pipeline ranks do not "
        "receive the raw input_ids it needs. Please run with PP=1.")


def _qwen4_build(ctx: _Ctx):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.models.qwen4_exp.common.qsa_cache import QSAStateBackend
    from vllm.models.qwen4_exp.nvidia.qsa import Qwen4ExpQSAFlashAttentionBackend
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    hf, cfg, cache = ctx.hf, ctx.vllm_config, ctx.cache
    model_dtype = cfg.model_config.dtype
    alignment = _qwen4_checkpoint_alignment(ctx)
    grid = (math.lcm(cache.prefix_match_unit, alignment) if cache.prefix_match_unit is not None
            else cache.mamba_block_size) if alignment is not None else None  # abstract.py:114-128

    def mamba(shapes, dtypes, mamba_type, replicated, checkpoints):
        spec = MambaSpec(shapes=tuple(shapes), dtypes=dtypes, block_size=cache.mamba_block_size,
                         page_size_padded=cache.mamba_page_size_padded, mamba_type=mamba_type,
                         tp_replicated=replicated, mamba_cache_mode=cache.mamba_cache_mode,
                         num_speculative_blocks=ctx.num_spec)
        if checkpoints:
            spec = replace(spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=grid)
        return spec

    ratio, index_dim = hf.indexer_compress_ratio, hf.indexer_head_dim
    key_head = index_dim
    if cfg.model_config.uses_mrope:  # QSAKeyStateCache(cache_rope_positions=...), qsa_cache.py:811-825
        key_head = round_up(index_dim, 4) + 3 * 4
    capacity = round_up(ratio + ctx.num_spec, ratio)
    assert ctx.block_size % capacity == 0  # qsa_cache.py:850-853
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"language_model.model.layers.{i}"
        if (i + 1) in hf.ple_layer_ids:
            out.append((f"{p}.ple", mamba(
                MambaStateShapeCalculator.short_conv_state_shape(
                    tp_world_size=1, intermediate_size=hf.hidden_size * hf.hc_count,
                    conv_kernel=(hf.ple_conv_kernel_size - 1) * hf.ngram_size + 1, num_spec=ctx.num_spec),
                MambaStateDtypeCalculator.short_conv_state_dtype(model_dtype, cache.mamba_cache_dtype),
                MambaAttentionBackendEnum.SHORT_CONV, True, alignment is not None), None))
        if hf.layer_types[i] == "linear_attention":
            out.append((f"{p}.linear_attn", mamba(
                MambaStateShapeCalculator.gated_delta_net_state_shape(
                    ctx.tp, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                    hf.linear_value_head_dim, hf.linear_conv_kernel_dim, ctx.num_spec),
                MambaStateDtypeCalculator.gated_delta_net_state_dtype(model_dtype, cache.mamba_cache_dtype,
                                                                      cache.mamba_ssm_cache_dtype),
                MambaAttentionBackendEnum.GDN_ATTN, False, alignment is not None), None))
            continue
        q = f"{p}.self_attn"
        out.append((f"{q}.indexer.raw_key_cache", CircularBufferSpec(
            block_size=capacity, num_kv_heads=1, head_size=key_head, head_size_v=0, dtype=torch.bfloat16),
            QSAStateBackend))
        out.append((f"{q}.indexer.compressed_key_cache", MLAAttentionSpec(
            block_size=ctx.block_size, num_kv_heads=1, head_size=index_dim, dtype=torch.bfloat16,
            tokens_per_state=ratio), QSAStateBackend))
        kv_dtype = cache.cache_dtype
        out.append((f"{q}.attn", FullAttentionSpec(
            block_size=ctx.block_size, num_kv_heads=_heads(hf.num_key_value_heads, ctx.tp), head_size=hf.head_dim,
            head_size_v=hf.head_dim, dtype=kv_cache_dtype_str_to_dtype(kv_dtype, cfg.model_config),
            kv_quant_mode=get_kv_quant_mode(kv_dtype)), Qwen4ExpQSAFlashAttentionBackend))
    return out


def _qwen4_backends(ctx: _Ctx):
    from vllm.models.qwen4_exp.common.qsa_cache import QSAStateBackend
    from vllm.models.qwen4_exp.nvidia.qsa import Qwen4ExpQSAFlashAttentionBackend
    return [QSAStateBackend, Qwen4ExpQSAFlashAttentionBackend]


_family(_Family(
    name="qwen4_exp",
    config={"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
            "torch_dtype": "bfloat16",
            "text_config": {
                "model_type": "qwen4_exp_text", "torch_dtype": "bfloat16", "num_hidden_layers": 8,
                "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
                "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "hc_count": 2, "hc_lowrank": 16,
                "ple_layer_ids": [3, 7], "ple_embed_dim": 64, "ple_conv_kernel_size": 4, "ngram_size": 3,
                "heads_per_ngram": 8, "ngram_vocab_size_base": 4096, "split_ngram_parts": 8,
                "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 64, "indexer_budget": 64,
                "indexer_compress_ratio": 4, "vocab_size": 1024, "max_position_embeddings": 4096,
                "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0},
            "vision_config": {"depth": 1, "hidden_size": 64, "intermediate_size": 64, "num_heads": 2,
                              "out_hidden_size": 256}},
    layers=lambda c: c["text_config"]["num_hidden_layers"], kv_heads=lambda c: c["text_config"]["num_key_value_heads"],
    build=_qwen4_build, backends=_qwen4_backends))


# ---------------------------------------------------------------------------------------------------------------
# step5: models/step5/nvidia/model.py (Step5ForCausalLM, P = model.layers.{i}.self_attn, Step5DecoderLayer
# :1826-1925; Step5Attention :857-1260). Layer type from layer_types (default: even layers sliding, :894-903); the
# DSA branch is taken by layers of sparse_config.apply_to_layer_types ("full_attention") without a window (:1017).
#   P.attn                       generic Attention (:1196-1208), kv heads max(1, num_attention_groups // tp)
#                                (:932-953), head_dim; backend Step5DSAAttentionBackend on DSA layers (BLNHC only,
#                                sparse_attention.py:807-826), else Step5SplitKVFlashAttentionBackend with the window.
#   P.attn.sparse_summary_cache  DSA layers (:1243-1247): Step5SparseSummaryCacheLayer
#                                (sparse_summary_cache.py:117-154): FullAttentionSpec(cache block, 1 head, head 256
#                                uint8, head_size_v 0, tokens_per_state 8). Backend Step5SparseSummaryBackend.
#   P.attn.csa_tail_ring         DSA layers (:1248-1254): Step5CSATailRing (csa_tail_ring.py:131-187):
#                                CircularBufferSpec sized to the main layer's (un-customized) page: block = main
#                                block size, 1 head,
#                                head_size = page // (block * 2) bf16, head_size_v 0, block_stride_alignment 1024
#                                (a 1 KB row); needs 7 + num_spec rows per page.

@functools.cache
def _step5_attention_backends() -> tuple[type[AttentionBackend], type[AttentionBackend]]:
    """(Step5SplitKVFlashAttentionBackend, Step5DSAAttentionBackend) of models/step5/nvidia/sparse_attention.py:795-826.
    That module needs CUDA Triton (ops/summary_update.py reads tl.extra.cuda at import), so on CPU stand-ins with
    their declarations: both are FlashAttentionBackend (kernel blocks, customize_spec) with only the impl changed;
    the DSA one declares layouts (BLNHC,) and is_sparse."""
    try:
        from vllm.models.step5.nvidia.sparse_attention import (Step5DSAAttentionBackend,
                                                               Step5SplitKVFlashAttentionBackend)
        return Step5SplitKVFlashAttentionBackend, Step5DSAAttentionBackend
    except (ImportError, AttributeError):
        pass
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.kv_cache_layout import KVCacheLayout

    class Step5SplitKVFlashAttentionBackend(FlashAttentionBackend):
        pass

    class Step5DSAAttentionBackend(Step5SplitKVFlashAttentionBackend):
        @classmethod
        def is_sparse(cls) -> bool:
            return True

        @classmethod
        def supported_kv_cache_layouts(cls):
            return (KVCacheLayout.BLNHC,)

    return Step5SplitKVFlashAttentionBackend, Step5DSAAttentionBackend


def _step5_build(ctx: _Ctx):
    from vllm.models.step5.nvidia.csa_tail_ring import _ROW_BYTES, Step5CSATailRingBackend
    from vllm.models.step5.nvidia.sparse_summary_cache import Step5SparseSummaryBackend
    Step5SplitKVFlashAttentionBackend, Step5DSAAttentionBackend = _step5_attention_backends()
    hf = ctx.hf
    apply_to = tuple(hf.sparse_config.get("apply_to_layer_types", ("full_attention",)))
    heads = _heads(hf.num_attention_groups, ctx.tp)
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"model.layers.{i}.self_attn.attn"
        layer_type = hf.layer_types[i]
        window = hf.sliding_window if layer_type == "sliding_attention" else None
        dsa = layer_type in apply_to and window is None
        backend = Step5DSAAttentionBackend if dsa else Step5SplitKVFlashAttentionBackend
        main = _generic_attention_spec(ctx, backend, num_kv_heads=heads, head_size=hf.head_dim,
                                       sliding_window=window)
        out.append((p, main, backend))
        if not dsa:
            continue
        assert ctx.block_size % 8 == 0  # sparse_summary_cache.py:145-146
        out.append((f"{p}.sparse_summary_cache", FullAttentionSpec(
            block_size=ctx.block_size, num_kv_heads=1, head_size=256, head_size_v=0, dtype=torch.uint8,
            tokens_per_state=8), Step5SparseSummaryBackend))
        page = main.page_size_bytes
        assert page % _ROW_BYTES == 0 and page // _ROW_BYTES >= 7 + ctx.num_spec  # csa_tail_ring.py:170-175
        out.append((f"{p}.csa_tail_ring", CircularBufferSpec(
            block_size=main.block_size, num_kv_heads=1, head_size=page // (main.block_size * torch.bfloat16.itemsize),
            head_size_v=0, dtype=torch.bfloat16, block_stride_alignment=_ROW_BYTES), Step5CSATailRingBackend))
    return out


def _step5_backends(ctx: _Ctx):
    from vllm.models.step5.nvidia.csa_tail_ring import Step5CSATailRingBackend
    from vllm.models.step5.nvidia.sparse_summary_cache import Step5SparseSummaryBackend
    Step5SplitKVFlashAttentionBackend, Step5DSAAttentionBackend = _step5_attention_backends()
    return [Step5SplitKVFlashAttentionBackend, Step5DSAAttentionBackend, Step5SparseSummaryBackend,
            Step5CSATailRingBackend]


ENGINE_REFUSALS["step5"] = (
    "Step5 DSA sparse summaries are only transferred by MooncakeStoreConnector, or by NixlConnector with CUDA "
    "buffers, directly or under a MultiConnector.")  # models/step5/nvidia/model.py:314-331, raised at layer build

_family(_Family(
    name="step5",
    config={"architectures": ["Step5ForCausalLM"], "model_type": "step5", "torch_dtype": "bfloat16",
            "num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8,
            "num_attention_groups": 2, "head_dim": 128, "vocab_size": 1024, "max_position_embeddings": 4096,
            "layer_types": ["sliding_attention", "full_attention"] * 3, "sliding_window": 128,
            "use_moe": False, "att_impl_type": "GQA",
            "sparse_config": {"index_tp_size": 2, "sparse_indexer_num_heads": 4, "topk": 64}},
    layers=lambda c: c["num_hidden_layers"], kv_heads=lambda c: c["num_attention_groups"],
    build=_step5_build, backends=_step5_backends))
