"""`python -m connector {plan,demo,bench}`: a thin layer over the planning and streaming code."""

from __future__ import annotations

import argparse
import json
import sys

from connector.core.layout import LayoutError, ModelLayout, ParallelLayout


class CliError(ValueError):
    """Bad command-line input; printed as one line, exit code 2."""


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


def _add_common(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--model", required=True, help="preset (minimax-m3, deepseek-v3.2, qwen3-8b), a config.json or its folder")
    sub.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    sub.add_argument("--json", action="store_true", help="print one JSON object instead of the readable summary")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m connector", description=__doc__)
    subs = parser.add_subparsers(dest="command", required=True)
    plan = subs.add_parser("plan", help="print which prefill rank sends which (pool, layer, heads) to which decode rank")
    _add_common(plan)
    plan.add_argument("--prefill", required=True, metavar="tp=T,pp=P[,layers=a:b:c]")
    plan.add_argument("--decode", required=True, metavar="tp=T,pp=P[,layers=a:b:c]")
    from connector.demo_cli import add_subcommands  # imports the transport stack only when a command runs

    add_subcommands(subs, _add_common)
    return parser


def run_plan(args: argparse.Namespace) -> int:
    from connector.core.hf_config import load_model
    from connector.core.plan import build_plan, check_plan, format_table

    model = load_model(args.model, args.kv_cache_dtype)
    plan = build_plan(model, parse_side(args.prefill, model, "--prefill"), parse_side(args.decode, model, "--decode"))
    check_plan(plan)
    print(json.dumps(plan.to_json()) if args.json else format_table(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            return run_plan(args)
        return args.run(args)
    except (LayoutError, CliError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
