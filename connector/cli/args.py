"""Command-line arguments every subcommand shares, and the parsing of a side's layout."""

from __future__ import annotations

import argparse
from typing import Any

from connector.core.errors import CliError, LayoutError
from connector.core.layout import ModelLayout, ParallelLayout


def parse_side(text: str, model: ModelLayout, flag: str) -> ParallelLayout:
    """`tp=T,pp=P[,layers=a:b:c]` -> ParallelLayout (layers: a count per stage, like VLLM_PP_LAYER_PARTITION)."""
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("tp", "pp", "layers"):
            raise CliError(f"{flag} {text!r}: expected tp=T,pp=P[,layers=a:b:c], got {item!r}")
        fields[key.strip()] = value.strip()
    try:
        tp = int(fields.get("tp", "1"))
        pp = int(fields.get("pp", "1"))
        counts = [int(c) for c in fields["layers"].split(":")] if "layers" in fields else None
    except ValueError:
        raise CliError(f"{flag} {text!r}: tp, pp and the layers counts must be integers, e.g. tp=4,pp=2,layers=30:30")
    try:
        return ParallelLayout.build(model.num_layers, tp, pp, counts)
    except LayoutError as exc:
        raise CliError(f"{flag}: {exc}") from None


def add_common(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--model", required=True, help="preset (minimax-m3, deepseek-v3.2, qwen3-8b), a config.json or its folder")
    sub.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    sub.add_argument("--json", action="store_true", help="print one JSON object instead of the readable summary")


def parse_node(text: str | None, flag: str) -> Any:
    """`host=H[,netns=N][,dev=D][,tls=T]` -> where one side's ranks run. `netns`: a network namespace they enter
    (`ip netns add`); `dev`: the interface UCX uses (UCX_NET_DEVICES); `tls`: UCX_TLS, `tcp` by default once
    `netns` or `dev` is given (otherwise UCX moves the bytes through shared memory, network or not). Returns a
    connector.sim.spec.Placement (imported here: `plan` loads nothing of the transport stack)."""
    from connector.sim.spec import LOOPBACK, Placement  # noqa: PLC0415

    if not text:
        return Placement()
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("host", "netns", "dev", "tls") or not value.strip():
            raise CliError(f"{flag} {text!r}: expected host=H[,netns=N][,dev=D][,tls=T], got {item!r}")
        fields[key.strip()] = value.strip()
    env = [("UCX_NET_DEVICES", fields["dev"])] if "dev" in fields else []
    tls = fields.get("tls", "tcp" if env or "netns" in fields else "")
    env += [("UCX_TLS", tls)] if tls else []
    return Placement(fields.get("host", LOOPBACK), fields.get("netns"), tuple(env))
