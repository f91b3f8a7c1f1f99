"""Command-line arguments every subcommand shares, and the parsing of a side's layout."""

from __future__ import annotations

import argparse

from connector.cli.checks import MAX_RANKS, check_ranks
from connector.core.errors import CliError, LayoutError
from connector.core.layout import ModelLayout, ParallelLayout, check_tp


def parse_side(text: str, model: ModelLayout, flag: str, most: int = MAX_RANKS) -> ParallelLayout:
    """`tp=T,pp=P[,layers=a:b:c]` -> ParallelLayout (layers: a count per stage, like VLLM_PP_LAYER_PARTITION).
    A tp x pp over `most` ranks, a pp over the layer count or a tp the KV heads do not allow is refused here, before
    any plan is built."""
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
        layout = ParallelLayout.build(model.num_layers, tp, pp, counts)
        for pool in model.pools.values():
            if pool.layers:
                check_tp(pool, tp)
    except LayoutError as exc:
        raise CliError(f"{flag}: {exc}") from None
    check_ranks(layout, flag, most)
    return layout


def add_common(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--model", required=True, help="preset (minimax-m3, deepseek-v3.2, qwen3-8b), a config.json or its folder")
    sub.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                     help="vLLM's --kv-cache-dtype: fp8 halves the main KV cache (and DeepSeek's indexer keys)")
    sub.add_argument("--json", action="store_true", help="print one JSON object instead of the readable summary")
