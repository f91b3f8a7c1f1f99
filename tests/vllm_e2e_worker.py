"""Worker-process side of tests/test_vllm_e2e.py: one OS process plays one (pp, tp) rank of one vLLM instance.

A process is started once (spawn; importing vLLM costs ~15 s of CPU) and can host one rank after another: `setup`
builds the rank exactly as a vLLM 0.33 GPU worker does, `teardown` shuts it down as vLLM does at exit. Per rank:

  fake_parallel_groups(rank)  ->  ensure_kv_transfer_initialized(cfg, worker KVCacheConfig of this PP stage)
  (the WORKER-role SparseKVConnector, built by vLLM's factory from kv_connector_module_path or the registered name)
  ->  allocate_kv_cache in the layout vLLM resolves with the connector's get_required_kvcache_layout
  ->  vLLM's own ActiveKVConnector (v1/worker/gpu/kv_connector.py): register_kv_caches + set_host_xfer_buffer_ops.

Before register_kv_caches, the rank registers the model's attention modules in static_forward_context as loading
the model does on a CUDA worker: vLLM 0.33's own classes made on CPU (tests/vllm_layers.py), so the connector finds
and re-wraps the eager-break methods of MiniMax-M3's sparse layers and DeepSeek-V3.2's layers (spec "model_layers",
default on; off gives what the connector saw before it had per-layer signals).

Each `step` gets the pickled SchedulerOutput (as vLLM's executor ships it) and runs the model runner's order
(v1/worker/gpu/model_runner.py execute_model/sample_tokens): request-state update, then either no_forward, or
[forward context: pre_forward (handle_preemptions, bind_connector_metadata), the layers of THIS stage in order --
the fake KV insert of the layer (index cache, then main), then its attention: vLLM's generic op with
wait_for_layer_load/save_kv_layer on the layers vLLM hooks (M3's dense layers), or the layer's eager-break method
(the REAL method body, its kernels stood in for), which signals when the connector installed its copy; then
spec "layer_ms" of the layer's remaining compute -- ], finish_forward, post_forward (start_load_kv, wait_for_save,
get_transfer_results, clear_connector_metadata). The KVConnectorOutput goes back to the driver, which aggregates
with KVOutputAggregator.

The fake forward writes `expected()` -- deterministic bytes per (pool, global layer, token, GLOBAL head, byte),
salted with the prompt token id at that position -- into the scheduled tokens' slots of the tensor's LOGICAL view
[B, H, N, C] (uint8), whatever the physical layout. Decode writes the same function for the tokens it computes
itself, so its cache must equal prefill's byte for byte on every transferred block.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys
import traceback
from typing import Any

LOG_NAMESPACES = ("connector",)


class _Keep(logging.Handler):
    """Keeps this process's connector log lines (INFO and up) for the driver to read back."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - a bad log call must not break the worker
            pass


def token_keys(positions, prompt_ids: list[int]):
    """The per-token key fed to sparse_kv_lab.sim.buffers.content: position, salted with the prompt token id there
    (positions past the prompt -- generated tokens -- use the position alone). Two requests share bytes at a
    position only if they share the token there, so a block that lands in the wrong request is caught too."""
    import torch

    pos = torch.as_tensor(positions, dtype=torch.int64)
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.int64)
    salt = torch.zeros_like(pos)
    inside = pos < len(ids)
    salt[inside] = ids[pos[inside]] + 1
    return pos + (salt << 16)


def expected(pool: str, layer: int, keys, heads: tuple[int, int], row_bytes: int):
    """uint8 [T, heads, row_bytes]: the bytes (pool, global layer, token key, global head) must hold."""
    import torch

    from sparse_kv_lab.sim.buffers import content

    return content(pool, layer, keys, heads, 1, row_bytes, torch.device("cpu"))[:, 0]


