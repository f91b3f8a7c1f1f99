"""`python -m connector serve-local`: a prefill engine, a decode engine and a router on this machine, one request
checked through them, a ready-to-paste request printed, and every process stopped on Ctrl-C, SIGTERM or SIGHUP
(from a terminal or from a script: `kill PID` of this process is enough)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from connector.cli.checks import float_in, int_in
from connector.core.errors import CliError, PeerError
from sparse_kv_lab.pd.local import FLOWS, ROOT, LocalConfig, LocalPair

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Besides SIGINT (Ctrl-C, KeyboardInterrupt): what a script, systemd or a closed terminal sends."""
WATCH_S = 1.0
"""How often a running pair is checked for a process that died."""


def add_subcommand(subs: Any) -> None:
    p = subs.add_parser("serve-local", help="a prefill engine, a decode engine and a router on this machine (the tiny "
                                            "model on CPU): one command, stopped with Ctrl-C")
    p.add_argument("--engine-python", default=str(ROOT / ".venv-cpu" / "bin" / "python"),
                   help="python of the vLLM environment that serves (default: the .venv-cpu that "
                        "tools/cpu-engine-env.sh builds)")
    p.add_argument("--work-dir", type=Path, default=Path("serve-local"), help="model, request body and logs")
    p.add_argument("--flow", choices=sorted(FLOWS), default="concurrent",
                   help="concurrent: examples/proxy.py sends both legs at once and the KV streams while prefill "
                        "computes; sequential: examples/sequential_router.py, vLLM's prefill-then-decode pattern")
    p.add_argument("--port", type=int_in(1, 65535), default=None, help="the router's port (default: a free one)")
    p.add_argument("--prefill-port", type=int_in(1, 65535), default=None,
                   help="prefill's HTTP port (default: a free one)")
    p.add_argument("--side-channel-port", type=int_in(1, 65535), default=None,
                   help="prefill's side channel, where decode fetches the KV (default: a free one)")
    p.add_argument("--decode-port", type=int_in(1, 65535), default=None,
                   help="decode's HTTP port (default: a free one)")
    p.add_argument("--timeout", type=float_in(1, 7200), default=600.0,
                   help="seconds to wait for the engines to be healthy")
    p.add_argument("--no-check", action="store_true",
                   help="do not send the check request (PD answer against decode alone) before serving")
    p.set_defaults(run=run)


def _raise_stop(signum: int, _frame: object) -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does (in the main thread, wherever it waits)."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    if not Path(args.engine_python).exists():
        raise CliError(f"--engine-python {args.engine_python} does not exist: build the CPU engine environment with "
                       f"`bash tools/cpu-engine-env.sh`, or point it at a vLLM environment's python")
    say = lambda line: print(line, flush=True)  # noqa: E731 - a script reading our output sees each line at once
    previous = {sig: signal.signal(sig, _raise_stop) for sig in STOP_SIGNALS}
    pair = None
    try:
        config = LocalConfig(args.engine_python, args.work_dir, args.flow, router_port=args.port,
                             prefill_port=args.prefill_port, side_channel_port=args.side_channel_port,
                             decode_port=args.decode_port, timeout_s=args.timeout)
        pair = LocalPair(config, log=say)
        pair.start()
        if not args.no_check:
            check = pair.check()
            verdict = "token-equal" if check.token_equal else "DIFFERENT (the KV did not arrive intact)"
            say(f"check: PD answer {check.pd_tokens} vs decode alone {check.alone_tokens}: {verdict}; decode "
                f"received {check.received_bytes / 1e6:.3f} MB of KV from prefill")
        say(f"warm-up: a text request through the router, first token after {pair.warm():.2f} s")
        _ready(pair, say)
        while not (dead := pair.dead()):
            time.sleep(WATCH_S)
        say(f"serve-local: {', '.join(dead)} exited; stopping the others. Last log lines:")
        for process in pair.processes:
            if process.name in dead:
                say(f"-- {process.name} ({process.log_path}):\n{process.log_tail(20)}")
        return 1
    except KeyboardInterrupt as exc:
        say(f"serve-local: {exc or 'SIGINT'}: stopping prefill, decode and the router")
        return 0
    except PeerError as exc:  # a server that would not start or died (its log's tail is in the message)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (*STOP_SIGNALS, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        if pair is not None:
            pair.stop()
            say("serve-local: stopped " + ", ".join(f"{p.name} (pid {p.proc.pid})" for p in pair.processes
                                                     if p.proc is not None))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _ready(pair: LocalPair, say) -> None:  # noqa: ANN001 - print-like
    flow = f"{pair.config.flow} flow, examples/{FLOWS[pair.config.flow]}"
    say(f"serve-local: ready\n"
        f"  router   {pair.router.url}   ({flow}; log {pair.router.log_path})\n"
        f"  prefill  {pair.prefill.url}   kv_producer, side channel {pair.side_channel} (log {pair.prefill.log_path})\n"
        f"  decode   {pair.decode.url}   kv_consumer (log {pair.decode.log_path})\n"
        f"  process groups: " + ", ".join(f"{p.name} {p.pid}" for p in pair.processes) + "\n"
        f"Send a request (the tiny model's tokenizer makes up words; the answer is in choices[0].text):\n"
        f"  curl -s {pair.router.url}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{{\"prompt\": \"hello world\", \"max_tokens\": 8}}'\n"
        f"or the check's long one ({pair.config.prompt_tokens} prompt token ids, {pair.config.max_tokens} greedy "
        f"tokens, in choices[0].token_ids):\n"
        f"  curl -s {pair.router.url}/v1/completions -H 'Content-Type: application/json' -d @{pair.request_path}\n"
        f"The same body with \"cache_salt\": \"any\" added, sent to {pair.decode.url} (decode computing the prompt "
        f"itself), gives the same tokens. Ctrl-C or SIGTERM stops all three.")
