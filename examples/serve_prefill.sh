#!/usr/bin/env bash
# Prefill instance of a disaggregated MiniMax-M3 deployment with SparseKVConnector (kv_producer, PP=2).
#
#   SPARSE_KV_AUTH_TOKEN=secret PREFILL_KEY_FILE=/etc/sparse-kv/prefill.key \
#     examples/serve_prefill.sh [MODEL] [extra vllm serve args...]
#
# PREFILL_KEY_FILE: `python -m connector keygen FILE` writes it and prints the public key decodes trust
# (serve_decode.sh's TRUSTED_PREFILL_KEYS).
#
# Needs: the MiniMax-M3 weights (MODEL: a Hugging Face id or a local folder, default MiniMaxAI/MiniMax-M3; bf16, several
# hundred GB) and PP x TP GPUs on this node (default 2 x 4 = 8, e.g. 8x H200) with room for the weights and the KV
# cache; an RDMA-capable network (NIXL/UCX) to the decode nodes, and TCP from decode to the side-channel ports.
# Needs the package in the same environment as vLLM 0.33.0: `pip install -e .` from this tree registers the name
# "SparseKVConnector" through the vllm.general_plugins entry point. Without the entry point (e.g. the source tree
# on PYTHONPATH), set KV_CONNECTOR_MODULE_PATH=connector.vllm to add "kv_connector_module_path" to the config.
#
# The connector's side channel listens on SIDE_CHANNEL_HOST:SIDE_CHANNEL_PORT for rank (pp0, tp0), and rank (pp, tp)
# on SIDE_CHANNEL_PORT + pp * TP + tp: open that whole port range (5600-5607 by default) to the decode nodes.
# Give the proxy: --prefill http://THIS_HOST:PORT,SIDE_CHANNEL_HOST:SIDE_CHANNEL_PORT
# The auth token must be the same on prefill and decode; unset disables authentication. The config names the
# variable (auth_token_env), so the token itself is neither on the vllm command line (ps) nor in vLLM's log.
set -euo pipefail

MODEL="${1:-MiniMaxAI/MiniMax-M3}"
shift $(( $# > 0 ? 1 : 0 ))
HOST="${HOST:-0.0.0.0}"                      # OpenAI server bind address
PORT="${PORT:-8100}"
TP="${TP:-4}"
PP="${PP:-2}"
# An address decode can reach; 0.0.0.0 is not (decode is told this address by the proxy, not this one).
SIDE_CHANNEL_HOST="${SIDE_CHANNEL_HOST:-${VLLM_HOST_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}}"
SIDE_CHANNEL_PORT="${SIDE_CHANNEL_PORT:-5600}"
LEASE_S="${LEASE_S:-120}"                    # how long finished prefill blocks wait for a slow/late decode
# Staging buffer per GPU worker (MiB), on both sides: scattered blocks move as gathered chunks (docs/internals.md,
# "Staged transfers"). It is allocated after vLLM sized its KV cache: lower --gpu-memory-utilization a little for it.
# 0 turns it off.
STAGING_MB="${STAGING_MB:-256}"
PYTHON="${PYTHON:-python3}"

if [[ -z "$SIDE_CHANNEL_HOST" ]]; then
    echo "serve_prefill.sh: set SIDE_CHANNEL_HOST to an address the decode nodes can reach" >&2
    exit 2
fi
[[ -n "${SPARSE_KV_AUTH_TOKEN:-}" ]] || echo "serve_prefill.sh: SPARSE_KV_AUTH_TOKEN unset: no side-channel auth" >&2

# JSON via Python so a token with quotes or backslashes cannot break (or inject into) the config.
KV_TRANSFER_CONFIG="$(SIDE_CHANNEL_HOST="$SIDE_CHANNEL_HOST" SIDE_CHANNEL_PORT="$SIDE_CHANNEL_PORT" LEASE_S="$LEASE_S" \
STAGING_MB="$STAGING_MB" \
"$PYTHON" - <<'PY'
import json, os
config = {
    "kv_connector": "SparseKVConnector",
    "kv_role": "kv_producer",
    "kv_connector_extra_config": {
        "side_channel_host": os.environ["SIDE_CHANNEL_HOST"],
        "side_channel_port": int(os.environ["SIDE_CHANNEL_PORT"]),
        "lease_s": float(os.environ["LEASE_S"]),
        "staging_mb": int(os.environ["STAGING_MB"]),
    },
}
if os.environ.get("SPARSE_KV_AUTH_TOKEN"):  # each worker reads it from its environment
    config["kv_connector_extra_config"]["auth_token_env"] = "SPARSE_KV_AUTH_TOKEN"
if os.environ.get("PREFILL_KEY_FILE"):  # `python -m connector keygen FILE`: decodes trust its public half
    config["kv_connector_extra_config"]["prefill_key_file"] = os.environ["PREFILL_KEY_FILE"]
if os.environ.get("KV_CONNECTOR_MODULE_PATH"):
    config["kv_connector_module_path"] = os.environ["KV_CONNECTOR_MODULE_PATH"]
print(json.dumps(config))
PY
)"

THIS_HOST="$(hostname -f 2>/dev/null || hostname)"
echo "serve_prefill.sh: for the proxy: --prefill http://$THIS_HOST:$PORT,$SIDE_CHANNEL_HOST:$SIDE_CHANNEL_PORT" >&2
exec vllm serve "$MODEL" \
    --host "$HOST" --port "$PORT" \
    --tensor-parallel-size "$TP" \
    --pipeline-parallel-size "$PP" \
    --kv-transfer-config "$KV_TRANSFER_CONFIG" \
    "$@"
