"""One rank, framework-agnostic asyncio on the process's one event loop: the prefill-side sender (sender,
sender_state), the decode-side receiver, both halves of a staged chunk (staging), and their settings (config).

It knows vLLM only through what the vllm/ adapter hands it (layouts, regions, block ids, hooks); it imports neither
vllm nor nixl (tests/test_layers.py holds this) and moves bytes only through connector.transport."""
