"""connector.core.hf_config: layouts from config.json files and presets, sized as vLLM 0.33 allocates its caches."""

from __future__ import annotations

import copy
import json

import pytest

from connector.core.errors import LayoutError
from connector.core.hf_config import PRESETS, dsa_indexer_layers, load_model, model_from_config
from connector.core.layout import POOLS, ModelLayout


def _write(path, config) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return str(path)


def _m3_text(num_layers=60, dense=3, disable=None, **over):
    freq = [0] * dense + [1] * (num_layers - dense)
    text = {
        "num_hidden_layers": num_layers, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "hidden_size": 6144,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": 128, "sparse_num_index_heads": 4,
            "sparse_attention_freq": freq,
            "sparse_disable_index_value": disable if disable is not None else [0] * dense + [1] * (num_layers - dense),
        },
    }
    text.update(over)
    return text


def _m3_top(**over):
    return {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
            "torch_dtype": "bfloat16", "text_config": _m3_text(**over)}


def _dsa(**over):
    cfg = copy.deepcopy(json.loads(PRESETS["deepseek-v3.2"].read_text()))
    cfg.update(over)
    return cfg


def _llama(**over):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}
    cfg.update(over)
    return cfg


def _pools(m: ModelLayout):
    return {n: (m.pools[n].layers, m.pools[n].num_heads, m.pools[n].bytes_per_token_per_head, m.pools[n].num_parts,
                m.pools[n].sharded) for n in POOLS}


def _raises(match, fn, *args, **kwargs) -> str:
    with pytest.raises(LayoutError, match=match) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and msg.strip() == msg
    return msg


# ---------------------------------------------------------------------------------------------------------------
# presets

def test_presets_exist():
    assert set(PRESETS) == {"minimax-m3", "deepseek-v3.2", "qwen3-8b"}
    for path in PRESETS.values():
        assert path.is_file()
        json.loads(path.read_text())


def test_preset_minimax_m3():
    m = load_model("minimax-m3")
    assert (m.name, m.num_layers, m.dtype, m.kv_cache_dtype) == ("minimax-m3", 60, "bfloat16", "auto")
    kv, ik, iv = (m.pools[n] for n in POOLS)
    assert kv.layers == tuple(range(60)) and (kv.num_heads, kv.bytes_per_token_per_head) == (4, 512)
    assert kv.num_parts == 2 and kv.sharded and kv.bytes_per_token == 2048
    assert ik.layers == tuple(range(3, 60)) and (ik.num_heads, ik.bytes_per_token_per_head) == (1, 256)
    assert ik.num_parts == 1 and not ik.sharded
    assert iv.layers == () and not iv.sharded
    assert m.bytes_per_token() == 60 * 2048 + 57 * 256


def test_preset_minimax_m3_fp8():
    m = load_model("minimax-m3", "fp8")
    assert m.kv_cache_dtype == "fp8"
    assert m.pools["kv"].bytes_per_token_per_head == 256
    # vLLM keeps the index cache bf16 whatever --kv-cache-dtype says (resolve_indexer_kv_dtype("bf16")).
    assert m.pools["index_k"].bytes_per_token_per_head == 256
    assert load_model("minimax-m3", "fp8", indexer_kv_dtype="fp8").pools["index_k"].bytes_per_token_per_head == 128
    _raises(r'indexer_kv_dtype "mxfp4"', load_model, "minimax-m3", indexer_kv_dtype="mxfp4")


def test_preset_deepseek_v32():
    m = load_model("deepseek-v3.2")
    assert (m.num_layers, m.dtype) == (61, "bfloat16")
    assert _pools(m) == {
        "kv": (tuple(range(61)), 1, 1152, 1, False),
        "index_k": (tuple(range(61)), 1, 132, 1, False),
        "index_v": ((), 1, 0, 1, False),
    }
    f = load_model("deepseek-v3.2", "fp8")
    assert f.pools["kv"].bytes_per_token_per_head == 656
    assert f.pools["index_k"].bytes_per_token_per_head == 132
    assert f.pools["index_k"].layers == tuple(range(61))
    _raises(r'indexer_kv_dtype "bf16"', load_model, "deepseek-v3.2", indexer_kv_dtype="bf16")


