"""Worker-side half (one per GPU worker process). Thin: it turns vLLM's tensors into Regions and vLLM's hooks into
stream-engine calls; the transfer logic lives in connector.engine.sender / connector.engine.receiver."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import uuid
from typing import Any

import torch

from connector.core.descriptors import NULL_BLOCK
from connector.core.errors import ConfigError, LayoutError
from connector.core.describe import describe_model
from connector.core.untrusted import shown, shown_text
from connector.core.layout import POOLS, ModelLayout, ParallelLayout, RankLayout, Region
from connector.engine.rank import LocalRank
from connector.engine.receiver import ReceiveResult, RecvSpec, StreamReceiver
from connector.engine.sender import StreamSender
from connector.engine.stats import StatsDelta
from connector.engine.timeline import close
from connector.protocol.addressing import engine_base_port, side_channel_port
from connector.transport.loop import LoopThread
from connector.transport.nixl import Transport
from connector.vllm import layer_signals, token_layout
from connector.vllm.config import ConnectorSettings, role_halves
from connector.vllm.early import bind_problem
from connector.vllm.idle_hold import WakeSender
from connector.vllm.metadata import SparseKVHandshake, SparseKVMetadata
from connector.vllm.regions import LayoutOf, build_regions, classify_layers, model_layout_from_hf
from connector.vllm.specs import (CacheFacts, assign_pools, draft_layer_names, gather_stages, model_from_caches,
                                  model_names)
from connector.vllm.states import state_split_of
from connector.vllm.stats import SparseKVConnectorStats

log = logging.getLogger(__name__)


def this_rank() -> tuple[int, int]:
    """(pp rank, tp rank) from vLLM's process groups."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return get_pp_group().rank_in_group, get_tp_group().rank_in_group


def parallel_layout(vllm_config: Any, num_layers: int) -> ParallelLayout:
    """This side's ParallelLayout: vLLM's own layer split of the hidden layers (get_pp_indices, which honours
    VLLM_PP_LAYER_PARTITION), and the draft layers of speculative decoding (ids from num_hidden_layers on, which
    vLLM builds on the last stage) on the last stage."""
    from vllm.distributed.utils import get_pp_indices

    pc = vllm_config.parallel_config
    hidden = vllm_config.model_config.hf_text_config.num_hidden_layers
    counts = [e - s for s, e in (get_pp_indices(hidden, r, pc.pipeline_parallel_size)
                                 for r in range(pc.pipeline_parallel_size))]
    counts[-1] += num_layers - hidden
    return ParallelLayout.build(num_layers, pc.tensor_parallel_size, pc.pipeline_parallel_size, counts)


def model_from_vllm(caches: dict[str, Any], vllm_config: Any) -> tuple[ModelLayout, dict[str, Any]]:
    """The whole model's layout from every stage's KV-cache specs (connector.vllm.specs), cross-checked with the
    Hugging Face config where the parser knows the model: a difference is logged (the specs are what vLLM runs);
    and this stage's caches with the pools the whole model gives them (connector.vllm.specs.assign_pools)."""
    hidden = vllm_config.model_config.hf_text_config.num_hidden_layers
    every = gather_stages(list(caches.values()))
    pools = {c.name: c for c in assign_pools(every)}
    caches = {name: pools[name] for name in caches}
    model = model_from_caches(every, hidden, model_names(vllm_config))
    try:
        hf = model_layout_from_hf(vllm_config)
    except LayoutError:
        return model, caches  # an architecture the parser does not know: the specs alone
    # the config.json describes the hidden layers only: compare those (a draft model's layers come after them)
    hidden_only = dataclasses.replace(model, num_layers=hidden, pools={
        name: dataclasses.replace(p, layers=tuple(i for i in p.layers if i < hidden))
        for name, p in model.pools.items()})
    if hf.fingerprint() != hidden_only.fingerprint():
        log.warning("SparseKVConnector: vLLM's KV-cache specs give %s; the model's config.json reads as %s (connector."
                    "core.hf_config). The connector moves what vLLM built", describe_model(model), describe_model(hf))
    return model, caches


class WorkerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings, kv_role: str,
                 engine_id: str) -> None:
        self.vllm_config, self.kv_cache_config, self.settings = vllm_config, kv_cache_config, settings
        self.sends, self.receives = role_halves(kv_role)
        """kv_producer sends, kv_consumer receives, kv_both does both (each request is one or the other)."""
        self.engine_id = engine_id
        """vLLM's kv_transfer_config.engine_id: with data parallelism the engine core appends `_dp<rank>`, so each
        DP rank is an engine of its own to the peers."""
        self.dp_index = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
        pp, tp = this_rank()
        self.rank = (pp, tp)
        self._caches = self._classify()
        """This rank's transferable KV-cache layers, by name, as their specs describe them (a cache the connector
        cannot move is refused here, at construction)."""
        self.model: ModelLayout | None = None
        self.parallel: ParallelLayout | None = None
        self.rank_layout: RankLayout | None = None
        """The whole model and this rank's share of it: known once every stage's specs are in (register_kv_caches)."""
        self.loop = LoopThread(f"sparse-kv-{kv_role}-{pp}-{tp}")
        self._wake = WakeSender()
        """Ends the scheduler side's paced wait when a receive completes or a send ends (connector.vllm.idle_hold)."""
        self.transport: Transport | None = None
        self.sender: StreamSender | None = None
        self.receiver: StreamReceiver | None = None
        self._layer_of: dict[str, int] = {name: info.layer for name, info in self._caches.items()}
        self._lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._req_of_tid: dict[str, str] = {}
        self._active_sends: list[str] = []     # transfer ids in this step's forward
        self._receiving: dict[str, concurrent.futures.Future] = {}
        self._failed: dict[str, str] = {}
        """Receives that ended without data (bad params, never started): request id -> reason."""
        self._aborted: set[str] = set()
        self._stats = SparseKVConnectorStats()
        """Observations since the last get_kv_connector_stats (model-runner thread only): decode's receives,
        prefill's per-step layer signals."""
        self._sender_delta: StatsDelta | None = None
        """Reads the sender's counters and samples at each get_kv_connector_stats (the report is what is new)."""
        self._cuda = False
        self._signals: layer_signals.StepSignals | None = None
        """Prefill: which layers got their per-layer signal this step, and their CUDA events."""
        self._installed = layer_signals.InstallResult()
        self._staging: torch.Tensor | None = None
        self.host, self.port = "", 0

    # ---- startup ----------------------------------------------------------------------------------------------
    def _classify(self) -> dict[str, CacheFacts]:
        model = self.vllm_config.model_config
        return classify_layers(self.kv_cache_config, model.get_total_num_kv_heads(),
                               draft_layer_names(self.vllm_config), model.hf_text_config.num_hidden_layers,
                               bool(getattr(model, "use_mla", False)), state_split_of(self.vllm_config))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Again, now that every layer module (a draft model's too) is in the forward context.
        self._caches = self._classify()
        self._layer_of = {name: info.layer for name, info in self._caches.items()}
        self.model, self._caches = model_from_vllm(self._caches, self.vllm_config)
        self.parallel = parallel_layout(self.vllm_config, self.model.num_layers)
        self.rank_layout = RankLayout(self.model, self.parallel, *self.rank)
        if self.rank == (0, 0):
            log.info("SparseKVConnector: the model's caches, from vLLM's KV-cache specs: %s (fingerprint %s)",
                     describe_model(self.model), self.model.fingerprint())
        regions = build_regions(kv_caches, self._caches, self.kv_cache_config.num_blocks, self.rank_layout,
                                self._token_layout_of())
        self._cuda = any(t.is_cuda for t in kv_caches.values())
        self.loop.start()
        # Unique per process start: a restarted rank must not look like the old one to its peers' NIXL agents.
        side = "b" if self.sends and self.receives else "p" if self.sends else "d"
        name = f"{self.engine_id}-{side}-{self.rank[0]}-{self.rank[1]}-{uuid.uuid4().hex[:8]}"
        self.transport = Transport(self.settings.transport_config(name))
        self.loop.run(self.transport.open(), 60)
        # Register each distinct storage once, whole (several layers may share one, and a permuted view's bytes
        # are not its data_ptr() .. + numel()).
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in kv_caches.values()}
        for storage in storages.values():
            self.transport.register(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
        staging = None
        staging_bytes = self.settings.staging_bytes(self._cuda)
        if staging_bytes:
            device = next(iter(kv_caches.values())).device
            staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device)
            self.transport.register(staging)
            self._staging = staging  # kept alive as long as the transport uses it
        # Groups may have different block sizes (DeepSeek-V4's compressor states, a Mamba state): token ranges count
        # in their gcd, and each region converts them to its own blocks (connector.core.descriptors.group_range).
        paged = [r.block_size for r in regions if not r.per_request]
        unit = math.gcd(*paged) if paged else max((r.block_size for r in regions), default=1)
        me = LocalRank(self.engine_id, self.model, self.parallel, self.rank, tuple(regions), unit,
                       mem_type="VRAM" if self._cuda else "DRAM", staging=staging, null_block=NULL_BLOCK)
        s = self.settings
        if self.sends:
            self.host = host = s.listen_host()  # what handshake_metadata names too
            base = engine_base_port(s.side_channel_port, self.dp_index, self.parallel.tp, self.parallel.pp)
            self.port = side_channel_port(base, self.rank, self.parallel.tp)
            self.sender = StreamSender(me, self.transport, s.sender_config(host, self.port), self.loop.loop,
                                       on_finished=self._on_sent)
            self._sender_delta = StatsDelta(self.sender.stats)
            try:
                self.loop.run(self.sender.start(), 30)
            except OSError as exc:  # not a bare "[Errno 98] address already in use": name the setting and the port
                raise ConfigError(bind_problem(exc, host, self.port, self.rank, s.side_channel_port,
                                               self.parallel.tp * self.parallel.pp)) from None
            log.info("SparseKVConnector prefill rank %s: side channel %s:%d, %d regions", self.rank, host, self.port,
                     len(regions))
            self._signals = layer_signals.StepSignals(self._layer_of.values(), cuda=self._cuda)
            self._install_layer_signals()
        if self.receives:
            self.receiver = StreamReceiver(me, self.transport, s.receiver_config())
            log.info("SparseKVConnector decode rank %s: %d regions, %s", self.rank, len(regions),
                     f"staging {staging_bytes >> 20} MiB" if staging is not None else "no staging")

    def _token_layout_of(self) -> LayoutOf:
        """How each layer's backend lays tokens out in a block, asked of its cache-update kernel
        (connector.vllm.token_layout); each distinct answer logged once, on rank (0, 0)."""
        context = self.vllm_config.compilation_config.static_forward_context
        model_dtype = self.vllm_config.model_config.dtype  # what an fp8 cache's K and V are quantised from
        logged: set[tuple] = set()

        def layout_of(name: str, tensor: torch.Tensor, region: Region) -> tuple[tuple[tuple[int, int], ...], str]:
            layer = context.get(name)
            got = token_layout.probe(layer, tensor, region.block_size, region.head_major, model_dtype) \
                if layer is not None else ((), f"vLLM's forward context has no layer {name}")
            if self.rank == (0, 0) and (region.pool, got) not in logged:
                logged.add((region.pool, got))
                log.info("SparseKVConnector: token layout of %s in a block (%s): %s", region.pool,
                         type(getattr(layer, "impl", None)).__name__,
                         token_layout.describe(*got, tensor.element_size()))
            return got

        return layout_of

    def _install_layer_signals(self) -> None:
        """Prefill only (decode has nothing to send per layer): a per-layer signal for the layers vLLM never runs
        save_kv_layer for (connector.vllm.layer_signals). vLLM calls register_kv_caches after the model is loaded
        and profiled and before CUDA-graph capture, so the installed methods are the ones capture records."""
        compilation = self.vllm_config.compilation_config
        self._installed = layer_signals.install(compilation.static_forward_context, self._layer_of,
                                                self._signal_layer, compile_mode=compilation.mode)
        for line in self._installed.log_lines():
            log.info("SparseKVConnector prefill rank %s: %s", self.rank, line)

    def handshake_metadata(self) -> SparseKVHandshake:
        return SparseKVHandshake(self.engine_id, self.rank[0], self.rank[1], self.model.fingerprint(),
                                 f"{self.host}:{self.port}" if self.sends else "")

    # ---- per step (model runner thread) -----------------------------------------------------------------------
    def bind(self, meta: SparseKVMetadata) -> None:
        """Called before the forward: announce this step's tokens to the sender, start receives and aborts.
        (start_load_kv may run after the forward launch, too late for the sender's bookkeeping.)"""
        self._wake.to = getattr(meta, "wake_addr", "")
        for req_id, tid in meta.aborts.items():
            self._abort(req_id, tid)
        if self.sender is not None:
            active = []
            for req_id, spec in meta.sends.items():
                if spec.new:
                    self._req_of_tid[spec.transfer_id] = req_id
                    self.sender.start_request(spec.transfer_id, spec.num_prompt_tokens, spec.transfer_secret)
                self.sender.begin_chunk(spec.transfer_id, [list(g) for g in spec.block_ids], spec.computed_after_step)
                active.append(spec.transfer_id)
            self._active_sends = active
            self._signals.begin()
        if self.receiver is not None:
            if meta.engine_key:
                self.receiver.set_engine_key(meta.engine_key)  # (the same every step: set once)
            for req_id, spec in meta.recvs.items():
                self._start_receive(req_id, spec)

    def _start_receive(self, req_id: str, spec: RecvSpec) -> None:
        if spec.finished:  # vLLM is done with it: only prefill has to hear, and vLLM must hear nothing more
            self.loop.spawn(self.receiver.abort_unregistered(
                spec.transfer_id, spec.prefill, "request ended on decode before it registered", spec.transfer_secret),
                f"abort of unregistered transfer {spec.transfer_id}")
            return
        if spec.aborted:
            self._aborted.add(req_id)
        if spec.error:
            self._failed[req_id] = spec.error
            return
        if spec.aborted:
            fut = self.loop.submit(self.receiver.abort_unregistered(
                spec.transfer_id, spec.prefill, "request aborted on decode before it registered", spec.transfer_secret))
        else:
            fut = self.loop.submit(self.receiver.receive(spec))
        self._receiving[req_id] = fut
        fut.add_done_callback(lambda _fut: self._wake.wake())  # the next step collects it: no need to wait for it

    def _abort(self, req_id: str, tid: str) -> None:
        if self.sender is not None and self._req_of_tid.get(tid) == req_id:
            self.sender.abort(tid, "request aborted on prefill")
        if self.receiver is None or req_id not in self._receiving:
            # Not receiving (any more): it was already reported finished, and vLLM must not hear of it twice.
            # (A registration that never went out comes as RecvSpec.aborted instead.)
            return
        self._aborted.add(req_id)
        # The receive ends once every prefill rank confirmed it writes nothing more into our blocks; only then is
        # the request reported finished, so vLLM does not hand the blocks to another request early.
        self.loop.spawn(self.receiver.abort(tid, "request aborted on decode"), f"abort of transfer {tid}")

    def layer_saved(self, layer_name: str) -> None:
        """save_kv_layer (vLLM's generic attention layers)."""
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            self._signal_layer(layer)

    def _signal_layer(self, layer: int) -> None:
        """Global layer `layer` (every pool of it on this rank) holds this step's tokens: from save_kv_layer, or
        from a method layer_signals installed. Must return at once: records the layer's CUDA event, the engine
        waits for it off this thread. A second signal of the layer in the same step is dropped (StepSignals)."""
        if not self._active_sends or self.sender is None or not self._signals.first(layer):
            return
        event = self._signals.record(layer)
        for tid in self._active_sends:
            self.sender.layer_ready(tid, layer, event)

    def step_done(self) -> None:
        """wait_for_save: the sweep. Every layer of this step is computed (including those with no signal)."""
        if self.sender is None or not self._active_sends:
            return
        event = self._signals.record_sweep()
        for tid in self._active_sends:
            self.sender.end_chunk(tid, event)
        self._active_sends = []
        self._stats.count_step(*self._signals.end())

    def _on_sent(self, tid: str, ok: bool) -> None:
        """Loop thread: the sender is done with a request (all decode ranks completed, aborted or lease expired)."""
        req_id = self._req_of_tid.pop(tid, None)
        if req_id is not None:
            with self._lock:
                self._finished_sending.add(req_id)
            self._wake.wake()
            if not ok:
                log.warning("request %s (transfer %s) finished sending without every decode rank completing",
                            shown(req_id), shown(tid))

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        with self._lock:
            sending, self._finished_sending = self._finished_sending, set()
        recving, failed = set(), set()
        done = dict(self._failed)
        self._failed = {}
        for req_id, fut in list(self._receiving.items()):
            if fut.done():
                del self._receiving[req_id]
                exc = fut.exception() if not fut.cancelled() else TimeoutError("cancelled")
                if exc is None:
                    recving.add(req_id)
                    result = fut.result()
                    if isinstance(result, ReceiveResult):  # (an abort_unregistered has no result)
                        self._stats.add(bytes_received=result.bytes_written, recvs_ok=1,
                                        bytes_received_by_cache=result.bytes_by_pool,
                                        **{f"bytes_received_{pool}": n for pool, n in result.bytes_by_pool.items()
                                           if pool in POOLS})
                        self._told(req_id, result)  # (recv_seconds and tell_seconds among its stages)
                else:
                    done[req_id] = str(exc)
        for req_id, reason in done.items():
            recving.add(req_id)  # vLLM wants failed receives in finished_recving too
            if req_id in self._aborted:
                self._aborted.discard(req_id)
            else:
                log.error("request %s: KV transfer failed: %s", shown(req_id), shown_text(reason))
                failed.add(req_id)
                self._stats.add(recvs_failed=1)
        return sending, recving, failed

    def _told(self, req_id: str, result: ReceiveResult) -> None:
        """vLLM hears now that `req_id`'s KV is in: the end of this rank's timeline of it."""
        close(log, "decode", result.transfer_id, result.points, "told", self.settings.log_timeline, self._stats.data,
              rank=list(self.rank), request_id=req_id)

    def take_stats(self) -> SparseKVConnectorStats | None:
        """What happened since the last call (model-runner thread): the sender's counters as a delta, and the
        receives that ended. None when nothing did, so vLLM ships nothing."""
        out, self._stats = self._stats, SparseKVConnectorStats()
        if self._sender_delta is not None:
            counts, samples = self._sender_delta.take()
            out.add(**counts)
            out.extend(**samples)
        return None if out.is_empty() else out

    def shutdown(self) -> None:
        layer_signals.uninstall(self._installed)  # the model may outlive the connector: no calls into a closed one
        self._wake.close()
        if not self.loop._thread:
            return
        try:
            if self.sender is not None:
                self.loop.run(self.sender.aclose(), 30)
            if self.receiver is not None:
                self.loop.run(self.receiver.aclose(), 30)
            if self.transport is not None:
                self.loop.run(self.transport.aclose(), 30)
        finally:
            self.loop.stop()
