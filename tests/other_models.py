"""Tiny seeded checkpoints of dense architectures that connector.core.hf_config does not list, for the real-engine
test of the layout built from vLLM's own KV-cache specs: the connector must move whatever vLLM built for them
without knowing the architecture.

Each checkpoint is the architecture's own Hugging Face class (transformers, in the test venv) built from a tiny
config, with every matrix redrawn from a seeded normal as sparse_kv_lab.pd.model.TinyLlama draws them (attention
projections several times the usual scale, so each generated token depends on the whole prompt and a decode that
got the wrong KV generates other tokens). Norms and biases keep the class's own initial values."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sparse_kv_lab.pd.model import CONFIG_NAME, WEIGHTS_NAME

SHARP = ("q_proj", "k_proj", "qkv_proj", "query_key_value")
"""Weights whose scale sharpens attention (q and k, alone or fused)."""


@dataclass(frozen=True)
class TinyArch:
    """A tiny config of one architecture (`fields` on top of the sizes every test model shares)."""

    architecture: str
    model_type: str
    fields: dict = field(default_factory=dict)
    seed: int = 4321
    num_hidden_layers: int = 3
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 32000

    def config(self) -> dict:
        return {"architectures": [self.architecture], "model_type": self.model_type,
                "num_hidden_layers": self.num_hidden_layers, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "vocab_size": self.vocab_size,
                "max_position_embeddings": 4096, "torch_dtype": "float32", "tie_word_embeddings": False,
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **self.fields}

    def write(self, folder: str | Path) -> Path:
        """Write config.json and model.safetensors into `folder` unless the same config is already there."""
        import torch
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(folder)
        config = self.config() | {"sparse_kv_seed": self.seed}
        cfg_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
        if cfg_file.exists() and weights_file.exists() and json.loads(cfg_file.read_text()) == config:
            return path
        path.mkdir(parents=True, exist_ok=True)
        hf_config = AutoConfig.for_model(self.model_type, **{k: v for k, v in self.config().items()
                                                             if k not in ("architectures", "model_type")})
        torch.manual_seed(self.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        gen = torch.Generator().manual_seed(self.seed)
        weights = {}
        for name, tensor in model.state_dict().items():
            if tensor.dim() == 2 and "embed" in name and "embed_out" not in name:
                tensor = torch.randn(tensor.shape, generator=gen)
            elif tensor.dim() == 2:
                scale = 4.0 if any(s in name for s in SHARP) else 1.0
                tensor = torch.randn(tensor.shape, generator=gen) * scale * tensor.shape[1] ** -0.5
            weights[name] = tensor.contiguous().clone()
        save_file(weights, str(weights_file), metadata={"format": "pt"})
        cfg_file.write_text(json.dumps(config, indent=2) + "\n")
        return path


PHI3 = TinyArch("Phi3ForCausalLM", "phi3", {"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                                            "original_max_position_embeddings": 4096})
"""Fused qkv_proj and gate_up_proj (vLLM's Phi3 is its Llama with other weight names)."""
GPT_NEOX = TinyArch("GPTNeoXForCausalLM", "gpt_neox",
                    {"rotary_pct": 0.25, "use_parallel_residual": True, "layer_norm_eps": 1e-5,
                     "hidden_act": "gelu", "num_key_value_heads": 4})
"""Another module tree (`gpt_neox.layers.N.attention.attn`), partial rotary, no GQA."""
SLIDING = TinyArch("Ministral3ForCausalLM", "mistral",
                  {"sliding_window": 48, "layer_types": ["sliding_attention", "full_attention"] * 2,
                   "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu"},
                  num_hidden_layers=4)
"""Sliding-window attention (a 48-token window: shorter than the test prompts) on every other layer, by
`layer_types`, which vLLM's Llama family honours (vLLM maps Ministral3ForCausalLM to its Mistral, a Llama): two
KV-cache groups, full and sliding window. (Gemma 2, tried first, moved the same way, but its tiny seeded
checkpoint gave the same tokens for any prompt, so no control run could tell a wrong KV from a right one.)"""
