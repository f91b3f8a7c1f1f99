"""The same end-to-end transfers with the caches in GPU memory (VRAM -> VRAM over NIXL/UCX cuda_ipc).
Run on a CUDA machine: `pytest -m gpu`. Skipped elsewhere."""

from __future__ import annotations

import pytest

from connector.core.hf_config import load_model
from connector.core.layout import ParallelLayout
from sparse_kv_lab.sim.cluster import Scenario, run_scenario

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
    """Staging in VRAM: the block-wise gather and scatter run on the GPU (connector.transport.device_copy)."""
    model = load_model("minimax-m3")
    sc = Scenario(model=model, prefill=ParallelLayout.build(60, *prefill), decode=ParallelLayout.build(60, *decode),
                  tokens=1000, block_size=16, device="cuda", chunks=chunks, layer_ms=1.0, timeout_s=120,
                  staging_mb=8, run_blocks=run_blocks)
    result = run_scenario(sc)
    assert result.verified, result.problems
    assert result.staged_chunks > 0


def test_block_copies_on_the_gpu_are_byte_exact_on_a_side_stream():
    """The CUDA gather (index_select) and scatter (index_copy_) of connector.transport.device_copy: many region parts
    in one chunk, rows packed in order, nothing else written, and the copies ordered by their own stream's event
    (a busy default stream is not waited for as a whole: no device-wide synchronize)."""
    import numpy as np
    import torch

    from connector.core.staging_ranges import Rows
    from connector.transport.device_copy import BlockCopier

    rng = np.random.default_rng(0)
    row, nb, sel = 16384, 64, 24
    src = torch.randint(0, 256, (60, 2, nb, row), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    stage = torch.zeros(60 * 2 * sel * row, dtype=torch.uint8, device="cuda")
    s_ids, d_ids = rng.choice(nb, sel, replace=False), rng.choice(nb, sel, replace=False)
    torch.cuda.synchronize()
    copier = BlockCopier(src.device)
    copier.gather([Rows(src[l, p].data_ptr(), row, row, s_ids) for l in range(60) for p in range(2)],
                  stage.data_ptr())
    assert torch.equal(stage.view(60, 2, sel, row), src[:, :, torch.from_numpy(s_ids).cuda()])
    copier.scatter([Rows(dst[l, p].data_ptr(), row, row, d_ids) for l in range(60) for p in range(2)],
                   stage.data_ptr())
    d = torch.from_numpy(d_ids).cuda()
    assert torch.equal(dst[:, :, d], src[:, :, torch.from_numpy(s_ids).cuda()])
    untouched = torch.ones(nb, dtype=torch.bool, device="cuda")
    untouched[d] = False
    assert int(dst[:, :, untouched].count_nonzero()) == 0


def test_block_copies_on_the_gpu_with_head_slices_and_odd_strides():
    """Rows that are a head slice of a block (TP splits) and rows whose length is not a word multiple."""
    import numpy as np
    import torch

    from connector.core.staging_ranges import Rows
    from connector.transport.device_copy import BlockCopier

    copier = BlockCopier("cuda")
    for row, stride, offset in [(3000, 8192, 1024), (1234, 4096, 3), (64, 64, 0)]:
        src = torch.randint(0, 256, (40 * stride,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        ids = np.array([5, 0, 39, 17], dtype=np.int64)
        stage = torch.zeros(ids.size * row, dtype=torch.uint8, device="cuda")
        copier.gather([Rows(src.data_ptr() + offset, stride, row, ids)], stage.data_ptr())
        copier.scatter([Rows(dst.data_ptr() + offset, stride, row, ids)], stage.data_ptr())
        for b in ids.tolist():
            a = b * stride + offset
            assert torch.equal(dst[a:a + row], src[a:a + row])
        assert int(dst.count_nonzero()) <= int(src.count_nonzero()) and \
            int((dst != 0).sum()) == sum(int((src[b * stride + offset:b * stride + offset + row] != 0).sum())
                                         for b in ids.tolist())


def test_checksums_on_the_gpu_equal_the_cpus_and_verify_a_vram_transfer():
    """kv_checksum: the reduction on a GPU gives the CPU's digests for the same bytes (a CPU decode can check a GPU
    prefill), and a VRAM -> VRAM transfer with head slices verifies end to end."""
    import numpy as np
    import torch

    from connector.core.staging_ranges import Rows
    from connector.transport.device_copy import BlockCopier

    data = torch.randint(0, 256, (64 * 8192 + 12,), dtype=torch.uint8)
    blocks = np.array([5, 0, 63, 17], dtype=np.int64)
    gpu = data.cuda()
    cpu_rows = [Rows(data.data_ptr() + 4, 8192, 4096, blocks), Rows(data.data_ptr() + 4 + 4096, 8192, 4096, blocks)]
    gpu_rows = [Rows(gpu.data_ptr() + 4, 8192, 4096, blocks), Rows(gpu.data_ptr() + 4 + 4096, 8192, 4096, blocks)]
    assert np.array_equal(BlockCopier("cpu").digests(cpu_rows), BlockCopier("cuda:0").digests(gpu_rows))
    model = load_model("minimax-m3")
    sc = Scenario(model=model, prefill=ParallelLayout.build(60, 2, 1), decode=ParallelLayout.build(60, 1, 2),
                  tokens=1000, block_size=16, device="cuda", layer_ms=1.0, timeout_s=120, kv_checksum=True)
    result = run_scenario(sc)
    assert result.verified, result.problems
    assert result.checksummed_blocks > 0
