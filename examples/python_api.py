#!/usr/bin/env python3
"""Offline (Python API) prefill/decode disaggregation with SparseKVConnector: one process per role.

Needs GPUs, the MiniMax-M3 weights and vLLM 0.33.0; it does not run on a CPU-only machine. Defaults: prefill
PP=2 x TP=4 (8 GPUs), decode TP=8 (8 more GPUs, usually another node, reachable over RDMA for NIXL and over TCP for
prefill's side-channel ports SIDE_PORT .. SIDE_PORT + PP*TP - 1). Run the two roles with the same prompt and
transfer id, prefill first:

    # node A (prefill); prints its kv_transfer_params, then keeps the KV for --linger-s seconds
    SPARSE_KV_AUTH_TOKEN=s python examples/python_api.py producer --transfer-id demo1 --side-channel-host 10.0.0.1
    # node B (decode), once prefill's model is loaded (its side channel must be up to take the registration)
    SPARSE_KV_AUTH_TOKEN=s python examples/python_api.py consumer --transfer-id demo1 --prefill-addr 10.0.0.1:5600

Decode may register before or after prefill computed the prompt: prefill pushes each layer as soon as it is both
computed and registered, and keeps a finished request's blocks for `lease_s` seconds for a decode that is late.

How kv_transfer_params reach the connector offline: there is no request field for them in `LLM.generate()`; vLLM
reads them from `SamplingParams.extra_args["kv_transfer_params"]` when it builds the engine request
(vllm/v1/request.py, `Request.__init__`), which is also where the OpenAI server puts the request body's
`kv_transfer_params` (vllm/entrypoints/openai/completion/protocol.py, `to_sampling_params`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time
import uuid

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

import connector

PROMPT = "Explain in three sentences why sparse attention needs an index cache besides the KV cache."


def connector_installed() -> bool:
    """True when the package's vllm.general_plugins entry point exists (`pip install -e .` from this tree)."""
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(ep.value.split(":")[0] == "connector" for ep in plugins)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", choices=["producer", "consumer"], help="producer = prefill, consumer = decode")
    ap.add_argument("--model", default="MiniMaxAI/MiniMax-M3")
    ap.add_argument("--transfer-id", default=uuid.uuid4().hex, help="must be the same on both sides")
    ap.add_argument("--transfer-secret", default=os.environ.get("SPARSE_KV_TRANSFER_SECRET", ""),
                    help="the transfer's capability, the same on both sides (e.g. python -c 'from "
                         "connector.protocol.auth import new_transfer_secret as s; print(s())'; default "
                         "$SPARSE_KV_TRANSFER_SECRET); without one the transfer is open to any holder of the auth "
                         "token that knows its id (README, Security)")
    ap.add_argument("--prompt", default=PROMPT, help="must be the same on both sides (same tokens)")
    ap.add_argument("--tp", type=int, help="tensor parallel size (default: 4 producer, 8 consumer)")
    ap.add_argument("--pp", type=int, help="pipeline parallel size (default: 2 producer, 1 consumer)")
    ap.add_argument("--side-channel-host", help="producer: address decode can reach (default: vLLM's host IP)")
    ap.add_argument("--side-channel-port", type=int, default=5600, help="producer: port of rank (pp0, tp0)")
    ap.add_argument("--lease-s", type=float, default=120.0, help="producer: how long kept KV waits for decode")
    ap.add_argument("--linger-s", type=float, default=120.0,
                    help="producer: stay up this long after prefill so decode can still take the KV")
    ap.add_argument("--prefill-addr", help="consumer: SIDE_HOST:SIDE_PORT of the producer")
    ap.add_argument("--max-tokens", type=int, default=128, help="consumer: tokens to generate")
    args = ap.parse_args()
    producer = args.role == "producer"
    if not producer and not args.prefill_addr:
        ap.error("consumer needs --prefill-addr SIDE_HOST:SIDE_PORT")

    # Registers "SparseKVConnector" with KVConnectorFactory in this process. The engine core and its workers are
    # other processes: they get the name from the vllm.general_plugins entry point of the installed package, or,
    # when running from a source tree without it, from kv_connector_module_path (importable there via PYTHONPATH).
    connector.register()
    # staging_mb (both sides): scattered blocks move as gathered chunks; see docs/internals.md, "Staged transfers".
    # The token is named, not written (auth_token_env): every worker reads it from its own environment.
    extra: dict[str, object] = {"staging_mb": int(os.environ.get("STAGING_MB", "256"))}
    if os.environ.get("SPARSE_KV_AUTH_TOKEN"):
        extra["auth_token_env"] = "SPARSE_KV_AUTH_TOKEN"
    if producer:
        extra.update(side_channel_port=args.side_channel_port, lease_s=args.lease_s)
        if args.side_channel_host:
            extra["side_channel_host"] = args.side_channel_host
        if os.environ.get("PREFILL_KEY_FILE"):  # `python -m connector keygen FILE`: decode trusts its public half
            extra["prefill_key_file"] = os.environ["PREFILL_KEY_FILE"]
    else:  # decode hands its memory only to a prefill that proves one of these keys (required: README, Security)
        extra["trusted_prefill_keys"] = [k for k in os.environ.get("TRUSTED_PREFILL_KEYS", "").split(",") if k]
    kv_config = KVTransferConfig(
        kv_connector="SparseKVConnector",
        kv_role="kv_producer" if producer else "kv_consumer",
        kv_connector_extra_config=extra,
        kv_connector_module_path=None if connector_installed() else "connector.vllm",
    )
    llm = LLM(model=args.model,
              tensor_parallel_size=args.tp or (4 if producer else 8),
              pipeline_parallel_size=args.pp or (2 if producer else 1),
              kv_transfer_config=kv_config)

    if producer:
        # One token: prefill only computes the prompt's KV (pushed to decode per layer while it computes).
        kv_params = {"do_remote_decode": True, "transfer_id": args.transfer_id}
        kv_params |= {"transfer_secret": args.transfer_secret} if args.transfer_secret else {}
        params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": kv_params})
    else:
        kv_params = {"do_remote_prefill": True, "transfer_id": args.transfer_id, "prefill_addr": args.prefill_addr}
        kv_params |= {"transfer_secret": args.transfer_secret} if args.transfer_secret else {}
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                extra_args={"kv_transfer_params": kv_params})

    start = time.monotonic()
    out = llm.generate([args.prompt], params)[0]
    print(json.dumps({"role": args.role, "transfer_id": args.transfer_id, "seconds": round(time.monotonic() - start, 3),
                      "text": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason,
                      "kv_transfer_params": out.kv_transfer_params}, indent=2))
    if producer and args.linger_s > 0:
        # The request is finished here, but its blocks stay held (delay-free) until decode completes or the lease
        # runs out; exiting now would kill the engine and with it a transfer still in flight.
        print(f"keeping the KV available for {args.linger_s:g} s (Ctrl-C to stop)", flush=True)
        time.sleep(args.linger_s)


if __name__ == "__main__":
    main()
