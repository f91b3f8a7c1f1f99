"""`python -m connector bench-pd`: argument checks and output for sparse_kv_lab.pd.bench (which interleaves the modes
round by round, so machine drift is not reported as a mode's overhead; sparse_kv_lab.pd.interleave says why)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from connector.cli.checks import int_in
from connector.core.errors import CliError
from sparse_kv_lab.pd.bench import MODES, BenchConfig, PdBench, dump, from_json
from sparse_kv_lab.pd.model import MODELS, REPO_ROOT, SPARSE_MODELS

MAX_MODEL_LEN = 32768


def add_subcommand(subs: Any) -> None:
    p = subs.add_parser("bench-pd", help="TTFT of one vLLM engine vs PD pairs (SparseKVConnector concurrent and "
                                         "sequential, NixlConnector as shipped and clamped) on real engines")
    p.add_argument("--requests", type=int_in(1, 10_000), default=30,
                   help="measured rounds; each round asks every mode once, the same prompt, in a rotating order")
    p.add_argument("--warmup", type=int_in(0, 100), default=3, help="rounds before measuring")
    p.add_argument("--prompt-tokens", default="600,900,1000", help="prompt lengths in tokens, cycled")
    p.add_argument("--max-tokens", type=int_in(1, 1024), default=16, help="tokens generated per request")
    p.add_argument("--model", default="tiny", choices=sorted(MODELS) + list(SPARSE_MODELS),
                   help="tiny: 2 layers (the default); deep: 16 narrow layers, where per-layer streaming shows; "
                        "m3-sparse: the MiniMax-M3-shaped test model, main KV + index K + index V (a checkout only)")
    p.add_argument("--max-model-len", type=int_in(64, MAX_MODEL_LEN), default=4096,
                   help="the engines' --max-model-len (prompts up to it minus --max-tokens)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)} (default: all)")
    p.add_argument("--engine-python", default=".venv-cpu/bin/python",
                   help="python of the vLLM environment that serves (default: the one tools/cpu-engine-env.sh "
                        "builds)")
    p.add_argument("--work-dir", type=Path, default=None, help="model and server logs (default: a temp folder)")
    p.add_argument("--no-pin", action="store_true",
                   help="let every engine use every core (default: prefill and local on core 0, decode on core 1, "
                        "as on separate nodes)")
    p.add_argument("--max-engines", type=int_in(3, 64), default=None,
                   help="engines that may run at once (default: what free memory holds at 2 GiB each); when the "
                        "modes need more, they run in batches, each interleaved with the local engine")
    p.add_argument("--settle-ms", type=int_in(0, 10_000), default=300,
                   help="idle pause before each request, so the previous request's engines are idle again")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--report", type=Path, default=None, metavar="FILE",
                   help="run nothing: print the tables of a saved `bench-pd --json` run")
    p.set_defaults(run=run)


def config_from(args: argparse.Namespace) -> BenchConfig:
    if not 1 <= args.requests <= 10_000:
        raise CliError(f"--requests {args.requests}: give 1..10000")
    if not 0 <= args.warmup <= 100:
        raise CliError(f"--warmup {args.warmup}: give 0..100")
    if not 1 <= args.max_tokens <= 1024:
        raise CliError(f"--max-tokens {args.max_tokens}: give 1..1024")
    try:
        lengths = tuple(int(x) for x in args.prompt_tokens.split(","))
    except ValueError:
        raise CliError(f"--prompt-tokens {args.prompt_tokens!r}: give integers, e.g. 600,900,1000") from None
    longest = args.max_model_len - args.max_tokens
    too_long = [n for n in lengths if not 2 <= n <= longest]
    if too_long:
        raise CliError(f"--prompt-tokens {too_long}: each must be 2..{longest} (--max-model-len "
                       f"{args.max_model_len} minus --max-tokens; raise --max-model-len for longer prompts)")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise CliError(f"--modes {args.modes!r}: unknown {unknown}; choose from {','.join(MODES)}")
    if not Path(args.engine_python).exists():
        raise CliError(f"--engine-python {args.engine_python} does not exist: build the CPU engine environment "
                           f"with `bash tools/cpu-engine-env.sh`, or point it at a vLLM environment's python")
    if args.model in SPARSE_MODELS and not (REPO_ROOT / "tests" / "sparse_model").is_dir():
        raise CliError(f"--model {args.model}: the sparse test models live in a repository checkout's "
                       f"tests/sparse_model, which {REPO_ROOT} lacks: run bench-pd from a git clone")
    return BenchConfig(requests=args.requests, warmup=args.warmup, prompt_lengths=lengths,
                       max_tokens=args.max_tokens, modes=modes, engine_python=args.engine_python,
                       work_dir=args.work_dir, pin=not args.no_pin, model=args.model,
                       max_model_len=args.max_model_len, max_engines=args.max_engines,
                       settle_ms=float(args.settle_ms))


def run(args: argparse.Namespace) -> int:
    if args.report is not None:
        try:
            saved = json.loads(args.report.read_text())
            results = from_json(saved)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CliError(f"--report {args.report}: not a saved `bench-pd --json` run ({exc})") from None
        about = ", ".join(f"{k} {saved[k]}" for k in ("date", "model", "max_model_len", "load_average") if k in saved)
        about += "" if saved.get("interleaved") else " (modes run one after another: overheads unpaired)"
        print(f"{about}\n\n{dump(results, False)}")
        return 0
    config = config_from(args)  # a CliError is printed as one line, exit code 2 (cli.main)
    results = PdBench(config, log=lambda line: print(line, file=sys.stderr, flush=True)).run()
    print(dump(results, args.json, config))
    return 0 if all(r.token_equal == r.requests for r in results) else 1
