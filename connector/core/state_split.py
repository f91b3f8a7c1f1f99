"""How a Mamba/GDN state splits over tensor parallelism, so that prefill and decode may run different TP sizes.

vLLM packs a layer's states into one page per block, in the order of its state shapes (conv, then SSM: vllm/
model_executor/layers/mamba/abstract.py bind_kv_cache), each a C-contiguous array of this rank's share. The conv
state's channel dimension is the concatenation of the layer's sub-projections, each split over TP on its own:
Mamba1 `x`; Mamba2 `x | B | C` (x by heads, B and C by groups); GDN `q | k | v` (q and k by key heads, v by value
heads) (vllm/model_executor/layers/mamba/mamba_utils.py MambaStateShapeCalculator; vLLM's NixlConnector reads the
same split in kv_connector/v1/ssm_conv_transfer_utils.py). The SSM state is split by its first dimension (heads, or
channels for Mamba1).

Each (sub-projection, and for the state-dim-first "SD" conv layout each conv row) is one piece: a run of whole units
(heads, groups or channels) at a byte offset of the page, held by a TP rank as vLLM shards KV heads (contiguous
ranges; a Mamba2 model of one group replicates it on every rank: `heads_of_rank` with fewer heads than ranks). A
piece is then a head-sharded per-request pool of its own, and the plan routes its heads like any other.

vLLM's NixlConnector 0.33 needs the "DS" conv layout (channels first) and reads a Mamba2 group's B/C slice at an
offset that assumes the groups are sharded, also where one group is replicated; here both layouts split, and a
replicated group is read whole."""

from __future__ import annotations

import math
from typing import Iterable

import msgspec

from connector.core.errors import LayoutError

PIECE_SEPARATOR = ":"
"""Between a state's pool and its piece's name (`mixer:conv-ds.x`); no cache's own pool name holds it."""
CONV_DS, CONV_SD = "conv-ds", "conv-sd"
"""The prefixes of a conv piece's name: channels first, rows first (vLLM's VLLM_SSM_CONV_STATE_LAYOUT)."""
CONV_LAYOUTS = {CONV_DS: "channels first (DS)", CONV_SD: "rows first (SD)"}
SPLIT_KINDS = ("mamba1", "mamba2", "gdn")
"""The state kinds whose TP split is known (vLLM's MambaAttentionBackendEnum MAMBA1, MAMBA2, GDN_ATTN)."""


class StatePiece(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One TP-split run of a state page: `num_heads` units over the whole model, `unit_bytes` each, this rank's
    share starting `offset` bytes into the page (the offset follows the TP size; the rest does not)."""

    name: str
    offset: int
    num_heads: int
    unit_bytes: int


def split_state(kind: str, shapes: list[tuple[int, ...]], itemsizes: list[int], tp: int, dim_first: bool,
                groups_replicated: bool = False) -> tuple[StatePiece, ...]:
    """The pieces of one rank's state page of `kind` (SPLIT_KINDS), from its state `shapes` and element sizes, at
    TP size `tp`. `dim_first`: the conv state is (channels, rows) (vLLM's "DS"), else (rows, channels) ("SD").
    `groups_replicated`: a Mamba2 layer of one group that vLLM copies to every rank (it shards groups otherwise).
    Raises LayoutError where the shapes do not decompose as `kind` says."""
    if kind not in SPLIT_KINDS or len(shapes) != 2 or len(itemsizes) != 2 or len(shapes[0]) != 2:
        raise LayoutError(f"a {kind} state of shapes {shapes} is not a conv state and an SSM state")
    conv, ssm = shapes
    channels, rows = conv if dim_first else conv[::-1]
    projections = _projections(kind, channels, ssm, tp, groups_replicated)
    conv_bytes, ssm_bytes = (math.prod(s) * size for s, size in zip(shapes, itemsizes))
    pieces = []
    size = itemsizes[0]
    for row in range(1 if dim_first else rows):  # DS: a channel's rows are contiguous; SD: each row is a run
        first_channel = 0
        for name, units, channels_per_unit, local_units in projections:
            if dim_first:
                offset, per_unit = first_channel * rows * size, channels_per_unit * rows * size
                label = f"{CONV_DS}.{name}"
            else:
                offset, per_unit = (row * channels + first_channel) * size, channels_per_unit * size
                label = f"{CONV_SD}.r{row}.{name}"
            pieces.append(StatePiece(label, offset, units, per_unit))
            first_channel += local_units * channels_per_unit
        if first_channel != channels:
            raise LayoutError(f"a {kind} conv state's sub-projections cover {first_channel} of its {channels} channels")
    pieces.append(StatePiece("ssm", conv_bytes, ssm[0] * tp, ssm_bytes // ssm[0]))
    return tuple(pieces)


def _projections(kind: str, channels: int, ssm: tuple[int, ...], tp: int,
                 groups_replicated: bool) -> list[tuple[str, int, int, int]]:
    """(name, units over the model, channels per unit, this rank's units) of each conv sub-projection, in order."""
    def whole(n: float, what: str) -> int:
        if n != int(n) or n <= 0:
            raise LayoutError(f"a {kind} conv state of {channels} channels per rank and SSM state {ssm} at tp={tp} "
                              f"does not decompose: {what} would be {n}")
        return int(n)

    if kind == "mamba1":  # conv x: (intermediate / tp) channels; SSM (intermediate / tp, state)
        if ssm[0] != channels:
            raise LayoutError(f"a mamba1 state's conv has {channels} channels but its SSM {ssm[0]}: not Mamba1")
        return [("x", channels * tp, 1, channels)]
    if kind == "mamba2":  # SSM (heads / tp, head_dim, state); conv x (heads x head_dim) | B | C (groups x state)
        if len(ssm) != 3:
            raise LayoutError(f"a mamba2 SSM state of shape {ssm} is not (heads, head_dim, state)")
        heads, head_dim, state = ssm
        groups = whole((channels - heads * head_dim) / 2 / state, "its groups per rank")
        if groups_replicated and groups != 1:
            raise LayoutError(f"a mamba2 layer with replicated groups holds {groups} per rank, not 1")
        units = 1 if groups_replicated else groups * tp
        return [("x", heads * tp, head_dim, heads), ("B", units, state, groups), ("C", units, state, groups)]
    # gdn: SSM (v_heads / tp, head_v_dim, head_k_dim); conv q | k (k_heads x head_k_dim) | v (v_heads x head_v_dim)
    if len(ssm) != 3:
        raise LayoutError(f"a gdn SSM state of shape {ssm} is not (v_heads, head_v_dim, head_k_dim)")
    v_heads, head_v, head_k = ssm
    k_heads = whole((channels - v_heads * head_v) / 2 / head_k, "its key heads per rank")
    return [("q", k_heads * tp, head_k, k_heads), ("k", k_heads * tp, head_k, k_heads),
            ("v", v_heads * tp, head_v, v_heads)]


def piece_of(pool: str) -> tuple[str, str]:
    """A pool's name -> (the cache it moves, its piece's name: '' for a whole cache)."""
    cache, _, piece = pool.partition(PIECE_SEPARATOR)
    return cache, piece


def conv_layouts(pool_names: Iterable[str]) -> str:
    """In words, how the split states among `pool_names` keep their conv state (several if they disagree); '' for
    none."""
    prefixes = {piece_of(name)[1].split(".")[0] for name in pool_names}
    return " and ".join(CONV_LAYOUTS[p] for p in sorted(prefixes) if p in CONV_LAYOUTS)
