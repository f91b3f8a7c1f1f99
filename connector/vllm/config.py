"""`kv_connector_extra_config` -> typed settings, and the engine and transport configs built from them.

The defaults are the engines' own (connector.engine.config, connector.transport.side_channel,
connector.transport.limits, connector.transport.nixl.TransportConfig): one set of defaults, read here, and one
generic conversion (`build`: a setting fills the config field of its name). The dict is converted with
`msgspec.convert` in its lax mode: a string that spells a number is accepted (configs built from environment
variables), but `true` or `1.5` for an integer is refused, naming the key. Unknown keys are a startup error listing
the valid ones."""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from connector.core.errors import ConfigError
from connector.engine.config import ReceiverConfig, SenderConfig, default_staging_mb, lost_source_hold_s
from connector.protocol.auth import key_from_text
from connector.protocol.addressing import check_allowed_hosts
from connector.transport.limits import ServerLimits
from connector.transport.nixl import TransportConfig
from connector.transport.side_channel import SideChannelConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
Positive = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(gt=0)]
_SIDE, _SENDER, _RECEIVER, _LIMITS = SideChannelConfig(), SenderConfig(), ReceiverConfig(), ServerLimits()
_TRANSPORT = {f.name: f.default for f in dataclasses.fields(TransportConfig)}


class LimitSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kv_connector_extra_config["limits"]`: how much a peer may hold of prefill's side channel before it is
    refused. A key without a docstring here means what the engine setting of the same name says
    (connector.transport.limits, connector.transport.side_channel, connector.engine.config)."""

    max_connections: PositiveInt = _LIMITS.max_connections
    max_connections_per_host: PositiveInt = _LIMITS.max_connections_per_host
    max_handshakes: PositiveInt = _LIMITS.max_handshakes
    max_handshakes_per_host: PositiveInt = _LIMITS.max_handshakes_per_host
    handshake_deadline_s: Positive = _LIMITS.handshake_deadline_s
    handshake_frame_bytes: Annotated[int, Meta(ge=4096)] = _LIMITS.handshake_frame_bytes
    max_frame_bytes: Annotated[int, Meta(ge=65536)] = _LIMITS.max_frame_bytes
    messages_per_s: Positive = _LIMITS.messages_per_s
    max_auth_failures: PositiveInt = _LIMITS.max_auth_failures
    auth_failure_window_s: Positive = _LIMITS.auth_failure_window_s
    """The window of max_auth_failures, in seconds."""
    refusal_log_interval_s: Positive = _LIMITS.refusal_log_interval_s
    max_peer_ranks: PositiveInt = _SIDE.max_peer_ranks
    max_parked_per_connection: PositiveInt = _SENDER.max_parked_per_connection
    max_parked_bytes_per_connection: PositiveInt = _SENDER.max_parked_bytes_per_connection
    max_parked: PositiveInt = _SENDER.max_parked
    """Registrations waiting for prefill to start their request, over all decode connections together."""
    max_parked_bytes: PositiveInt = _SENDER.max_parked_bytes
    """The memory those may hold, over all decode connections together."""
    max_peer_agents: PositiveInt = _SENDER.max_peer_agents
    """Decode NIXL agents a prefill worker keeps loaded at once (live and idle ones)."""
    max_agents_per_host: PositiveInt = _SENDER.max_agents_per_host
    """Of those, the most for connections from one source address (a decode node needs one per rank of each engine
    it runs); a new one beyond it replaces an idle one of that address, else it is refused."""
    agent_unloads_per_hour: PositiveInt = _SENDER.agent_unloads_per_hour
    """Idle decode agents a prefill worker unloads for new ones from one source address, at most, per hour (NIXL
    1.5.1 leaks sockets on each); one address spending it refuses no other."""


LIMIT_KEYS = frozenset(LimitSettings.__struct_fields__)
"""Keys that used to sit at the top level and now go under "limits" (accepted flat, with a warning, in 0.1.x)."""


class ConnectorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kv_connector_extra_config`, every key. A key without a docstring here means what the engine setting of the
    same name says (connector.engine.config, connector.transport.limits, connector.transport.nixl.settings):
    `python -m connector settings` prints them all, and the README's table is its output."""

    side_channel_host: str | None = None
    """Address prefill ranks listen on for decode's side channel. Default: the host vLLM reports for this node
    (VLLM_HOST_IP / its own IP detection), never 0.0.0.0 unless set explicitly."""
    side_channel_port: Annotated[int, Meta(gt=0, lt=65536)] = 5600
    """Port of prefill rank (pp0, tp0); the others follow connector.protocol.addressing.side_channel_port."""
    auth_token: str = _SIDE.auth_token
    """Shared secret both sides prove they hold (challenge-response; it never crosses the wire). Written here it
    shows in vLLM's "non-default args" log line and in `ps`: prefer auth_token_file or auth_token_env."""
    auth_token_file: str = ""
    """A file holding the auth token (one line; surrounding whitespace is dropped), read by every worker at start."""
    auth_token_env: str = ""
    """The name of an environment variable holding the auth token (e.g. SPARSE_KV_AUTH_TOKEN), read by every
    worker at start. At most one of auth_token, auth_token_file and auth_token_env may be set."""
    tls_cert_file: str = _SIDE.tls_cert_file
    """Prefill: PEM certificate of the side channel (with tls_key_file: the side channel is served over TLS)."""
    tls_key_file: str = _SIDE.tls_key_file
    """Prefill: PEM private key of tls_cert_file."""
    tls_ca_file: str = _SIDE.tls_ca_file
    """Decode: PEM CA bundle; set = connect over TLS and verify prefill's certificate and host."""
    prefill_key_file: str = ""
    """Prefill: a file holding its prefill key (`python -m connector keygen FILE` writes one, mode 0600), read by
    every worker at start; each handshake is signed with it, for decodes that set trusted_prefill_keys."""
    trusted_prefill_keys: Annotated[list[str], Meta(max_length=1024)] = []
    """Decode: the public prefill keys (64 hex digits each, as `python -m connector keygen` prints them) of the
    prefills it may feed from. Set, decode sends its memory (NIXL metadata and regions, with which a peer can WRITE
    anywhere decode registered) only to a prefill that proves one of them, so a holder of the auth token cannot
    pose as a prefill. Required on a decode (kv_consumer, kv_both) unless insecure_any_prefill is set.
    Public keys: not secret (a ConfigMap, the command line)."""
    insecure_any_prefill: bool = False
    """Decode: start without trusted_prefill_keys, and so hand this decode's memory (its NIXL metadata and regions,
    with which a peer can WRITE anywhere in its KV cache) to any peer that proves the auth token, or to anyone
    without one. Off (default): a decode without trusted_prefill_keys refuses to start, saying how to make keys.
    For a test bench on one trusted machine only."""
    allowed_prefill_hosts: Annotated[list[str], Meta(max_length=1024)] = []
    """Decode: the hosts (names or addresses as prefill_addr gives them) or networks (10.0.0.0/16) a request's
    kv_transfer_params may send it to; a request naming another fails at once, naming this setting, and decode
    never connects there. Empty: any host (prefill keys still keep a stranger from learning anything)."""
    limits: "LimitSettings" = msgspec.field(default_factory=lambda: LimitSettings())
    """The abuse bounds of prefill's side channel (connections, handshakes, frames, waiting registrations, NIXL
    agents): one nested object, e.g. {"limits": {"max_connections": 2048}}. An operator rarely changes them; the
    README's settings section lists them after the rest."""
    given_up_keep_s: Positive = _SENDER.given_up_keep_s
    lease_s: Positive = _SENDER.lease_s
    max_inflight_bytes: PositiveInt = _TRANSPORT["max_inflight_bytes"]
    """Backpressure: bytes posted to NIXL but not completed, per worker."""
    posts_per_second: Positive | None = _TRANSPORT["posts_per_second"]
    """Optional cap on NIXL WRITE posts per second per worker."""
    handshake_timeout_s: Positive = _SIDE.handshake_timeout_s
    transfer_timeout_s: Positive = _RECEIVER.transfer_timeout_s
    write_timeout_s: Positive = _SENDER.write_timeout_s
    layer_wake_gap_us: Annotated[int, Meta(ge=0, le=1_000_000)] = _SENDER.layer_wake_gap_us
    layer_wake_cpu_share: Annotated[float, Meta(ge=0.0, le=1.0)] = _SENDER.layer_wake_cpu_share
    layer_wake_gap_max_us: Annotated[int, Meta(ge=0, le=1_000_000)] = _SENDER.layer_wake_gap_max_us
    heartbeat_interval_s: Positive = _SIDE.heartbeat_interval_s
    """How often each side-channel connection sends a heartbeat (decode's also extend prefill's leases)."""
    dead_after_s: Positive = _SIDE.dead_after_s
    tcp_user_timeout_s: Positive | None = _TRANSPORT["tcp_user_timeout_s"]
    """UCX over TCP: a WRITE whose data stays unacknowledged this long (a cut link) fails, whatever the kernel's
    tcp_retries2; decode keeps a lost prefill rank's blocks this long plus a heartbeat interval and 1 s. None: the
    kernel decides (many minutes with its defaults)."""
    log_timeline: bool = False
    """Log each transfer's timeline at INFO (one `SparseKV timeline {...}` line per transfer per rank and scheduler;
    at DEBUG otherwise): when prefill saw, scheduled and computed it, posted and completed its WRITEs, when decode
    registered, had the KV, told vLLM and scheduled it (README, "Where TTFT goes"; bench-pd's breakdown)."""
    require_transfer_secret: bool = True
    """Prefill: a request that names its transfer_id but brings no transfer_secret (a router that does not mint one
    in the concurrent flow) gets one minted anyway, so its decode leg, which cannot know it, is refused (naming
    transfer_secret) instead of the transfer being open to any holder of the auth token. Off: such a transfer is
    open (the first decode engine to register it owns it): set it off only for a router that names transfer ids
    and mints no secret. Requests without a transfer_id (the sequential flow) always get a secret (README,
    Security). On by default: every flow this project ships carries a secret."""
    kv_checksum: bool = False
    """Decode: verify every transfer end to end. Prefill digests what it sent per (pool, layer, block) and decode
    what its blocks hold once all is in; a difference fails the transfer (vLLM's kv_load_failure_policy applies),
    naming the pool, layer and blocks. Costs one extra read of the transfer's bytes on each side (on a GPU, a
    reduction kernel; on a CPU about 1 ms per MB, measured here: the bench's --checksum measures it), and delays
    each Complete by prefill's digest. As SGLang's --disaggregation-enable-kv-checksum."""
    holding_step_interval_s: Annotated[float, Meta(ge=0, le=300)] = 30.0
    """Prefill: while the engine has nothing to compute but holds finished requests' KV for decode, vLLM steps it
    only to collect their sends, in a busy loop: 1.4 cores on 2 here (the engine core, and its worker spinning on
    vLLM's shared-memory queue), for as long as the KV is held, up to `lease_s` for a decode that never comes
    (tools/idle_hold_cpu.py). The connector spaces those empty steps out: 0.1 s, then twice as long each time, up to
    this. Decode: while its only requests wait for their KV, the same busy loop; each wait is at most 10% of how long
    the youngest has waited (1 ms to 5 s). Either way a worker ends the wait as soon as a send ends or a receive
    completes (on one node), and a new request, an abort or any call wakes the engine at once; a request waiting for
    blocks is never held up, and transfers never wait for a step. 0: vLLM's own pace. Off with data parallelism."""
    progress_delay_us: PositiveInt = _TRANSPORT["progress_delay_us"]
    """NIXL progress-thread poll delay (never 0: 0 spins a core)."""
    nixl_threads: Annotated[int, Meta(ge=0, le=64)] = _TRANSPORT["nixl_threads"]
    """Threads NIXL's UCX backend spreads a WRITE of many descriptors over (its `num_threads`; vLLM's NixlConnector
    uses 4 as well). 0: every descriptor is posted by the calling thread."""
    staging_mb: Annotated[int, Meta(ge=0)] | None = None
    """Per-worker staging buffer on the KV-cache device, in MiB (0 = off). When prefill and decode both have one,
    scattered blocks move as gathered chunks, one NIXL descriptor each, and decode scatters them
    (connector.engine.staging): far fewer descriptors when vLLM's blocks are fragmented. None (unset): the default
    for the KV cache's device (connector.engine.config.default_staging_mb). It is allocated after vLLM sized its
    KV cache, so it comes out of the memory `gpu_memory_utilization` leaves free."""
    staging_slot_mb: PositiveInt = _RECEIVER.staging_slot_bytes >> 20
    """Decode: the most of its staging buffer one prefill rank connection may use; prefill cuts it into a ring of
    chunks in flight."""

    def staging_bytes(self, cuda: bool) -> int:
        """The staging buffer a worker allocates, in bytes (0: none)."""
        return (default_staging_mb(cuda) if self.staging_mb is None else self.staging_mb) << 20

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        """The settings of `extra`, or a ConfigError of one line naming the key, its value and the fix (for an
        unknown key: the closest valid key and all of them)."""
        extra = nest_limits(dict(extra or {}))
        unknown = sorted(set(extra) - set(cls.__struct_fields__))
        if unknown:
            hints = [f"{key!r} (value {extra[key]!r}){did_you_mean(key, cls.__struct_fields__)}" for key in unknown]
            raise ConfigError(f"SparseKVConnector: unknown kv_connector_extra_config key(s) {unknown}: "
                              f"{'; '.join(hints)}; valid keys are {sorted(cls.__struct_fields__)}")
        limits = extra.get("limits", {})
        if not isinstance(limits, dict):
            raise ConfigError(f"SparseKVConnector: kv_connector_extra_config['limits']={limits!r} is refused: give "
                              f"an object, e.g. {{\"limits\": {{\"max_connections\": 2048}}}}")
        unknown = sorted(set(limits) - LIMIT_KEYS)
        if unknown:
            hints = [f"{key!r} (value {limits[key]!r}){did_you_mean(key, LIMIT_KEYS)}" for key in unknown]
            raise ConfigError(f"SparseKVConnector: unknown kv_connector_extra_config['limits'] key(s) {unknown}: "
                              f"{'; '.join(hints)}; valid keys are {sorted(LIMIT_KEYS)}")
        try:
            settings = msgspec.convert(extra, cls, strict=False)
        except msgspec.ValidationError as exc:
            why, _, where = str(exc).rpartition(" - at `$.")
            path = where.rstrip("`").split(".")
            value = extra.get(path[0]) if len(path) == 1 else limits.get(path[-1])
            key = "".join(f"[{part!r}]" for part in (path[:1] if len(path) == 1 else (path[0], path[-1])))
            raise ConfigError(f"SparseKVConnector: kv_connector_extra_config{key}={value!r} is refused: "
                              f"{why or exc}") from None
        sources = [name for name in TOKEN_SOURCES if getattr(settings, name)]
        if len(sources) > 1:
            raise ConfigError(f"SparseKVConnector: kv_connector_extra_config sets {sources}: give the auth token one "
                              f"way only (auth_token_file or auth_token_env keep it out of vLLM's log)")
        return settings

    def token(self) -> str:
        """The auth token, from auth_token, the file auth_token_file or the variable auth_token_env ("" = none).
        Raises ConfigError naming the setting when the file cannot be read or the variable is unset or empty."""
        if self.auth_token_file:
            try:
                with open(self.auth_token_file, encoding="utf-8") as f:
                    token = f.read().strip()
            except OSError as exc:
                raise ConfigError(f"SparseKVConnector: auth_token_file {self.auth_token_file!r} cannot be read: "
                                  f"{exc.strerror}: give a file this process can read (on every node)") from None
            if not token:
                raise ConfigError(f"SparseKVConnector: auth_token_file {self.auth_token_file!r} is empty: write the "
                                  f"token into it (e.g. `openssl rand -hex 32 > {self.auth_token_file}`)")
            return token
        if self.auth_token_env:
            token = os.environ.get(self.auth_token_env, "").strip()
            if not token:
                raise ConfigError(f"SparseKVConnector: auth_token_env names {self.auth_token_env!r}, which is unset "
                                  f"or empty in this process: export {self.auth_token_env}=... before vllm serve")
            return token
        return self.auth_token

    def prefill_key(self) -> bytes:
        """The private prefill key from prefill_key_file (b"" = none). Raises ConfigError naming the setting when
        the file cannot be read or does not hold a key."""
        if not self.prefill_key_file:
            return b""
        try:
            with open(self.prefill_key_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(f"SparseKVConnector: prefill_key_file {self.prefill_key_file!r} cannot be read: "
                              f"{exc.strerror}: give a file this process can read (on every prefill node)") from None
        try:
            return key_from_text(text, f"prefill_key_file {self.prefill_key_file!r}")
        except ValueError as exc:
            raise ConfigError(f"SparseKVConnector: {exc}") from None

    def trusted_keys(self) -> frozenset[bytes]:
        """trusted_prefill_keys as keys. Raises ConfigError naming the entry that is not a key."""
        keys = set()
        for i, text in enumerate(self.trusted_prefill_keys):
            try:
                keys.add(key_from_text(text, f"trusted_prefill_keys[{i}] ({text[:20]!r})"))
            except ValueError as exc:
                raise ConfigError(f"SparseKVConnector: {exc}: give the public key it prints (--public), never the "
                                  f"private key file's content") from None
        return frozenset(keys)

    def check_trust(self, kv_role: str) -> None:
        """Raise ConfigError if a decode (kv_consumer, kv_both) would hand its memory to any token holder: no
        trusted_prefill_keys and no insecure_any_prefill. Also checks allowed_prefill_hosts."""
        check_allowed_hosts(self.allowed_prefill_hosts)
        if role_halves(kv_role)[1] and not self.trusted_prefill_keys and not self.insecure_any_prefill:
            raise ConfigError(
                f"SparseKVConnector: this {kv_role} engine receives KV and has no trusted_prefill_keys, so any peer "
                f"holding the auth token could pose as a prefill and WRITE anywhere in its KV cache. Make a prefill "
                f"key: `python -m connector keygen prefill.key` (prints its public key), give prefill "
                f"\"prefill_key_file\": \"prefill.key\" and this engine \"trusted_prefill_keys\": [\"<public key>\"] "
                f"(README, Security); or, on a trusted test bench only, \"insecure_any_prefill\": true")

    def listen_host(self) -> str:
        """The side channel's host, which prefill listens on and names to decode: `side_channel_host`, else the
        address vLLM reports for this node (never 0.0.0.0 unless set so)."""
        return self.side_channel_host or default_host()

    def side_channel(self) -> SideChannelConfig:
        return build(SideChannelConfig, self, auth_token=self.token(), limits=build(ServerLimits, self),
                     prefill_key=self.prefill_key(), trusted_keys=self.trusted_keys())

    def sender_config(self, host: str, port: int) -> SenderConfig:
        return build(SenderConfig, self, host=host, port=port, side_channel=self.side_channel())

    def receiver_config(self) -> ReceiverConfig:
        return build(ReceiverConfig, self, side_channel=self.side_channel(),
                     staging_slot_bytes=self.staging_slot_mb << 20,
                     lost_source_hold_s=lost_source_hold_s(self.tcp_user_timeout_s, self.heartbeat_interval_s))

    def transport_config(self, name: str) -> TransportConfig:
        return build(TransportConfig, self, name=name)


def build(config_type: type[T], settings: ConnectorSettings, **derived: Any) -> T:
    """An engine or transport config (a dataclass) from the settings: every field that has a setting of the same
    name (at the top level or under `limits`) takes its value, `derived` gives the others that depend on the
    settings, and the rest keep their defaults (tests/test_settings.py holds that every field is one of the three,
    on purpose)."""
    own = {}
    for f in dataclasses.fields(config_type):
        if f.name in derived:
            continue
        if f.name in LIMIT_KEYS:
            own[f.name] = getattr(settings.limits, f.name)
        elif f.name in settings.__struct_fields__:
            own[f.name] = getattr(settings, f.name)
    return config_type(**own, **derived)


def nest_limits(extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` with the abuse bounds given at the top level (as before 0.1.x's `limits`) moved under "limits", named in one
    warning with its new place. A bound given both ways is refused (which one was meant is not known)."""
    flat = sorted(LIMIT_KEYS & set(extra))
    if not flat:
        return extra
    limits = extra.get("limits", {})
    if not isinstance(limits, dict):
        return extra  # refused by the caller, naming "limits"
    both = [key for key in flat if key in limits]
    if both:
        raise ConfigError(f"SparseKVConnector: kv_connector_extra_config sets {both} both at the top level and under "
                          f"'limits': keep only the one under 'limits'")
    moved = {key: extra.pop(key) for key in flat}
    log.warning("SparseKVConnector: kv_connector_extra_config keys %s belong under \"limits\" now (e.g. "
                "{\"limits\": {\"%s\": %s}}); the flat keys still work in this version and will be refused in the next",
                flat, flat[0], json.dumps(moved[flat[0]]))
    return {**extra, "limits": {**limits, **moved}}


TOKEN_SOURCES = ("auth_token", "auth_token_file", "auth_token_env")
"""The settings an auth token may come from (one at most)."""


def did_you_mean(key: str, valid: Any) -> str:
    """`: did you mean 'x'?` for the valid name closest to a misspelt `key`, or "" when none is close."""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f": did you mean {close[0]!r}?" if close else ""


def default_host() -> str:
    """The address vLLM reports for this node (VLLM_HOST_IP or its own detection), not 0.0.0.0."""
    from vllm.utils.network_utils import get_ip

    return get_ip()


ROLES = ("kv_producer", "kv_consumer", "kv_both")
"""The kv_role values SparseKVConnector runs as."""


def role_halves(kv_role: str) -> tuple[bool, bool]:
    """(sends, receives) of an engine of `kv_role`: kv_both does both, each request by its kv_transfer_params."""
    return kv_role in ("kv_producer", "kv_both"), kv_role in ("kv_consumer", "kv_both")
