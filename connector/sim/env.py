"""The process environment of simulated ranks: UCX and NIXL settings that must be set before NIXL loads, and free
loopback ports for their side channels."""

from __future__ import annotations

import os

from connector.transport.ports import free_ports

ENV_DEFAULTS = {
    "UCX_NET_DEVICES": "lo",          # loopback only; otherwise UCX advertises every interface
    "NIXL_LOG_LEVEL": "WARN",
    "THP_MEM_ALLOC_ENABLE": "1",      # huge pages for torch CPU tensors: 2x faster cross-memory copies
}


def free_port_range(count: int) -> int:
    """A base port with `count` consecutive free ports on 127.0.0.1 (prefill rank (pp,tp) gets base+pp*tp_size+tp)."""
    return free_ports(count, "127.0.0.1")


def apply_env(overrides: tuple[tuple[str, str], ...] = ()) -> None:
    """Set `overrides`, then the ENV_DEFAULTS this process has not set itself (call before NIXL loads)."""
    for key, value in overrides:
        os.environ[key] = value
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
