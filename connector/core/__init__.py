"""The pure model: what a model keeps per token, which rank sends what to whom, block ids as byte ranges, and every
exception the package raises.

  layout          ModelLayout, pools, regions: what a model keeps per token and what one rank holds of it
  hf_config       model layouts from a Hugging Face config.json, and the named presets
  describe        layouts in words, for logs and for refusing a pair whose caches do not match
  plan            which prefill rank sends which (pool, global layer, heads) to which decode rank
  descriptors     block ids -> (address, length) descriptor lists for one route
  block_views     the two sides' regions in blocks of the smaller size, where their block sizes differ
  state_split     a Mamba/GDN state page as pieces split over TP (conv sub-projections, SSM heads)
  staging_ranges  the pure half of staging: what a chunk holds, how a batch is cut, the byte allocator
  checksums       the end-to-end digest of what a transfer filled (`kv_checksum`)
  untrusted       a peer's text as it may appear in a log line (escaped, bounded)
  errors          every exception, one root, two branches

Nothing here does I/O beyond reading a config.json, and nothing imports torch, asyncio, nixl or vllm
(tests/test_layers.py holds this; tests/test_module_lists.py holds this list). Every layer above builds on these
types."""
