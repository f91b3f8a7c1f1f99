"""Which Mamba/GDN states split over TP, from the layer modules vLLM built (connector.core.state_split has the split
itself): the TP size, the conv layout, and per layer the state kind, read from the module's exact class."""

from __future__ import annotations

import logging

import msgspec
from vllm.v1.kv_cache_interface import MambaSpec

from connector.core.errors import LayoutError
from connector.core.state_split import StatePiece, split_state

log = logging.getLogger(__name__)


class StateSplit(msgspec.Struct, frozen=True):
    """What splitting a Mamba/GDN state over TP needs beyond its spec (`state_split_of`)."""

    tp: int = 1
    dim_first: bool = False
    """vLLM stores conv states channels first ("DS", VLLM_SSM_CONV_STATE_LAYOUT), else rows first ("SD")."""
    kinds: dict[str, tuple[str, bool]] = {}
    """Layer name -> (state kind, a Mamba2 layer's one group replicated on every rank), for the layers whose
    module is one of SPLIT_MODULES exactly."""


SPLIT_MODULES = {
    "vllm.model_executor.layers.mamba.mamba_mixer.MambaMixer": ("mamba1", "MAMBA1"),
    "vllm.model_executor.layers.mamba.mamba_mixer2.MambaMixer2": ("mamba2", "MAMBA2"),
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention": ("gdn", "GDN_ATTN"),
}
"""The layer classes, matched exactly, whose state pages split as connector.core.state_split says (their
get_state_shape is MambaStateShapeCalculator's mamba1 / mamba2 / gated_delta_net shape, their conv1d the
sub-projections in that order), with the mamba_type each declares. Not by mamba_type alone: Kimi's and GLM-5-next's
KDA layers subclass GatedDeltaNet and declare GDN_ATTN, but shape their state with kda_state_shape and build their
own conv weights, an order not checked here; their states stay tied to one TP size."""
SPLIT_MODULES_TYPES = {kind: mamba_type for kind, mamba_type in SPLIT_MODULES.values()}


def state_pieces(name: str, spec: MambaSpec, split: StateSplit | None) -> tuple[StatePiece, ...]:
    """The pieces of layer `name`'s state page where `split` knows its kind and the spec's shapes decompose as it
    says; () otherwise (the state stays whole, tied to one TP size)."""
    kind, replicated_groups = (split.kinds.get(name) if split else None) or ("", False)
    if not kind or SPLIT_MODULES_TYPES.get(kind) != getattr(spec.mamba_type, "name", spec.mamba_type):
        return ()
    try:
        return split_state(kind, [tuple(s) for s in spec.shapes], [d.itemsize for d in spec.dtypes], split.tp,
                           split.dim_first, replicated_groups)
    except LayoutError as exc:  # its shapes are not what its class computes: each rank's state stays its own
        log.warning("SparseKVConnector: %s (%s) does not split over TP as a %s state (%s); it moves only between "
                    "the same TP sizes", name, type(spec).__name__, kind, exc)
        return ()


def state_split_of(vllm_config) -> StateSplit:  # noqa: ANN001 - VllmConfig
    """The TP size, the conv layout, and which Mamba/GDN layers are of a class whose split is known, read from the
    layer modules in the forward context (a Mamba2 module whose in_proj is not merged per output keeps one group
    replicated on every rank: vllm/model_executor/layers/mamba/mamba_mixer2.py)."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
        dim_first = bool(is_conv_state_dim_first())
    except ImportError:  # pragma: no cover - older vLLM: rows first
        dim_first = False
    kinds = {}
    for layer_name, module in vllm_config.compilation_config.static_forward_context.items():
        cls = type(module)
        kind = SPLIT_MODULES.get(f"{cls.__module__}.{cls.__qualname__}", ("", ""))[0]
        if kind:
            merged = type(getattr(module, "conv1d", None)).__name__ == "MergedColumnParallelLinear"
            kinds[layer_name] = (kind, kind == "mamba2" and not merged and getattr(module, "tp_size", 1) > 1)
    return StateSplit(int(vllm_config.parallel_config.tensor_parallel_size), dim_first, kinds)
