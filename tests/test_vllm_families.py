"""tests/vllm_families.py against vLLM 0.33's real planner and allocator: for every family x (TP1, TP2, PP2 stage 0,
PP2 stage 1) the groups vLLM builds cover every declared layer once, each layer gets a tensor whose page is the one
its spec states, and per-family facts hold (cache classes, group counts, rings, replication). Where vLLM's own cache
modules can be built on CPU, their get_kv_cache_spec (customized by their backend) must equal the fixture's spec.
Pure vLLM: nothing from the `connector` package."""

from __future__ import annotations

import dataclasses

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm==0.33.0")

from tests import vllm_harness as H  # noqa: E402

if H.VLLM_IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip(f"vllm import failed: {H.VLLM_IMPORT_ERROR!r}", allow_module_level=True)

import torch  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import (AttentionSpec, CircularBufferSpec, FullAttentionSpec,  # noqa: E402
                                        MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec,
                                        SparseCacheRole, UniformTypeKVCacheSpecs)
from vllm.v1.worker.utils import customize_attention_spec  # noqa: E402

from tests import vllm_families as F  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SETTINGS = {"tp1": dict(tp=1, pp=1, pp_rank=0), "tp2": dict(tp=2, pp=1, pp_rank=0),
            "pp2-stage0": dict(tp=1, pp=2, pp_rank=0), "pp2-stage1": dict(tp=1, pp=2, pp_rank=1)}
NUM_BLOCKS = 8


def layer_of(name: str) -> int:
    return int(name.split("model.layers.")[1].split(".")[0])


def group_specs(kvc) -> dict[str, object]:
    """{layer: the spec the planner gave it} over all groups (UniformTypeKVCacheSpecs unwrapped)."""
    out = {}
    for g in kvc.kv_cache_groups:
        for name in g.layer_names:
            spec = g.kv_cache_spec
            out[name] = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
    return out


@pytest.fixture(scope="module")
def planned():
    """(family, setting) -> (specs, vllm_config, kv_cache_config), or the exception vLLM raised."""
    out = {}
    for fam in F.FAMILIES:
        for setting, kw in SETTINGS.items():
            try:
                specs = F.family_layer_specs(fam, tp=kw["tp"], pp=kw["pp"], pp_rank=kw["pp_rank"])
                cfg, kvc = F.family_kv_cache_config(fam, num_blocks=NUM_BLOCKS, **kw)
                out[fam, setting] = (specs, cfg, kvc)
            except Exception as exc:  # checked against PLANNING_LIMITS below
                out[fam, setting] = exc
    return out


def test_family_list():
    assert len(F.FAMILIES) == len(set(F.FAMILIES)) == 13
    assert set(F.FAMILIES) == {"deepseek_v4", "deepseek_v41", "glm5next", "qwen4_exp", "step5", "kimi_k3",
                               "minimax_m3", "deepseek_v32", "hy_v4", "dots3_note", "inkling", "flint", "muse_spark"}
    for fam in F.FAMILIES:
        assert 4 <= F.family_num_layers(fam) <= 8
        assert F.family_kv_heads(fam) >= 1


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", F.FAMILIES)
def test_planner_covers_every_layer_and_allocates_each_page(planned, family, setting):
    result = planned[family, setting]
    limit = F.PLANNING_LIMITS.get((family, setting))
    if limit is not None:
        assert isinstance(result, Exception) and limit in str(result), result
        return
    assert not isinstance(result, Exception), repr(result)
    specs, cfg, kvc = result
    kw = SETTINGS[setting]
    lo, hi = H.get_pp_indices(F.family_num_layers(family), kw["pp_rank"], kw["pp"])
    assert specs and all(lo <= layer_of(n) < hi for n in specs)
    assert len({layer_of(n) for n in specs}) == hi - lo  # every layer of the stage declares a cache

    # the groups partition the declared layers
    names = [n for g in kvc.kv_cache_groups for n in g.layer_names]
    assert sorted(names) == sorted(specs) and len(names) == len(set(names))
    planned_specs = group_specs(kvc)
    for name, spec in specs.items():
        got = planned_specs[name]
        assert type(got) is type(spec), name
        # the planner may only rescale block size / pad the page to unify pages (kv_cache_planning.py:346-408)
        assert got == spec or got == dataclasses.replace(spec, block_size=got.block_size,
                                                         page_size_padded=got.page_size_padded), name

    # one tensor per layer, [B, H, N, C] of the planned spec: its page bytes, its dtype
    caches = F.allocate_family_caches(cfg, kvc)
    assert set(caches) == set(specs)
    layout = H.KVCacheLayout[kvc.kv_cache_layout]
    for name, tensor in caches.items():
        spec = planned_specs[name]
        assert tensor.shape[0] == kvc.num_blocks, name
        block_bytes = tensor[0].numel() * tensor.element_size()
        if isinstance(spec, MambaSpec):
            assert tensor.dtype == torch.int8 and tensor.shape[1:3] == (1, 1)
            assert block_bytes == spec.real_page_size_bytes
        else:
            assert tensor.dtype == spec.dtype, name
            assert tuple(tensor.shape[1:3]) == (spec.num_heads, spec.num_states), name
            assert tensor.shape[3] * tensor.element_size() == spec.state_content_size_bytes, name
            assert block_bytes == spec.real_page_size_bytes, name
        stride = tensor.stride(0) * tensor.element_size()
        assert stride >= spec.page_size_bytes, name
        if not layout.is_block_outermost:
            assert stride == F.planning._get_layer_block_stride(spec), name
    assert kvc.kv_cache_layout == cfg.cache_config.kv_cache_layout


