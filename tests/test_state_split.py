"""Mamba/GDN states between different TP sizes (connector.core.state_split): a state page built as vLLM shards it
at prefill's TP size, moved by the plan's routes and the descriptors of each piece, is on every decode rank the page
vLLM builds at decode's TP size, byte for byte: conv sub-projections (x | B | C, q | k | v) each split on its own,
in both conv layouts (channels first "DS", rows first "SD"), a Mamba2 model of one group replicated on every rank,
SSM heads; padding after the states untouched. Memory here is numpy arrays copied with memmove (the real engines
are in tests/real_engine/test_real_zoo_pd.py)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest

from connector.core.descriptors import group_range, route_descriptors
from connector.core.errors import LayoutError
from connector.core.layout import POOLS, ModelLayout, ParallelLayout, PoolSpec, Region, heads_of_rank
from connector.core.plan import build_plan
from connector.core.state_split import split_state

LAYERS, ROWS, NUM_BLOCKS, PAD = 2, 3, 6, 40
"""Layers, conv rows (kernel - 1), blocks per rank, bytes of padding after a page's states (page_size_padded)."""


@dataclass(frozen=True)
class Model:
    """A layer's state over the whole model: conv sub-projections as (name, units, channels per unit, replicated),
    the SSM state's units and elements per unit; float32 throughout."""

    kind: str
    projections: tuple[tuple[str, int, int, bool], ...]
    ssm_units: int
    ssm_shape: tuple[int, ...]

    def local_units(self, units: int, replicated: bool, tp: int, rank: int) -> range:
        if replicated:
            return range(units)  # one group, on every rank
        per = units // tp
        return range(rank * per, (rank + 1) * per)

    def page(self, layer: int, tp: int, rank: int, dim_first: bool) -> np.ndarray:
        """What vLLM's page holds on `rank` of `tp`: conv (channels, rows) or (rows, channels), then SSM, padding."""
        channels = []
        for p, (_name, units, per_unit, replicated) in enumerate(self.projections):
            for u in self.local_units(units, replicated, tp, rank):
                channels += [(p, u * per_unit + c) for c in range(per_unit)]
        conv = np.array([[value(layer, p, ch, r) for r in range(ROWS)] for p, ch in channels], np.float32)
        ssm = np.array([[value(layer, 9, h, e) for e in range(int(np.prod(self.ssm_shape)))]
                        for h in self.local_units(self.ssm_units, False, tp, rank)], np.float32)
        conv = conv if dim_first else conv.T.copy()
        return np.concatenate([conv.reshape(-1).view(np.uint8), ssm.reshape(-1).view(np.uint8),
                               np.zeros(PAD, np.uint8)])

    def shapes(self, tp: int, dim_first: bool) -> list[tuple[int, ...]]:
        channels = sum((units if replicated else units // tp) * per_unit
                       for _n, units, per_unit, replicated in self.projections)
        conv = (channels, ROWS) if dim_first else (ROWS, channels)
        return [conv, (self.ssm_units // tp, *self.ssm_shape)]


def value(layer: int, what: int, index: int, sub: int) -> float:
    return float(layer * 1_000_003 + what * 100_003 + index * 101 + sub + 1)


HEADS, HEAD_DIM, STATE = 8, 4, 2
MODELS = {
    # Mamba2 of one group: vLLM copies it to every rank (mamba_mixer2.py, extra_groups_for_head_shards)
    "mamba2-1group": Model("mamba2", (("x", HEADS, HEAD_DIM, False), ("B", 1, STATE, True), ("C", 1, STATE, True)),
                           HEADS, (HEAD_DIM, STATE)),
    "mamba2-4groups": Model("mamba2", (("x", HEADS, HEAD_DIM, False), ("B", 4, STATE, False),
                                       ("C", 4, STATE, False)), HEADS, (HEAD_DIM, STATE)),
    # GDN: q and k by key heads (4 of 3 channels), v by value heads (8 of 2); SSM (v_heads, head_v, head_k)
    "gdn": Model("gdn", (("q", 4, 3, False), ("k", 4, 3, False), ("v", 8, 2, False)), 8, (2, 3)),
    "mamba1": Model("mamba1", (("x", 16, 1, False),), 16, (STATE,)),
}


class Rank:
    """One rank's pages, as numpy memory, and its regions of every piece."""

    def __init__(self, model: Model, tp: int, rank: int, dim_first: bool, fill: bool) -> None:
        self.pages = {}
        self.pieces = split_state(model.kind, model.shapes(tp, dim_first), [4, 4], tp, dim_first,
                                  model.projections[-1][3] if model.kind == "mamba2" else False)
        for layer in range(LAYERS):
            page = model.page(layer, tp, rank, dim_first)
            mem = np.zeros((NUM_BLOCKS, page.size), np.uint8) if not fill else \
                np.stack([page if b == 4 else np.full(page.size, b, np.uint8) for b in range(NUM_BLOCKS)])
            self.pages[layer] = mem
        self.tp, self.rank = tp, rank

    def pools(self) -> dict[str, PoolSpec]:
        return {f"mixer:{p.name}": PoolSpec(f"mixer:{p.name}", tuple(range(LAYERS)), p.num_heads, 0, 1, True,
                                            bytes_per_block_per_head=p.unit_bytes, per_request=True)
                for p in self.pieces}

    def region(self, pool: PoolSpec, layer: int) -> Region:
        piece = next(p for p in self.pieces if f"mixer:{p.name}" == pool.name)
        heads = heads_of_rank(pool, self.tp, self.rank)
        mem = self.pages[layer]
        return Region(pool.name, layer, layer, mem.ctypes.data + piece.offset, NUM_BLOCKS,
                      (heads[1] - heads[0]) * piece.unit_bytes, mem.strides[0], heads, per_request=True)


def model_layout(pools: dict[str, PoolSpec]) -> ModelLayout:
    empty = {name: PoolSpec(name, (), 1, 0, 1, False) for name in POOLS}
    return ModelLayout("state", LAYERS, empty | pools)


@pytest.mark.parametrize("dim_first", [True, False], ids=["DS", "SD"])
@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2)],
                         ids=lambda t: f"P{t[0]}-D{t[1]}")
