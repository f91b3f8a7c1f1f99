"""`demo` and `bench` subcommands (they need the transport stack; `plan` does not)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from connector.cli.args import add_common, parse_side
from connector.cli.checks import float_in, int_in
from connector.core.errors import CliError
from sparse_kv_lab.cli.checks import MAX_SIM_RANKS, check_device, check_memory, check_time, parse_node
from sparse_kv_lab.cli.yardsticks import bench_lines, demo_lines, with_yardsticks

MAX_TOKENS = 1 << 24
MAX_BLOCK_SIZE = 1024
MAX_REQUESTS = 10_000


def add_subcommands(subs: Any) -> None:
    demo = subs.add_parser("demo", help="prefill and decode ranks as OS processes; stream every pool over NIXL and "
                                        "verify every byte on decode")
    add_common(demo)
    demo.add_argument("--prefill", default="tp=1,pp=1", metavar="tp=T,pp=P[,layers=a:b:c]",
                      help="prefill's layout: TP size, PP size and optionally layers per PP stage")
    demo.add_argument("--decode", default="tp=1,pp=1", metavar="tp=T,pp=P[,layers=a:b:c]",
                      help="decode's layout, as --prefill")
    _add_run_args(demo)
    demo.add_argument("--mode", choices=["stream", "bulk"], default="stream",
                      help="stream: each layer leaves as prefill computes it; bulk: everything after compute (what "
                           "a connector without per-layer streaming does)")
    demo.add_argument("--chunks", type=int_in(1, MAX_TOKENS), default=1,
                      help="chunked prefill: forwards per prompt (at most --tokens)")
    demo.add_argument("--prefix-tokens", type=int_in(0, MAX_TOKENS), default=0,
                      help="decode prefix-cache hit, block-aligned")
    demo.add_argument("--late-register", action="store_true", help="decode registers after prefill finished")
    demo.add_argument("--requests", type=int_in(1, MAX_REQUESTS), default=1, help="requests, one after another")
    demo.set_defaults(run=run_demo)

    bench = subs.add_parser("bench", help="raw NIXL vs connector bulk vs connector stream, one process pair")
    add_common(bench)
    _add_run_args(bench, layer_ms=None)
    bench.add_argument("--repeats", type=int_in(1, 1000), default=5, help="runs of each kind; medians (and p99) are reported")
    bench.add_argument("--compute-tflops", type=float_in(0, 1e9, lo_open=True), default=400.0,
                       help="prefill's sustained speed: each layer computes 2 x active parameters x tokens / layers "
                            "FLOPs at this rate (default 400: an H200 at about 40%% of its bf16 peak); --layer-ms "
                            "overrides it")
    bench.add_argument("--plot", metavar="FILE.png", help="draw each layer's compute, post and landing times for a "
                                                          "bulk and a streaming run (needs matplotlib)")
    bench.add_argument("--checksum", action="store_true",
                       help="also run bulk transfers that decode verifies end to end (kv_checksum), and report "
                            "what the checksums cost")
    bench.set_defaults(run=run_bench)


def _add_run_args(p: argparse.ArgumentParser, layer_ms: float | None = 2.0) -> None:
    p.add_argument("--tokens", type=int_in(1, MAX_TOKENS), default=1024 if layer_ms is not None else 4096,
                   help="prompt tokens per request")
    p.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=16, help="tokens per KV-cache block")
    p.add_argument("--layer-ms", type=float_in(0, 60_000), default=layer_ms,
                   help="simulated prefill compute per layer, ms" + ("" if layer_ms is not None else
                                                          " (default: from --compute-tflops)"))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the simulated KV caches live (cuda: VRAM to VRAM over NIXL)")
    p.add_argument("--run-blocks", type=int_in(1, MAX_TOKENS), default=1,
                   help="allocate block ids in runs of this length (1: scattered, as a busy vLLM does)")
    p.add_argument("--staging-mb", type=int_in(0, 1 << 20), default=None,
                   help="per-rank staging buffer in MiB: scattered blocks move as gathered chunks (0 = off; default: "
                        "the connector's default for --device)")
    p.add_argument("--nixl-threads", type=int_in(0, 64), default=None,
                   help="threads NIXL's UCX backend spreads a WRITE of many descriptors over (0 = the posting "
                        "thread alone; default: the connector's, 4)")
    p.add_argument("--timeout", type=float_in(0, 86_400, lo_open=True), default=120.0,
                   help="seconds any one step may take")
    for side in ("prefill", "decode"):
        p.add_argument(f"--{side}-node", metavar="host=H[,netns=N][,dev=D][,tls=T]",
                       help=f"run the {side} ranks there (default: 127.0.0.1 in this namespace)" +
                            ("; decode connects to this host" if side == "prefill" else ""))


def _scenario(args: argparse.Namespace, **over: Any):
    """The run's Scenario, after every check that needs the model: ranks, chunks, prefix, time, device and memory
    (nothing is started or allocated before they pass)."""
    from connector.core.hf_config import load_model
    from sparse_kv_lab.sim.cluster import Scenario

    model = load_model(args.model, args.kv_cache_dtype)
    fields = dict(model=model,
                  prefill=parse_side(getattr(args, "prefill", "tp=1,pp=1"), model, "--prefill", MAX_SIM_RANKS),
                  decode=parse_side(getattr(args, "decode", "tp=1,pp=1"), model, "--decode", MAX_SIM_RANKS),
                  tokens=args.tokens, block_size=args.block_size, layer_ms=args.layer_ms or 0.0,
                  device=args.device, run_blocks=args.run_blocks, timeout_s=args.timeout,
                  staging_mb=args.staging_mb, prefill_node=parse_node(args.prefill_node, "--prefill-node"),
                  decode_node=parse_node(args.decode_node, "--decode-node"))
    if args.nixl_threads is not None:
        fields["nixl_threads"] = args.nixl_threads
    fields.update(over)
    prefix = fields.get("prefix_tokens", 0)
    if prefix % args.block_size or not 0 <= prefix < args.tokens:
        raise CliError(f"--prefix-tokens {prefix} must be a multiple of --block-size {args.block_size} "
                       f"below --tokens {args.tokens}")
    if fields.get("chunks", 1) > args.tokens:
        raise CliError(f"--chunks {fields['chunks']}: each chunk needs a token; give 1..{args.tokens} (--tokens)")
    check_time(model, fields["layer_ms"], args.timeout)
    check_device(args.device)
    sc = Scenario(**fields)
    check_memory(model, sc.prefill, sc.decode, sc.num_blocks, sc.block_size, sc.staging, sc.device)
    return sc


def run_demo(args: argparse.Namespace) -> int:
    from sparse_kv_lab.sim.cluster import run_scenario

    sc = _scenario(args, mode=args.mode, chunks=args.chunks, prefix_tokens=args.prefix_tokens,
                   late_register=args.late_register, requests=args.requests)
    result = run_scenario(sc)
    if args.json:
        out = result.to_json()
        out.pop("requests")
        print(json.dumps(out))
    else:
        print(f"model {sc.model.name}: prefill tp={sc.prefill.tp} pp={sc.prefill.pp} -> decode tp={sc.decode.tp} "
              f"pp={sc.decode.pp}, {sc.tokens} tokens, block size {sc.block_size}, mode {sc.mode}, {sc.device}")
        print("\n".join(demo_lines(result, sc)))
        print("  VERIFIED: every byte of every pool on every decode rank matches" if result.verified else
              "  FAILED:\n    " + "\n    ".join(result.problems[:20]))
    return 0 if result.verified else 1


def run_bench(args: argparse.Namespace) -> int:
    from sparse_kv_lab.sim.bench import bench

    if args.plot:
        from sparse_kv_lab.sim.plot import check_plotting

        check_plotting()
    compute = None
    if args.layer_ms is None:
        from sparse_kv_lab.sim.compute import active_params
        from connector.core.hf_config import load_config

        compute = (active_params(load_config(args.model)[0]), args.compute_tflops)
    out = bench(_scenario(args), progress=sys.stderr.isatty() and not args.json, repeats=args.repeats,
                compute=compute, plot=args.plot, checksum=args.checksum)
    out = with_yardsticks(out)
    if args.json:
        print(json.dumps(out))
    else:
        print("\n".join(bench_lines(out)))
    return 0 if out["verified"] else 1