@pytest.mark.parametrize("family", F.FAMILIES)
def test_pp_stages_split_the_model_and_share_group_ids(planned, family):
    if (family, "pp2-stage0") in F.PLANNING_LIMITS:
        pytest.skip(F.PLANNING_LIMITS[family, "pp2-stage0"])
    whole = planned[family, "tp1"][0]
    s0, _, kvc0 = planned[family, "pp2-stage0"]
    s1, _, kvc1 = planned[family, "pp2-stage1"]
    assert list(s0) + list(s1) == list(whole) and s0 == {n: whole[n] for n in s0}
    # the engine groups the whole model and projects it: both stages have the same groups (possibly empty)
    assert len(kvc0.kv_cache_groups) == len(kvc1.kv_cache_groups)
    for g0, g1 in zip(kvc0.kv_cache_groups, kvc1.kv_cache_groups):
        assert type(g0.kv_cache_spec) is type(g1.kv_cache_spec)


@pytest.mark.parametrize("family", F.FAMILIES)
def test_tp_ranks_declare_the_same_specs(planned, family):
    """Every family's caches are rank-symmetric: TP rank 1 declares what rank 0 does (the planner needs that:
    get_global_kv_cache_groups asserts equal specs for equal names across workers)."""
    assert F.family_layer_specs(family, tp=2, tp_rank=1) == planned[family, "tp2"][0]
    with pytest.raises(ValueError):
        F.family_layer_specs(family, tp=2, tp_rank=2)


def test_single_stage_planning_is_the_engines_global_grouping():
    """For PP 1, make_kv_cache_config (get_kv_cache_groups) and the engine's get_global_kv_cache_groups agree."""
    for fam in ("deepseek_v4", "qwen4_exp", "step5"):
        cfg, kvc = F.family_kv_cache_config(fam, num_blocks=NUM_BLOCKS)
        specs = F.family_layer_specs(fam)
        groups = F.planning.get_global_kv_cache_groups(cfg, [specs])
        assert [g.layer_names for g in groups] == [g.layer_names for g in kvc.kv_cache_groups]
        assert [g.kv_cache_spec for g in groups] == [g.kv_cache_spec for g in kvc.kv_cache_groups]


# ---------------------------------------------------------------------------------------------------------------
# per-family facts (reference: /work/shared/reference/vllm-0.33-cache-specs.md section 3)

def by_suffix(specs, suffix):
    return {n: s for n, s in specs.items() if n.endswith(suffix)}


def group_kinds(kvc):
    out = []
    for g in kvc.kv_cache_groups:
        spec = g.kv_cache_spec
        out.append(type(spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec).__name__)
    return out