@pytest.mark.parametrize("name", list(MODELS))
def test_every_decode_rank_gets_the_page_vllm_builds_at_its_tp(name, tps, dim_first):
    model, (p_tp, d_tp) = MODELS[name], tps
    prefill = [Rank(model, p_tp, r, dim_first, fill=True) for r in range(p_tp)]
    decode = [Rank(model, d_tp, r, dim_first, fill=False) for r in range(d_tp)]
    pools = prefill[0].pools()
    assert {n: (p.num_heads, p.bytes_per_block_per_head) for n, p in pools.items()} == \
        {n: (p.num_heads, p.bytes_per_block_per_head) for n, p in decode[0].pools().items()}  # one fingerprint
    plan = build_plan(model_layout(pools), ParallelLayout.build(LAYERS, p_tp, 1), ParallelLayout.build(LAYERS, d_tp, 1))
    src_ids, dst_ids = [0, 2, 4], [1, 3]  # placeholders, then the running state (vLLM's clip_ssm_state_blocks)
    for route in plan.routes:
        src = prefill[route.src.tp].region(pools[route.pool], route.layer)
        dst = decode[route.dst.tp].region(pools[route.pool], route.layer)
        s, d = src_ids[group_range(src, 0, 0, True)], dst_ids[group_range(dst, 0, 0, True)]
        pairs = route_descriptors(src, dst, s, d, route.heads).pairs()
        for (sa, n), (da, _) in zip(*pairs):
            ctypes.memmove(da, sa, n)
    for rank in decode:
        for layer in range(LAYERS):
            want = model.page(layer, d_tp, rank.rank, dim_first)
            want[-PAD:] = 0  # padding is not state: nothing is written there
            assert np.array_equal(rank.pages[layer][3], want), (rank.rank, layer)
            assert not rank.pages[layer][[0, 1, 2, 4, 5]].any()  # no other block touched


def test_the_pieces_name_the_conv_layout_so_prefill_and_decode_of_different_layouts_differ():
    model = MODELS["mamba2-4groups"]
    ds = [p.name for p in split_state("mamba2", model.shapes(2, True), [4, 4], 2, True)]
    sd = [p.name for p in split_state("mamba2", model.shapes(2, False), [4, 4], 2, False)]
    assert ds == ["conv-ds.x", "conv-ds.B", "conv-ds.C", "ssm"]
    assert sd[:3] == ["conv-sd.r0.x", "conv-sd.r0.B", "conv-sd.r0.C"] and len(sd) == 3 * ROWS + 1


@pytest.mark.parametrize("kind, shapes, match", [
    ("mamba2", [(3, 35), (8, 4, 2)], "groups per rank would be"),      # 35 - 32 channels is not two B/C halves
    ("mamba2", [(3, 36), (8, 4)], "is not \\(heads, head_dim, state\\)"),
    ("gdn", [(3, 25), (8, 2, 3)], "key heads per rank would be"),
    ("mamba1", [(3, 16), (8, 2)], "not Mamba1"),
    ("short_conv", [(3, 16), (16, 2)], "not a conv state and an SSM state"),
    ("mamba2", [(3, 36), (8, 4, 2), (1,)], "not a conv state and an SSM state"),
])
def test_shapes_that_do_not_decompose_are_refused(kind, shapes, match):
    with pytest.raises(LayoutError, match=match):
        split_state(kind, shapes, [4] * len(shapes), 1, False)


def test_a_replicated_group_must_be_one_group_per_rank():
    with pytest.raises(LayoutError, match="holds 2 per rank, not 1"):
        split_state("mamba2", [(3, 40), (8, 4, 2)], [4, 4], 2, False, groups_replicated=True)


def test_prefill_and_decode_of_different_conv_layouts_are_refused_naming_the_setting():
    from connector.core.describe import layout_difference

    def layout(dim_first: bool) -> ModelLayout:
        return model_layout(Rank(MODELS["mamba2-4groups"], 2, 0, dim_first, fill=False).pools())

    assert layout_difference(layout(True), layout(False), "prefill", "decode") == (
        "prefill stores its Mamba/GDN conv states channels first (DS) and decode rows first (SD) (vLLM's "
        "VLLM_SSM_CONV_STATE_LAYOUT): set it the same on both engines")
    assert layout_difference(layout(True), layout(True)) == ""


def test_the_start_up_log_names_a_state_in_pieces_once_with_its_whole_size():
    from connector.core.describe import describe_model

    model = MODELS["mamba2-4groups"]
    rank = Rank(model, 1, 0, True, fill=False)
    text = describe_model(model_layout(rank.pools()))
    page = sum(p.num_heads * p.unit_bytes for p in rank.pieces)  # a TP1 rank holds the whole state
    assert page == model.page(0, 1, 0, True).size - PAD
    assert text.startswith("no kv, no index_k, no index_v, ")
    assert text.endswith(f"mixer on layers 0-{LAYERS - 1} (cache, {page} B per request over all TP ranks, in 4 "
                         f"pieces split over TP by heads: conv-ds.B, conv-ds.C, conv-ds.x, ssm)")
    assert text.count("mixer") == 1
