"""One simulated rank as an object: its event loop thread, a NIXL transport, its paged cache (and staging buffer)
registered with it, and the engine it runs. The demo's worker processes (sparse_kv_lab.sim.rank_process) and the tests'
in-process ranks are both this.

Import it after `sparse_kv_lab.sim.env.apply_env()` in a fresh process: it loads torch, and the transport loads NIXL."""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

import torch

from connector.engine.config import ReceiverConfig, SenderConfig, lost_source_hold_s
from connector.engine.rank import LocalRank
from connector.engine.receiver import StreamReceiver
from connector.engine.sender import StreamSender
from sparse_kv_lab.sim.buffers import RankBuffers
from sparse_kv_lab.sim.spec import RankSpec
from connector.transport.loop import LoopThread
from connector.transport.nixl import Transport, TransportConfig


class SimRank:
    """Use as `with SimRank(spec) as rank:`, or `open()` / `close()`. The engine made by `sender()` or `receiver()`
    is closed with the rank."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.loop = LoopThread(f"sim-{spec.side}-{spec.rank[0]}-{spec.rank[1]}")
        self.transport: Transport | None = None
        self.bufs: RankBuffers | None = None
        self.staging: torch.Tensor | None = None
        self.engine: StreamSender | StreamReceiver | None = None

    def open(self) -> "SimRank":
        spec = self.spec
        try:
            self.loop.start()
            # unique per rank opened, as a vLLM worker's (connector.vllm.worker): prefill binds an agent name to the
            # engine key that first used it, and a rank opened again is a restarted one
            name = f"{spec.run_id}-{spec.side}-{spec.rank[0]}-{spec.rank[1]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.transport = Transport(TransportConfig(name=name, tcp_user_timeout_s=spec.tcp_user_timeout_s,
                                                       nixl_threads=spec.nixl_threads))
            self.loop.run(self.transport.open(), 60)
            self.bufs = RankBuffers(spec.model, spec.parallel, spec.rank, spec.block_size, spec.num_blocks,
                                    spec.device)
            for tensor in self.bufs.tensors:
                self.transport.register(tensor)
            if spec.staging_mb:
                self.staging = torch.empty(spec.staging_mb << 20, dtype=torch.uint8, device=spec.device)
                self.transport.register(self.staging)
        except BaseException:
            self.close()
            raise
        return self

    def me(self) -> LocalRank:
        """This rank as the engines see it."""
        spec = self.spec
        return LocalRank(spec.engine_id, spec.model, spec.parallel, spec.rank, tuple(self.bufs.regions()),
                         spec.block_size, mem_type=spec.mem_type, staging=self.staging)

    def sender(self, config: SenderConfig | None = None) -> StreamSender:
        """A started StreamSender on this rank (its side channel on `config.host:config.port`, by default the
        spec's placement and port)."""
        spec = self.spec
        if config is None and spec.sender_config is not None:
            config = dataclasses.replace(spec.sender_config, host=spec.placement.host, port=spec.port)
        config = config or SenderConfig(host=spec.placement.host, port=spec.port, side_channel=spec.side_channel_config,
                                        write_timeout_s=spec.write_timeout_s or spec.timeout_s,
                                        record_timeline=True)
        sender = StreamSender(self.me(), self.transport, config, self.loop.loop)
        self.engine = sender
        self.loop.run(sender.start(), 30)
        return sender

    def receiver(self, config: ReceiverConfig | None = None, engine_key: bytes = b"") -> StreamReceiver:
        """A StreamReceiver on this rank; by default with the connector's own staging areas (ReceiverConfig), which
        prefill ranks share equally when the buffer is smaller. `engine_key`: its engine's (StreamReceiver.
        set_engine_key; none by default: a simulated engine is known by its id alone)."""
        spec = self.spec
        if config is None:
            config = ReceiverConfig(  # the connector's default staging area per connection
                side_channel=spec.side_channel_config, transfer_timeout_s=spec.timeout_s,
                lost_source_hold_s=lost_source_hold_s(spec.tcp_user_timeout_s, spec.side_channel.heartbeat_interval_s),
                kv_checksum=spec.kv_checksum)
        self.engine = StreamReceiver(self.me(), self.transport, config)
        if engine_key:
            self.engine.set_engine_key(engine_key)
        return self.engine

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run `coro` on this rank's loop and wait for it (at most `timeout`, by default the spec's)."""
        return self.loop.run(coro, timeout if timeout is not None else self.spec.timeout_s)

    def close(self) -> None:
        """Close the engine, then the transport, then stop the loop; safe after a partial `open()`."""
        try:
            if self.engine is not None:
                self.loop.run(self.engine.aclose(), 30)
            if self.transport is not None:
                self.loop.run(self.transport.aclose(), 30)
        finally:
            self.engine = self.transport = None
            self.loop.stop()

    def __enter__(self) -> "SimRank":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