def test_deepseek_v4(planned):
    specs, cfg, kvc = planned["deepseek_v4", "tp1"]
    assert cfg.cache_config.cache_dtype == "fp8_ds_mla" and cfg.cache_config.block_size == 256
    assert kvc.kv_cache_layout == "BLHNC"  # the indexer backend declares block-outermost layouts only
    assert len(kvc.kv_cache_groups) == 6
    assert group_kinds(kvc) == ["SlidingWindowMLASpec"] * 3 + ["MLAAttentionSpec"] + ["SlidingWindowMLASpec"] * 2
    ratios = {layer_of(n): s.tokens_per_state for n, s in specs.items() if n.endswith(".attn")}
    assert ratios == {1: 128, 2: 4, 3: 128, 4: 4, 5: 128, 6: 4}  # sliding layers 0 and 7 declare no main cache
    assert set(by_suffix(specs, ".attn.swa_cache")) == {f"model.layers.{i}.attn.swa_cache" for i in range(8)}
    for s in by_suffix(specs, ".swa_cache").values():
        assert type(s) is SlidingWindowMLASpec and not isinstance(s, MLAAttentionSpec)  # the isinstance trap
        assert (s.block_size, s.state_content_size_bytes, s.sliding_window, s.max_tp_shards) == (64, 584, 128, 1)
        assert s.page_size_bytes == 37440  # 64 * 584 padded to 576
    main = specs["model.layers.2.attn"]
    assert (main.dtype, main.state_content_size_bytes, main.alignment, main.num_states) == (torch.uint8, 584, 576, 64)
    index = specs["model.layers.2.attn.indexer.k_cache"]
    assert index.cache_role == SparseCacheRole.SPARSE and index.head_size == 132 and index.tokens_per_state == 4
    states = by_suffix(specs, "compressor.state_cache")
    assert len(states) == 3 + 3 + 3  # ratio-128 main, ratio-4 main, ratio-4 indexer
    assert {(s.block_size, s.head_size, s.sliding_window) for s in states.values()} == {
        (8, 1024, 128), (4, 2048, 8), (4, 512, 8)}
    assert all(s.dtype == torch.float32 for s in states.values())
    assert kvc.kv_tp_replicas == 1
    specs2, _, kvc2 = planned["deepseek_v4", "tp2"]
    assert specs2 == specs and kvc2.kv_tp_replicas == 2  # every cache is max_tp_shards=1: fully replicated


def test_deepseek_v41(planned):
    specs, cfg, kvc = planned["deepseek_v41", "tp1"]
    assert cfg.cache_config.cache_dtype == "fp8_ds_mla"
    rings = by_suffix(specs, "compressor.state_cache")
    assert set(rings) == {f"language_model.model.layers.{i}.attn.compressor.state_cache" for i in (1, 5)}
    assert all(type(s) is CircularBufferSpec and (s.block_size, s.head_size, s.head_size_v) == (8, 1024, 0)
               and s.max_tp_shards is None and s.dtype == torch.float32 for s in rings.values())
    ring_groups = [g for g, kind in zip(kvc.kv_cache_groups, group_kinds(kvc)) if kind == "CircularBufferSpec"]
    assert len(ring_groups) == 1 and set(ring_groups[0].layer_names) == set(rings)
    mains = {n: s for n, s in specs.items() if n.endswith(".attn")}
    assert {layer_of(n) for n in mains} == {1, 3, 5, 7}  # kv sources only
    assert all(s.max_tp_shards is None and s.state_content_size_bytes == 584 for s in mains.values())
    assert {layer_of(n): s.tokens_per_state for n, s in mains.items()} == {1: 2, 3: 1, 5: 2, 7: 1}
    swa = by_suffix(specs, ".swa_cache")
    assert len(swa) == 8 and all(s.block_size == 32 and s.bounded_replay for s in swa.values())
    assert kvc.kv_cache_layout == "BLHNC" and cfg.cache_config.block_size == 128


