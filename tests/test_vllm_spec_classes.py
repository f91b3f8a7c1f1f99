"""Every KV-cache spec class of vLLM 0.33, built with vLLM's own objects, classified as what it is
(connector.vllm.specs): never by `isinstance` alone (SlidingWindowMLASpec derives from SlidingWindowSpec,
HiddenStateCacheSpec from MLAAttentionSpec, CircularBufferSpec is a plain AttentionSpec), sizes from vLLM's pages,
per-request states moved whole, caches whose TP split vLLM does not declare tied to one TP size, and a layer's
several caches each in a pool of its own."""

from __future__ import annotations

from fractions import Fraction

import pytest

pytest.importorskip("vllm", reason="needs vllm==0.33.0")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, CircularBufferSpec,  # noqa: E402
                                        EncoderOnlyAttentionSpec, FullAttentionSpec, HiddenStateCacheSpec,
                                        HiSparseHotSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        MLAAttentionSpec, RSWASpec, SinkFullAttentionSpec, SlidingWindowMLASpec,
                                        SlidingWindowSpec, SparseCacheRole, UniformTypeKVCacheSpecs)

from connector.core.errors import LayoutError  # noqa: E402
from connector.core.layout import ParallelLayout  # noqa: E402
from connector.core.plan import build_plan, check_plan  # noqa: E402
from connector.vllm.specs import ModelNames, cache_facts, model_from_caches, stage_caches  # noqa: E402

pytestmark = pytest.mark.vllm
NAME = "model.layers.3.self_attn.x"
BF16 = torch.bfloat16


def facts(spec, name=NAME, heads=8):
    c = cache_facts(name, spec, 0, heads)
    return (c.pool, c.num_heads, c.num_parts, c.sharded, c.per_request, c.same_tp, c.bytes_per_block_per_head)


@pytest.mark.parametrize("cls, extra", [
    (FullAttentionSpec, {}), (SlidingWindowSpec, {"sliding_window": 64}),
    (ChunkedLocalAttentionSpec, {"attention_chunk_size": 64}), (SinkFullAttentionSpec, {"sink_len": 4}),
    (RSWASpec, {"rswa_window": 64}),
])
def test_kv_pairs_of_every_attention_class_are_the_main_pool_split_over_tp(cls, extra):
    spec = cls(block_size=16, num_kv_heads=2, head_size=64, head_size_v=64, dtype=BF16, **extra)
    assert facts(spec) == ("kv", 8, 2, True, False, False, 0)


def test_a_sliding_window_mla_latent_is_one_replicated_part_not_kv_heads():
    spec = SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576, dtype=BF16, sliding_window=128)
    assert isinstance(spec, SlidingWindowSpec) and not isinstance(spec, MLAAttentionSpec)  # the trap
    pool, heads, parts, sharded, per_request, same_tp, per_block = facts(spec)
    assert (pool, heads, parts, sharded, per_request, same_tp) == ("self_attn.x", 1, 1, False, False, False)
    assert per_block == 16 * 576 * 2 == spec.page_size_bytes


def test_a_ring_is_one_state_per_request_never_kv_heads():
    ring = CircularBufferSpec(block_size=8, num_kv_heads=2, head_size=64, dtype=BF16, head_size_v=0)
    pool, heads, parts, sharded, per_request, same_tp, per_block = facts(ring)
    # num_kv_heads of a ring are slots ([K, gate] for GLM-5-next), not TP heads: each rank keeps its own ring
    assert (pool, heads, sharded, per_request, same_tp) == ("self_attn.x", 2, False, True, True)
    assert heads * per_block == ring.page_size_bytes
    replicated = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=64, dtype=BF16, head_size_v=0,
                                    max_tp_shards=1)
    assert facts(replicated)[4:6] == (True, False)


