"""Sockets, threads, NIXL and device copies: what moves bytes, and nothing about which bytes or why.

  control         the asyncio TCP side channel's server, carrying connector.protocol messages
  connection      one handshaken side-channel connection: its reader, heartbeat and close
  client          the client's side: open a connection to a prefill rank and run the handshake
  handshake       the handshake over a socket, both halves of it
  admission       who may hold what on one server before and after authentication
  limits          the numbers admission enforces (connections, handshakes, frames, message rates)
  refusals        refused connections counted by kind and logged at a bounded rate
  side_channel    SideChannelConfig: the side channel's settings, one object handed to both ends
  tls             optional TLS for the side channel
  ports           free TCP ports below the kernel's ephemeral range
  loop            the process's one asyncio event loop, in its own thread
  base            KVTransport: what the engines use of a transport (nixl.Transport implements it)
  device_copy     range copies on the device that holds the memory (a staged chunk's gather and scatter)
  nixl/           the NIXL agent driven from asyncio: the only package that imports nixl

No vllm here, and no transfer logic (that is connector.engine)."""
