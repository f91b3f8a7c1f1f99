"""The pool of real engines serving dense architectures that connector.core.hf_config does not list
(tests.other_models): for each, a prefill and a decode whose connector knows the model's caches only from vLLM's
KV-cache specs.

  phi3       prefill TP2 (one KV head per rank) -> decode TP1; fused qkv_proj
  gpt_neox   prefill TP1 -> decode TP1; another module tree (gpt_neox.layers.N.attention), partial rotary
  sliding    prefill TP1 -> decode TP1; sliding-window attention (a 48-token window) on every other layer, so two
             KV-cache groups (full and sliding window) with their own block ids

Prefill engines are pinned to core 0, decode engines to core 1 (tests.real_engine.sparse_engines says why)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from sparse_kv_lab.pd.client import complete, completion_body
from sparse_kv_lab.pd.servers import ServerSpec, VllmServer, sparse_kv_config, start_all
from connector.transport.ports import free_ports
from tests.other_models import GPT_NEOX, PHI3, SLIDING, TinyArch
from tests.real_engine.conftest import MACHINE_STALL_S, STARVED_SIDE_CHANNEL, Prefill
from tests.real_engine.sparse_engines import DECODE_CPUS, PREFILL_CPUS

CHUNK_TOKENS = 256
KV_CACHE_BYTES = 64 << 20
ARCHS = {"phi3": (PHI3, 2), "gpt_neox": (GPT_NEOX, 1), "sliding": (SLIDING, 1)}
"""name -> (tiny checkpoint, prefill TP)."""
DP_SIZE = 2
"""Data-parallel ranks of the DP prefill."""


@dataclass
class Pair:
    arch: TinyArch
    prefill: Prefill
    decode: VllmServer

    def reference(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        """Greedy tokens of the decode engine computing everything itself (a fresh cache salt)."""
        return complete(self.decode.url, completion_body(prompt, max_tokens, cache_salt=uuid.uuid4().hex)).token_ids


class ArchEngines:
    def __init__(self, root: Path, python: Path) -> None:
        self.log_dir = root / "logs"
        self.pairs: dict[str, Pair] = {}
        for name, (arch, tp) in ARCHS.items():
            model = arch.write(root / name)
            side = free_ports(tp)
            prefill = VllmServer(ServerSpec(
                f"{name}-prefill", model, free_ports(), tp=tp, max_num_batched_tokens=CHUNK_TOKENS,
                kv_cache_bytes=KV_CACHE_BYTES, cpus=PREFILL_CPUS,
                kv_transfer_config=sparse_kv_config("kv_producer", side_channel_port=side, load_by="module_path",
                                                    **STARVED_SIDE_CHANNEL)), str(python), self.log_dir)
            decode = VllmServer(ServerSpec(
                f"{name}-decode", model, free_ports(), kv_cache_bytes=KV_CACHE_BYTES, cpus=DECODE_CPUS,
                kv_transfer_config=sparse_kv_config("kv_consumer", load_by="module_path", **STARVED_SIDE_CHANNEL)),
                str(python), self.log_dir)
            self.pairs[name] = Pair(arch, Prefill(prefill, side), decode)
        # Data parallel: a prefill of the GPT-NeoX model with two DP ranks (two engine cores behind one API server,
        # vLLM's own load balancer between them), decoded by the GPT-NeoX pair's decode: each rank is an engine of
        # its own with a side channel at side_channel_port + dp_index
        neox = self.pairs["gpt_neox"]
        side = free_ports(DP_SIZE)
        self.dp_prefill = Prefill(VllmServer(ServerSpec(
            "gpt_neox-prefill-dp2", neox.prefill.server.spec.model, free_ports(), max_num_batched_tokens=CHUNK_TOKENS,
            kv_cache_bytes=KV_CACHE_BYTES, cpus=PREFILL_CPUS,
            kv_transfer_config=sparse_kv_config("kv_producer", side_channel_port=side, load_by="module_path",
                                                **STARVED_SIDE_CHANNEL),
            extra_args=("--data-parallel-size", str(DP_SIZE), "--data-parallel-rpc-port", str(free_ports()))),
            str(python), self.log_dir), side)
        self.servers = [s for p in self.pairs.values() for s in (p.prefill.server, p.decode)] + [
            self.dp_prefill.server]

    def start(self) -> None:
        start_all(self.servers, timeout_s=600 + MACHINE_STALL_S)

    def stop(self) -> None:
        for server in self.servers:
            server.stop(20)
