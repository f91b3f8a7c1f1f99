"""Shared fixtures: the models most tests use, and simulated ranks and worker clusters that are always closed when
the test ends (loop threads, NIXL agents and engines in this process; worker processes ended by PID)."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from connector.core.hf_config import load_model


VLLM_ENV_AT_START = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
"""vLLM's settings in this process's environment before any test ran (this conftest loads before test modules)."""


def restore_vllm_env() -> None:
    """Put vLLM's settings in os.environ back as they were at the start. Building a VllmConfig for MiniMax-M3 in this
    process (the vLLM 0.33 harness tests, some in module-scoped fixtures) sets VLLM_USE_BREAKABLE_CUDAGRAPH=1
    (vLLM's auto-enable, config/vllm.py), and every `vllm serve` started afterwards inherits it: a Llama engine with
    that flag behaves otherwise (eager_break_during_capture wraps; PP workers assert on missing intermediate
    tensors). The real-engine fixtures call this before they start servers."""
    for key in [k for k in os.environ if k.startswith("VLLM_") and k not in VLLM_ENV_AT_START]:
        del os.environ[key]
    os.environ.update(VLLM_ENV_AT_START)


@pytest.fixture(scope="session")
def m3():
    return load_model("minimax-m3")


@pytest.fixture(scope="session")
def m3_index_v(tmp_path_factory):
    """A small M3-style model whose sparse layers 4, 6 and 9 keep an index value."""
    path = tmp_path_factory.mktemp("m3v") / "config.json"
    freq = [0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]
    disable = [0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1]
    path.write_text(json.dumps({
        "architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3", "num_hidden_layers": 12,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "hidden_size": 512,
        "torch_dtype": "bfloat16", "sparse_attention_config": {
            "sparse_attention_freq": freq, "sparse_disable_index_value": disable, "sparse_index_dim": 64}}))
    model = load_model(str(path))
    assert model.pools["index_v"].layers == (4, 6, 9)
    return model


@pytest.fixture
def open_rank():
    """`open_rank(spec)`: a SimRank (sparse_kv_lab.sim.rank) in this process, opened; closed with its engine when the
    test ends, in reverse order of opening."""
    from sparse_kv_lab.sim.env import apply_env

    apply_env()  # before NIXL and torch's allocator see the environment
    from sparse_kv_lab.sim.rank import SimRank

    ranks: list[SimRank] = []

    def make(spec) -> SimRank:
        rank = SimRank(spec).open()
        ranks.append(rank)
        return rank

    yield make
    for rank in reversed(ranks):
        rank.close()


@pytest.fixture
def cluster():
    """`cluster(scenario, spawn=("prefill",))`: worker processes for those sides, ready; ended when the test ends
    (in reverse order of starting)."""
    from sparse_kv_lab.sim.cluster import Cluster

    with contextlib.ExitStack() as started:
        yield lambda sc, spawn=("prefill", "decode"): started.enter_context(Cluster(sc, spawn=spawn))


@pytest.fixture
def two_nodes():
    """Two network namespaces ("nodes") joined by a veth pair (sparse_kv_lab.sim.netns.TwoNodes), deleted when the test
    ends, also after a failure. Skipped, with the reason in the summary (`-rs`), where they cannot be made."""
    from sparse_kv_lab.sim import netns

    why = netns.available()
    if why is not None:
        pytest.skip(f"two-node tests need network namespaces: {why}")
    with netns.TwoNodes() as net:
        yield net
