"""The process environment of simulated ranks: UCX and NIXL settings that must be set before NIXL loads (their
side-channel ports come from connector.transport.ports)."""

from __future__ import annotations

import os

ENV_DEFAULTS = {
    "UCX_NET_DEVICES": "lo",          # loopback only; otherwise UCX advertises every interface
    "NIXL_LOG_LEVEL": "WARN",
    "THP_MEM_ALLOC_ENABLE": "1",      # huge pages for torch CPU tensors: 2x faster cross-memory copies
}


def apply_env(overrides: tuple[tuple[str, str], ...] = ()) -> None:
    """Set `overrides`, then the ENV_DEFAULTS this process has not set itself (call before NIXL loads)."""
    for key, value in overrides:
        os.environ[key] = value
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
