"""A vLLM worker extension (`--worker-extension-cls tests.sparse_model.zoo.wiper.CacheWiper`) that clears one
cache in the middle of a request, between its prefill and its decode: the control of the zoo tests (a cache the
forward did not read could be wiped without changing a token).

`zoo_arm_wipe(suffix)`, called over vLLM's dev-mode `/collective_rpc` (VLLM_SERVER_DEV_MODE=1), arms it. Before the
first step in which every scheduled request has its prompt computed (a decode step), it zeroes, in each layer whose
name ends with `suffix`, the blocks those requests hold in that layer's group, then disarms. Only the requests'
own blocks: vLLM's hybrid allocator lays every group's tensors over the same bytes (one block id belongs to one
group at a time), so zeroing a whole layer view would clear other groups' blocks too. Blocks a sliding-window
group freed below its window (the worker keeps their stale ids) and ids another group holds are left alone. Works
for any spec whose layer binds a tensor (or, as Mamba, a tuple of state tensors) indexed by block id first."""

from __future__ import annotations

import torch


class CacheWiper:
    def zoo_arm_wipe(self, suffix: str) -> list[str]:
        """Arm a wipe of the layers named `*suffix`; returns their names (ValueError if none)."""
        runner = self.model_runner  # self: vLLM's Worker
        names = [name for group in runner.kv_cache_config.kv_cache_groups for name in group.layer_names
                 if name.endswith(suffix)]
        if not names:
            raise ValueError(f"no KV-cache layer ends with {suffix!r}")
        if not getattr(runner, "_zoo_wrapped", False):
            inner = runner.execute_model

            def execute_model(scheduler_output, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                self._zoo_before_step(scheduler_output)
                return inner(scheduler_output, *args, **kwargs)

            runner.execute_model = execute_model
            runner._zoo_wrapped = True
        self._zoo_armed = suffix
        return names

    def zoo_kv_cache_plan(self) -> list[dict]:
        """The KV-cache groups vLLM planned on this worker: layer names, spec class and geometry of each."""
        plan = []
        for group in self.model_runner.kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            plan.append({"layers": list(group.layer_names), "spec": type(spec).__name__,
                         "block_size": spec.block_size, "page_size_bytes": spec.page_size_bytes,
                         "tokens_per_state": _plain(getattr(spec, "tokens_per_state", None)),
                         "num_states": spec.num_states, "sliding_window": getattr(spec, "sliding_window", None),
                         "page_size_padded": getattr(spec, "page_size_padded", None)})
        return plan

    def zoo_wipes(self) -> list[dict]:
        """What each wipe zeroed: {"suffix", "layers", "blocks" (per group id), "at_tokens" (per request)}."""
        return list(getattr(self, "_zoo_wipe_log", []))

    def _zoo_before_step(self, scheduler_output) -> None:  # noqa: ANN001 - vLLM's SchedulerOutput
        suffix = getattr(self, "_zoo_armed", None)
        if suffix is None or scheduler_output.scheduled_new_reqs or not scheduler_output.num_scheduled_tokens:
            return
        runner = self.model_runner
        cached = scheduler_output.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
        decoding = {}
        for req_id in scheduler_output.num_scheduled_tokens:
            state = runner.requests.get(req_id)
            if state is None or computed.get(req_id, -1) < state.num_prompt_tokens:
                return  # a prefill (or a chunk of one) in this step: not yet
            decoding[req_id] = state
        context = self.vllm_config.compilation_config.static_forward_context
        wiped: dict[int, list[int]] = {}
        layers = []
        for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            names = [name for name in group.layer_names if name.endswith(suffix)]
            if not names:
                continue
            spec = group.kv_cache_spec
            window = getattr(spec, "sliding_window", None)
            others = {b for st in runner.requests.values() for g, ids in enumerate(st.block_ids) if g != gid
                      for b in ids}
            blocks: set[int] = set()
            for req_id, state in decoding.items():
                ids = list(state.block_ids[gid])
                if window:
                    ids = ids[max(0, computed[req_id] - window + 1) // spec.block_size:]
                blocks.update(ids)
            blocks -= others | {0}  # 0: vLLM's null block
            index = torch.tensor(sorted(blocks), dtype=torch.long)
            for name in names:
                cache = context[name].kv_cache
                for tensor in cache if isinstance(cache, (tuple, list)) else (cache,):
                    tensor[index] = 0
            wiped[gid] = sorted(blocks)
            layers += names
        self._zoo_armed = None
        log = getattr(self, "_zoo_wipe_log", [])
        log.append({"suffix": suffix, "layers": layers, "blocks": wiped, "at_tokens": computed})
        self._zoo_wipe_log = log


def _plain(value):  # noqa: ANN001, ANN202 - a spec field (an int, a Fraction or None) as JSON can carry it
    return value if value is None or isinstance(value, int) else str(value)
