"""The end-to-end harness (tests/vllm_e2e_driver.py, tests/vllm_e2e_worker.py) for the families of vLLM 0.33's
model tree: each family's own spec declarations (tests.vllm_families), planned by vLLM's real planner, allocated
as vLLM's worker allocates them, scheduled by vLLM's real Scheduler, moved by SparseKVConnector over real NIXL
between OS processes.

The fake forward writes every cache the way its spec class is used, so a cache moved as another kind (or not at
all) shows:
  paged   (every AttentionSpec but a ring; k = tokens_per_state): state s of tokens [s*k, (s+1)*k) is written
          when its last token is computed, in the request's block s*k // block_size of the cache's group, row
          (s*k % block_size) // k, one row per head;
  ring    (CircularBufferSpec): the request's one block, row p % capacity for each token p (later tokens
          overwrite earlier ones);
  state   (MambaSpec): the running block (the last before the speculative scratch ones) wholly rewritten each
          step as a function of the tokens computed so far.
Bytes are a hash of (cache, global layer, token key or state key, global head, byte); a cache whose TP split the
spec declares (MLA latents, max_tp_shards 1, tp_replicated, any attention cache of a model vLLM runs as MLA) holds
the same bytes on every TP rank, any other is salted with its TP rank. Decode checks, when it leaves
WAITING_FOR_REMOTE_KVS: every full state of the tokens it loaded, the ring rows of the last `capacity` tokens
prefill computed, and the state after them."""

from __future__ import annotations

import zlib
from typing import Any

P_NAME = "prefill"


def _mix(x):
    from sparse_kv_lab.sim.buffers import _mix as mix

    return mix(x)


