"""A misbehaving side-channel peer and what the security tests need around it: a real prefill rank in its own
process (the target), its state and RSS as the process itself reports them, a recording TCP relay, and raw frames.

The adversary speaks the wire protocol with the project's own codec (connector.protocol): it knows the protocol as
well as a real peer does; what it lacks is the token, or the right to what it asks for."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import msgspec

from connector.core.layout import ModelLayout
from connector.protocol.auth import client_proof, identity, lane_tag, memory_of, new_nonce, opening
from connector.protocol.messages import HEADER, Hello, Message, decode_body, encode_frame
from sparse_kv_lab.sim.buffers import pick_blocks
from sparse_kv_lab.sim.cluster import Cluster, Scenario
from tests.helpers import bare_side_channel, scenario

TOKEN = "7c1f0e9a4b2d8c6e5f3a1b0d9e8c7f6a5b4c3d2e1f0a9b8c"
WITH_TOKEN = bare_side_channel(auth_token=TOKEN)
"""A raw client's side channel that holds the token (no heartbeats)."""
"""The shared secret of the target and its legitimate decode ranks (48 hex characters)."""
TOKENS, BLOCK = 64, 16


def make_scenario(model: ModelLayout, **kw: Any) -> Scenario:
    kw.setdefault("auth_token", TOKEN)
    return scenario(model, tokens=TOKENS, block_size=BLOCK, timeout_s=30.0, **kw)


