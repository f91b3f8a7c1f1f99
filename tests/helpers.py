"""Model layouts built directly (no config files) for pure tests."""

from __future__ import annotations

from connector.core.layout import ModelLayout, PoolSpec


def make_model(kinds: str, kv_heads: int = 4, mla: bool = False, head_dim: int = 128,
               index_dim: int = 128, name: str = "test") -> ModelLayout:
    """`kinds` has one letter per layer: d = dense, k = sparse K-only, v = sparse with an index value."""
    n = len(kinds)
    if mla:
        kv = PoolSpec("kv", tuple(range(n)), 1, 1152, 1, False)
    else:
        kv = PoolSpec("kv", tuple(range(n)), kv_heads, 2 * head_dim * 2, 2, True)
    index_k = PoolSpec("index_k", tuple(i for i, c in enumerate(kinds) if c in "kv"), 1, index_dim * 2, 1, False)
    index_v = PoolSpec("index_v", tuple(i for i, c in enumerate(kinds) if c == "v"), 1, index_dim * 2, 1, False)
    return ModelLayout(name=name, num_layers=n, pools={"kv": kv, "index_k": index_k, "index_v": index_v})


def m3_like() -> ModelLayout:
    return make_model("ddd" + "k" * 57, kv_heads=4, name="minimax-m3-like")
