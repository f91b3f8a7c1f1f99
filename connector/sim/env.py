"""The process environment of simulated ranks: UCX and NIXL settings that must be set before NIXL loads, and free
loopback ports for their side channels."""

from __future__ import annotations

import os
import socket

ENV_DEFAULTS = {
    "UCX_NET_DEVICES": "lo",          # loopback only; otherwise UCX advertises every interface
    "NIXL_LOG_LEVEL": "WARN",
    "THP_MEM_ALLOC_ENABLE": "1",      # huge pages for torch CPU tensors: 2x faster cross-memory copies
}


def free_port_range(count: int, attempts: int = 50) -> int:
    """A base port with `count` consecutive free ports on 127.0.0.1 (prefill rank (pp,tp) gets base+pp*tp_size+tp)."""
    for _ in range(attempts):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        socks = []
        try:
            for i in range(count):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1 after {attempts} attempts")


def apply_env(overrides: tuple[tuple[str, str], ...] = ()) -> None:
    """Set `overrides`, then the ENV_DEFAULTS this process has not set itself (call before NIXL loads)."""
    for key, value in overrides:
        os.environ[key] = value
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