@contextlib.contextmanager
def spawned_target(model: ModelLayout, config: Any) -> Iterator["Target"]:
    """A real prefill rank in its own process, with SenderConfig `config` (the attacks' target), ended on exit."""
    from sparse_kv_lab.sim.env import apply_env

    apply_env()  # before NIXL and torch's allocator see the environment
    with Cluster(make_scenario(model, sender_config=config), spawn=("prefill",)) as cluster:
        yield Target(cluster)


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid`, from /proc (what the kernel charges it)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Target:
    """A real prefill rank (TP1/PP1) in its own process."""

    cluster: Cluster

    @property
    def port(self) -> int:
        return self.cluster.base_port

    @property
    def pid(self) -> int:
        return self.cluster.prefill[(0, 0)][0].pid

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def state(self) -> dict[str, int]:
        """Peers, NIXL agents, connections, waiting registrations, requests... as the prefill process sees them."""
        _p, conn = self.cluster.prefill[(0, 0)]
        answer = self.cluster.ask(conn, ("state",), 20, "prefill")
        while not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[1], dict)):
            # a reply left by a test that failed before reading it (a compute started with wait=False): skip it,
            # so one failure does not fail every later test of the module
            answer = self.cluster.reply(conn, 20, "prefill")
        return answer[1]

    def wait_state(self, what: str, check: Callable[[dict[str, int]], bool], timeout_s: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if check(state):
                return state
            assert time.monotonic() < deadline, f"{what}: prefill state is still {state}"
            time.sleep(0.1)

    def compute(self, tid: str, layer_ms: float = 0.0, wait: bool = True, index: int = 0, secret: str = "") -> None:
        """Prefill computes request `tid` (every layer, then the sweep), started with capability `secret` (if any)."""
        _p, conn = self.cluster.prefill[(0, 0)]
        self.cluster.ask(conn, ("start", tid, TOKENS, index, secret), 30, "prefill")
        conn.send(("chunk", tid, 0, TOKENS, layer_ms, "stream", "all"))
        if wait:
            self.cluster.reply(conn, 60, "prefill")

    def chunk_done(self) -> None:
        _p, conn = self.cluster.prefill[(0, 0)]
        self.cluster.reply(conn, 60, "prefill")

    def finished(self, tid: str) -> bool:
        """Wait until prefill released `tid`; True if every decode rank completed it."""
        _p, conn = self.cluster.prefill[(0, 0)]
        return self.cluster.ask(conn, ("finish", tid), 60, "prefill")[1]


def blocks(num_blocks: int, seed: int) -> list[list[int]]:
    return pick_blocks(TOKENS, BLOCK, num_blocks, seed=seed)


async def send_frames(port: int, frames: list[bytes], read_s: float = 5.0) -> list[Message | str]:
    """Raw TCP: write `frames`, then read what comes back until the server closes (or `read_s`). Returns the
    messages, and "closed" / "reset" / "timeout" for how it ended."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out: list[Message | str] = []
    try:
        for frame in frames:
            writer.write(frame)
        await writer.drain()
        async with asyncio.timeout(read_s):
            while True:
                header = await reader.readexactly(HEADER.size)
                length, _version = HEADER.unpack(header)
                out.append(decode_body(await reader.readexactly(length)))
    except asyncio.IncompleteReadError:
        out.append("closed")
    except ConnectionResetError:
        out.append("reset")
    except TimeoutError:
        out.append("timeout")
    finally:
        writer.close()
    return out


async def read_message(reader: asyncio.StreamReader) -> Message:
    length, _version = HEADER.unpack(await reader.readexactly(HEADER.size))
    return decode_body(await reader.readexactly(length))


async def guess(port: int, hello: Hello, token: str, timeout_s: float = 10.0) -> str:
    """One guess of the token, the way a guesser does it (it does not care whether prefill's proof is right): Hello,
    then an Auth whose proof is made with `token`. Returns what came back: the server's answer's type and reason,
    or how the connection ended."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"refused: {exc!r}"
    try:
        async with asyncio.timeout(timeout_s):
            # its lane: the one `hello` names (one the guesser chose, or copied from an opening it saw), else one of
            # its own, the same for every guess of this identity (the guesser cannot compute the real one)
            claim = msgspec.structs.replace(identity(hello), nonce=new_nonce(), lane=hello.lane or lane_tag("", hello))
            ours = opening(claim)
            writer.write(encode_frame(ours))
            server = await read_message(reader)
            if not isinstance(server, Hello):
                return f"{type(server).__name__}: {getattr(server, 'reason', '')}"
            auth = memory_of(hello, claim=claim)
            writer.write(encode_frame(msgspec.structs.replace(auth, proof=client_proof(token, ours, server, auth))))
            answer = await read_message(reader)
            return f"{type(answer).__name__}: {getattr(answer, 'reason', '')}"
    except asyncio.IncompleteReadError:
        return "closed"
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "timeout"
    finally:
        writer.close()


def hello_frame(hello: Hello) -> bytes:
    """The first frame a client sends for `hello` (its opening: fresh nonce, no identity, no memory)."""
    return encode_frame(opening(msgspec.structs.replace(identity(hello), nonce=new_nonce())))


def auth_frame(hello: Hello, proof: bytes = b"") -> bytes:
    return encode_frame(memory_of(hello, proof))


class Relay:
    """A TCP relay between a client and the target that keeps every byte each way (what an eavesdropper on the
    network gets). Use as `async with Relay(port) as relay:` on a loop; connect to `relay.port`. `source`: the
    loopback address its connections to the target come from (the side channel sees them come from there)."""

    def __init__(self, target_port: int, source: str | None = None) -> None:
        self.target_port, self.source = target_port, source
        self.to_server = bytearray()
        self.to_client = bytearray()
        self.first_client_bytes: list[bytes] = []
        """What each client connection sent, in order (one entry per connection)."""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port = 0

    async def __aenter__(self) -> "Relay":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> "Relay":
        """(Where one `async with` cannot span the relay's life: a test running many loops' worth of steps.)"""
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        sreader, swriter = await asyncio.open_connection(
            "127.0.0.1", self.target_port, local_addr=(self.source, 0) if self.source else None)
        sent = bytearray()
        self.first_client_bytes.append(b"")
        index = len(self.first_client_bytes) - 1

        async def pump(reader, writer, keep: bytearray, mine: bytearray | None) -> None:
            try:
                while data := await reader.read(65536):
                    keep += data
                    if mine is not None:
                        mine += data
                        self.first_client_bytes[index] = bytes(mine)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        tasks = [asyncio.create_task(pump(creader, swriter, self.to_server, sent)),
                 asyncio.create_task(pump(sreader, cwriter, self.to_client, None))]
        self._tasks.update(tasks)
        try:
            await asyncio.gather(*tasks)
        finally:
            self._tasks.difference_update(tasks)


# ---- outsiders: many connections, from another process -------------------------------------------------------------
ATTACKER_HOST = "127.0.0.2"
"""Where a flood comes from when it is another host than the decode's (127.0.0.0/8 is all loopback on Linux)."""


def open_sockets(port: int, n: int, source: str = "127.0.0.1", first: bytes = b"") -> list:
    """`n` plain TCP connections from `source` that send `first` (maybe nothing) and then nothing more. A
    connection the server closes at once still counts (the caller holds what it got)."""
    import socket

    out = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
            if first:
                s.sendall(first)
        except OSError:
            continue
        out.append(s)
    return out


def flood(port: int, n: int, source: str, mode: str, payload: bytes, stop: Any, ready: Any) -> None:
    """An outsider's process (multiprocessing target): `n` connections from `source` that send `payload` (maybe
    nothing) and then hold the connection. mode "hold": keep what stays open; "reopen": reopen each one the server
    closes, in a loop, as fast as it goes; "churn": open, send, close, again (each a fresh connection), until `stop`
    is set. `ready` is set once the first `n` were opened."""
    import resource
    import selectors
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 256)), hard))

    def one() -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(source, 0))
            if payload:
                s.sendall(payload)
            return s
        except OSError:
            return None

    if mode == "churn":
        ready.set()
        while not stop.is_set():
            s = one()
            if s is not None:
                try:
                    s.settimeout(1.0)
                    s.recv(65536)  # its answer (a Reject), so the server did the work
                except OSError:
                    pass
                s.close()
        return
    sel = selectors.DefaultSelector()
    for _ in range(n):
        if (s := one()) is not None:
            sel.register(s, selectors.EVENT_READ)
    ready.set()
    while not stop.is_set():
        for key, _ev in sel.select(timeout=0.1):
            sel.unregister(key.fileobj)
            key.fileobj.close()
            if mode == "reopen" and (s := one()) is not None:
                sel.register(s, selectors.EVENT_READ)
    for key in list(sel.get_map().values()):
        key.fileobj.close()


class Flood:
    """`with Flood(port, n, source, mode, payload):` an outsider's `flood` running in its own process (so its loop
    does not compete with this process's decode ranks for the GIL), ended by PID on exit."""

    def __init__(self, port: int, n: int, source: str = ATTACKER_HOST, mode: str = "hold",
                 payload: bytes = b"") -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.stop, self.ready = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=flood, args=(port, n, source, mode, payload, self.stop, self.ready),
                                name=f"flood-{mode}", daemon=True)

    def __enter__(self) -> "Flood":
        self.proc.start()
        assert self.ready.wait(60), "the flood did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
