"""What both sparse test models share (vLLM code, imported only inside engine processes): an index cache as a
KV-cache layer of its own, the per-step metadata lookup, and a Llama whose decoder layers are handed the token ids.

Index rows come from per-layer tables indexed by token id (tests.sparse_model.m3 says why), so a sparse layer needs
the step's token ids; vLLM passes every PP stage the step's input_ids (v1/worker/gpu_model_runner.py
`_preprocess`), so a later stage has them too."""

from __future__ import annotations

from itertools import islice

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_pp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
from vllm.sequence import IntermediateTensors
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec, SparseCacheRole

from tests.sparse_model.attention import Batch
from tests.sparse_model.backend import TinySparseBackend


def register_layer(module: nn.Module, name: str) -> None:
    """Put `module` in vLLM's static_forward_context under `name`, as vLLM's own attention layers do: that is
    what makes the KV-cache manager allocate its cache (v1/worker/gpu_model_runner.py get_kv_cache_spec)."""
    context = get_current_vllm_config().compilation_config.static_forward_context
    if name in context:
        raise ValueError(f"Duplicate layer name: {name}")
    context[name] = module


class IndexCache(nn.Module, AttentionLayerBase):
    """One per-token index cache: a KV-cache layer of its own, one vector per token, the INDEXER cache role of
    vLLM's MiniMaxM3IndexerCache and DeepseekV32IndexerCache."""

    def __init__(self, prefix: str, head_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.prefix, self.head_size, self.dtype = prefix, head_size, dtype
        self.kv_cache = torch.tensor([])
        register_layer(self, prefix)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return MLAAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=1,
                                head_size=self.head_size, dtype=self.dtype, cache_role=SparseCacheRole.INDEXER)

    def get_attn_backend(self) -> type[TinySparseBackend]:
        return TinySparseBackend

    def forward(self) -> None: ...


def step_batch(layer_name: str) -> Batch | None:
    """This step's metadata for `layer_name` (built by TinySparseMetadataBuilder); None in vLLM's profiling and
    dummy runs, which have no cache to write or read."""
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):
        meta = meta[0]
    if isinstance(meta, dict):
        meta = meta.get(layer_name)
    return meta


class TokenIdsDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer whose attention may take the token ids (`attention_for` picks the attention class per
    layer; one whose `takes_token_ids` is true gets them)."""

    @classmethod
    def attention_for(cls, config, layer: int) -> type[nn.Module]:  # noqa: ANN001 - an HF config
        raise NotImplementedError

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None) -> None:  # noqa: ANN001
        from vllm.model_executor.models.utils import extract_layer_index

        config = config or vllm_config.model_config.hf_config
        super().__init__(vllm_config, prefix, config,
                         attn_layer_type=self.attention_for(config, extract_layer_index(prefix)))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if getattr(self.self_attn, "takes_token_ids", False):
            hidden_states = self.self_attn(positions, hidden_states, token_ids)
        else:
            hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class TokenIdsModel(LlamaModel):
    """LlamaModel (torch.compile-able the same way: the same forward arguments), its layers given the token ids."""

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual, input_ids)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states
