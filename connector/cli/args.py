"""Command-line arguments every subcommand shares, and the parsing of a side's layout."""

from __future__ import annotations

import argparse

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
