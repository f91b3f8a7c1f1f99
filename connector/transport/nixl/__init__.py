"""NIXL transport: the only package that imports nixl (lazily, on the first agent). No vllm here.

`Transport` wraps one NIXL agent (UCX backend) for asyncio: register memory, exchange metadata over our own side
channel, WRITE descriptor lists with byte backpressure. Open it with `async with` or `open()` / `aclose()`."""

from connector.transport.nixl.agent import Transport
from connector.transport.nixl.settings import TransportConfig, TransportStats, WriteTiming
from connector.transport.nixl.glue import descs_array, make_agent

__all__ = ["Transport", "TransportConfig", "TransportStats", "WriteTiming", "descs_array", "make_agent"]