def test_glm5next(planned):
    specs, cfg, kvc = planned["glm5next", "tp1"]
    tails = by_suffix(specs, ".indexer.tail_cache")
    assert len(tails) == 2
    for s in tails.values():
        assert type(s) is CircularBufferSpec
        assert (s.block_size, s.num_kv_heads, s.head_size, s.head_size_v, s.dcp_sharded) == (16, 2, 128, 0, False)
    keys = by_suffix(specs, ".indexer.k_cache")
    assert all(s.cache_role == SparseCacheRole.INDEXER and s.tokens_per_state == 16 for s in keys.values())
    kda = [s for s in specs.values() if isinstance(s, MambaSpec)]
    assert len(kda) == 6 and all(s.mamba_type == MambaAttentionBackendEnum.GDN_ATTN for s in kda)
    assert all(s.prefill_checkpoint_alignment == 16 and s.num_prefill_checkpoint_blocks == 1 for s in kda)
    mla = by_suffix(specs, ".self_attn.attn")
    assert all(s.head_size == 512 and s.topk_buffer_width == 128 and s.is_index_group_leader for s in mla.values())
    # hybrid alignment: the KDA page is padded to exactly the MLA page (platforms/interface.py:1100-1140)
    assert {s.page_size_bytes for s in kda} == {next(iter(mla.values())).page_size_bytes}
    assert group_kinds(kvc).count("CircularBufferSpec") == 1 and len(kvc.kv_cache_groups) == 5
    assert kvc.kv_cache_layout == "BLHNC"
    specs2 = planned["glm5next", "tp2"][0]
    k1 = specs["language_model.model.layers.0.self_attn"]
    k2 = specs2["language_model.model.layers.0.self_attn"]
    assert k2.shapes[1][0] * 2 == k1.shapes[1][0]  # recurrent state heads split over TP


def test_qwen4_exp(planned):
    specs, cfg, kvc = planned["qwen4_exp", "tp1"]
    raw = by_suffix(specs, ".indexer.raw_key_cache")
    assert len(raw) == 2 and all(type(s) is CircularBufferSpec and s.block_size == 4 for s in raw.values())
    comp = by_suffix(specs, ".indexer.compressed_key_cache")
    assert all(type(s) is MLAAttentionSpec and s.tokens_per_state == 4 and s.max_tp_shards is None
               and s.cache_role == SparseCacheRole.SPARSE for s in comp.values())
    ple = by_suffix(specs, ".ple")
    assert set(ple) == {"language_model.model.layers.2.ple", "language_model.model.layers.6.ple"}
    assert all(s.tp_replicated and s.mamba_type == MambaAttentionBackendEnum.SHORT_CONV for s in ple.values())
    gdn = by_suffix(specs, ".linear_attn")
    assert len(gdn) == 6 and not any(s.tp_replicated for s in gdn.values())
    assert all(s.prefill_checkpoint_alignment == cfg.cache_config.mamba_block_size for s in gdn.values())
    main = by_suffix(specs, ".self_attn.attn")
    assert all(type(s) is FullAttentionSpec and s.num_kv_heads == 2 for s in main.values())
    assert kvc.kv_cache_layout == "BLNHC"
    specs2 = planned["qwen4_exp", "tp2"][0]
    p1, p2 = specs["language_model.model.layers.2.ple"], specs2["language_model.model.layers.2.ple"]
    assert p2.shapes == p1.shapes  # tp_replicated: the whole state on every rank (only the page padding follows TP)
    g1, g2 = specs["language_model.model.layers.0.linear_attn"], specs2["language_model.model.layers.0.linear_attn"]
    assert g2.shapes[1][0] * 2 == g1.shapes[1][0]  # GDN heads split
    assert specs2["language_model.model.layers.3.self_attn.attn"].num_kv_heads == 1
    assert F.PLANNING_LIMITS["qwen4_exp", "pp2-stage0"].startswith("Qwen4Exp N-gram PLE embedding requires")


def test_step5(planned):
    specs, cfg, kvc = planned["step5", "tp1"]
    summaries = by_suffix(specs, ".sparse_summary_cache")
    rings = by_suffix(specs, ".csa_tail_ring")
    assert {layer_of(n) for n in summaries} == {layer_of(n) for n in rings} == {1, 3, 5}  # full (DSA) layers
    for name, s in summaries.items():
        assert type(s) is FullAttentionSpec and (s.head_size, s.head_size_v, s.dtype, s.tokens_per_state) == (
            256, 0, torch.uint8, 8)
    for name, s in rings.items():
        main = specs[name.removesuffix(".csa_tail_ring")]
        assert type(s) is CircularBufferSpec and s.page_size_bytes == main.page_size_bytes
        assert s.block_stride_alignment == 1024
    assert all(type(specs[f"model.layers.{i}.self_attn.attn"]) is SlidingWindowSpec for i in (0, 2, 4))
    assert kvc.kv_cache_layout == "BLNHC"
    assert "MooncakeStoreConnector" in F.ENGINE_REFUSALS["step5"]


