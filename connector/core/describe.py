"""Model layouts in words, for logs and for the refusal of a pair whose caches do not match: what a pool holds, and
the first thing two layouts disagree on (the layers, the heads, the bytes per token). Pure."""

from __future__ import annotations

from connector.core.layout import POOLS, ModelLayout, PoolSpec
from connector.core.plan import fold_ranges
from connector.core.state_split import conv_layouts, piece_of
from connector.core.untrusted import shown


def describe_pool(pool: PoolSpec) -> str:
    if not pool.layers:
        return f"no {pool.name}"
    sharding = "sharded over TP" if pool.sharded else "each TP rank its own, same TP on both sides" \
        if pool.same_tp else "on every TP rank"
    if pool.bytes_per_block_per_head:
        unit = (f"{pool.bytes_per_block_per_head} B per request" if pool.per_request else
                f"{pool.bytes_per_block_per_head} B per block of {pool.block_size} tokens")
        return (f"{pool.name} on layers {fold_ranges(pool.layers)} ({shown(pool.spec, 64) or 'cache'}, "
                f"{pool.num_heads} head(s) x {unit}, {sharding})")
    return (f"{pool.name} on layers {fold_ranges(pool.layers)} ({pool.num_heads} head(s) x "
            f"{pool.bytes_per_token_per_head} B per token, {sharding})")


def describe_model(model: ModelLayout) -> str:
    """`kv on layers 0-59 (4 head(s) x 512 B per token, sharded over TP), index_k on layers 3-59 (...), no
    index_v`; a state moved in pieces (pools `<cache>:<piece>`) is one entry."""
    entries, pieces = [], {}
    for name in model.pool_names:
        cache, piece = piece_of(name)
        if not piece or not model.pools[name].layers:
            entries.append(describe_pool(model.pools[name]))
        elif cache not in pieces:
            pieces[cache] = [model.pools[name]]
            entries.append(cache)  # filled in below, where its first piece stood
        else:
            pieces[cache].append(model.pools[name])
    return ", ".join(_describe_pieces(e, pieces[e]) if e in pieces else e for e in entries)


def _describe_pieces(cache: str, pools: list[PoolSpec]) -> str:
    """`mixer on layers 0-3 (MambaSpec, 39296 B per request over all TP ranks, in 10 pieces split over TP by heads:
    conv-sd.r0.B, ..., ssm)`, the pieces in the order of their pools."""
    layers = sorted({layer for p in pools for layer in p.layers})
    total = sum(p.num_heads * p.bytes_per_block_per_head for p in pools)
    names = ", ".join(piece_of(p.name)[1] for p in pools)
    return (f"{cache} on layers {fold_ranges(layers)} ({shown(pools[0].spec, 64) or 'cache'}, {total} B per request "
            f"over all TP ranks, in {len(pools)} pieces split over TP by heads: {names})")


def _pool_order(name: str) -> tuple[int, str]:
    return (POOLS.index(name), "") if name in POOLS else (len(POOLS), name)


def layout_difference(mine: ModelLayout, theirs: ModelLayout, me: str = "this side", them: str = "the peer") -> str:
    """The first difference between two layouts in words ('' when they hold the same caches)."""
    if mine.num_layers != theirs.num_layers:
        return (f"{me} has {mine.num_layers} layers, {them} {theirs.num_layers} (a different model, or draft "
                f"layers of speculative decoding on one side only?)")
    layouts = [conv_layouts(n for n, p in m.pools.items() if p.layers) for m in (mine, theirs)]
    if all(layouts) and layouts[0] != layouts[1]:
        return (f"{me} stores its Mamba/GDN conv states {layouts[0]} and {them} {layouts[1]} (vLLM's "
                f"VLLM_SSM_CONV_STATE_LAYOUT): set it the same on both engines")
    for name in sorted(set(mine.pool_names) | set(theirs.pool_names), key=_pool_order):
        empty = PoolSpec(name, (), 1, 0, 1, False)
        a, b = mine.pools.get(name, empty), theirs.pools.get(name, empty)
        if a.layers != b.layers:
            only_a, only_b = sorted(set(a.layers) - set(b.layers)), sorted(set(b.layers) - set(a.layers))
            parts = [f"{me} has {name} on layers {fold_ranges(only_a)} that {them} lacks"] if only_a else []
            parts += [f"{them} has {name} on layers {fold_ranges(only_b)} that {me} lacks"] if only_b else []
            return "; ".join(parts)
        if a.layers and not (a.same_tp and b.same_tp) and \
                (a.num_heads, a.bytes_per_token_per_head, a.num_parts, a.sharded, *a.extras()) != \
                (b.num_heads, b.bytes_per_token_per_head, b.num_parts, b.sharded, *b.extras()):
            return f"{me} keeps {describe_pool(a)}, {them} {describe_pool(b)}"
    return ""