def test_compressed_and_padded_pages_take_vllms_page_not_head_arithmetic():
    spec = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8, tokens_per_state=4,
                            alignment=576, cache_dtype_str="fp8_ds_mla", state_content_bytes=584,
                            model_version="deepseek_v4")
    c = cache_facts("model.layers.2.self_attn.attn", spec, 0, 8)
    assert (c.pool, c.sharded, c.same_tp, c.per_request) == ("self_attn.attn~4x", False, False, False)
    assert c.bytes_per_block_per_head == 64 * 584  # 64 states of 584 B: the content
    assert c.page_bytes == spec.page_size_bytes > c.bytes_per_block_per_head  # padded to the alignment
    indexer = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=128, dtype=BF16, tokens_per_state=4)
    assert cache_facts("model.layers.2.self_attn.indexer.k_cache", indexer, 0, 8).pool == \
        "self_attn.indexer.k_cache~4x"
    summary = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=256, head_size_v=0, dtype=torch.uint8,
                                tokens_per_state=8)
    assert facts(summary)[:6] == ("self_attn.x~8x", 1, 1, False, False, True)


def test_hidden_states_and_mamba_states():
    hidden = HiddenStateCacheSpec(block_size=16, num_kv_heads=1, head_size=4096, dtype=BF16)
    assert facts(hidden)[:6] == ("self_attn.x", 1, 1, False, False, False)  # not the layer's main latent
    mamba = MambaSpec(block_size=1024, shapes=((3, 64), (4, 16, 16)), dtypes=(BF16, torch.float32))
    pool, heads, _, sharded, per_request, same_tp, per_block = facts(mamba, "model.layers.1.mixer")
    assert (pool, heads, sharded, per_request, same_tp) == ("mixer", 1, False, True, True)
    assert per_block == 3 * 64 * 2 + 4 * 16 * 16 * 4 == mamba.page_size_bytes
    replicated = MambaSpec(block_size=1024, shapes=((3, 64),), dtypes=(BF16,), tp_replicated=True)
    assert facts(replicated, "model.layers.1.ple")[5] is False


@pytest.mark.parametrize("spec, words", [
    (EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16), "an encoder's cache"),
    (HiSparseHotSpec(block_size=16, page_size=4096, blocks_per_request=4), "a HiSparseHotSpec, a state"),
    (FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16, tokens_per_state=Fraction(1, 2)),
     "several states per token"),
])
def test_what_cannot_move_is_refused_naming_layer_and_spec(spec, words):
    with pytest.raises(LayoutError, match=f"KV-cache layer {NAME}") as err:
        cache_facts(NAME, spec, 0, 8)
    assert words in str(err.value)


def config(*groups: dict) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(g), UniformTypeKVCacheSpecs.from_specs(g) or next(iter(g.values()))) for g in groups])


def test_one_layer_owning_several_caches_gets_a_pool_for_each():
    """DeepSeek-V4's shape: main MLA (compressed), indexer k_cache left at role SPARSE, sliding-window latent and a
    compressor state, plus Inkling's second SlidingWindowSpec (a conv state) beside its attention."""
    main = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=512, dtype=BF16, tokens_per_state=4)
    index = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=128, dtype=BF16, tokens_per_state=4)
    swa = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=BF16, sliding_window=128)
    state = SlidingWindowMLASpec(block_size=8, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=8)
    attn = SlidingWindowSpec(block_size=64, num_kv_heads=2, head_size=64, head_size_v=64, dtype=BF16,
                             sliding_window=64)
    conv = SlidingWindowSpec(block_size=64, num_kv_heads=1, head_size=256, head_size_v=0, dtype=BF16,
                             sliding_window=64)  # Inkling: four conv streams packed in head_size, no V
    layers = {}
    for i in range(2):
        p = f"model.layers.{i}"
        layers |= {f"{p}.self_attn.attn": main, f"{p}.self_attn.indexer.k_cache": index,
                   f"{p}.self_attn.swa_cache": swa, f"{p}.self_attn.compressor.state_cache": state,
                   f"{p}.attn": attn, f"{p}.conv_state": conv}
    groups = [{n: s for n, s in layers.items() if s is k} for k in (main, index, swa, state, attn, conv)]
    caches = stage_caches(config(*groups), 2)
    model = model_from_caches(caches, 2, ModelNames("v4", "bfloat16", "auto"))
    assert model.pool_names == ("kv", "index_k", "index_v", "conv_state", "self_attn.attn~4x",
                                "self_attn.compressor.state_cache", "self_attn.indexer.k_cache~4x",
                                "self_attn.swa_cache")
    assert model.pools["kv"].layers == (0, 1) and model.pools["conv_state"].layers == (0, 1)  # shortest name keeps kv
    assert model.pools["self_attn.compressor.state_cache"].block_size == 8
    plan = build_plan(model, ParallelLayout.build(2, 2, 2), ParallelLayout.build(2, 2, 1))  # PP2 -> PP1
    check_plan(plan)
    assert {r.pool for r in plan.routes_to((0, 1))} == set(model.pool_names) - {"index_k", "index_v"}
    assert {r.src.rank for r in plan.routes_to((0, 1)) if r.pool == "conv_state"} == {(0, 1), (1, 1)}