def test_kimi_k3(planned):
    specs, cfg, kvc = planned["kimi_k3", "tp1"]
    kda = {n: s for n, s in specs.items() if isinstance(s, MambaSpec)}
    mla = {n: s for n, s in specs.items() if isinstance(s, MLAAttentionSpec)}
    assert {layer_of(n) for n in mla} == {3, 7} and len(kda) == 6
    assert all(s.max_tp_shards == 1 and s.num_kv_heads == 1 and s.head_size == 192 for s in mla.values())
    assert all(s.prefill_checkpoint_alignment == 16 and s.mamba_cache_mode == "align" for s in kda.values())
    assert group_kinds(kvc) == ["MambaSpec"] * 3 + ["MLAAttentionSpec"]
    assert cfg.cache_config.block_size == 768
    specs2, cfg2, _ = planned["kimi_k3", "tp2"]
    a, b = specs["language_model.model.layers.0.self_attn"], specs2["language_model.model.layers.0.self_attn"]
    assert b.shapes[1][0] * 2 == a.shapes[1][0] and cfg2.cache_config.block_size == 384


def test_minimax_m3(planned):
    specs, cfg, kvc = planned["minimax_m3", "tp1"]
    assert len(kvc.kv_cache_groups) == 1 and isinstance(kvc.kv_cache_groups[0].kv_cache_spec,
                                                         UniformTypeKVCacheSpecs)
    index = by_suffix(specs, ".index_cache")
    assert {layer_of(n) for n in index} == {2, 3, 4, 5}
    assert all(s.cache_role == SparseCacheRole.INDEXER and s.max_tp_shards is None for s in index.values())
    assert planned["minimax_m3", "tp2"][0]["language_model.model.layers.0.self_attn.attn"].num_kv_heads == 2
    # the harness builds the same specs for its own M3 config (tests/vllm_harness.layer_specs)
    assert specs == H.layer_specs(cfg)


def test_deepseek_v32_and_hy_v4(planned):
    specs, cfg, kvc = planned["deepseek_v32", "tp1"]
    assert len(kvc.kv_cache_groups) == 1 and cfg.cache_config.block_size == 64
    assert all(s.cache_role == SparseCacheRole.INDEXER for s in by_suffix(specs, ".k_cache").values())
    mla = by_suffix(specs, ".self_attn.attn")
    assert all(s.head_size == 192 and s.dtype == torch.bfloat16 and s.is_index_group_leader and s.topk_buffer_width
               == 64 for s in mla.values())
    assert planned["deepseek_v32", "tp2"][2].kv_tp_replicas == 2
    specs, _, kvc = planned["hy_v4", "tp1"]
    assert {layer_of(n) for n in by_suffix(specs, ".k_cache")} == {1, 3, 5}  # 0 dense, 2 and 4 share top-k
    assert not specs["model.layers.2.self_attn.attn"].is_index_group_leader
    assert len(kvc.kv_cache_groups) == 1


def test_dots3_note(planned):
    specs, cfg, kvc = planned["dots3_note", "tp1"]
    sliding = {n: s for n, s in specs.items() if isinstance(s, SlidingWindowMLASpec)}
    assert {layer_of(n) for n in sliding} == {0, 2, 4}
    assert not any(isinstance(s, MLAAttentionSpec) for s in sliding.values())
    full = {n: s for n, s in specs.items() if type(s) is MLAAttentionSpec and n.endswith(".attn")}
    assert all(s.head_size == 1088 for s in full.values())  # padded to the SWA latent width
    assert {s.page_size_bytes for s in full.values()} == {s.page_size_bytes for s in sliding.values()}
    assert kvc.kv_cache_layout == "BLHNC" and len(kvc.kv_cache_groups) == 2


