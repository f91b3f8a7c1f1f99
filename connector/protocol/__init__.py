"""What crosses the wire between prefill and decode, and the pure checks on it: the messages and the versioned frame
codec (messages), the Hello checks and peer acceptance (handshake), where a prefill rank listens (addressing).

No sockets, no threads, no torch, no asyncio (tests/test_layers.py holds this): connector.transport moves these
bytes, connector.engine acts on them."""
