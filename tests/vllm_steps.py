"""The scheduler side of the CPU harness (tests.vllm_harness, which re-exports these as H.*): vLLM 0.33.0's real
Scheduler built as EngineCore builds it, real Requests with EngineCore's block hasher, and one step's
ModelRunnerOutput / KVConnectorOutput as a GPU worker would return them."""

from __future__ import annotations

import copy
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config, get_request_block_hasher,
                                             init_none_hash, resolve_kv_cache_block_sizes)
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
except Exception:  # pragma: no cover - environment without vllm (tests.vllm_harness reports why)
    pass


def scheduler_kv_cache_config(kv_cache_config: KVCacheConfig) -> KVCacheConfig:
    """What the scheduler (and the SCHEDULER-role connector) gets: engine core's
    generate_scheduler_kv_cache_config (kv_cache_utils.py:1096) -- worker 0's config, UniformTypeKVCacheSpecs
    replaced by its FIRST layer spec (for M3: a dense FullAttentionSpec; the index spec is gone)."""
    return generate_scheduler_kv_cache_config([kv_cache_config])


def make_scheduler(vllm_config, kv_cache_config: KVCacheConfig, *, log_stats: bool = False):
    """The real Scheduler (AsyncScheduler if vllm_config asks for it), built like EngineCore.__init__ (core.py:176).
    `kv_cache_config` is a worker config (converted with scheduler_kv_cache_config) or already a scheduler one;
    with PP pass PP stage 0's config (the engine uses worker 0's: its layer_names are stage 0's layers only)."""
    cfg = scheduler_kv_cache_config(copy.deepcopy(kv_cache_config))
    vllm_config.cache_config.num_gpu_blocks = cfg.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(cfg, vllm_config)
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return cls(vllm_config=vllm_config, kv_cache_config=cfg, structured_output_manager=StructuredOutputManager(
        vllm_config), block_size=block_size, hash_block_size=hash_block_size, log_stats=log_stats)


_HASHER: dict[int, Any] = {}


def make_request(request_id: str, prompt_len: int, *, kv_transfer_params: dict | None = None, max_tokens: int = 8,
                 prompt_token_ids: Sequence[int] | None = None, block_size: int = 16) -> Request:
    """A real Request with the sha256 block hasher EngineCore installs (core.py:224), so prefix caching works.
    Default tokens depend on request_id (no accidental prefix hits); pass prompt_token_ids to share a prefix."""
    if block_size not in _HASHER:
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        _HASHER[block_size] = get_request_block_hasher(block_size, fn)
    if prompt_token_ids is None:
        base = zlib.crc32(request_id.encode()) % 500 + 10
        prompt_token_ids = [base + (i % 400) for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)
    return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                   pooling_params=None, block_hasher=_HASHER[block_size])


def make_model_runner_output(scheduler, scheduler_output: SchedulerOutput,
                             kv_connector_output: KVConnectorOutput | None = None,
                             sampled_token: int = 1) -> ModelRunnerOutput:
    """One ModelRunnerOutput covering exactly the scheduled requests: one sampled token each, none for a request
    still mid-prefill (`is_prefill_chunk`, as the runner discards partial-prefill samples)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[r].is_prefill_chunk else [sampled_token] for r in req_ids]
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled, kv_connector_output=kv_connector_output)


def kv_output(*, finished_sending=(), finished_recving=(), failed_recving=(), invalid_block_ids=(),
              expected_finished_count: int = 0) -> KVConnectorOutput | None:
    """A KVConnectorOutput with 0.33's field names (v1/outputs.py:214); None if empty (as the runner sends)."""
    out = KVConnectorOutput(finished_sending=set(finished_sending) or None,
                            finished_recving=set(finished_recving) or None, failed_recving=set(failed_recving),
                            invalid_block_ids=set(invalid_block_ids), expected_finished_count=expected_finished_count)
    return None if out.is_empty() else out


def finish_step(scheduler, scheduler_output: SchedulerOutput, kv_connector_output: KVConnectorOutput | None = None,
                *, sampled_token: int = 1):
    """update_from_output for a step built by the caller (schedule -> worker hooks -> this). Returns
    dict[client_index, EngineCoreOutputs]."""
    mro = make_model_runner_output(scheduler, scheduler_output, kv_connector_output, sampled_token)
    return scheduler.update_from_output(scheduler_output, mro)


def run_step(scheduler, *, finished_sending=(), finished_recving=(), failed_recving=(), sampled_token: int = 1,
             kv_connector_output: KVConnectorOutput | None = None):
    """schedule() + update_from_output() with the given worker completions. Returns (SchedulerOutput, outputs)."""
    so = scheduler.schedule()
    if kv_connector_output is None:
        kv_connector_output = kv_output(finished_sending=finished_sending, finished_recving=finished_recving,
                                        failed_recving=failed_recving)
    return so, finish_step(scheduler, so, kv_connector_output, sampled_token=sampled_token)


def outputs_by_request(engine_core_outputs) -> dict[str, Any]:
    """{request_id: EngineCoreOutput} from update_from_output's dict[int, EngineCoreOutputs]."""
    return {o.request_id: o for eco in engine_core_outputs.values() for o in eco.outputs}


def free_block_count(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def abort(scheduler, request_ids: str | Iterable[str]):
    """What EngineCore.abort_requests does (scheduler.finish_requests(..., FINISHED_ABORTED))."""
    return scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)


def aggregate(kv_outputs: Sequence[KVConnectorOutput | None], aggregator: KVOutputAggregator) -> KVConnectorOutput:
    """Merge one step's per-worker outputs with vLLM's KVOutputAggregator (executor/abstract.py:349): a request
    is finished only when `expected_finished_count` (default world size = tp*pp) workers reported it."""
    mros = [ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=o) for o in kv_outputs]
    return aggregator.aggregate(mros, output_rank=0).kv_connector_output
