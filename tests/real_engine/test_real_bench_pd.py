"""`python -m connector bench-pd` end to end on real engines, small: every mode it runs answers token-equal to the
local engine, and the table the README quotes comes out of it. (The README's numbers come from the full run.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sparse_kv_lab.pd.timelines import COLUMNS
from tests.real_engine.conftest import ROOT, engine_python

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]


def test_bench_pd_runs_every_flow_token_equal(tmp_path):
    python = engine_python()
    out = subprocess.run(
        [sys.executable, "-m", "connector", "bench-pd", "--requests", "2", "--warmup", "1", "--prompt-tokens",
         "300,500", "--modes", "local,sparse-concurrent,sparse-sequential,nixl-clamped", "--engine-python",
         str(python), "--work-dir", str(tmp_path), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert out.returncode == 0, f"bench-pd failed ({out.returncode}):\n{out.stderr[-4000:]}"
    result = json.loads(out.stdout)
    modes = {m["mode"]: m for m in result["modes"]}
    assert list(modes) == ["local", "sparse-concurrent", "sparse-sequential", "nixl-clamped"]
    for name, m in modes.items():
        assert (m["requests"], m["token_equal"]) == (2, 2), name
        assert len(m["ttft_ms"]) == 2 and m["p50_ms"] > 0, name
    # the breakdown of each SparseKVConnector request, from both engines' timeline lines (sparse_kv_lab.pd.timelines):
    # every stage of every prompt length, each request's stages adding up to no more than its TTFT
    for name in ("sparse-concurrent", "sparse-sequential"):
        by_len = modes[name]["breakdown"]
        assert sorted(by_len) == ["300", "500"], (name, by_len)
        for tokens, stages in by_len.items():
            assert set(stages) == set(COLUMNS), (name, tokens, sorted(stages))
            assert all(n == 1 for _p50, _p99, n in stages.values()), (name, tokens)
            assert stages["compute"][0] > 0 and stages["exposed"][0] >= 0 and stages["tell"][0] >= 0
            assert stages["landed_after"][0] <= stages["ttft"][0], (name, tokens, stages)
    assert modes["nixl-clamped"]["breakdown"] == {}  # NixlConnector logs no timeline