def test_preset_qwen3_8b():
    m = load_model("qwen3-8b")
    assert m.num_layers == 36
    assert _pools(m)["kv"] == (tuple(range(36)), 8, 512, 2, True)
    assert m.pools["index_k"].layers == () and m.pools["index_v"].layers == ()
    assert load_model("qwen3-8b", "fp8").pools["kv"].bytes_per_token_per_head == 256


def test_fingerprint_depends_on_kv_dtype():
    assert load_model("minimax-m3").fingerprint() == load_model("minimax-m3").fingerprint()
    assert load_model("minimax-m3").fingerprint() != load_model("minimax-m3", "fp8").fingerprint()


# ---------------------------------------------------------------------------------------------------------------
# configs written by the test

def test_m3_top_level_and_text_only_agree(tmp_path):
    top = load_model(_write(tmp_path / "top" / "config.json", _m3_top()))
    text = load_model(_write(tmp_path / "text" / "config.json",
                             {"architectures": ["MiniMaxM3SparseForCausalLM"], "torch_dtype": "bfloat16",
                              **_m3_text()}))
    assert _pools(top) == _pools(text) == _pools(load_model("minimax-m3"))
    assert top.name == "top" and text.name == "text"


def test_m3_text_only_by_model_type(tmp_path):
    cfg = {"model_type": "minimax_m3_text", **_m3_text(num_layers=8, dense=2)}
    m = model_from_config(cfg, "tiny")
    assert m.pools["index_k"].layers == tuple(range(2, 8))


def test_m3_index_value_layers():
    disable = [0, 0, 0] + [0, 1, 0, 1] + [1] * 53
    m = model_from_config(_m3_top(disable=disable), "m3v")
    assert m.pools["index_k"].layers == tuple(range(3, 60))
    assert m.pools["index_v"].layers == (3, 5)  # dense layers 0-2 never keep an index value
    assert m.pools["index_v"].bytes_per_token_per_head == 256 and not m.pools["index_v"].sharded


def test_m3_irregular_sparse_layers_and_short_lists():
    text = _m3_text(num_layers=6)
    text["sparse_attention_config"]["sparse_attention_freq"] = [0, 1, 0, 1]  # layers 4, 5 dense (vLLM enumerate)
    text["sparse_attention_config"]["sparse_disable_index_value"] = [0, 0]  # missing entries: K-only
    m = model_from_config({"model_type": "minimax_m3", **text}, "m")
    assert m.pools["index_k"].layers == (1, 3)
    assert m.pools["index_v"].layers == (1,)


def test_m3_sparse_config_at_top_level():
    text = _m3_text(num_layers=4, dense=1)
    sparse = text.pop("sparse_attention_config")
    cfg = {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "text_config": text,
           "sparse_attention_config": sparse}
    assert model_from_config(cfg, "m").pools["index_k"].layers == (1, 2, 3)


def test_m3_dtype_from_text_or_default():
    assert model_from_config(_m3_top(torch_dtype="float16"), "m").dtype == "float16"
    cfg = _m3_top()
    del cfg["torch_dtype"]
    assert model_from_config(cfg, "m").dtype == "bfloat16"
    cfg["text_config"]["dtype"] = "float32"  # vLLM downcasts float32 to bfloat16 on CUDA
    assert model_from_config(cfg, "m").dtype == "bfloat16"


@pytest.mark.parametrize("pattern_kwargs, expected", [
    ({}, tuple(range(8))),
    ({"index_topk_freq": 4}, (0, 1, 5)),  # offset 2: max(l - 1, 0) % 4 == 0
    ({"index_topk_freq": 2, "index_skip_topk_offset": 0}, (1, 3, 5, 7)),  # (l + 1) % 2 == 0
    ({"index_topk_freq": 3, "index_skip_topk_offset": 3}, (0, 1, 2, 5)),
    ({"index_topk_pattern": "FSSFFS"}, (0, 3, 4, 6, 7)),  # past the pattern: indexer
    ({"index_topk_pattern": ["F", "S", "F", "S", "F", "S", "F", "S"], "index_topk_freq": 4}, (0, 2, 4, 6)),
])
def test_dsa_indexer_layers(pattern_kwargs, expected):
    m = model_from_config(_dsa(num_hidden_layers=8, **pattern_kwargs), "d")
    assert m.pools["index_k"].layers == expected
    assert m.pools["kv"].layers == tuple(range(8))


