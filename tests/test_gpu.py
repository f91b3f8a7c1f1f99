"""The same end-to-end transfers with the caches in GPU memory (VRAM -> VRAM over NIXL/UCX cuda_ipc).
Run on a CUDA machine: `pytest -m gpu`. Skipped elsewhere."""

from __future__ import annotations

import pytest

from connector.demo import Scenario, run_scenario
from connector.layout import ParallelLayout
from connector.models import load_model

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