def test_inkling_flint_muse(planned):
    specs, _, kvc = planned["inkling", "tp1"]
    conv = by_suffix(specs, ".conv_state")
    assert len(conv) == 6 and all(type(s) is SlidingWindowSpec and (s.block_size, s.head_size_v, s.head_size) ==
                                  (4, 0, 512) for s in conv.values())
    assert len(kvc.kv_cache_groups) == 6
    assert planned["inkling", "tp2"][0]["model.layers.0.conv_state"].num_kv_heads == 1
    for fam, full_layers in (("flint", {2, 5}), ("muse_spark", {3, 7})):
        specs, _, kvc = planned[fam, "tp1"]
        assert {layer_of(n) for n, s in specs.items() if type(s) is FullAttentionSpec} == full_layers
        assert all(type(s) in (FullAttentionSpec, SlidingWindowSpec) for s in specs.values())
        assert planned[fam, "tp2"][0][next(iter(specs))].num_kv_heads == 1


# ---------------------------------------------------------------------------------------------------------------
# the fixtures' hand-built specs against vLLM's own cache modules, where those build on CPU

def module_spec(cfg, module):
    spec = module.get_kv_cache_spec(cfg)
    return customize_attention_spec(module.get_attn_backend(), spec) if isinstance(spec, AttentionSpec) else spec


