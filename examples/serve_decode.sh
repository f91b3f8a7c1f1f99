#!/usr/bin/env bash
# Decode instance of a disaggregated MiniMax-M3 deployment with SparseKVConnector (kv_consumer, PP=1).
#
#   SPARSE_KV_AUTH_TOKEN=secret TRUSTED_PREFILL_KEYS=<public key> ALLOWED_PREFILL_HOSTS=10.0.0.5 \
#     examples/serve_decode.sh [MODEL] [extra vllm serve args...]
#
# Needs: the MiniMax-M3 weights (MODEL: a Hugging Face id or a local folder, default MiniMaxAI/MiniMax-M3; bf16, several
# hundred GB) and TP GPUs on this node (default 8, e.g. 8x H200) with room for the weights and the KV cache; an
# RDMA-capable network (NIXL/UCX) to the prefill nodes, and TCP to their side-channel ports.
# Needs the package in the same environment as vLLM 0.33.0: `pip install -e .` from this tree registers the name
# "SparseKVConnector" through the vllm.general_plugins entry point. Without the entry point (e.g. the source tree
# on PYTHONPATH), set KV_CONNECTOR_MODULE_PATH=connector.vllm to add "kv_connector_module_path" to the config.
#
# Decode does not listen on a side channel: per request it connects to the prefill address that the proxy puts in
# kv_transfer_params.prefill_addr and registers its blocks there; prefill then pushes the KV into them.
# Give the proxy: --decode http://THIS_HOST:PORT
# SPARSE_KV_AUTH_TOKEN must equal the prefill instances' token. The config names the variable (auth_token_env), so the
# token itself is neither on the vllm command line (ps) nor in vLLM's log.
set -euo pipefail

MODEL="${1:-MiniMaxAI/MiniMax-M3}"
shift $(( $# > 0 ? 1 : 0 ))
HOST="${HOST:-0.0.0.0}"                      # OpenAI server bind address
PORT="${PORT:-8200}"
TP="${TP:-8}"
PP="${PP:-1}"
PYTHON="${PYTHON:-python3}"

[[ -n "${SPARSE_KV_AUTH_TOKEN:-}" ]] || echo "serve_decode.sh: SPARSE_KV_AUTH_TOKEN unset: no side-channel auth" >&2
# The prefills' public keys (`python -m connector keygen FILE` on a prefill node prints one), comma-separated: decode
# hands its memory only to a prefill that proves one. Without them the connector refuses to start.
if [[ -z "${TRUSTED_PREFILL_KEYS:-}" && -z "${INSECURE_ANY_PREFILL:-}" ]]; then
    echo "serve_decode.sh: set TRUSTED_PREFILL_KEYS to the prefills' public keys (python -m connector keygen" \
         "prefill.key prints one; give the prefills PREFILL_KEY_FILE=prefill.key), or INSECURE_ANY_PREFILL=1 on a" \
         "trusted test bench only" >&2
    exit 2
fi

# JSON via Python so a token with quotes or backslashes cannot break (or inject into) the config.
# side_channel_host/port and lease_s are prefill-side settings; decode only needs the shared token.
# Staging (MiB per GPU worker; 0 = off): with prefill PP x TP = 8 ranks, 256 MiB is eight 32-MiB slots.
KV_TRANSFER_CONFIG="$(STAGING_MB="${STAGING_MB:-256}" "$PYTHON" - <<'PY'
import json, os
staging_mb = int(os.environ["STAGING_MB"])
config = {
    "kv_connector": "SparseKVConnector",
    "kv_role": "kv_consumer",
    "kv_connector_extra_config": {"staging_mb": staging_mb, "staging_slot_mb": max(1, staging_mb // 8)},
}
if os.environ.get("SPARSE_KV_AUTH_TOKEN"):  # each worker reads it from its environment
    config["kv_connector_extra_config"]["auth_token_env"] = "SPARSE_KV_AUTH_TOKEN"
keys = [k.strip() for k in os.environ.get("TRUSTED_PREFILL_KEYS", "").split(",") if k.strip()]
if keys:
    config["kv_connector_extra_config"]["trusted_prefill_keys"] = keys
elif os.environ.get("INSECURE_ANY_PREFILL"):
    config["kv_connector_extra_config"]["insecure_any_prefill"] = True
hosts = [h.strip() for h in os.environ.get("ALLOWED_PREFILL_HOSTS", "").split(",") if h.strip()]
if hosts:  # where requests may send this decode (prefill hosts or networks)
    config["kv_connector_extra_config"]["allowed_prefill_hosts"] = hosts
if os.environ.get("KV_CONNECTOR_MODULE_PATH"):
    config["kv_connector_module_path"] = os.environ["KV_CONNECTOR_MODULE_PATH"]
print(json.dumps(config))
PY
)"

exec vllm serve "$MODEL" \
    --host "$HOST" --port "$PORT" \
    --tensor-parallel-size "$TP" \
    --pipeline-parallel-size "$PP" \
    --kv-transfer-config "$KV_TRANSFER_CONFIG" \
    "$@"