def replicated(spec: Any, mla_model: bool) -> bool:
    """Every TP rank holds the same bytes of this cache (what the model's forward does; see module docstring)."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    if isinstance(spec, MambaSpec):
        return bool(getattr(spec, "tp_replicated", False))
    if isinstance(spec, MLAAttentionSpec) or type(spec).__name__ == "SlidingWindowMLASpec":
        return True
    shards = getattr(spec, "max_tp_shards", None)
    return shards == 1 or (mla_model and shards is None)


def rows(cache: str, layer: int, keys, heads, nbytes: int):
    """uint8 [len(keys), len(heads), nbytes]."""
    import torch

    seed = zlib.crc32(cache.split("layers.", 1)[-1].encode()) + layer * 7_919
    k = torch.as_tensor(keys, dtype=torch.int64)[:, None, None]
    h = torch.as_tensor(list(heads), dtype=torch.int64)[None, :, None]
    e = torch.arange(nbytes, dtype=torch.int64)[None, None, :]
    return _mix(_mix(k * 0x9E3779B1 + seed) + h * 65_537 + e * 2_654_435_761).to(torch.uint8)


class Cache:
    """One cache of one rank: how the fake forward writes it and how decode checks it."""

    def __init__(self, name: str, spec: Any, group: int, tensor: Any, tp_rank: int, mla_model: bool) -> None:
        import torch
        from vllm.v1.kv_cache_interface import CircularBufferSpec, MambaSpec

        self.name, self.spec, self.group = name, spec, group
        self.layer = int(name.split("layers.", 1)[1].split(".", 1)[0])
        self.u8 = tensor.view(torch.uint8)
        self.kind = "state" if isinstance(spec, MambaSpec) else "ring" if isinstance(spec, CircularBufferSpec) \
            else "paged"
        local = self.u8.shape[1]
        first = 0 if replicated(spec, mla_model) else tp_rank * local
        self.heads = range(first, first + local)
        self.k = max(1, int(getattr(spec, "tokens_per_state", 1))) if self.kind == "paged" else 1
        self.scratch = int(getattr(spec, "num_speculative_blocks", 0) or 0)

    def _state_block(self, blocks: list[int]) -> int:
        live = blocks[:len(blocks) - self.scratch] if self.scratch else blocks
        return live[-1]

    def write(self, blocks: list[int], keys, start: int, end: int) -> None:
        """Tokens [start, end) of one request were computed; `keys` [end] are the token keys of positions 0..end."""
        import torch

        bs, C = self.spec.block_size, self.u8.shape[-1]
        if self.kind == "state":
            block = self._state_block(blocks)
            self.u8[block].view(-1)[:] = rows(self.name, self.layer, [int(keys[end - 1])], self.heads[:1],
                                              self.u8[block].numel()).view(-1)
            return
        if self.kind == "ring":
            block, ring = blocks[-1], bs
            pos = torch.arange(max(start, end - ring), end)
            self.u8[block, :, pos % ring, :] = rows(self.name, self.layer, keys[pos], self.heads, C).transpose(0, 1)
            return
        states = torch.arange(start // self.k, end // self.k)
        if not states.numel():
            return
        first_tok = states * self.k
        ids = torch.as_tensor(blocks, dtype=torch.int64)[first_tok // bs]
        last = keys[first_tok + self.k - 1]
        self.u8[ids, :, (first_tok % bs) // self.k, :] = rows(self.name, self.layer, last, self.heads, C)

    def verify(self, blocks: list[int], keys, t1: int, computed: int, null_block: int = 0) -> tuple[str, int]:
        """('' or a problem, bytes compared) for decode having loaded tokens [0, t1) of a prompt prefill computed
        `computed` tokens of (the ring and the state are as prefill left them)."""
        import torch

        bs, C = self.spec.block_size, self.u8.shape[-1]
        if self.kind == "state":
            block = self._state_block(blocks)
            want = rows(self.name, self.layer, [int(keys[computed - 1])], self.heads[:1], self.u8[block].numel())
            ok = torch.equal(self.u8[block].reshape(-1), want.reshape(-1))
            return ("" if ok else f"{self.name}: state block {block} differs"), self.u8[block].numel()
        if self.kind == "ring":
            block, ring = blocks[-1], bs
            pos = torch.arange(max(0, computed - ring), computed)
            got = self.u8[block, :, pos % ring, :].transpose(0, 1)
            want = rows(self.name, self.layer, keys[pos], self.heads, C)
            bad = (got != want).reshape(len(pos), -1).any(dim=1)
            return (f"{self.name}: ring rows of tokens {pos[bad][:8].tolist()} differ" if bool(bad.any()) else "",
                    got.numel())
        states = torch.arange(0, t1 // self.k)
        first_tok = states * self.k
        ids = torch.as_tensor(blocks, dtype=torch.int64)[first_tok // bs]
        keep = ids != null_block  # a sliding window left these behind: decode reads none of them
        states, first_tok, ids = states[keep], first_tok[keep], ids[keep]
        if not states.numel():
            return "", 0
        got = self.u8[ids, :, (first_tok % bs) // self.k, :]
        want = rows(self.name, self.layer, keys[first_tok + self.k - 1], self.heads, C)
        bad = (got != want).reshape(len(states), -1).any(dim=1)
        if bool(bad.any()):
            s = int(states[bad][0])
            return (f"{self.name}: {int(bad.sum())} of {len(states)} states differ, first state {s} (tokens "
                    f"{s * self.k}-{s * self.k + self.k - 1}, block {int(ids[bad][0])})"), got.numel()
        return "", got.numel()


def family_config(family: str, spec: dict[str, Any]):
    """The VllmConfig of one instance of `family` with SparseKVConnector (tests.vllm_families settings)."""
    from tests import vllm_families as F

    return F.make_family_vllm_config(
        family, tp=spec["tp"], pp=spec["pp"], kv_role=spec["kv_role"], engine_id=spec["engine_id"],
        extra_config=spec["extra_config"], kv_connector="SparseKVConnector", kv_connector_module_path="connector.vllm",
        max_num_batched_tokens=spec["max_num_batched_tokens"], kv_load_failure_policy=spec["kv_load_failure_policy"],
        enable_prefix_caching=spec.get("enable_prefix_caching", True))


class FamilyRank:
    """One (pp, tp) rank of one instance of a family (the counterpart of vllm_e2e_worker.Rank)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import contextlib

        import torch  # noqa: F401
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized
        from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
        from vllm.v1.worker.gpu.kv_connector import get_kv_connector

        from tests import vllm_families as F
        from tests import vllm_harness as H
        from tests.vllm_e2e_worker import _shutdown_connector

        self.spec, self.family = spec, spec["family"]
        self.pp_rank, self.tp_rank = spec["rank"]
        self.tp, self.pp = spec["tp"], spec["pp"]
        cfg = family_config(self.family, spec)
        self.cfg = cfg
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(set_current_vllm_config(cfg))
            self._stack.enter_context(H.fake_parallel_groups(tp_rank=self.tp_rank, tp_size=self.tp,
                                                             pp_rank=self.pp_rank, pp_size=self.pp,
                                                             pp_gather=self._stage_gather()))
            _, kvc = F.family_kv_cache_config(self.family, tp=self.tp, pp=self.pp, pp_rank=self.pp_rank,
                                              tp_rank=self.tp_rank, num_blocks=spec["num_blocks"], vllm_config=cfg)
            self.kvc = kvc
            ensure_kv_transfer_initialized(cfg, kvc)
            self._stack.callback(_shutdown_connector)
            self.caches = H.allocate_kv_caches(kvc, cfg)
            self.kv = get_kv_connector(cfg, self.caches)  # vLLM's ActiveKVConnector: register_kv_caches
            self.connector = get_kv_transfer_group()
        except BaseException:
            self._stack.close()
            raise
        mla = bool(cfg.model_config.use_mla)
        self.mamba = bool(kvc.has_mamba_layers)
        # vLLM's NixlConnector's rule (nixl/base_scheduler.py _prefill_backoff): a Mamba state or a bounded-replay
        # sliding window makes prefill stop one token short of the prompt
        self.backoff = int(self.mamba or any(getattr(g.kv_cache_spec, "prefix_replay_tokens", 0) > 0
                                             for g in kvc.kv_cache_groups))
        self.layers: list[Cache] = []
        for g, group in enumerate(kvc.kv_cache_groups):
            for name in group.layer_names:
                s = group.kv_cache_spec
                s = s.kv_cache_specs[name] if isinstance(s, UniformTypeKVCacheSpecs) else s
                self.layers.append(Cache(name, s, g, self.caches[name], self.tp_rank, mla))
        self.requests: dict[str, dict[str, Any]] = {}

    def _stage_gather(self):
        """The other PP stages' caches, as their workers would send them to connector.vllm.specs.gather_stages."""
        from connector.vllm.specs import stage_caches
        from tests import vllm_families as F

        def gather(local: list) -> list[list]:
            out = []
            for r in range(self.pp):
                if r == self.pp_rank:
                    out.append(local)
                    continue
                cfg, kvc = F.family_kv_cache_config(self.family, tp=self.tp, pp=self.pp, pp_rank=r,
                                                    tp_rank=self.tp_rank, num_blocks=self.spec["num_blocks"],
                                                    vllm_config=family_config(self.family, self.spec))
                out.append(stage_caches(kvc, cfg.model_config.get_total_num_kv_heads(), frozenset(),
                                        cfg.model_config.hf_text_config.num_hidden_layers,
                                        bool(cfg.model_config.use_mla)))
            return out
        return gather

    def info(self) -> dict[str, Any]:
        md = self.connector.get_handshake_metadata()
        return {"handshake": {(self.pp_rank, self.tp_rank): md} if md is not None else None,
                "num_blocks": self.kvc.num_blocks, "layout": self.kvc.kv_cache_layout,
                "connector": type(self.connector).__module__ + "." + type(self.connector).__name__,
                "hooked": [], "signalled": [], "layers": [(c.name, c.kind, c.layer) for c in self.layers],
                "mamba": self.mamba, "pools": self._pools()}

    def _pools(self) -> dict[str, list[int]]:
        """The connector's layout of the model: pool -> its layers (those that have any)."""
        model = self.connector._worker.model
        return {name: list(model.pools[name].layers) for name in model.pool_names if model.pools[name].layers}

    def step(self, blob: bytes) -> Any:
        import pickle

        from vllm.forward_context import set_forward_context

        from tests.vllm_e2e_worker import Rank, token_keys

        so = pickle.loads(blob)
        Rank._update_states(self, so)
        if so.total_num_scheduled_tokens == 0:
            return self.kv.no_forward(so).kv_connector_output
        computed = Rank._computed(self, so)
        with set_forward_context(None, self.cfg):
            self.kv.pre_forward(so)
            for req_id, n in so.num_scheduled_tokens.items():
                state = self.requests[req_id]
                start, end = computed[req_id], computed[req_id] + n
                keys = token_keys(range(end), state["prompt"])
                for cache in self.layers:  # no per-layer hook: the connector's wait_for_save sweep sends them
                    cache.write(state["blocks"][cache.group], keys, start, end)
        self.kv.finish_forward()
        return self.kv.post_forward(so.finished_req_ids)

    def verify(self, block_ids: list[list[int]], t0: int, t1: int, prompt_ids: list[int]) -> tuple[list[str], int]:
        from tests.vllm_e2e_worker import token_keys

        computed = len(prompt_ids) - self.backoff  # what prefill computed (its per-request states are after it)
        keys = token_keys(range(len(prompt_ids)), prompt_ids)
        problems, checked = [], 0
        for cache in self.layers:
            problem, n = cache.verify(block_ids[cache.group], keys, t1, computed)
            checked += n
            if problem:
                problems.append(f"rank pp{self.pp_rank},tp{self.tp_rank} {problem}")
        return problems, checked

    def sender_stats(self) -> dict[str, int]:
        sender = getattr(getattr(self.connector, "_worker", None), "sender", None)
        if sender is None:
            return {}
        return {"bytes_written": sender.stats.bytes_sent, "descriptors": sender.stats.descriptors,
                "writes": sender.stats.writes, "staged_chunks": sender.stats.staged_chunks,
                "by_cache": dict(sender.stats.bytes_by_cache)}

    def parked(self, transfer_id: str) -> bool:
        sender = getattr(getattr(self.connector, "_worker", None), "sender", None)
        return sender is not None and transfer_id in sender.ownership.parked

    def close(self) -> None:
        self._stack.close()