def test_a_cache_without_a_declared_tp_split_refuses_different_tp_sizes_by_name():
    ring = CircularBufferSpec(block_size=8, num_kv_heads=2, head_size=64, dtype=BF16, head_size_v=0)
    kv = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, head_size_v=64, dtype=BF16)
    caches = stage_caches(config({"model.layers.0.attn": kv}, {"model.layers.0.self_attn.tail_cache": ring}), 2)
    model = model_from_caches(caches, 1, ModelNames("glm", "bfloat16", "auto"))
    check_plan(build_plan(model, ParallelLayout.build(1, 2, 1), ParallelLayout.build(1, 2, 1)))
    with pytest.raises(LayoutError, match=r"prefill runs tp=2 and decode tp=1, but vLLM's specs do not say how "
                                          r"self_attn.tail_cache \(CircularBufferSpec, layers 0\) split over TP"):
        build_plan(model, ParallelLayout.build(1, 2, 1), ParallelLayout.build(1, 1, 1))
    same = build_plan(model, ParallelLayout.build(1, 2, 1), ParallelLayout.build(1, 2, 1))
    assert {(r.src.tp, r.dst.tp) for r in same.routes if r.pool == "self_attn.tail_cache"} == {(0, 0), (1, 1)}


def test_in_a_model_vllm_runs_as_mla_a_ring_that_declares_no_split_is_replicated():
    """DeepSeek-V4.1's compressor ring and GLM-5-next's tail ring leave max_tp_shards unset; their models run as MLA
    (model_config.use_mla), where every attention cache is one latent per rank (NixlConnector reads them whole)."""
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=128, dtype=torch.float32, head_size_v=0)
    c = cache_facts("model.layers.0.self_attn.compressor.state_cache", ring, 0, 1, mla_model=True)
    assert (c.per_request, c.same_tp, c.sharded) == (True, False, False)
    assert cache_facts("model.layers.0.self_attn.compressor.state_cache", ring, 0, 1).same_tp  # not MLA: unknown
    mamba = MambaSpec(block_size=1024, shapes=((3, 64),), dtypes=(BF16,))
    assert cache_facts("model.layers.1.self_attn", mamba, 0, 1, mla_model=True).same_tp  # a GDN state stays split


