"""Soak the connector between two OS processes on real NIXL (sparse_kv_lab.sim.soak): many small requests back to back,
sampling RSS, fds, threads, live objects and the engines' tables in both processes, to show nothing grows per
request. One JSON line per sample on stdout (and in --out), then one summary line: per side the baseline (the first
sample after the warm-up) and the last sample, the change of each metric and its slope per 10,000 requests, the
request rate, and the failed transfers (must be 0).

    python tools/soak.py --requests 100000                         # one decode connection for the whole run
    python tools/soak.py --churn 10000 --churn-every 50            # the decode peer dropped every 50 requests
    python tools/soak.py --requests 20000 --out /work/notes/soak-one.jsonl

On a shared machine, run it under `flock /tmp/heavy.lock`. Exit status 1 if any transfer failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparse_kv_lab.sim.soak import SoakPlan, run_soak, summarize  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kind = ap.add_mutually_exclusive_group(required=True)
    kind.add_argument("--requests", type=int, help="requests over one decode connection")
    kind.add_argument("--churn", type=int, help="requests with the decode peer dropped every --churn-every")
    ap.add_argument("--churn-every", type=int, default=50, help="requests between drops of the decode peer")
    ap.add_argument("--restart-every", type=int, default=4,
                    help="every this-many-th drop restarts the decode rank (a new NIXL agent); 0: never")
    ap.add_argument("--sample-every", type=int, default=0, help="requests between samples (default: 5%% of the run)")
    ap.add_argument("--warmup", type=int, default=0, help="requests before the baseline (default: one interval)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per request (a multiple of 16)")
    ap.add_argument("--verify-every", type=int, default=1, help="check the bytes of every this-many-th request")
    ap.add_argument("--released-max-ids", type=int, default=None,
                    help="override prefill's memory of released transfer ids (default: the engine's 65536)")
    ap.add_argument("--out", type=Path, help="also write the JSON lines to this file")
    args = ap.parse_args()

    churn = args.churn is not None
    requests = args.churn if churn else args.requests
    every = args.sample_every or max(1, requests // 20)
    if churn:  # every sample at the same point of the churn cycle
        every = max(args.churn_every, every // args.churn_every * args.churn_every)
    plan = SoakPlan(requests=requests, churn_every=args.churn_every if churn else 0,
                    restart_every=args.restart_every if churn else 0, sample_every=every,
                    warmup=args.warmup or every, tokens=args.tokens, verify_every=args.verify_every,
                    released_max_ids=args.released_max_ids)
    out = args.out.open("w") if args.out else None

    def emit(obj: dict) -> None:
        line = json.dumps(obj, sort_keys=True)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    try:
        result = run_soak(plan, emit)
        emit({"summary": summarize(result)})
    finally:
        if out is not None:
            out.close()
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
