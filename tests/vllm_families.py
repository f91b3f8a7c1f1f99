"""Per-layer KV-cache specs of every model family in vLLM 0.33's `vllm/models/` tree, for TINY configs, and the
KVCacheConfig vLLM's real planner builds from them. Pure vLLM fixtures: nothing here imports the `connector` package
(tests.vllm_harness, which this builds on, reads connector.core.hf_config's presets through tests/model_configs.py).

API (from tests.vllm_family_harness; the families register from tests.vllm_families_deepseek, _mla and
_gqa): FAMILIES; family_layer_specs(family, *, tp, tp_rank, pp, pp_rank) -> {layer: KVCacheSpec};
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

# the families' modules register each family in the harness's registry on import
from tests import vllm_families_deepseek, vllm_families_gqa, vllm_families_mla  # noqa: F401
from tests.vllm_family_harness import (ENGINE_REFUSALS, FAMILIES, PLANNING_LIMITS, _REGISTRY, _stage_range,
                                       allocate, allocate_family_caches, family_backends, family_config_dir,
                                       family_kv_cache_config, family_kv_heads, family_layer_specs, family_num_layers,
                                       make_family_vllm_config, planning)

__all__ = ["ENGINE_REFUSALS", "FAMILIES", "PLANNING_LIMITS", "_REGISTRY", "_stage_range", "allocate",
           "allocate_family_caches", "family_backends", "family_config_dir", "family_kv_cache_config",
           "family_kv_heads", "family_layer_specs", "family_num_layers", "make_family_vllm_config", "planning"]
