"""What the scheduler-side connector tells every worker each step (pickled by vLLM with the SchedulerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from connector.engine.receiver import RecvSpec  # noqa: F401 - re-exported (what StreamReceiver.receive takes)


@dataclass(frozen=True)
class SendSpec:
    """Prefill: a request whose KV goes to decode; sent every step it is scheduled."""

    transfer_id: str
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]
    """All blocks of the request so far, per KV-cache group, from token 0."""
    computed_after_step: int
    """Tokens that hold valid KV once this step's forward is done (prefix hits included)."""
    new: bool
    """First step of this request on the workers."""
    transfer_secret: str = ""
    """The transfer's capability: only a decode that proves it is served ('' = an open transfer)."""


@dataclass
class SparseKVMetadata(KVConnectorMetadata):
    sends: dict[str, SendSpec] = field(default_factory=dict)
    recvs: dict[str, RecvSpec] = field(default_factory=dict)
    aborts: dict[str, str] = field(default_factory=dict)
    """request id -> transfer id: stop sending / receiving it."""
    engine_key: bytes = b""
    """Decode: the key all ranks of this engine prove in their handshakes (connector.protocol.auth.new_engine_key,
    minted once by the scheduler side); every worker gets it with each step."""
    wake_addr: str = ""
    """The scheduler side's StepWake (connector.vllm.idle_hold): workers send it a datagram when a receive completes
    or a send ends, so a paced empty step returns at once. '' = none."""


@dataclass
class SparseKVHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup (vLLM collects it from every (pp, tp) rank). The data path handshake runs
    worker to worker over our own side channel; this only lets the scheduler check and log the ranks."""

    engine_id: str
    pp_rank: int
    tp_rank: int
    fingerprint: str
    side_channel_addr: str
    """host:port this rank's side channel listens on (prefill), or "" (decode)."""
