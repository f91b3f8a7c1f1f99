"""The same end-to-end transfers with the caches in GPU memory (VRAM -> VRAM over NIXL/UCX cuda_ipc).
Run on a CUDA machine: `pytest -m gpu`. Skipped elsewhere."""

from __future__ import annotations

import pytest

from connector.core.hf_config import load_model
from connector.core.layout import ParallelLayout
from connector.sim.cluster import Scenario, run_scenario

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _needs_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("prefill, decode, chunks", [((1, 2), (1, 1), 1), ((2, 1), (1, 2), 2)])
def test_m3_vram_streams_byte_exact(prefill, decode, chunks):
    model = load_model("minimax-m3")
    sc = Scenario(model=model, prefill=ParallelLayout.build(60, *prefill), decode=ParallelLayout.build(60, *decode),
                  tokens=1000, block_size=16, device="cuda", chunks=chunks, layer_ms=1.0, timeout_s=120)
    result = run_scenario(sc)
    assert result.verified, result.problems


@pytest.mark.parametrize("prefill, decode, chunks, run_blocks", [((1, 2), (1, 1), 1, 1), ((2, 1), (1, 2), 2, 4)])
def test_m3_vram_staged_byte_exact(prefill, decode, chunks, run_blocks):
    """Staging in VRAM: the indexed gather and scatter run on the GPU (connector.transport.device_copy.indexed_copy)."""
    model = load_model("minimax-m3")
    sc = Scenario(model=model, prefill=ParallelLayout.build(60, *prefill), decode=ParallelLayout.build(60, *decode),
                  tokens=1000, block_size=16, device="cuda", chunks=chunks, layer_ms=1.0, timeout_s=120,
                  staging_mb=8, run_blocks=run_blocks)
    result = run_scenario(sc)
    assert result.verified, result.problems
    assert result.staged_chunks > 0


def test_indexed_copy_on_the_gpu_is_byte_exact():
    import numpy as np
    import torch

    from connector.transport.device_copy import copy_ranges

    rng = np.random.default_rng(0)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    starts = np.sort(rng.choice((1 << 20) // 256, 500, replace=False)) * 256
    lens = rng.integers(1, 16, 500) * 16
    packed = np.cumsum(lens) - lens
    copy_ranges(src.data_ptr() + starts, dst.data_ptr() + packed, lens, src.device)
    want = torch.cat([src[s:s + n] for s, n in zip(starts.tolist(), lens.tolist())])
    assert torch.equal(dst[:int(lens.sum())], want) and int(dst[int(lens.sum()):].count_nonzero()) == 0