def test_dsa_indexer_layers_matches_vllm_formula():
    for freq in (1, 2, 3, 4, 7):
        for offset in (-1, 0, 1, 2, 5):
            want = tuple(i for i in range(40) if max(i - offset + 1, 0) % freq == 0)
            assert dsa_indexer_layers(40, freq, None, offset) == want


def test_dsa_glm_and_deepseek_v3_with_indexer():
    glm = _dsa(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", num_hidden_layers=78,
               index_topk_pattern="F" + "FSS" * 25 + "FS")
    m = model_from_config(glm, "glm")
    assert m.pools["index_k"].layers[:5] == (0, 1, 4, 7, 10) and m.pools["index_k"].layers[-1] == 76
    v3 = _dsa(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    assert model_from_config(v3, "v3").pools["index_k"].layers == tuple(range(61))
    del v3["index_topk"]
    _raises(r'unknown architecture "DeepseekV3ForCausalLM" .*without index_topk', model_from_config, v3, "v3")


def test_an_unlisted_architecture_is_read_by_its_own_fields(tmp_path):
    # A fine-tune or a new model class of a listed family's shape: MiniMax-M3's sparse_attention_config (top level or
    # in text_config), DeepSeek-V3.2's MLA latent with an indexer. Sized exactly as the listed architectures.
    m3 = _m3_top()
    listed = model_from_config(m3, "m3")
    m3["architectures"] = ["MyM3FineTuneForCausalLM"]
    assert _pools(model_from_config(m3, "m3")) == _pools(listed)
    flat = {"architectures": ["TinySparseM3ForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
            **_m3_text(num_layers=6, dense=2)}
    assert model_from_config(flat, "tiny").pools["index_k"].layers == (2, 3, 4, 5)
    dsa = _dsa(architectures=["MyDsaForCausalLM"], model_type="my_dsa")
    assert _pools(model_from_config(dsa, "dsa")) == _pools(load_model("deepseek-v3.2"))
    del dsa["index_topk"]  # an MLA model without an indexer is not recognised by its fields
    _raises(r'unknown architecture "MyDsaForCausalLM" in <x>: supported are', model_from_config, dsa, "x")


def test_dsa_fp8_needs_ds_mla_dims():
    msg = _raises(r"fp8_ds_mla", model_from_config, _dsa(kv_lora_rank=256), "d", "fp8")
    assert "kv_cache_dtype \"auto\"" in msg
    assert model_from_config(_dsa(kv_lora_rank=256), "d").pools["kv"].bytes_per_token_per_head == (256 + 64) * 2


def test_dense_llama_without_head_dim():
    m = model_from_config(_llama(), "llama")
    assert _pools(m)["kv"] == (tuple(range(32)), 8, 2 * 128 * 2, 2, True)
    mha = model_from_config(_llama(num_key_value_heads=None, hidden_size=2048, num_attention_heads=16), "mha")
    assert (mha.pools["kv"].num_heads, mha.pools["kv"].bytes_per_token_per_head) == (16, 512)
    assert model_from_config(_llama(torch_dtype="float16"), "l", "fp8").pools["kv"].bytes_per_token_per_head == 256


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "Qwen3MoeForCausalLM"])
def test_dense_architectures(arch):
    assert model_from_config(_llama(architectures=[arch]), "x").pools["kv"].num_heads == 8


