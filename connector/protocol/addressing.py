"""Where a prefill rank listens: the one place that states the port rule and parses a side-channel address. Pure."""

from __future__ import annotations

import ipaddress

import re
from dataclasses import dataclass

from connector.core.errors import ConfigError
from connector.core.plan import Rank
from connector.core.untrusted import shown

HOST = re.compile(r"\[?[A-Za-z0-9._:%-]{1,253}\]?")
"""A host name, IPv4 or IPv6 address (in brackets or not, with a zone): nothing else reaches a log as an address."""


def side_channel_port(base_port: int, rank: Rank, tp_size: int) -> int:
    """Prefill rank (pp, tp) of an engine whose rank (0, 0) listens on `base_port` listens on
    `base_port + pp * tp_size + tp` (the same convention as vLLM's NixlConnector side-channel ports)."""
    return base_port + rank[0] * tp_size + rank[1]


def engine_base_port(configured_port: int, dp_index: int, tp_size: int, pp_size: int) -> int:
    """Where rank (0, 0) of data-parallel rank `dp_index` listens when every DP rank of a prefill deployment has the
    same `side_channel_port`: each DP rank is an engine of its own (tp_size x pp_size ranks), and they take
    consecutive port ranges, as vLLM's NixlConnector offsets its port by the DP index. Decode needs no rule: the
    `prefill_addr` in prefill's response names the DP rank that served the request."""
    return configured_port + dp_index * tp_size * pp_size


@dataclass(frozen=True)
class PrefillAddress:
    host: str
    port: int
    """Side-channel port of prefill rank (0, 0)."""

    @classmethod
    def parse(cls, text: str) -> "PrefillAddress":
        host, sep, port = str(text).rpartition(":")
        if not sep or not HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
            # (a request's kv_transfer_params carry it: the client's text, shown escaped and cut)
            raise ConfigError(f"prefill side-channel address {shown(text, 300, quote=True)} is not host:port (e.g. "
                              f"10.0.0.5:5600)")
        return cls(host.strip("[]"), int(port))

    def port_of(self, rank: Rank, tp_size: int) -> int:
        """Side-channel port of prefill rank `rank` of this engine (`tp_size` TP ranks per stage)."""
        return side_channel_port(self.port, rank, tp_size)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def host_allowed(host: str, allowed: tuple[str, ...] | list[str]) -> bool:
    """Whether a prefill host named by a request may be connected to: `allowed` empty (any), or `host` is one of
    its entries as written (a name or an address), or an address inside one of its networks (`10.0.0.0/16`)."""
    if not allowed:
        return True
    host = host.strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in allowed:
        if entry.strip("[]") == host:
            return True
        if address is not None and "/" in entry:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue
    return False


def check_allowed_hosts(allowed: list[str]) -> None:
    """Raise ConfigError naming an `allowed_prefill_hosts` entry that is neither a host nor a network."""
    for i, entry in enumerate(allowed):
        if "/" in entry:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ConfigError(f"allowed_prefill_hosts[{i}] = {entry!r} is not a network (e.g. 10.0.0.0/16)") \
                    from None
        elif not HOST.fullmatch(entry):
            raise ConfigError(f"allowed_prefill_hosts[{i}] = {entry!r} is not a host name or address")