def cache_modules(family, cfg, specs):
    """(name, vLLM cache module) for the cache-only modules of the family that build without a GPU."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    hf = cfg.model_config.hf_text_config
    out = []
    for name in specs:
        if family == "deepseek_v4":
            from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
            from vllm.models.deepseek_v4.compressor import CompressorStateCache
            from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekSparseSWAFlashMLABackend
            from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
            ratio = specs[name].tokens_per_state if name.endswith("k_cache") else None
            if name.endswith(".swa_cache"):
                out.append((name, DeepseekV4SWACache(head_dim=512, window_size=hf.sliding_window, dtype=torch.uint8,
                                                     prefix=name, cache_config=cfg.cache_config,
                                                     backend_cls=DeepseekSparseSWAFlashMLABackend)))
            elif name.endswith("indexer.k_cache"):
                out.append((name, DeepseekV4IndexerCache(head_dim=132, dtype=torch.uint8, prefix=name,
                                                         cache_config=cfg.cache_config, compress_ratio=ratio)))
            elif name.endswith("state_cache"):
                ratio = 4 if specs[name].block_size == 4 else 128
                dim = 128 if ".indexer." in name else 512
                out.append((name, CompressorStateCache(state_dim=2 * (1 + (ratio == 4)) * dim, dtype=torch.float32,
                                                       compress_ratio=ratio, prefix=name)))
        elif family == "deepseek_v41":
            from vllm.models.deepseek_v41.attention import DeepseekV4IndexerCache
            from vllm.models.deepseek_v41.compressor import CompressorStateCache
            from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekSparseSWAFlashMLABackend
            from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
            if name.endswith(".swa_cache"):
                out.append((name, DeepseekV4SWACache(
                    head_dim=512, window_size=hf.sliding_window, dtype=torch.uint8, prefix=name,
                    cache_config=cfg.cache_config, backend_cls=DeepseekSparseSWAFlashMLABackend, block_size=32,
                    packed_bytes_per_token=584, packed_page_alignment=576, packed_block_stride_alignment=None,
                    bounded_replay=True)))
            elif name.endswith("indexer.k_cache"):
                out.append((name, DeepseekV4IndexerCache(head_dim=132, dtype=torch.uint8, prefix=name,
                                                         cache_config=cfg.cache_config,
                                                         compress_ratio=specs[name].tokens_per_state)))
            elif name.endswith("state_cache"):
                out.append((name, CompressorStateCache(state_dim=1024, dtype=torch.float32, prefix=name)))
        elif family in ("deepseek_v32", "hy_v4", "dots3_note") and name.endswith("indexer.k_cache"):
            out.append((name, DeepseekV32IndexerCache(head_dim=132, dtype=torch.uint8, prefix=name,
                                                      cache_config=cfg.cache_config)))
        elif family == "glm5next":
            from vllm.models.glm5next.common.attention import Glm5NextIndexerCache, Glm5NextTailCache
            if name.endswith("k_cache"):
                out.append((name, Glm5NextIndexerCache(head_dim=132, dtype=torch.uint8, prefix=name,
                                                       cache_config=cfg.cache_config, index_kpool=hf.index_kpool)))
            elif name.endswith("tail_cache"):
                out.append((name, Glm5NextTailCache(head_dim=128, dtype=torch.bfloat16, prefix=name,
                                                    cache_config=cfg.cache_config, index_kpool=hf.index_kpool)))
        elif family == "qwen4_exp":
            from vllm.models.qwen4_exp.common.qsa_cache import QSACompressedKeyCache, QSAKeyStateCache
            common = dict(head_size=hf.indexer_head_dim, cache_config=cfg.cache_config, prefix=name,
                          vllm_config=cfg, compress_ratio=hf.indexer_compress_ratio)
            if name.endswith("raw_key_cache"):
                out.append((name, QSAKeyStateCache(dtype=torch.bfloat16,
                                                   cache_rope_positions=cfg.model_config.uses_mrope, **common)))
            elif name.endswith("compressed_key_cache"):
                out.append((name, QSACompressedKeyCache(dtype=torch.bfloat16, **common)))
        elif family == "step5" and name.endswith("sparse_summary_cache"):
            from vllm.models.step5.nvidia.sparse_summary_cache import Step5SparseSummaryCacheLayer
            out.append((name, Step5SparseSummaryCacheLayer(prefix=name, target_impl=None,
                                                           static_forward_context=cfg.compilation_config
                                                           .static_forward_context)))
        elif family == "minimax_m3" and name.endswith("index_cache"):
            from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerCache
            out.append((name, MiniMaxM3IndexerCache(head_dim=hf.sparse_attention_config["sparse_index_dim"],
                                                    prefix=name, cache_config=cfg.cache_config)))
        elif family == "inkling" and name.endswith("conv_state"):
            from vllm.models.inkling.nvidia.sconv_swa_attn import InklingConvState
            local = layer_of(name) in hf.local_layer_ids
            out.append((name, InklingConvState(
                num_kv_heads=hf.swa_num_key_value_heads if local else hf.num_key_value_heads,
                head_dim=hf.swa_head_dim if local else hf.head_dim, hidden_size=hf.hidden_size,
                kernel_size=hf.sconv_kernel_size, prefix=name)))
    return out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41", "deepseek_v32", "hy_v4", "dots3_note",
                                    "glm5next", "qwen4_exp", "step5", "minimax_m3", "inkling"])
def test_specs_match_vllm_cache_modules(family, tp):
    cfg = F.make_family_vllm_config(family, tp=tp)
    specs = F.family_layer_specs(family, tp=tp)
    with set_current_vllm_config(cfg), H.fake_parallel_groups(tp_size=tp):
        modules = cache_modules(family, cfg, specs)
        assert modules
        for name, module in modules:
            assert module_spec(cfg, module) == specs[name], name


@pytest.mark.parametrize("family", ["kimi_k3", "glm5next", "qwen4_exp"])
def test_mamba_shapes_match_the_model_classes(family):
    """The model classes' own state-shape helpers (what _align_hybrid_block_size sizes pages with)."""
    from vllm.model_executor.models import ModelRegistry
    for tp in (1, 2):
        cfg = F.make_family_vllm_config(family, tp=tp)
        specs = [s for s in F.family_layer_specs(family, tp=tp).values() if isinstance(s, MambaSpec)]
        model_cls, _ = ModelRegistry.resolve_model_cls(cfg.model_config.architectures, model_config=cfg.model_config)
        if family == "qwen4_exp":
            expected = {(m.shapes, m.dtypes, m.tp_replicated) for m in model_cls.get_mamba_specs_from_config(cfg)}
        else:
            expected = {(tuple(model_cls.get_mamba_state_shape_from_config(cfg)),
                         tuple(model_cls.get_mamba_state_dtype_from_config(cfg)), False)}
        assert {(s.shapes, s.dtypes, s.tp_replicated) for s in specs} == expected
        assert {s.page_size_bytes for s in specs} == {cfg.cache_config.mamba_page_size_padded}
