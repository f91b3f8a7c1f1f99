"""Model layouts in words, for logs and for the refusal of a pair whose caches do not match: what a pool holds, and
the first thing two layouts disagree on (the layers, the heads, the bytes per token). Pure."""

from __future__ import annotations

from connector.core.layout import POOLS, ModelLayout, PoolSpec
from connector.core.plan import fold_ranges


def describe_pool(pool: PoolSpec) -> str:
    if not pool.layers:
        return f"no {pool.name}"
    sharding = "sharded over TP" if pool.sharded else "on every TP rank"
    return (f"{pool.name} on layers {fold_ranges(pool.layers)} ({pool.num_heads} head(s) x "
            f"{pool.bytes_per_token_per_head} B per token, {sharding})")


def describe_model(model: ModelLayout) -> str:
    """`kv on layers 0-59 (4 head(s) x 512 B per token, sharded over TP), index_k on layers 3-59 (...), no
    index_v`."""
    return ", ".join(describe_pool(model.pools[p]) for p in POOLS)


def layout_difference(mine: ModelLayout, theirs: ModelLayout, me: str = "this side", them: str = "the peer") -> str:
    """The first difference between two layouts in words ('' when they hold the same caches)."""
    if mine.num_layers != theirs.num_layers:
        return (f"{me} has {mine.num_layers} layers, {them} {theirs.num_layers} (a different model, or draft "
                f"layers of speculative decoding on one side only?)")
    for name in POOLS:
        a, b = mine.pools[name], theirs.pools[name]
        if a.layers != b.layers:
            only_a, only_b = sorted(set(a.layers) - set(b.layers)), sorted(set(b.layers) - set(a.layers))
            parts = [f"{me} has {name} on layers {fold_ranges(only_a)} that {them} lacks"] if only_a else []
            parts += [f"{them} has {name} on layers {fold_ranges(only_b)} that {me} lacks"] if only_b else []
            return "; ".join(parts)
        if a.layers and (a.num_heads, a.bytes_per_token_per_head, a.num_parts, a.sharded) != \
                (b.num_heads, b.bytes_per_token_per_head, b.num_parts, b.sharded):
            return f"{me} keeps {describe_pool(a)}, {them} {describe_pool(b)}"
    return ""
