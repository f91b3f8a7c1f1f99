"""vLLM 0.33's other MLA families for tests.vllm_families: glm5next (KDA + MLA with a kpool indexer and a tail ring),
kimi_k3 (KDA + MLA) and dots3_note (DSA + sliding-window MLA); each family's specs built as its code builds them,
cited per family. Paths are inside the vllm package of vLLM 0.33.0."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from vllm.utils.math_utils import cdiv, next_power_of_2, round_up
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import (CircularBufferSpec, MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec,
                                        SparseCacheRole, get_kv_quant_mode)

from tests.vllm_family_harness import _Ctx, _Family, _bf16_mla_dtype, _family
from tests.vllm_families_deepseek import _dsa_skip_topk, _flash_attn_mla_backend, _mla_spec


# ---------------------------------------------------------------------------------------------------------------
# glm5next (GLM-5.3-Flash): models/glm5next/common (Glm5NextForConditionalGeneration wraps the LM under
# "language_model", model.py:1226-1231). P = language_model.model.layers.{i}.self_attn
#   KDA layers (layer_types[i] == "linear_attention", model.py:140-147, 384-390): P  Glm5NextLinearAttention
#       (kda.py:163-202): MambaBase spec with kda_state_shape(tp, linear_num_heads, linear_head_dim,
#       linear_conv_kernel_dim, num_spec) / kda_state_dtype, mamba_type GDN_ATTN, then prefill checkpoints (1
#       block, alignment 16) with FlashKDA (sm90, head 128, bf16, bounded gate: kda.py:137-160, 344-351).
#   MLA layers: Glm5NextMLAAttention (attention.py:385-569), an Indexer (attention.py:187-300) built first:
#       P.indexer.k_cache     Glm5NextIndexerCache (:79-119): DeepSeek-V3.2 indexer spec (132 B uint8, INDEXER,
#                             max_tp_shards 1) with tokens_per_state = index_kpool. Backend Glm5NextIndexerBackend.
#       P.indexer.tail_cache  Glm5NextTailCache (:125-184): CircularBufferSpec, ring = kpool *
#                             next_power_of_2(cdiv(kpool + num_spec, kpool)), num_kv_heads 2 ([K, gate]), head
#                             index_head_dim, head_size_v 0, bf16, dcp_sharded False. Backend KpoolTailBackend (BLHNC).
#       P.attn                MultiHeadLatentAttentionWrapper -> MLAAttention (model_executor/layers/mla.py:122-137):
#                             sparse MLA, head kv_lora_rank + qk_rope_head_dim (512, NoPE), topk_buffer_width
#                             round_up(index_topk + kpool - 1, 128) (model.py:106-112, 712-721), index group leader.
#                             sm90 sparse MLA with head 512 -> FLASHINFER_MLA_SPARSE_SM90 (platforms/cuda.py:144-147).

def _kda_spec(ctx: _Ctx, num_heads: int, head_dim: int, conv: int, flashkda: bool) -> MambaSpec:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    cache = ctx.cache
    spec = MambaSpec(  # model_executor/layers/mamba/abstract.py:72-90
        shapes=tuple(MambaStateShapeCalculator.kda_state_shape(ctx.tp, num_heads, head_dim, conv_kernel_size=conv,
                                                               num_spec=ctx.num_spec)),
        dtypes=MambaStateDtypeCalculator.kda_state_dtype(ctx.vllm_config.model_config.dtype, cache.mamba_cache_dtype,
                                                         cache.mamba_ssm_cache_dtype),
        block_size=cache.mamba_block_size, page_size_padded=cache.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN, tp_replicated=False, mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=ctx.num_spec)
    return replace(spec, num_prefill_checkpoint_blocks=int(flashkda),
                   prefill_checkpoint_alignment=16 if flashkda else None)


def _glm5next_build(ctx: _Ctx):
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import FlashInferMLASparseSM90Backend
    from vllm.v1.attention.backends.mla.indexer import Glm5NextIndexerBackend, KpoolTailBackend
    hf, cfg = ctx.hf, ctx.vllm_config
    cache_dtype = ctx.cache.cache_dtype
    kpool = hf.index_kpool
    flashkda = (hf.linear_head_dim == 128 and cfg.model_config.dtype == torch.bfloat16
                and hf.linear_lower_bound is not None)
    ring = kpool * next_power_of_2(cdiv(kpool + ctx.num_spec, kpool))
    assert ctx.block_size % ring == 0  # attention.py:163-169
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"language_model.model.layers.{i}.self_attn"
        if hf.layer_types[i] == "linear_attention":
            out.append((p, _kda_spec(ctx, hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim,
                                     flashkda), None))
            continue
        out.append((f"{p}.indexer.k_cache", MLAAttentionSpec(
            block_size=ctx.block_size, num_kv_heads=1, max_tp_shards=1,
            head_size=hf.index_head_dim + hf.index_head_dim // 128 * 4, dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER, tokens_per_state=kpool), Glm5NextIndexerBackend))
        out.append((f"{p}.indexer.tail_cache", CircularBufferSpec(
            block_size=ring, num_kv_heads=2, head_size=hf.index_head_dim, head_size_v=0, dtype=torch.bfloat16,
            dcp_sharded=False), KpoolTailBackend))
        out.append((f"{p}.attn", _mla_spec(ctx, hf.kv_lora_rank + hf.qk_rope_head_dim, cache_dtype,
                                            topk_buffer_width=round_up(hf.index_topk + kpool - 1, 128),
                                            is_index_group_leader=True, non_causal_multi_token_decode=False),
                    FlashInferMLASparseSM90Backend))
    return out


def _glm5next_backends(ctx: _Ctx):
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import FlashInferMLASparseSM90Backend
    from vllm.v1.attention.backends.mla.indexer import Glm5NextIndexerBackend, KpoolTailBackend
    return [Glm5NextIndexerBackend, KpoolTailBackend, FlashInferMLASparseSM90Backend]


_family(_Family(
    name="glm5next",
    config={"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
            "torch_dtype": "bfloat16",
            "text_config": {
                "model_type": "glm5_next_text", "torch_dtype": "bfloat16", "num_hidden_layers": 8,
                "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 64, "n_routed_experts": 4,
                "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
                "kv_lora_rank": 512, "qk_rope_head_dim": 0, "qk_nope_head_dim": 64, "v_head_dim": 64,
                "index_topk": 64, "index_head_dim": 128, "index_n_heads": 4, "index_kpool": 16,
                "linear_head_dim": 128, "linear_num_heads": 4, "linear_conv_kernel_dim": 4,
                "linear_lower_bound": -5.0, "vocab_size": 1024, "max_position_embeddings": 4096,
                "pad_token_id": 0, "mla_use_nope": True, "mhc": False, "indexer_rope_interleave": False},
            "vision_config": {"depth": 1, "hidden_size": 64, "num_heads": 2, "intermediate_size": 64,
                              "out_hidden_size": 256}},
    layers=lambda c: c["text_config"]["num_hidden_layers"], kv_heads=lambda c: c["text_config"]["num_key_value_heads"],
    build=_glm5next_build, backends=_glm5next_backends))


# ---------------------------------------------------------------------------------------------------------------
# kimi_k3: models/kimi_k3 (CUDA: nvidia/model.py). KimiK3ForConditionalGeneration wraps the LM under
# "language_model" (:1675-1680): P = language_model.model.layers.{i}.
#   P.self_attn   KDA layers ((i + 1) in linear_attn_config["kda_layers"], KimiLinearConfig.is_kda_layer):
#                 KimiK3DeltaAttention (nvidia/model.py:715-726, nvidia/kda.py:567-909; registered :896-899):
#                 MambaBase.get_kv_cache_spec (model_executor/layers/mamba/abstract.py:72-90) with shapes
#                 MambaStateShapeCalculator.kda_state_shape(tp, num_heads, head_dim, conv_kernel_size, num_spec)
#                 and dtypes kda_state_dtype(model dtype, mamba_cache_dtype, mamba_ssm_cache_dtype), mamba_type
#                 GDN_ATTN (gdn/base.py:50), block mamba_block_size, padded to mamba_page_size_padded; then
#                 (kda.py:901-909) num_prefill_checkpoint_blocks = 1 and prefill_checkpoint_alignment 16 when the
#                 prefill backend is FlashKDA (sm90, head_dim 128, bf16, bounded gate: kda.py:363-379, 486-525).
#   P.self_attn   MLA layers: MultiHeadLatentAttention (nvidia/mla.py:127-437; registered under its own prefix,
#                 :405-408): MLAAttentionSpec 1 head, max_tp_shards 1, head kv_lora_rank + qk_rope_head_dim,
#                 C 656 for fp8_ds_mla (:421-437). Dense MLA backend (use_sparse=False, :324-331): FLASH_ATTN_MLA.

def _kimi_build(ctx: _Ctx):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    hf, cfg = ctx.hf, ctx.vllm_config
    kda = hf.linear_attn_config
    cache_dtype = ctx.cache.cache_dtype
    flashkda = (kda["head_dim"] == 128 and cfg.model_config.dtype == torch.bfloat16
                and kda.get("gate_lower_bound") is not None)
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"language_model.model.layers.{i}.self_attn"
        if hf.is_kda_layer(i):
            spec = MambaSpec(  # abstract.py:76-90
                shapes=tuple(MambaStateShapeCalculator.kda_state_shape(
                    ctx.tp, kda["num_heads"], kda["head_dim"], conv_kernel_size=kda["short_conv_kernel_size"],
                    num_spec=ctx.num_spec)),
                dtypes=MambaStateDtypeCalculator.kda_state_dtype(cfg.model_config.dtype, ctx.cache.mamba_cache_dtype,
                                                                 ctx.cache.mamba_ssm_cache_dtype),
                block_size=ctx.cache.mamba_block_size, page_size_padded=ctx.cache.mamba_page_size_padded,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN, tp_replicated=False,
                mamba_cache_mode=ctx.cache.mamba_cache_mode, num_speculative_blocks=ctx.num_spec)
            spec = replace(spec, num_prefill_checkpoint_blocks=int(flashkda),  # kda.py:901-909
                           prefill_checkpoint_alignment=16 if flashkda else None)
            out.append((p, spec, None))
        else:
            out.append((p, MLAAttentionSpec(  # mla.py:421-437
                block_size=ctx.block_size, num_kv_heads=1, max_tp_shards=1,
                head_size=hf.kv_lora_rank + hf.qk_rope_head_dim, dtype=_bf16_mla_dtype(ctx, cache_dtype),
                cache_dtype_str=cache_dtype, kv_quant_mode=get_kv_quant_mode(cache_dtype),
                state_content_bytes=656 if cache_dtype == "fp8_ds_mla" else None,
                non_causal_multi_token_decode=False), _flash_attn_mla_backend()))
    return out


_KIMI_KDA = [1, 2, 3, 5, 6, 7]  # 1-based, as kimi's linear_attn_config lists them: 3 KDA : 1 MLA

_family(_Family(
    name="kimi_k3",
    config={"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "torch_dtype": "bfloat16",
            "text_config": {
                "model_type": "kimi_linear", "torch_dtype": "bfloat16", "num_hidden_layers": 8, "hidden_size": 256,
                "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_token": 2,
                "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 4,
                "num_key_value_heads": 4, "head_dim": 64, "q_lora_rank": 64, "kv_lora_rank": 128,
                "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64, "mla_use_nope": True,
                "vocab_size": 1024, "max_position_embeddings": 4096,
                "linear_attn_config": {"kda_layers": _KIMI_KDA, "full_attn_layers": [4, 8], "num_heads": 4,
                                       "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                                       "gate_lower_bound": -5.0}}},
    layers=lambda c: c["text_config"]["num_hidden_layers"], kv_heads=lambda c: c["text_config"]["num_key_value_heads"],
    build=_kimi_build, backends=lambda ctx: [_flash_attn_mla_backend()]))


# ---------------------------------------------------------------------------------------------------------------
# dots3_note: models/dots3_note/nvidia (Dots3NoteForCausalLM wraps the LM under "language_model", multimodal.py:
# 155-158; Dots3NoteModel model.py:572-610, Dots3NoteDecoderLayer :504-535).
# P = language_model.model.layers.{i}.self_attn
#   full layers ("full_attention"): Dots3NoteFullAttention (:242-345) = DeepseekV2MLAAttention
#       (model_executor/models/deepseek_v2.py:1138-1192) whose MLA is rebuilt as Dots3NotePaddedMLAAttention under the
#       same name (:278-308):
#       P.indexer.k_cache  DeepseekV32IndexerCache (deepseek_v2.py:731-736, :658-666) unless the layer skips top-k;
#                          DeepseekV32IndexerBackend.
#       P.attn             MLAAttention spec (mla_attention.py:1371-1400: sparse, topk_buffer_width index_topk,
#                          index group leader) with head_size replaced by the SWA latent width
#                          swa_kv_lora_rank + swa_qk_rope_head_dim (:227-239). Dots3NotePaddedSparseBackend
#                          (attention.py:692-708, FLASH_ATTN_MLA_SPARSE + layouts (BLHNC,)).
#   sliding layers: Dots3NoteSlidingAttention (:352-483): P.attn MLAAttention(sliding_window=sliding_window_size,
#       Dots3NoteTritonMLABackend) -> SlidingWindowMLASpec (mla_attention.py:1390-1394), head swa_kv_lora_rank +
#       swa_qk_rope_head_dim (its backend takes 1088 only, attention.py:433-439); fp8_ds_mla -> "fp8" (model.py:433-436).
# Neither backend module imports without CUDA flash-attention: stand-ins with their declarations.

@functools.cache
def _dots3_backends_classes() -> tuple[type[AttentionBackend], type[AttentionBackend]]:
    """(Dots3NotePaddedSparseBackend, Dots3NoteTritonMLABackend) of models/dots3_note/nvidia/attention.py, or on CPU
    stand-ins: FLASH_ATTN_MLA_SPARSE's declarations (kernel blocks [MultipleOf(64)], customize_spec =
    align_blocks_to_rows, flashattn_mla_sparse.py:50-55) plus layouts (BLHNC,); TritonMLABackend unchanged."""
    try:
        from vllm.models.dots3_note.nvidia.attention import Dots3NotePaddedSparseBackend, Dots3NoteTritonMLABackend
        return Dots3NotePaddedSparseBackend, Dots3NoteTritonMLABackend
    except ImportError:
        pass
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
    from vllm.v1.kv_cache_layout import KVCacheLayout

    class Dots3NotePaddedSparseBackend(AttentionBackend):
        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            return [MultipleOf(64)]

        @classmethod
        def customize_spec(cls, spec):
            return align_blocks_to_rows(spec)

        @classmethod
        def supported_kv_cache_layouts(cls):
            return (KVCacheLayout.BLHNC,)

        @staticmethod
        def get_name() -> str:
            return "DOTS3_NOTE_PADDED_MLA_SPARSE"

        @classmethod
        def is_mla(cls) -> bool:
            return True

    class Dots3NoteTritonMLABackend(TritonMLABackend):
        pass

    return Dots3NotePaddedSparseBackend, Dots3NoteTritonMLABackend


def _dots3_model_info():
    """What the registry's inspection (_ModelInfo.from_model_cls) gives for Dots3NoteForCausalLM on CUDA, computed
    over a class with the real one's bases and class attributes (models/dots3_note/nvidia/multimodal.py:65-68):
    its module does not import without CUDA flash-attention."""
    from torch import nn
    from vllm.model_executor.models.interfaces import SupportsMultiModal, SupportsPP
    from vllm.model_executor.models.registry import _ModelInfo

    class Dots3NoteForCausalLM(nn.Module, SupportsMultiModal, SupportsPP):
        supports_encoder_tp_data = True

        @classmethod
        def get_placeholder_str(cls, modality: str, i: int) -> str | None: ...

        def __init__(self, *, vllm_config, prefix: str = "") -> None: ...

        def embed_multimodal(self, **kwargs: object): ...

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs): ...

        def compute_logits(self, hidden_states): ...

        def load_weights(self, weights): ...

        def get_mm_mapping(self): ...

    return _ModelInfo.from_model_cls(Dots3NoteForCausalLM)


def _dots3_build(ctx: _Ctx):
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    padded_backend, swa_backend = _dots3_backends_classes()
    hf = ctx.hf
    cache_dtype = ctx.cache.cache_dtype
    swa_width = hf.swa_kv_lora_rank + hf.swa_qk_rope_head_dim
    out = []
    for i in range(ctx.lo, ctx.hi):
        p = f"language_model.model.layers.{i}.self_attn"
        if hf.layer_types[i] == "sliding_attention":
            swa_dtype = "fp8" if cache_dtype == "fp8_ds_mla" else cache_dtype  # model.py:433-436
            out.append((f"{p}.attn", _mla_spec(ctx, swa_width, swa_dtype, sliding_window=hf.sliding_window_size),
                        swa_backend))
            continue
        indexer = not _dsa_skip_topk(hf, i)
        if indexer:
            out.append((f"{p}.indexer.k_cache", MLAAttentionSpec(
                block_size=ctx.block_size, num_kv_heads=1, max_tp_shards=1,
                head_size=hf.index_head_dim + hf.index_head_dim // 128 * 4, dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER), DeepseekV32IndexerBackend))
        spec = _mla_spec(ctx, hf.kv_lora_rank + hf.qk_rope_head_dim, cache_dtype, topk_buffer_width=hf.index_topk,
                         is_index_group_leader=indexer, non_causal_multi_token_decode=False)
        out.append((f"{p}.attn", replace(spec, head_size=swa_width), padded_backend))
    return out


def _dots3_backends(ctx: _Ctx):
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    padded_backend, swa_backend = _dots3_backends_classes()
    return [swa_backend, DeepseekV32IndexerBackend, padded_backend]


_DOTS3_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention",
                "full_attention"]

_family(_Family(
    name="dots3_note",
    config={"architectures": ["Dots3NoteForCausalLM"], "model_type": "dots3_note", "torch_dtype": "bfloat16",
            "num_hidden_layers": len(_DOTS3_TYPES), "layer_types": _DOTS3_TYPES, "first_k_dense_replace": 1,
            "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 64, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
            "swa_num_attention_heads": 4, "swa_q_lora_rank": 64, "swa_kv_lora_rank": 1024,
            "swa_qk_rope_head_dim": 64, "swa_qk_nope_head_dim": 64, "swa_v_head_dim": 64,
            "sliding_window_size": 128, "swa_rope_theta": 10000.0, "attention_gate_type": "headwise",
            "swa_attention_gate_type": "headwise", "apply_mla_qkv_lora_rescale": False,
            "index_head_dim": 128, "index_n_heads": 4, "index_topk": 64, "vocab_size": 1024,
            "max_position_embeddings": 4096, "rope_scaling": None, "num_nextn_predict_layers": 0},
    layers=lambda c: c["num_hidden_layers"], kv_heads=lambda c: c["num_key_value_heads"],
    build=_dots3_build, backends=_dots3_backends, model_info=_dots3_model_info))