def test_folder_vs_file(tmp_path):
    file = _write(tmp_path / "Qwen3-8B" / "config.json", json.loads(PRESETS["qwen3-8b"].read_text()))
    by_folder, by_file = load_model(str(tmp_path / "Qwen3-8B")), load_model(file)
    assert by_folder == by_file and by_folder.name == "Qwen3-8B"
    assert _pools(by_file) == _pools(load_model("qwen3-8b"))
    other = _write(tmp_path / "elsewhere.json", _llama())
    assert load_model(other).num_layers == 32


# ---------------------------------------------------------------------------------------------------------------
# errors

def test_error_missing_head_dim(tmp_path):
    cfg = _m3_top()
    del cfg["text_config"]["head_dim"]
    path = _write(tmp_path / "config.json", cfg)
    msg = _raises(r'has no field "head_dim" \(MiniMax-M3 text config\): add it', load_model, path)
    assert path in msg


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_key_value_heads", "sparse_attention_config"])
def test_error_missing_m3_fields(field):
    cfg = _m3_top()
    del cfg["text_config"][field]
    _raises(f'no field "{field}"', model_from_config, cfg, "m3")


@pytest.mark.parametrize("field", ["sparse_attention_freq", "sparse_index_dim"])
def test_error_missing_m3_sparse_fields(field):
    cfg = _m3_top()
    del cfg["text_config"]["sparse_attention_config"][field]
    _raises(f'no field "{field}" \\(MiniMax-M3 sparse_attention_config\\)', model_from_config, cfg, "m3")


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_rope_head_dim", "index_head_dim", "num_hidden_layers"])
def test_error_missing_dsa_fields(field):
    cfg = _dsa()
    del cfg[field]
    _raises(f'no field "{field}" \\(DeepSeek-V3.2/GLM DSA config\\)', model_from_config, cfg, "d")


def test_error_bad_values():
    _raises(r'field "head_dim" is "128" .*integer 1\.\.65536', model_from_config, _m3_top(head_dim="128"), "m")
    _raises(r'field "num_key_value_heads" is 0', model_from_config, _m3_top(num_key_value_heads=0), "m")
    cfg = _m3_top()
    cfg["text_config"]["sparse_attention_config"]["sparse_attention_freq"] = "all"
    _raises(r'field "sparse_attention_freq" is "all".*list of integers', model_from_config, cfg, "m")
    _raises(r'field "index_topk_freq" is 0', model_from_config, _dsa(index_topk_freq=0), "d")
    _raises(r'field "index_topk_pattern" is 5', model_from_config, _dsa(index_topk_pattern=5), "d")
    _raises(r'field "torch_dtype" is "int8"', model_from_config, _llama(torch_dtype="int8"), "l")
    _raises(r'field "hidden_size" is 100 .*head_dim', model_from_config, _llama(hidden_size=100), "l")
    _raises(r'field "text_config" is \[\]', model_from_config, {"model_type": "minimax_m3_vl", "text_config": []}, "m")
    _raises(r"config <x> is a JSON list", model_from_config, [], "x")


def test_error_unknown_architecture(tmp_path):
    path = _write(tmp_path / "config.json", {"architectures": ["FooForCausalLM"], "num_hidden_layers": 2})
    msg = _raises(r'unknown architecture "FooForCausalLM" in .*config.json: supported are MiniMax-M3 \(', load_model,
                  path)
    for name in ("MiniMaxM3SparseForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                 "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert name in msg
    _raises(r'unknown model_type "bert"', model_from_config, {"model_type": "bert"}, "b")
    _raises(r'neither "architectures" nor "model_type"', model_from_config, {"num_hidden_layers": 2}, "b")
    _raises(r'unknown architecture \["A", "B"\]', model_from_config, {"architectures": ["A", "B"]}, "b")


def test_error_kv_cache_dtype():
    for bad in ("fp8_e5m2", "bfloat16", "int8", ""):
        _raises(r'kv_cache_dtype .* use "auto" .* or "fp8"', load_model, "qwen3-8b", bad)
        _raises(r"kv_cache_dtype", model_from_config, _llama(), "l", bad)


def test_error_unknown_preset():
    msg = _raises(r'unknown preset "llama-70b": presets are deepseek-v3.2, minimax-m3, qwen3-8b', load_model,
                  "llama-70b")
    assert "path" in msg


def test_error_missing_file_and_folder(tmp_path):
    _raises(r"config file .*nope.json does not exist", load_model, str(tmp_path / "nope.json"))
    _raises(r"config file .* does not exist", load_model, str(tmp_path / "no" / "such"))
    (tmp_path / "empty").mkdir()
    _raises(r"folder .*empty has no config.json", load_model, str(tmp_path / "empty"))


def test_error_unreadable_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"architectures": ["LlamaForCausalLM"],\n  "num_hidden_layers": }\n')
    _raises(r"config .*config.json is not valid JSON \(line 2 column .*\): fix or replace", load_model, str(path))
    path.write_bytes(b"\xff\xfe\x00garbage")
    _raises(r"config .*config.json cannot be read", load_model, str(path))


