#!/usr/bin/env bash
# Device check for a CUDA machine (the H200 device tool): GPU-marked tests, then the demo and the bench with
# --device cuda. Expects the NIXL/msgspec/asyncio-throttle/pytest-asyncio wheels in .whl (fetch-nixl-wheels.sh)
# and writes logs and JSON to $OUT (default ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_transport.py tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log"
timeout 60 python3 -m connector demo --model minimax-m3 --prefill tp=1,pp=2 --decode tp=1,pp=1 --device cuda \
    --tokens 4096 --json 2>&1 | tee "$OUT/demo.json"
# Staging is on by default on VRAM: the default run is the staged path, --staging-mb 0 the direct one.
timeout 80 python3 -m connector bench --model minimax-m3 --tokens 4096 --device cuda --repeats 3 --json 2>&1 | tee "$OUT/bench.json"
timeout 80 python3 -m connector bench --model minimax-m3 --tokens 4096 --device cuda --repeats 3 --run-blocks 16 --json 2>&1 \
    | tee "$OUT/bench-runs16.json"
timeout 80 python3 -m connector bench --model minimax-m3 --tokens 4096 --device cuda --repeats 3 --staging-mb 0 --json 2>&1 \
    | tee "$OUT/bench-direct.json"
timeout 60 python3 -m connector demo --model minimax-m3 --prefill tp=1,pp=2 --decode tp=1,pp=1 --device cuda \
    --tokens 4096 --staging-mb 0 --json 2>&1 | tee "$OUT/demo-direct.json"
# The issue-10 targets side by side: connector_gbps >= 0.5 x raw_coalesced_gbps, stream exposed <= 1 ms at
# --compute-tflops (default 400), NIXL descriptors per transfer <= layers x destinations, no regression in runs.
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import json, pathlib, sys
keys = ["raw_gbps", "raw_coalesced_gbps", "raw_threaded_gbps", "connector_gbps", "connector_vs_raw",
        "connector_vs_coalesced", "connector_vs_threaded", "bulk_exposed_ms", "bulk_exposed_ms_p99", "stream_exposed_ms", "stream_exposed_ms_p99", "streamed_pct",
        "hook_us", "layer_ms", "staging_mb", "staged_chunks", "nixl_descriptors_bulk", "nixl_descriptors_stream",
        "verified"]
for name in ("bench", "bench-runs16", "bench-direct"):
    try:
        r = json.loads(pathlib.Path(sys.argv[1], name + ".json").read_text().strip().splitlines()[-1])
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, the others still are
        print(f"{name}: no result ({exc})")
        continue
    print(name + ": " + ", ".join(f"{k}={r.get(k)}" for k in keys))
PY
