"""The model's layout from vLLM 0.33's own KV-cache specs (connector.vllm.specs), not from an architecture table:
each spec class to its pool, draft (MTP) layers after the hidden ones, refusals that name the layer, and the same
layout as the Hugging Face parser gives for every model the harness builds."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm==0.33.0")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (CrossAttentionSpec, FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec,
                                        SparseCacheRole, UniformTypeKVCacheSpecs)

from connector.core.errors import LayoutError  # noqa: E402
from connector.vllm.specs import (ModelNames, cache_facts, layer_id, model_from_caches,  # noqa: E402
                                  stage_caches)
from tests import vllm_harness as H  # noqa: E402

pytestmark = pytest.mark.vllm
NAMES = ModelNames("m", "bfloat16", "auto")


def full(heads: int = 2, head: int = 64, dtype=torch.bfloat16, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head, head_size_v=head, dtype=dtype, **kw)


def config(*groups: dict) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(g), UniformTypeKVCacheSpecs.from_specs(g) or next(iter(g.values()))) for g in groups])


def test_each_spec_class_goes_to_its_pool_with_its_sizes():
    kv = cache_facts("model.layers.3.self_attn.attn", full(heads=2), 0, total_kv_heads=8)
    assert (kv.pool, kv.layer, kv.num_heads, kv.bytes_per_token_per_head, kv.num_parts, kv.sharded) == \
        ("kv", 3, 8, 2 * 64 * 2, 2, True)  # K and V of one head, the model's 8 heads over TP
    window = cache_facts("model.layers.1.self_attn.attn", SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, head_size_v=64, dtype=torch.float32, sliding_window=48), 1, 2)
    assert (window.pool, window.bytes_per_token_per_head, window.group, window.spec) == \
        ("kv", 2 * 64 * 4, 1, "SlidingWindowSpec")
    mla = cache_facts("model.layers.0.self_attn.attn", MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16), 0, 1)
    assert (mla.pool, mla.num_heads, mla.bytes_per_token_per_head, mla.num_parts, mla.sharded) == \
        ("kv", 1, 576 * 2, 1, False)
    indexer = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=132, dtype=torch.uint8,
                               cache_role=SparseCacheRole.INDEXER)
    assert cache_facts("model.layers.2.self_attn.indexer.k_cache", indexer, 0, 1).pool == "index_k"
    assert cache_facts("m.layers.2.self_attn.attn.index_value_cache", indexer, 0, 1).pool == "index_v"


@pytest.mark.parametrize("spec, words", [
    (CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16), "an encoder's cache"),
])
def test_a_cache_it_cannot_move_is_refused_naming_the_layer(spec, words):
    with pytest.raises(LayoutError) as err:
        stage_caches(config({"model.layers.0.self_attn.attn": full()}, {"model.layers.1.mixer": spec}), 2)
    assert "KV-cache layer model.layers.1.mixer" in str(err.value) and words in str(err.value)


def test_a_layer_name_without_an_index_is_refused():
    with pytest.raises(LayoutError, match="cannot find a layer index in KV-cache layer name 'encoder.attn'"):
        stage_caches(config({"encoder.attn": full()}), 2)


def test_draft_layers_come_after_the_hidden_ones():
    draft = frozenset({"model.layers.0.self_attn.attn", "model.layers.61.self_attn.attn"})
    assert layer_id("model.layers.0.self_attn.attn", draft, 60) == 60  # MiniMax-M3's drafter counts from 0
    assert layer_id("model.layers.61.self_attn.attn", draft, 61) == 61  # DeepSeek's from num_hidden_layers
    assert layer_id("language_model.model.layers.0.self_attn.attn", draft, 60) == 0  # the target's own
    # vLLM 0.33 also marks the spec itself
    caches = stage_caches(config({"language_model.model.layers.0.self_attn.attn": full(),
                                  "model.layers.0.self_attn.attn": full(is_draft=True)}), 2, num_hidden_layers=1)
    assert [c.layer for c in caches] == [0, 1]
    model = model_from_caches(caches, 1, NAMES)
    assert (model.num_layers, model.pools["kv"].layers) == (2, (0, 1))


def test_a_pool_with_two_sizes_is_refused_naming_both_layers():
    caches = stage_caches(config({"model.layers.0.attn": full(heads=2), "model.layers.1.attn": full(heads=2,
                                                                                                      head=128)}), 2)
    with pytest.raises(LayoutError, match=r"kv caches of different sizes: layer 0 \(model.layers.0.attn, "
                                          r"FullAttentionSpec\) has 2 head\(s\) x 256 B per token \(sharded over "
                                          r"TP\) but layer 1 .* has 2 head\(s\) x 512 B"):
        model_from_caches(caches, 2, NAMES)


def test_two_caches_for_one_pool_and_layer_are_refused():
    caches = stage_caches(config({"model.layers.0.attn": full()}), 2)
    other = stage_caches(config({"draft.layers.0.attn": full()}), 2)
    with pytest.raises(LayoutError, match="two KV-cache layers are kv of layer 0: model.layers.0.attn and "
                                          "draft.layers.0.attn"):
        model_from_caches(caches + other, 1, NAMES)


@pytest.mark.parametrize("model", ["m3", "m3v", "dsv32", "dense", "m3-mtp", "dsv32-mtp"])
def test_the_specs_of_every_harness_model_give_the_hf_parsers_layout(tmp_path, model):
    from connector.vllm.regions import model_layout_from_hf

    mtp = int(model.endswith("-mtp"))
    base = model.removesuffix("-mtp")
    if base in ("m3", "m3v"):
        path = H.write_m3_config(tmp_path, index_value_layers=(3, 6) if base == "m3v" else (), mtp_layers=mtp)
    elif base == "dsv32":
        path = H.write_dsv32_config(tmp_path, mtp_layers=mtp)
    else:
        path = H.write_dense_config(tmp_path)
    cfg = H.make_vllm_config(path, kv_role="kv_producer")
    hidden = cfg.model_config.hf_text_config.num_hidden_layers
    caches = stage_caches(H.make_kv_cache_config(cfg), cfg.model_config.get_total_num_kv_heads(),
                          H.draft_layer_names(cfg), hidden)
    from_specs = model_from_caches(caches, hidden, NAMES)
    from_hf = model_layout_from_hf(cfg)
    assert from_specs.num_layers == hidden + mtp
    for pool, spec in from_hf.pools.items():
        got = from_specs.pools[pool]
        assert tuple(i for i in got.layers if i < hidden) == spec.layers, pool
        if spec.layers:
            assert (got.num_heads, got.bytes_per_token_per_head, got.num_parts, got.sharded) == \
                (spec.num_heads, spec.bytes_per_token_per_head, spec.num_parts, spec.sharded), pool
    if mtp:
        assert hidden in from_specs.pools["kv"].layers and hidden in from_specs.pools["index_k"].layers
