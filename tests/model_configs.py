"""Tiny Hugging Face config.json files for the vLLM tests: MiniMax-M3, DeepSeek-V3.2 and a dense Llama. Plain
files, no vLLM import (the vLLM side reads them: tests/vllm_harness.py)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable

from connector.core.hf_config import PRESETS

M3_ARCH_VL = "MiniMaxM3SparseForConditionalGeneration"
M3_ARCH_LM = "MiniMaxM3SparseForCausalLM"


def write_m3_config(path, num_layers: int = 8, dense_layers: int = 2, index_value_layers: Iterable[int] = (),
                    kv_heads: int = 4, head_dim: int = 64, index_dim: int = 64, *,
                    num_heads: int = 8, mtp_layers: int = 0) -> pathlib.Path:
    """A tiny MiniMax-M3 config.json shaped like connector/core/presets/minimax-m3.json (VL top level + text_config;
    a bare text config does not load: vLLM maps only minimax_m3_vl/_mtp, transformers_utils/config.py:155).
    Layers < dense_layers are dense, the rest sparse. index_value_layers clears sparse_disable_index_value there
    (vLLM 0.33 never reads it and builds no index-value cache; `layer_specs` adds one, see there). mtp_layers:
    the harness builds that many draft (MTP) layers (vllm_harness.draft_layer_specs). Returns the folder."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    freq = [0] * dense_layers + [1] * (num_layers - dense_layers)
    values = set(index_value_layers)
    text = {
        "model_type": "minimax_m3_text", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 128,
        "dense_intermediate_size": 256, "shared_intermediate_size": 128, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": 8192, "rope_theta": 5000000, "rotary_dim": head_dim // 2,
        "partial_rotary_factor": 0.5, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_layer_freq": freq,
        "torch_dtype": "bfloat16", "harness_mtp_layers": mtp_layers,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": index_dim, "sparse_num_index_heads": kv_heads,
            "sparse_topk_blocks": 16, "sparse_block_size": 128, "sparse_score_type": "max", "sparse_init_block": 0,
            "sparse_local_block": 1, "sparse_attention_freq": freq,
            "sparse_disable_index_value": [0 if (not f or i in values) else 1 for i, f in enumerate(freq)]}}
    if mtp_layers:
        text["num_mtp_modules"] = mtp_layers
    config = {"architectures": [M3_ARCH_VL], "model_type": "minimax_m3_vl", "torch_dtype": "bfloat16",
              "text_config": text}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_dense_config(path, num_layers: int = 4, kv_heads: int = 4, head_dim: int = 64,
                       num_heads: int = 8) -> pathlib.Path:
    """A tiny LlamaForCausalLM config.json (fallback only: M3 builds a ModelConfig on CPU)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024,
              "hidden_size": num_heads * head_dim, "intermediate_size": 256, "num_hidden_layers": num_layers,
              "num_attention_heads": num_heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_dsv32_config(path, num_layers: int = 6, first_dense: int = 1, kv_lora_rank: int = 128,
                       rope_dim: int = 64, index_head_dim: int = 128, mtp_layers: int = 0) -> pathlib.Path:
    """A tiny DeepSeek-V3.2 config.json (connector/core/presets/deepseek-v3.2.json, shrunk): MLA latent of
    kv_lora_rank + rope_dim bf16 per token, and an indexer on every layer (no index_topk_freq). Returns the folder."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads(PRESETS["deepseek-v3.2"].read_text())
    config.pop("quantization_config", None)
    config.update(num_hidden_layers=num_layers, first_k_dense_replace=first_dense, hidden_size=256,
                  intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                  n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                  kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, qk_nope_head_dim=32, v_head_dim=32,
                  index_head_dim=index_head_dim, index_n_heads=4, index_topk=64, vocab_size=1024,
                  harness_mtp_layers=mtp_layers)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
