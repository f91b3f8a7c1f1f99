"""python -m connector: set up, check and measure SparseKVConnector PD pairs.

  serve-local  a prefill engine, a decode engine and a router on this machine (the tiny model, CPU), one command
  doctor       check a prefill/decode pair's --kv-transfer-config (and running engines) before traffic
  settings     every kv_connector_extra_config setting, its default and meaning
  keygen       a prefill key: prefill signs each handshake with it, decode trusts only the keys it lists
  plan         which prefill rank sends which (pool, layer, heads) to which decode rank
  demo         prefill and decode ranks as OS processes, every byte over NIXL and verified
  bench        raw NIXL against the connector, bulk and streamed, on one process pair
  bench-pd     TTFT on real engines: one engine, SparseKVConnector and NixlConnector PD pairs"""

from __future__ import annotations

import argparse
import json
import sys

from connector.cli.args import add_common, parse_side
from connector.cli.bench_pd import add_subcommand as add_bench_pd
from connector.cli.checks import Parser
from connector.cli.demo import add_subcommands
from connector.cli.doctor import add_subcommand as add_doctor
from connector.cli.keygen import add_subcommand as add_keygen
from connector.cli.serve_local import add_subcommand as add_serve_local
from connector.cli.settings import add_subcommand as add_settings
from connector.core.errors import InputError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m connector", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = parser.add_subparsers(dest="command", required=True)
    add_serve_local(subs)
    add_doctor(subs)
    add_settings(subs)
    add_keygen(subs)
    plan = subs.add_parser("plan", help="print which prefill rank sends which (pool, layer, heads) to which decode rank")
    add_common(plan)
    plan.add_argument("--prefill", required=True, metavar="tp=T,pp=P[,layers=a:b:c]",
                      help="prefill's layout: TP size, PP size and optionally layers per PP stage")
    plan.add_argument("--decode", required=True, metavar="tp=T,pp=P[,layers=a:b:c]", help="decode's layout")
    add_subcommands(subs)  # (the transport stack is imported only when demo or bench runs)
    add_bench_pd(subs)
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
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