def mamba2(tp: int, groups: int = 1, dim_first: bool = False) -> MambaSpec:
    """vLLM's MambaSpec of a Mamba2 layer of 8 heads of 16, state 16, kernel 4 at `tp` (its shapes as
    MambaStateShapeCalculator.mamba2_state_shape gives them; one group is copied to every rank)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    local_groups = 1 if groups == 1 else groups // tp
    channels = 8 // tp * 16 + 2 * local_groups * 16
    conv = (channels, 3) if dim_first else (3, channels)
    return MambaSpec(block_size=1024, shapes=(conv, (8 // tp, 16, 16)), dtypes=(BF16, torch.float32),
                     mamba_type=MambaAttentionBackendEnum.MAMBA2)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_mamba2_state_of_a_known_class_splits_into_pools_that_pair_any_tp_sizes(groups):
    """Each piece (connector.core.state_split) is a head-sharded per-request pool; the layouts of both sides have
    one fingerprint, and the plan from TP2 to TP1 sends decode every head of every piece once."""
    from connector.vllm.states import StateSplit

    def model_at(tp: int):
        name = "model.layers.0.mixer"
        split = StateSplit(tp, False, {name: ("mamba2", groups == 1 and tp > 1)})
        c = cache_facts(name, mamba2(tp, groups), 0, 1, split=split)
        assert not c.same_tp and len(c.pieces) == 3 * 3 + 1
        return model_from_caches([c], 1, ModelNames("m", "bfloat16", "auto"))

    one, two = model_at(1), model_at(2)
    assert one.fingerprint() == two.fingerprint()
    assert two.pools["mixer:conv-sd.r0.B"].num_heads == groups and two.pools["mixer:ssm"].num_heads == 8
    plan = build_plan(two, ParallelLayout.build(1, 2, 1), ParallelLayout.build(1, 1, 1))
    check_plan(plan)
    b_sources = {r.src.tp for r in plan.routes if r.pool == "mixer:conv-sd.r1.B"}
    assert len(b_sources) == groups  # one group: read whole from one rank; two: one from each


def test_a_state_whose_class_is_not_known_to_split_stays_tied_to_one_tp_size():
    """Kimi's and GLM-5-next's KDA layers declare GDN_ATTN but keep KDA's conv state: only the classes in
    SPLIT_MODULES split, and a state whose shapes are not its kind's stays whole, tied to one TP size."""
    from connector.vllm.states import StateSplit

    name = "model.layers.0.mixer"
    assert cache_facts(name, mamba2(2), 0, 1, split=StateSplit(2, False, {})).same_tp  # not a known module
    wrong_kind = StateSplit(2, False, {name: ("gdn", False)})
    assert cache_facts(name, mamba2(2), 0, 1, split=wrong_kind).same_tp  # declares MAMBA2, module says gdn
    odd = MambaSpec(block_size=1024, shapes=((3, 129), (4, 16, 16)), dtypes=(BF16, torch.float32))
    assert cache_facts(name, odd, 0, 1, split=StateSplit(2, False, {name: ("mamba2", False)})).same_tp


def test_state_split_of_reads_the_modules_exact_classes():
    """Which layers split, from vLLM's forward context: a module of exactly a class in SPLIT_MODULES, a Mamba2
    module whose conv1d is not merged per output holds its one group on every rank; a subclass does not count."""
    from types import SimpleNamespace

    from connector.vllm.states import SPLIT_MODULES, state_split_of

    def module(path: str, **attrs):
        mod, _, cls = path.rpartition(".")
        return type(cls, (), {"__module__": mod})() if not attrs else \
            type(cls, (), {"__module__": mod, **attrs})()

    merged, plain = (type(n, (), {})() for n in ("MergedColumnParallelLinear", "ColumnParallelLinear"))
    mamba2_path, gdn_path = list(SPLIT_MODULES)[1], list(SPLIT_MODULES)[2]
    context = {"model.layers.0.mixer": module(mamba2_path, conv1d=plain, tp_size=2),
               "model.layers.1.mixer": module(mamba2_path, conv1d=merged, tp_size=2),
               "model.layers.2.linear_attn": module(gdn_path),
               "model.layers.3.linear_attn": module("vllm.models.kimi_k3.nvidia.kda.KimiK3DeltaAttention")}
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context),
                          parallel_config=SimpleNamespace(tensor_parallel_size=2))
    split = state_split_of(cfg)
    assert split.tp == 2 and split.kinds == {"model.layers.0.mixer": ("mamba2", True),
                                             "model.layers.1.mixer": ("mamba2", False),
                                             "model.layers.2.linear_attn": ("gdn", False)}
