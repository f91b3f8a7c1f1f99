"""One rank, framework-agnostic asyncio on the process's one event loop.

  rank          LocalRank: this rank as both engines and their peers see it (Hello, device, memory type, staging)
  config        SenderConfig, ReceiverConfig: every default once (the side channel's: connector.transport.side_channel)
  sender        prefill: streams each layer to the decode ranks that registered for it
  dispatch      prefill: the sender's writes to each decode rank, its Completes and notices, the release
  ownership     prefill: who owns which transfer; the pure rules the sender asks (no I/O)
  sender_state  prefill: requests, destinations, waiting registrations, and the check of a registration
  peers         prefill: the decode ranks it serves, one per live side-channel connection
  batch_writer  prefill: one batch to one decode rank, as a direct WRITE or staged chunks
  receiver      decode: registers its blocks and waits for every source to complete
  sources       decode: the prefill engines it receives from, their connections, lost sources confirmed stopped
  staging       both halves of a staged chunk (gather + one-descriptor WRITE; check + scatter)
  plans         transfer plans per peer layout, built off the loop and cached
  stats         the sender's counters and their per-interval deltas
  inbox         the hand-off from vLLM's forward thread to the loop (hooks append; a wake only when one is due)
  layer_events  prefill on a GPU: the layers one loop turn holds wait for their CUDA events together
  agents        prefill: the decode ranks' NIXL agents it keeps loaded, bound to their engine key, capped
  trim          prefill: memory waiting registrations held, handed back to the system once they are gone
  timeline      per-request timelines: when each stage of a transfer happened, on each side

It knows vLLM only through what the vllm/ adapter hands it (layouts, regions, block ids, hooks); it imports neither
vllm nor nixl (tests/test_layers.py holds this) and moves bytes only through a connector.transport.base.KVTransport.
docs/architecture.md follows one request through these modules."""
