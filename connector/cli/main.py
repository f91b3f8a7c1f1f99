"""python -m connector: set up, check and measure SparseKVConnector PD pairs.

  serve-local  a prefill engine, a decode engine and a router on this machine (the tiny model, CPU), one command
  doctor       check a prefill/decode pair's --kv-transfer-config (and running engines) before traffic
  settings     every kv_connector_extra_config setting, its default and meaning
  keygen       a prefill key: prefill signs each handshake with it, decode trusts only the keys it lists
  plan         which prefill rank sends which (pool, layer, heads) to which decode rank
  demo         prefill and decode ranks as OS processes, every byte over NIXL and verified
  bench        raw NIXL against the connector, bulk and streamed, on one process pair
  bench-pd     TTFT on real engines: one engine, SparseKVConnector and NixlConnector PD pairs

serve-local, demo, bench and bench-pd are the lab's (sparse_kv_lab, installed beside the connector by
`pip install -e ./lab` from this tree): found by module name, so the connector imports nothing of it."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from connector.cli.args import add_common, parse_side
from connector.cli.checks import Parser
from connector.cli.doctor import add_subcommand as add_doctor
from connector.cli.keygen import add_subcommand as add_keygen
from connector.cli.settings import add_subcommand as add_settings
from connector.core.errors import InputError

LAB = "sparse_kv_lab"
"""The lab's package: not a dependency of the connector, and never imported by name in its code (the layer test)."""
INSTALL_LAB = "pip install -e ./lab (from the sparse-kv-connector source tree)"
LAB_COMMANDS = {
    "serve-local": ("cli.serve_local", "add_subcommand",
                    "a prefill engine, a decode engine and a router on this machine"),
    "demo": ("cli.demo", "add_subcommands",
             "prefill and decode ranks as OS processes, every byte over NIXL and verified"),
    "bench": ("cli.demo", "add_subcommands", "raw NIXL against the connector, bulk and streamed, on one process pair"),
    "bench-pd": ("cli.bench_pd", "add_subcommand", "TTFT on real engines: one engine and PD pairs"),
}
"""Command -> (the lab module that adds it, its function, the help shown when the lab is not installed)."""


def lab_module(name: str) -> Any | None:
    """The lab's module `name`, or None when the lab is not installed (a module missing inside it still raises)."""
    try:
        return importlib.import_module(f"{LAB}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != LAB:
            raise
        return None


def add_lab(subs: Any, *commands: str) -> None:
    """Add the lab's parsers for `commands` (one module adds them all); without the lab, a stand-in for each that
    says how to install it."""
    module_name, adder, _ = LAB_COMMANDS[commands[0]]
    module = lab_module(module_name)
    if module is not None:
        getattr(module, adder)(subs)
        return
    for command in commands:
        stub = subs.add_parser(command, help=f"{LAB_COMMANDS[command][2]} (the lab: {INSTALL_LAB})", add_help=False)
        stub.add_argument("rest", nargs=argparse.REMAINDER)
        stub.set_defaults(run=lambda args, command=command: lab_missing(command))


def lab_missing(command: str) -> int:
    print(f"error: `{command}` is part of the lab ({LAB}), which is not installed: {INSTALL_LAB}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m connector", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = parser.add_subparsers(dest="command", required=True)
    add_lab(subs, "serve-local")
    add_doctor(subs)
    add_settings(subs)
    add_keygen(subs)
    plan = subs.add_parser("plan", help="print which prefill rank sends which (pool, layer, heads) to which decode rank")
    add_common(plan)
    plan.add_argument("--prefill", required=True, metavar="tp=T,pp=P[,layers=a:b:c]",
                      help="prefill's layout: TP size, PP size and optionally layers per PP stage")
    plan.add_argument("--decode", required=True, metavar="tp=T,pp=P[,layers=a:b:c]", help="decode's layout")
    add_lab(subs, "demo", "bench")  # (the transport stack is imported only when demo or bench runs)
    add_lab(subs, "bench-pd")
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
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in LAB_COMMANDS and lab_module(LAB_COMMANDS[argv[0]][0]) is None:
        return lab_missing(argv[0])  # (before parsing: the stand-in cannot know the lab's options)
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
