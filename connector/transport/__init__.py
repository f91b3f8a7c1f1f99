"""Sockets, threads, NIXL and device copies: what moves bytes, and nothing about which bytes or why.

  control      asyncio TCP side channel (connection, server, client handshake) carrying connector.protocol messages;
               handshake (both halves of it), limits (what a server lets peers use), tls, ports
  side_channel SideChannelConfig: the side channel's settings, one object handed to the server and to connect
  loop         the process's one asyncio event loop, in its own thread
  base         KVTransport: what the engines use of a transport (nixl.Transport implements it)
  device_copy  range copies on the device that holds the memory (the gather and scatter of a staged chunk)
  nixl/        the NIXL agent driven from asyncio: the only package that imports nixl

No vllm here, and no transfer logic (that is connector.engine)."""
