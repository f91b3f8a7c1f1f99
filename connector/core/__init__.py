"""The pure model: what a model keeps per token (layout, hf_config and its presets), which rank sends what to whom
(plan), block ids as byte ranges (descriptors), the pure half of staging (staging_ranges), and every exception the
package raises (errors: one root, two branches).

Nothing here does I/O beyond reading a config.json, and nothing imports torch, asyncio, nixl or vllm
(tests/test_layers.py holds this). Every layer above builds on these types."""
