"""Simulated ranks for the demo, the bench and the tests: real engines, real NIXL, real OS processes; only the model
is simulated (deterministic cache content written layer by layer, then verified byte by byte on decode).

  env           the environment NIXL/UCX need before they load; free loopback ports
  buffers       per-rank paged caches laid out like vLLM's, their content and its verification
  rank_process  one prefill or decode rank as an OS process, driven over a pipe
  cluster       the processes of one run (Scenario -> DemoResult)
  bench         raw NIXL vs connector bulk vs connector stream

No vllm here (tests/test_layers.py holds this)."""
