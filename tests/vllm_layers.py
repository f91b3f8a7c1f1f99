"""vLLM 0.33's own attention-layer classes on CPU, made without their CUDA __init__: the modules a CUDA worker
registers in `static_forward_context`, enough for the connector's per-layer signal installer (discovery, binding)
and for running the REAL eager-break method bodies, with CPU stand-ins only for what they call into CUDA kernels.

  MiniMax-M3 sparse layer  minimax_m3/nvidia/model.py MiniMaxM3SparseAttention; `_run_attention` calls
                           `self.indexer(index_query)` and `self.impl.forward(self, query, self.kv_cache, output, ...)`.
                           Its index cache: `indexer.index_cache` (a property: `indexer.impl.index_cache`), a
                           MiniMaxM3IndexerCache registered under `<layer>.index_cache`.
  DeepSeek-V3.2 layer      deepseek_v32/attention.py DeepseekV32Attention; `_sparse_indexer_and_attn` runs the indexer
                           kernel (CUDA only: skipped here with skip_topk=True), then
                           `self.impl.record_logical_topk_ready()`, then reads the layer's attention context (no
                           metadata outside a real step: it zeroes `output` and returns). Its index cache:
                           `indexer.k_cache`, a DeepseekV32IndexerCache.
  M3 dense layer           the generic `Attention` (attention.py): no eager-break method; vLLM runs save_kv_layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests import vllm_harness as H


def bare(cls: type, **attrs: Any) -> Any:
    """An instance of `cls` with only nn.Module's own init run, then `attrs` set."""
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    for key, value in attrs.items():
        setattr(obj, key, value)
    return obj


class M3IndexerImpl(nn.Module):
    """Stand-in for the M3 indexer kernel impl (top-k into a shared buffer): counts its calls."""

    def __init__(self, index_cache: nn.Module) -> None:
        super().__init__()
        self.index_cache = index_cache
        self.calls = 0

    def forward(self, index_query: torch.Tensor) -> tuple[None, None]:
        self.calls += 1
        return None, None


class M3AttendImpl:
    """Stand-in for MiniMaxM3SparseImpl.forward (the split-K sparse attention kernel): counts, returns `output`."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, *,
                query_fp8: torch.Tensor | None = None) -> torch.Tensor:
        assert kv_cache is layer.kv_cache
        self.calls += 1
        return output


class DsImpl:
    """Stand-in for the sparse MLA impl: what `_sparse_indexer_and_attn` calls before it finds no metadata."""

    def __init__(self) -> None:
        self.calls = 0

    def record_logical_topk_ready(self) -> None:
        self.calls += 1


def m3_sparse_layer(name: str, kv_cache: Any = None, index_cache: Any = None) -> tuple[nn.Module, nn.Module]:
    """(MiniMaxM3SparseAttention, its MiniMaxM3IndexerCache) for layer `name`."""
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3Indexer, MiniMaxM3IndexerCache
    from vllm.models.minimax_m3.nvidia.model import MiniMaxM3SparseAttention

    cache = bare(MiniMaxM3IndexerCache, prefix=f"{name}.index_cache", kv_cache=index_cache)
    indexer = bare(MiniMaxM3Indexer, impl=M3IndexerImpl(cache))
    layer = bare(MiniMaxM3SparseAttention, layer_name=name, indexer=indexer, impl=M3AttendImpl(),
                 kv_cache=kv_cache)
    return layer, cache


def dsv32_layer(name: str, kv_cache: Any = None, index_cache: Any = None) -> tuple[nn.Module, nn.Module]:
    """(DeepseekV32Attention, its DeepseekV32IndexerCache) for layer `name` (`...self_attn.attn`)."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention, DeepseekV32Indexer

    prefix = name.rsplit(".attn", 1)[0] + ".indexer"
    cache = bare(DeepseekV32IndexerCache, prefix=f"{prefix}.k_cache", kv_cache=index_cache)
    indexer = bare(DeepseekV32Indexer, k_cache=cache)
    # skip_topk: the indexer kernel the real method runs first is CUDA only (the real model has skip_topk False).
    layer = bare(DeepseekV32Attention, layer_name=name, indexer=indexer, impl=DsImpl(), kv_cache=kv_cache,
                 skip_topk=True)
    return layer, cache


def generic_layer(name: str, kv_cache: Any = None) -> nn.Module:
    from vllm.model_executor.layers.attention.attention import Attention

    return bare(Attention, layer_name=name, kv_cache=kv_cache)


def layer_modules(vllm_config: Any, caches: dict[str, Any] | None = None, *,
                  pp_rank: int | None = None) -> dict[str, nn.Module]:
    """{KV-cache layer name: module} as a CUDA worker's static_forward_context holds them for this PP stage (one
    module per cache: main layers and index caches). The index-V variant's `...index_value_cache` gets an
    M3 indexer cache of its own (vLLM 0.33 builds none, see vllm_harness.layer_specs)."""
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerCache

    caches = caches or {}
    specs = H.layer_specs(vllm_config, pp_rank=pp_rank)
    sparse = H.sparse_main_names(vllm_config)
    out: dict[str, nn.Module] = {}
    for name in specs:
        if name.endswith((".index_cache", ".indexer.k_cache")):
            continue  # made with its main layer
        if name.endswith(".index_value_cache"):
            out[name] = bare(MiniMaxM3IndexerCache, prefix=name, kv_cache=caches.get(name))
        elif H.is_dsa(vllm_config):
            layer, cache = dsv32_layer(name, caches.get(name), None)
            cache.kv_cache = caches.get(cache.prefix)
            out[name], out[cache.prefix] = layer, cache
        elif name in sparse:
            layer, cache = m3_sparse_layer(name, caches.get(name), caches.get(f"{name}.index_cache"))
            out[name], out[cache.prefix] = layer, cache
        else:
            out[name] = generic_layer(name, caches.get(name))
    for name in H.draft_layer_names(vllm_config, pp_rank=pp_rank):
        out[name].is_draft_layer = True  # as vLLM's proposer marks the layers its draft model added
    return out


def attend(layer: nn.Module, num_tokens: int = 4) -> bool:
    """Run `layer`'s eager-break method as its forward does after the KV insert (with small dummy activations);
    False for a generic layer (its attention goes through vLLM's op, which runs save_kv_layer)."""
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention
    from vllm.models.minimax_m3.nvidia.model import MiniMaxM3SparseAttention

    x = torch.zeros(num_tokens, 8)
    if isinstance(layer, MiniMaxM3SparseAttention):
        layer._run_attention(x, None, x.clone(), torch.empty_like(x))
        return True
    if isinstance(layer, DeepseekV32Attention):
        positions = torch.arange(num_tokens)
        layer._sparse_indexer_and_attn(positions, x, x, x, None, None, None, None, None, x, x, torch.ones_like(x))
        return True
    return False
