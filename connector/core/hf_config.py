"""Model layouts from a Hugging Face config.json, and named presets. Pure: reads JSON, imports no vllm/nixl.

Three families, each sized the way vLLM 0.33.0 allocates its caches (paths below are inside the vllm package):

MiniMax-M3 (`MiniMaxM3SparseForCausalLM`, `MiniMaxM3SparseForConditionalGeneration`; top-level config with a
  `text_config`, or the text config alone)
  kv       every layer, GQA K+V (`models/minimax_m3/nvidia/model.py` `MiniMaxM3SparseAttention.get_kv_cache_spec`:
           `FullAttentionSpec(num_kv_heads, head_size=head_dim, head_size_v=head_dim)`), sharded by KV head.
  index_k  the sparse layers (`_sparse_attention_layer_ids`: `sparse_attention_freq[i] != 0`). One key-only cache
           per layer, `<layer>.self_attn.attn.index_cache` (`models/minimax_m3/common/indexer.py`
           `MiniMaxM3IndexerCache.get_kv_cache_spec`: `MLAAttentionSpec(num_kv_heads=1, head_size=sparse_index_dim)`),
           replicated on every TP rank. Its dtype is NOT the KV-cache dtype: it is
           `attention_config.resolve_indexer_kv_dtype("bf16")`, i.e. bf16 unless `--attention-config
           '{"indexer_kv_dtype": "fp8"}'` (then float8_e4m3fn, 1 B).
  index_v  the sparse layers whose `sparse_disable_index_value` flag is 0 (SGLang's `index_kv_pool`). vLLM 0.33
           never builds an index value (the model docstring: "M3 always disables the index value/output
           projections"), so with vLLM this pool has no tensors; released M3 checkpoints have it empty anyway.
DeepSeek-V3.2 / GLM DSA (`DeepseekV32ForCausalLM`, `GlmMoeDsaForCausalLM`, or DeepSeek-V2/V3 with `index_topk`)
  kv       every layer, the MLA latent (kv_lora_rank + qk_rope_head_dim), one replicated head. fp8 is served as
           `fp8_ds_mla`, 656 B per token (`model_executor/layers/attention/mla_attention.py`
           `_canonicalize_sparse_mla_kv_cache_dtype` and `MLAAttention.get_kv_cache_spec`; layout documented in
           `v1/attention/backends/mla/flashmla_sparse.py`).
  index_k  the layers that build an indexer (`models/deepseek_v32/attention.py` `DeepseekV32Attention.__init__`),
           `<layer>.self_attn.indexer.k_cache`, uint8 of `index_head_dim + index_head_dim // 128 * 4` bytes per
           token (fp8 keys + fp32 scales) whatever the KV-cache dtype (`DeepseekV32Indexer.__init__`).
  index_v  none.
Dense GQA (Llama, Mistral, Qwen2/3 and their MoE variants): kv only.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from connector.core.errors import LayoutError
from connector.core.layout import ModelLayout, PoolSpec

PRESET_DIR = pathlib.Path(__file__).with_name("presets")
PRESETS: dict[str, pathlib.Path] = {
    "minimax-m3": PRESET_DIR / "minimax-m3.json",
    "deepseek-v3.2": PRESET_DIR / "deepseek-v3.2.json",
    "qwen3-8b": PRESET_DIR / "qwen3-8b.json",
}

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")

M3_ARCHS = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")
M3_MODEL_TYPES = ("minimax_m3", "minimax_m3_vl", "minimax_m3_text")
DSA_ARCHS = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# vLLM's deepseek_v2.py builds DSA for these too when the config has `index_topk` (`is_v32 = hasattr(...)`).
MLA_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
DENSE_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
               "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
DENSE_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")

SUPPORTED = (f"MiniMax-M3 ({', '.join(M3_ARCHS)}), DeepSeek-V3.2/GLM DSA ({', '.join(DSA_ARCHS)}, or "
             f"{'/'.join(MLA_ARCHS)} with index_topk), dense GQA ({', '.join(DENSE_ARCHS)})")

# fp8_ds_mla row: 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE (flashmla_sparse.py; mla_attention.py hard-codes 656).
FP8_DS_MLA_BYTES = 656
FP8_DS_MLA_DIMS = (512, 64)

_MISSING = object()

MAX_LAYERS = 1024
"""Bounds on a config's sizes, far above any released model: a value beyond them is a typo or a hostile file, and
refusing it keeps a layout (and every plan built from it) small."""
MAX_HEADS = 1024
MAX_DIM = 65536
MAX_INT = 1 << 20


def _one_line(msg: str) -> str:
    return msg.replace("\r", "\\r").replace("\n", "\\n")


def _fail(msg: str) -> LayoutError:
    return LayoutError(_one_line(msg))


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class _Fields:
    """A config section with typed getters whose errors name the file, the section, the field and the fix."""

    def __init__(self, data: dict, src: str, what: str) -> None:
        self.data, self.src, self.what = data, src, what

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def missing(self, key: str) -> LayoutError:
        return _fail(f'config {self.src} has no field "{key}" ({self.what}): add it')

    def bad(self, key: str, value: Any, fix: str) -> LayoutError:
        return _fail(f'config {self.src} field "{key}" is {_show(value)} ({self.what}): {fix}')

    def get_int(self, key: str, default: Any = _MISSING, minimum: int = 1, maximum: int = MAX_INT) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise self.missing(key)
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self.bad(key, value, f"set it to an integer {minimum}..{maximum}")
        return value

    def get_int_list(self, key: str, default: Any = _MISSING) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise self.missing(key)
            return default
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise self.bad(key, value, "give a list of integers, one per layer")
        return [int(v) for v in value]

    def section(self, key: str, what: str, fallback: "_Fields | None" = None) -> "_Fields":
        value = self.data.get(key)
        if value is None and fallback is not None and fallback.data.get(key) is not None:
            return fallback.section(key, what)
        if value is None:
            raise self.missing(key)
        if not isinstance(value, dict):
            raise self.bad(key, value, "make it a JSON object")
        return _Fields(value, self.src, what)


# ---------------------------------------------------------------------------------------------------------------
# dtypes

def _check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise _fail(f"kv_cache_dtype {_show(kv_cache_dtype)} is not supported: use \"auto\" (the model dtype) "
                    f"or \"fp8\" (1 byte per element)")


def _model_dtype(*sections: _Fields) -> str:
    """The dtype vLLM runs the model in with `--dtype auto` (config/model.py `_resolve_auto_dtype`).

    A float32 or unset config dtype (transformers' default is float32) is downcast to the platform's first
    supported dtype, bfloat16 on CUDA."""
    for f in sections:
        for key in ("torch_dtype", "dtype"):
            value = f.data.get(key)
            if value is None:
                continue
            name = value.removeprefix("torch.") if isinstance(value, str) else value
            if name in ("bfloat16", "float16"):
                return name
            if name == "float32":
                return "bfloat16"
            raise f.bad(key, value, 'set it to "bfloat16", "float16" or "float32"')
    return "bfloat16"


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _kv_elt(kv_cache_dtype: str, dtype: str) -> int:
    """Bytes per element of the main KV cache: the model dtype's ("auto"), or 1 for fp8 (per-tensor scale)."""
    return 1 if kv_cache_dtype == "fp8" else _DTYPE_BYTES[dtype]


def _resolved_dtype(model_dtype: str | None, *sections: _Fields) -> str:
    """vLLM's own resolved dtype when the caller knows it (`--dtype float32` on a CPU engine), else what
    `--dtype auto` gives for this config."""
    if model_dtype is None:
        return _model_dtype(*sections)
    name = model_dtype.removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise _fail(f"model dtype {_show(model_dtype)} is not supported: use one of {sorted(_DTYPE_BYTES)}")
    return name


def _empty(name: str, bytes_per_head: int = 0) -> PoolSpec:
    return PoolSpec(name=name, layers=(), num_heads=1, bytes_per_token_per_head=bytes_per_head, num_parts=1,
                    sharded=False)


# ---------------------------------------------------------------------------------------------------------------
# MiniMax-M3

def _minimax_m3(top: _Fields, name: str, kv_cache_dtype: str, indexer_kv_dtype: str,
                model_dtype: str | None) -> ModelLayout:
    if "text_config" in top.data:
        text = top.section("text_config", "MiniMax-M3 text config")
    else:
        text = _Fields(top.data, top.src, "MiniMax-M3 text config")
    num_layers = text.get_int("num_hidden_layers", maximum=MAX_LAYERS)
    kv_heads = text.get_int("num_key_value_heads", maximum=MAX_HEADS)
    head_dim = text.get_int("head_dim", maximum=MAX_DIM)
    # vLLM reads it from the text config; SGLang also accepts it at the top level (model_config.py:172).
    sparse = text.section("sparse_attention_config", "MiniMax-M3 sparse_attention_config", fallback=top)
    freq = sparse.get_int_list("sparse_attention_freq")
    # vLLM never reads this list (no index value); missing entries mean K-only, as in vLLM.
    disable = sparse.get_int_list("sparse_disable_index_value", default=[])
    index_dim = sparse.get_int("sparse_index_dim", maximum=MAX_DIM)
    dtype = _resolved_dtype(model_dtype, text, top)

    # nvidia/model.py `_sparse_attention_layer_ids`: {i for i, f in enumerate(freq) if f != 0}; entries past the
    # last layer are ignored and layers past the end of the list are dense.
    sparse_layers = tuple(i for i in range(min(num_layers, len(freq))) if freq[i] != 0)
    value_layers = tuple(i for i in sparse_layers if i < len(disable) and disable[i] == 0)

    # common/indexer.py `MiniMaxM3IndexerCache.__init__`: "bf16" -> bfloat16, "fp8"/"fp8_e4m3" -> float8_e4m3fn.
    if indexer_kv_dtype in ("auto", "bf16"):
        index_elt = 2
    elif indexer_kv_dtype in ("fp8", "fp8_e4m3"):
        index_elt = 1
    else:
        raise _fail(f"indexer_kv_dtype {_show(indexer_kv_dtype)} is not supported for MiniMax-M3 by vLLM 0.33: "
                    f"use \"auto\"/\"bf16\" or \"fp8\"")
    index_bytes = index_dim * index_elt
    pools = {
        "kv": PoolSpec(name="kv", layers=tuple(range(num_layers)), num_heads=kv_heads,
                       bytes_per_token_per_head=2 * head_dim * _kv_elt(kv_cache_dtype, dtype), num_parts=2, sharded=True),
        "index_k": PoolSpec(name="index_k", layers=sparse_layers, num_heads=1, bytes_per_token_per_head=index_bytes,
                            num_parts=1, sharded=False),
        "index_v": PoolSpec(name="index_v", layers=value_layers, num_heads=1, bytes_per_token_per_head=index_bytes,
                            num_parts=1, sharded=False),
    }
    return ModelLayout(name=name, num_layers=num_layers, pools=pools, dtype=dtype, kv_cache_dtype=kv_cache_dtype)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V3.2 / GLM DSA

def dsa_indexer_layers(num_layers: int, freq: int = 1, pattern: Any = None, offset: int = 2) -> tuple[int, ...]:
    """Layers that build an indexer (and so an `indexer.k_cache`), exactly as vLLM 0.33 decides it in
    `vllm/models/deepseek_v32/attention.py` `DeepseekV32Attention.__init__` (same code in
    `model_executor/models/deepseek_v2.py` `DeepseekV2MLAAttention.__init__`):

        if index_topk_pattern is None:
            skip_topk = max(layer_id - index_skip_topk_offset + 1, 0) % index_topk_freq != 0
        elif 0 <= layer_id < len(index_topk_pattern):
            skip_topk = index_topk_pattern[layer_id] == "S"
        else:
            skip_topk = False
        indexer = None if skip_topk (and not an MTP layer) else DeepseekV32Indexer(...)

    Defaults are vLLM's getattr defaults (freq 1, no pattern, offset 2): every layer. MTP layers (ids >= num_layers)
    always build one but are not part of this layout. vLLM ignores transformers' `indexer_types`."""
    layers = []
    for layer_id in range(num_layers):
        if pattern is None:
            skip = max(layer_id - offset + 1, 0) % freq != 0
        elif 0 <= layer_id < len(pattern):
            skip = pattern[layer_id] == "S"
        else:
            skip = False
        if not skip:
            layers.append(layer_id)
    return tuple(layers)


def _dsa(top: _Fields, name: str, kv_cache_dtype: str, indexer_kv_dtype: str, model_dtype: str | None) -> ModelLayout:
    f = _Fields(top.data, top.src, "DeepSeek-V3.2/GLM DSA config")
    num_layers = f.get_int("num_hidden_layers", maximum=MAX_LAYERS)
    kv_lora_rank = f.get_int("kv_lora_rank", maximum=MAX_DIM)
    rope_dim = f.get_int("qk_rope_head_dim", maximum=MAX_DIM)
    index_head_dim = f.get_int("index_head_dim", maximum=MAX_DIM)
    freq = f.get_int("index_topk_freq", default=1)
    offset = f.get_int("index_skip_topk_offset", default=2, minimum=-MAX_INT)
    pattern = f.data.get("index_topk_pattern")
    if pattern is not None and not (isinstance(pattern, str) or
                                    (isinstance(pattern, list) and all(isinstance(c, str) for c in pattern))):
        raise f.bad("index_topk_pattern", pattern, 'give a string like "FSSF..." with one letter per layer '
                                                    '(S = reuse the previous top-k, no indexer)')
    dtype = _resolved_dtype(model_dtype, f)

    if kv_cache_dtype == "fp8":
        if (kv_lora_rank, rope_dim) != FP8_DS_MLA_DIMS:
            raise _fail(f"config {top.src}: vLLM serves an fp8 sparse-MLA cache as fp8_ds_mla ({FP8_DS_MLA_BYTES} B), "
                        f"which needs kv_lora_rank={FP8_DS_MLA_DIMS[0]} and qk_rope_head_dim={FP8_DS_MLA_DIMS[1]}, "
                        f"not {kv_lora_rank} and {rope_dim}: use kv_cache_dtype \"auto\"")
        kv_bytes = FP8_DS_MLA_BYTES
    else:
        kv_bytes = (kv_lora_rank + rope_dim) * _kv_elt(kv_cache_dtype, dtype)
    if indexer_kv_dtype not in ("auto", "fp8"):
        raise _fail(f"indexer_kv_dtype {_show(indexer_kv_dtype)} is not supported for DeepSeek-V3.2/GLM DSA: vLLM "
                    f"0.33 always keeps its indexer keys in fp8 with fp32 scales; use \"auto\"")
    # DeepseekV32Indexer.__init__: head_dim=index_head_dim + index_head_dim // quant_block_size(128) * 4, uint8.
    index_bytes = index_head_dim + index_head_dim // 128 * 4
    pools = {
        "kv": PoolSpec(name="kv", layers=tuple(range(num_layers)), num_heads=1, bytes_per_token_per_head=kv_bytes,
                       num_parts=1, sharded=False),
        "index_k": PoolSpec(name="index_k", layers=dsa_indexer_layers(num_layers, freq, pattern, offset),
                            num_heads=1, bytes_per_token_per_head=index_bytes, num_parts=1, sharded=False),
        "index_v": _empty("index_v"),
    }
    return ModelLayout(name=name, num_layers=num_layers, pools=pools, dtype=dtype, kv_cache_dtype=kv_cache_dtype)


# ---------------------------------------------------------------------------------------------------------------
# dense GQA

def _dense(top: _Fields, name: str, kv_cache_dtype: str, indexer_kv_dtype: str, model_dtype: str | None) -> ModelLayout:
    f = _Fields(top.data, top.src, "dense GQA config")
    dtype = _resolved_dtype(model_dtype, f)
    num_layers = f.get_int("num_hidden_layers", maximum=MAX_LAYERS)
    heads = f.get_int("num_attention_heads", maximum=MAX_HEADS)
    kv_heads = f.get_int("num_key_value_heads", default=heads, maximum=MAX_HEADS)
    if f.has("head_dim"):
        head_dim = f.get_int("head_dim", maximum=MAX_DIM)
    else:
        hidden = f.get_int("hidden_size")
        if hidden % heads:
            raise f.bad("hidden_size", hidden, f"without head_dim it must be a multiple of num_attention_heads "
                                               f"({heads}); or add head_dim")
        head_dim = hidden // heads
    pools = {
        "kv": PoolSpec(name="kv", layers=tuple(range(num_layers)), num_heads=kv_heads,
                       bytes_per_token_per_head=2 * head_dim * _kv_elt(kv_cache_dtype, dtype), num_parts=2, sharded=True),
        "index_k": _empty("index_k"),
        "index_v": _empty("index_v"),
    }
    return ModelLayout(name=name, num_layers=num_layers, pools=pools, dtype=dtype, kv_cache_dtype=kv_cache_dtype)


# ---------------------------------------------------------------------------------------------------------------
# entry points

def _family(top: _Fields) -> str:
    archs = top.data.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise top.bad("architectures", archs, "give a list of class names")
    has_indexer = top.data.get("index_topk") is not None
    for arch in archs or ():
        if arch in M3_ARCHS:
            return "m3"
        if arch in DSA_ARCHS or (arch in MLA_ARCHS and has_indexer):
            return "dsa"
        if arch in DENSE_ARCHS:
            return "dense"
    by_fields = _family_by_fields(top, has_indexer)
    if by_fields:
        return by_fields
    model_type = top.data.get("model_type")
    if not archs:
        if model_type in M3_MODEL_TYPES:
            return "m3"
        if model_type in DSA_MODEL_TYPES or (model_type in MLA_MODEL_TYPES and has_indexer):
            return "dsa"
        if model_type in DENSE_MODEL_TYPES:
            return "dense"
    if archs:
        what = f"architecture {_show(archs[0]) if len(archs) == 1 else _show(archs)}"
    elif model_type is not None:
        what = f"model_type {_show(model_type)}"
    else:
        raise _fail(f'config {top.src} has neither "architectures" nor "model_type": add "architectures", '
                    f"supported are {SUPPORTED}")
    extra = " (an MLA model without index_topk has no sparse indexer)" if (
        set(archs or ()) & set(MLA_ARCHS) or model_type in MLA_MODEL_TYPES) else ""
    raise _fail(f"unknown {what} in {top.src}{extra}: supported are {SUPPORTED}")


def _family_by_fields(top: _Fields, has_indexer: bool) -> str | None:
    """A sparse family recognised by its own config fields, for an architecture not on the lists (a fine-tune, a
    new model class of the same shape): MiniMax-M3's `sparse_attention_config` section (top level or in
    `text_config`), or DeepSeek-V3.2's MLA latent with an indexer (`kv_lora_rank` and `index_topk`). The fields
    size every cache exactly as for the listed architectures; the worker then checks each size against the tensor
    vLLM allocated, so a model of another shape is refused at start-up, never moved wrongly."""
    text = top.data.get("text_config")
    sections = (top.data, text) if isinstance(text, dict) else (top.data,)
    if any(isinstance(s.get("sparse_attention_config"), dict) for s in sections):
        return "m3"
    if has_indexer and top.data.get("kv_lora_rank") is not None:
        return "dsa"
    return None


_BUILDERS = {"m3": _minimax_m3, "dsa": _dsa, "dense": _dense}


def model_from_config(config: dict, name: str, kv_cache_dtype: str = "auto", *, indexer_kv_dtype: str = "auto",
                      source: str | None = None, model_dtype: str | None = None) -> ModelLayout:
    """The layout of the model a config.json describes.

    `kv_cache_dtype` is vLLM's `--kv-cache-dtype` ("auto" or "fp8"); `indexer_kv_dtype` is vLLM's
    `--attention-config '{"indexer_kv_dtype": ...}'` (only MiniMax-M3 has a choice: "auto"/"bf16" or "fp8").
    `source` names the config in error messages (default: `<name>`). `model_dtype` is the dtype vLLM resolved
    (`model_config.dtype`, e.g. "float32" with `--dtype float32`); None = what `--dtype auto` gives."""
    src = source if source is not None else f"<{name}>"
    _check_kv_cache_dtype(kv_cache_dtype)
    if not isinstance(config, dict):
        raise _fail(f"config {src} is a JSON {type(config).__name__}, not an object: give the model's config.json")
    top = _Fields(config, src, "top level")
    return _BUILDERS[_family(top)](top, name, kv_cache_dtype, indexer_kv_dtype, model_dtype)


def _resolve(spec: str) -> tuple[pathlib.Path, str]:
    """(config.json path, model name) for a preset name, a config.json path or a folder holding one."""
    if spec in PRESETS:
        return PRESETS[spec], spec
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise _fail(f"folder {path} has no config.json: give the model folder or the config.json path")
        return config, path.resolve().name or str(path)
    if path.is_file():
        return path, path.resolve().parent.name or path.stem
    if path.suffix == ".json" or "/" in spec or "\\" in spec or spec.startswith("."):
        raise _fail(f"config file {spec} does not exist: give an existing config.json, its folder, or a preset "
                    f"({', '.join(sorted(PRESETS))})")
    raise _fail(f"unknown preset {_show(spec)}: presets are {', '.join(sorted(PRESETS))}; "
                f"or give a path to a config.json or its folder")


def load_model(spec: str, kv_cache_dtype: str = "auto", *, indexer_kv_dtype: str = "auto") -> ModelLayout:
    """A model layout from a preset name ("minimax-m3", "deepseek-v3.2", "qwen3-8b"), a config.json path or a
    folder holding config.json. See `model_from_config` for the dtypes."""
    _check_kv_cache_dtype(kv_cache_dtype)
    config, path, name = load_config(spec)
    return model_from_config(config, name, kv_cache_dtype, indexer_kv_dtype=indexer_kv_dtype, source=str(path))


def load_config(spec: str) -> tuple[Any, pathlib.Path, str]:
    """(the parsed config.json, its path, the model name) of a preset, a config.json or its folder."""
    path, name = _resolve(spec)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f"config {path} cannot be read ({type(exc).__name__}: {exc}): check the file and its "
                    f"permissions") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(f"config {path} is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg}): "
                    f"fix or replace the file") from None
    return config, path, name
