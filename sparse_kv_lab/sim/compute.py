"""How long prefill computes, for the bench: active parameters from a Hugging Face config.json, and the time a
forward over a prompt takes at a stated device speed. Pure: reads a dict.

A prefill forward costs about 2 FLOPs per active parameter per token (one multiply-add per weight). Attention's own
score FLOPs grow with the context and are not counted: the sparse models this project moves attend to a fixed number
of selected blocks, so for them the weights dominate. Embeddings and the LM head are left out too (prefill runs the
head on the last token only). The result is an estimate for sizing a benchmark, not a model of any kernel.
"""

from __future__ import annotations

from typing import Any

from connector.core.errors import LayoutError


def _layer_flags(freq: Any, num_layers: int, first_dense: int) -> list[bool]:
    """Per layer: does it have a MoE MLP? `freq` is a per-layer list, or every `freq`-th layer from `first_dense`."""
    if isinstance(freq, list):
        return [bool(f) for f in freq[:num_layers]] + [False] * max(0, num_layers - len(freq))
    step = int(freq or 1)
    return [i >= first_dense and (i - first_dense) % step == 0 for i in range(num_layers)]


def active_params(config: dict) -> int:
    """Parameters one token passes through in one forward (all layers, no embeddings or LM head)."""
    c = config.get("text_config", config)
    try:
        hidden, layers, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"config.json lacks a usable {exc} for a compute estimate: pass --layer-ms instead") from None
    if "kv_lora_rank" in c:  # MLA (DeepSeek-V3.2 / GLM DSA)
        nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        q_rank, kv_rank = c.get("q_lora_rank") or 0, c["kv_lora_rank"]
        q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        attn = q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * hidden
        if "index_n_heads" in c:  # the DSA indexer: its queries, keys and head weights
            attn += (q_rank or hidden) * c["index_n_heads"] * c["index_head_dim"] + hidden * c["index_head_dim"] \
                + hidden * c["index_n_heads"]
    else:
        head_dim = int(c.get("head_dim") or hidden // heads)
        kv_heads = int(c.get("num_key_value_heads") or heads)
        attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    dense_mlp = 3 * hidden * int(c.get("dense_intermediate_size") or c.get("intermediate_size") or 4 * hidden)
    experts = c.get("num_experts_per_tok") or 0
    expert_size = c.get("moe_intermediate_size") or c.get("intermediate_size") or 0
    shared = (c.get("n_shared_experts") or 0) * (c.get("shared_intermediate_size") or expert_size)
    moe_mlp = 3 * hidden * (experts * expert_size + shared) + hidden * (c.get("n_routed_experts")
                                                                         or c.get("num_local_experts") or 0)
    moe = _layer_flags(c.get("moe_layer_freq", 1), layers, int(c.get("first_k_dense_replace") or 0)) if experts \
        else [False] * layers
    return sum(attn + (moe_mlp if m else dense_mlp) for m in moe)


def prefill_ms(params: int, tokens: int, tflops: float) -> float:
    """Milliseconds a forward over `tokens` takes at `tflops` (sustained, not peak) for `params` active
    parameters."""
    if tflops <= 0:
        raise ValueError(f"compute speed {tflops} TFLOPS must be positive")
    return 2.0 * params * tokens / (tflops * 1e12) * 1e3
