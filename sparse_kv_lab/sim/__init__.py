"""Simulated ranks for the demo, the bench and the tests: real engines, real NIXL, real OS processes; only the model
is simulated (deterministic cache content written layer by layer, then verified byte by byte on decode).

  env           the environment NIXL/UCX need before they load; free loopback ports
  buffers       per-rank paged caches laid out like vLLM's, their content and its verification
  spec          RankSpec: what one simulated rank is (plain data, pickled to its worker process)
  rank          SimRank: one rank as an object (loop thread, transport, cache, engine), in any process
  rank_process  a SimRank as an OS process driven over a pipe (the demo's workers)
  cluster       the processes of one run (Scenario -> DemoResult), on loopback or each side in a namespace
  netns         two "nodes" on one machine: network namespaces, a veth pair, entering one from a fresh process
  bench         raw NIXL vs connector bulk vs connector stream
  raw_nixl      the bench's baseline: a descriptor list as one plain, blocking NIXL WRITE
  compute       how long prefill computes a prompt, for the bench
  costs         what the connector costs the forward: the hook's wall and CPU, the compute's stretch, threads' CPU
  plot          the bench's per-layer timeline plot (`bench --plot FILE.png`)
  soak          many small requests back to back between two processes, sampled as they go (tools/soak.py)
  soak_side     the soak's two worker processes
  soak_probe    what a soak samples in its own process (memory, fds, threads, objects, engine tables)

No vllm here (tests/test_layers.py holds this)."""
