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
timeout 80 python3 -m connector bench --model minimax-m3 --tokens 4096 --device cuda --repeats 3 --json 2>&1 | tee "$OUT/bench.json"
timeout 80 python3 -m connector bench --model minimax-m3 --tokens 4096 --device cuda --repeats 3 --run-blocks 16 --json 2>&1 \
    | tee "$OUT/bench-runs16.json"
timeout 80 python3 -m connector bench --model minimax-m3 --tokens 4096 --device cuda --repeats 3 --staging-mb 256 --json 2>&1 \
    | tee "$OUT/bench-staged.json"
timeout 60 python3 -m connector demo --model minimax-m3 --prefill tp=1,pp=2 --decode tp=1,pp=1 --device cuda \
    --tokens 4096 --staging-mb 256 --json 2>&1 | tee "$OUT/demo-staged.json"
