"""What crosses the wire between prefill and decode, and the pure checks on it.

  messages        the messages and the versioned frame codec
  handshake       the Hello checks (when a connection opens, and on the peer's layout) and peer acceptance
  auth            the handshake's proofs: the token's challenge-response, engine and prefill keys, lane tags
  addressing      where a prefill rank listens: the port rule, a side-channel address parsed once

No sockets, no threads, no torch, no asyncio (tests/test_layers.py holds this): connector.transport moves these
bytes, connector.engine acts on them."""