def test_error_message_is_one_line_even_with_odd_values():
    msg = _raises(r"unknown architecture", model_from_config, {"architectures": ["Foo\nBar"]}, "x")
    assert "Foo\\nBar" in msg


# ---------------------------------------------------------------------------------------------------------------
# against vLLM itself (skipped where vllm does not import)

@pytest.fixture(scope="module")
def vllm_m3_configs():
    try:
        from vllm.transformers_utils.configs.minimax_m3 import MiniMaxM3Config, MiniMaxM3TextConfig
    except Exception as exc:  # noqa: BLE001 - any import failure means "no vllm here"
        pytest.skip(f"vllm not importable: {exc}")
    return MiniMaxM3TextConfig, MiniMaxM3Config


@pytest.mark.vllm
def test_vllm_minimax_m3_defaults(vllm_m3_configs):
    text_cls, top_cls = vllm_m3_configs
    text = text_cls().to_dict()
    m = model_from_config(text, "vllm-m3-text")
    assert m.num_layers == 60
    assert m.pools["kv"].layers == tuple(range(60))
    assert m.pools["index_k"].layers == tuple(range(3, 60))  # 3 dense, 57 sparse
    assert m.pools["index_v"].layers == ()  # K-only
    assert _pools(m) == _pools(load_model("minimax-m3"))
    top = top_cls().to_dict()
    assert _pools(model_from_config(top, "vllm-m3")) == _pools(m)
    # The preset's text config is vLLM's defaults (plus the dtype).
    preset = json.loads(PRESETS["minimax-m3"].read_text())["text_config"]
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "sparse_attention_config", "moe_layer_freq", "hidden_size", "vocab_size"):
        assert preset[key] == text[key], key


@pytest.mark.vllm
def test_vllm_spec_page_sizes(vllm_m3_configs):
    """Our bytes per token equal vLLM's KV-cache spec page size divided by the block size."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SparseCacheRole, get_kv_quant_mode

    def per_token(spec):
        return spec.page_size_bytes // spec.block_size

    m3, ds, ds8 = load_model("minimax-m3"), load_model("deepseek-v3.2"), load_model("deepseek-v3.2", "fp8")
    m3_8 = load_model("minimax-m3", "fp8")
    assert per_token(FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=128, head_size_v=128,
                                       dtype=torch.bfloat16)) == m3.pools["kv"].bytes_per_token
    assert per_token(FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=128, head_size_v=128,
                                       dtype=torch.float8_e4m3fn, kv_quant_mode=get_kv_quant_mode("fp8"))) == \
        m3_8.pools["kv"].bytes_per_token
    assert per_token(MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=128, dtype=torch.bfloat16,
                                      cache_role=SparseCacheRole.INDEXER)) == m3.pools["index_k"].bytes_per_token
    assert per_token(MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576,
                                      dtype=torch.bfloat16)) == ds.pools["kv"].bytes_per_token
    assert per_token(MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576,
                                      dtype=torch.uint8, cache_dtype_str="fp8_ds_mla", state_content_bytes=656,
                                      kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"))) == ds8.pools["kv"].bytes_per_token
    assert per_token(MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=128 + 128 // 128 * 4,
                                      dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)) == \
        ds.pools["index_k"].bytes_per_token