class Rank:
    """One (pp, tp) rank of one instance, built as a vLLM worker builds it."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized
        from vllm.distributed.utils import get_pp_indices
        from vllm.v1.worker.gpu.kv_connector import get_kv_connector

        from tests import vllm_harness as H

        self.spec = spec
        self.pp_rank, self.tp_rank = spec["rank"]
        self.tp, self.pp = spec["tp"], spec["pp"]
        if spec["by_name"]:
            # What every vLLM process does at startup: run the vllm.general_plugins entry points (ours registers
            # "SparseKVConnector" with KVConnectorFactory).
            from vllm.plugins import load_general_plugins

            load_general_plugins()
        cfg = H.make_vllm_config(spec["model_dir"], kv_role=spec["kv_role"], engine_id=spec["engine_id"],
                                 extra_config=spec["extra_config"], block_size=spec["block_size"],
                                 max_num_batched_tokens=spec["max_num_batched_tokens"], tp=self.tp, pp=self.pp,
                                 kv_load_failure_policy=spec["kv_load_failure_policy"],
                                 enable_prefix_caching=spec.get("enable_prefix_caching", True))
        if spec["by_name"]:
            cfg.kv_transfer_config.kv_connector_module_path = None  # the registered name alone
        cfg.parallel_config.data_parallel_index = spec.get("dp_index", 0)
        self.cfg = cfg
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(set_current_vllm_config(cfg))
            self._stack.enter_context(H.fake_parallel_groups(tp_rank=self.tp_rank, tp_size=self.tp,
                                                             pp_rank=self.pp_rank, pp_size=self.pp,
                                                             pp_gather=self._stage_gather(cfg, spec)))
            layout = H.resolve_layout(cfg)  # engine core's resolution, with the connector's requirement
            kvc = H.make_kv_cache_config(cfg, num_blocks=spec["num_blocks"], pp_rank=self.pp_rank)
            self.kvc = kvc
            ensure_kv_transfer_initialized(cfg, kvc)
            self._stack.callback(_shutdown_connector)
            self.caches = H.allocate_kv_caches(kvc, cfg, layout=layout.name)
            self.modules: dict[str, Any] = {}
            if spec.get("model_layers", True):
                from tests import vllm_layers

                self.modules = vllm_layers.layer_modules(cfg, self.caches, pp_rank=self.pp_rank)
                cfg.compilation_config.static_forward_context.update(self.modules)
            self.kv = get_kv_connector(cfg, self.caches)  # vLLM's ActiveKVConnector: register_kv_caches
            self.connector = get_kv_transfer_group()
        except BaseException:
            self._stack.close()
            raise
        self.layout = layout.name
        self.block_size = spec["block_size"]
        text = cfg.model_config.hf_text_config
        self.lo, self.hi = get_pp_indices(text.num_hidden_layers, self.pp_rank, self.pp)
        self.hooked = set(H.hooked_layer_names(cfg, pp_rank=self.pp_rank))
        self.layer_s = spec.get("layer_ms", 0) / 1e3
        """Compute time of a layer after its attention (o_proj, MoE): what per-layer streaming hides WRITEs behind."""
        self.hook_all = spec.get("hook_all_layers", False)
        """Also run save_kv_layer on layers with an eager-break method (a vLLM that hooks them too): each layer
        then gets two signals a step, which must go out once."""
        group_of = {n: g for g, grp in enumerate(kvc.kv_cache_groups) for n in grp.layer_names}
        # (name, pool, global layer, group, uint8 logical view [B, H, N, C_bytes], global head range), in the
        # stage's registration order (index cache before its main layer, as M3 registers them).
        self.layers: list[tuple[str, str, int, int, Any, tuple[int, int]]] = []
        for name in H.layer_specs(cfg, pp_rank=self.pp_rank):
            tensor = self.caches[name]
            u8 = tensor.view(torch.uint8)
            layer = H.global_layer(cfg, name)
            if name.endswith((".index_cache", ".index_value_cache", ".indexer.k_cache")):
                pool = "index_v" if name.endswith(".index_value_cache") else "index_k"
                heads = (0, 1)  # one replicated head on every TP rank
                assert u8.shape[1] == 1, f"{name}: index cache has {u8.shape[1]} heads"
            elif cfg.model_config.use_mla:
                pool, heads = "kv", (0, 1)  # the MLA latent: one head, replicated on every TP rank
                assert u8.shape[1] == 1, f"{name}: MLA cache has {u8.shape[1]} heads"
            else:
                pool = "kv"
                local = u8.shape[1]
                assert local == text.num_key_value_heads // self.tp, f"{name}: {local} heads on TP rank"
                heads = (self.tp_rank * local, (self.tp_rank + 1) * local)  # local head i = global first+i
            self.layers.append((name, pool, layer, group_of[name], u8, heads))
        self.requests: dict[str, dict[str, Any]] = {}

    # ---- info ---------------------------------------------------------------------------------------------------

    def _stage_gather(self, cfg: Any, spec: dict):
        """What the other PP stages' workers would contribute to connector.vllm.specs.gather_stages: their caches
        as vLLM's specs for their KVCacheConfig describe them (the harness builds each stage's config as vLLM
        would)."""
        from connector.vllm.specs import stage_caches
        from tests import vllm_harness as H

        def gather(local: list) -> list[list]:
            total = cfg.model_config.get_total_num_kv_heads()
            hidden = cfg.model_config.hf_text_config.num_hidden_layers
            return [local if r == self.pp_rank else
                    stage_caches(H.make_kv_cache_config(cfg, num_blocks=spec["num_blocks"], pp_rank=r), total,
                                 H.draft_layer_names(cfg, pp_rank=r), hidden)
                    for r in range(self.pp)]
        return gather
    def info(self) -> dict[str, Any]:
        md = self.connector.get_handshake_metadata()
        worker = getattr(self.connector, "_worker", None)
        installed = getattr(worker, "_installed", None)
        return {"handshake": {(self.pp_rank, self.tp_rank): md} if md is not None else None,
                "num_blocks": self.kvc.num_blocks, "layout": self.layout,
                "connector": type(self.connector).__module__ + "." + type(self.connector).__name__,
                "hooked": sorted(self.hooked), "layers": [(n, p, l) for n, p, l, *_ in self.layers],
                "block_bytes": sum(u8[0].numel() for *_, u8, _h in self.layers),
                "layer_block_bytes": {n: u8[0].numel() for n, *_, u8, _h in self.layers},
                "signalled": sorted(i.global_layer for i in installed.installed) if installed else []}

    def parked(self, transfer_id: str) -> bool:
        """Prefill: a registration for `transfer_id` arrived and waits for the request to start."""
        sender = getattr(getattr(self.connector, "_worker", None), "sender", None)
        return sender is not None and transfer_id in sender.ownership.parked

    def sender_stats(self) -> dict[str, int]:
        worker = getattr(self.connector, "_worker", None)
        sender = getattr(worker, "sender", None)
        if sender is None:
            return {}
        return {"bytes_written": sender.stats.bytes_sent, "descriptors": sender.stats.descriptors,
                "writes": sender.stats.writes, "staged_chunks": sender.stats.staged_chunks}

    # ---- one engine step --------------------------------------------------------------------------------------
    def _update_states(self, so: Any) -> None:
        """What the model runner keeps per request: block table per group and prompt ids."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = {"blocks": [list(g) for g in new.block_ids],
                                         "prompt": list(new.prompt_token_ids or [])}
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            new_ids = cached.new_block_ids[i]
            if state is None or new_ids is None:
                continue
            if req_id in cached.resumed_req_ids:
                state["blocks"] = [list(g) for g in new_ids]
            else:
                for g, ids in enumerate(new_ids):
                    state["blocks"][g].extend(ids)

    def _computed(self, so: Any) -> dict[str, int]:
        out = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        out.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        return out

    def _write_layer(self, entry: tuple, batch: list[tuple[str, int, int]]) -> None:
        import torch

        _name, pool, layer, group, u8, heads = entry
        for req_id, start, count in batch:
            state = self.requests[req_id]
            pos = torch.arange(start, start + count, dtype=torch.int64)
            blocks = torch.tensor(state["blocks"][group], dtype=torch.int64)
            u8[blocks[pos // self.block_size], :, pos % self.block_size, :] = expected(
                pool, layer, token_keys(pos, state["prompt"]), heads, u8.shape[-1])

    def step(self, blob: bytes) -> Any:
        import time
        import types

        from vllm.forward_context import set_forward_context

        from tests.vllm_layers import attend

        so = pickle.loads(blob)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return self.kv.no_forward(so).kv_connector_output
        computed = self._computed(so)
        batch = [(r, computed[r], n) for r, n in so.num_scheduled_tokens.items()]
        with set_forward_context(None, self.cfg):
            self.kv.pre_forward(so)
            for entry in self.layers:  # this stage's caches in forward order (an index cache before its layer)
                name, pool = entry[0], entry[1]
                hooked = name in self.hooked
                if hooked:
                    self.connector.wait_for_layer_load(name)
                self._write_layer(entry, batch)
                if pool != "kv":
                    continue  # written by its layer's fused insert; the layer's attention comes with the main cache
                module = self.modules.get(name)
                if module is not None and attend(module) and self.hook_all:
                    hooked = True
                if hooked:
                    self.connector.save_kv_layer(name, self.caches[name], types.SimpleNamespace())
                if self.layer_s:
                    time.sleep(self.layer_s)
        self.kv.finish_forward()
        return self.kv.post_forward(so.finished_req_ids)

    # ---- checks -----------------------------------------------------------------------------------------------
    def verify(self, block_ids: list[list[int]], t0: int, t1: int, prompt_ids: list[int]) -> tuple[list[str], int]:
        """Mismatches for tokens [t0, t1) of every pool and layer this rank holds, and the bytes compared."""
        import torch

        problems, checked = [], 0
        pos = torch.arange(t0, t1, dtype=torch.int64)
        keys = token_keys(pos, prompt_ids)
        for name, pool, layer, group, u8, heads in self.layers:
            blocks = torch.tensor(block_ids[group], dtype=torch.int64)
            got = u8[blocks[pos // self.block_size], :, pos % self.block_size, :]
            want = expected(pool, layer, keys, heads, u8.shape[-1])
            checked += got.numel()
            bad = (got != want).reshape(len(pos), -1).any(dim=1)
            if bool(bad.any()):
                wrong = pos[bad]
                problems.append(f"rank pp{self.pp_rank},tp{self.tp_rank} {pool} layer {layer} ({name}): "
                                f"{int(bad.sum())} of {len(pos)} tokens differ, first at token {int(wrong[0])}, "
                                f"block {int(blocks[int(wrong[0]) // self.block_size])}")
        return problems, checked

    def close(self) -> None:
        self._stack.close()


def _shutdown_connector() -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()


def main(conn: Any, log_level: int = logging.WARNING) -> None:
    """Process entry point: answer the driver's commands until ("quit",). Every answer is ("ok", ...) or
    ("error", traceback): a failure is reported, never a silent hang."""
    from sparse_kv_lab.sim.env import apply_env

    apply_env()  # UCX on loopback, NIXL log level, huge pages: before NIXL is loaded
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="%(asctime)s e2e-worker %(levelname)s %(name)s: %(message)s")
    keep = _Keep()
    for ns in LOG_NAMESPACES:
        logging.getLogger(ns).addHandler(keep)
        logging.getLogger(ns).setLevel(logging.INFO)
    try:
        import torch  # noqa: F401
        import vllm  # noqa: F401

        from tests import vllm_harness  # noqa: F401
    except BaseException as exc:  # noqa: BLE001
        conn.send(("error", f"import failed: {exc!r}"))
        return
    torch.set_num_threads(1)
    conn.send(("ok", "ready"))
    rank: Rank | None = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        kind = msg[0]
        if kind == "quit":
            break
        try:
            if kind == "setup":
                if rank is not None:
                    raise RuntimeError("setup while a rank is still set up (teardown first)")
                keep.lines.clear()
                if msg[1].get("family"):
                    from tests.vllm_e2e_family import FamilyRank

                    rank = FamilyRank(msg[1])
                else:
                    rank = Rank(msg[1])
                reply = ("ok", rank.info())
            elif kind == "step":
                reply = ("ok", rank.step(msg[1]))
            elif kind == "verify":
                reply = ("ok", *rank.verify(*msg[1:]))
            elif kind == "stats":
                reply = ("ok", rank.sender_stats())
            elif kind == "parked":
                reply = ("ok", rank.parked(msg[1]))
            elif kind == "logs":
                lines, keep.lines = keep.lines, []
                reply = ("ok", lines)
            elif kind == "teardown":
                if rank is not None:
                    try:
                        rank.close()
                    finally:
                        rank = None
                reply = ("ok",)
            else:
                reply = ("error", f"unknown command {kind!r}")
        except BaseException as exc:  # noqa: BLE001 - the driver must hear about it
            reply = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        conn.send(reply)
    if rank is not None:
        with contextlib.suppress(BaseException):
            rank.close()
