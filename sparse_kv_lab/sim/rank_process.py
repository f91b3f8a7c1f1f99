"""Worker processes of the demo and bench: one per prefill rank and one per decode rank.

Each is a SimRank (sparse_kv_lab.sim.rank: the process's one event loop, a NIXL transport, the simulated cache, the
engine) that takes commands from the parent on a pipe in its main thread, which also plays the model: it "computes"
layers by writing deterministic content into the simulated cache and calls the engine's hooks exactly as the vLLM
adapter does.

This module stays light (no torch, no NIXL at import): the parent imports it to spawn workers, and a worker must set
its environment (sparse_kv_lab.sim.env) before those load.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Any

from connector.core.layout import blocks_for
from connector.core.plan import Rank
from sparse_kv_lab.sim import netns
from sparse_kv_lab.sim.env import apply_env
from sparse_kv_lab.sim.spec import RankSpec


def run(conn: Any, spec: RankSpec) -> None:
    """Process entry point: open the rank, say ("ready", ...), answer the parent's commands until "quit". A
    failure to start, or of a command, goes back to the parent as ("error", text), never a silent hang."""
    keep_stdout_clean()
    try:
        if spec.placement.netns:
            netns.enter(spec.placement.netns)  # first: before any thread, and before UCX lists the interfaces
    except (OSError, RuntimeError) as exc:
        conn.send(("error", f"{spec.side} rank {spec.rank} could not enter network namespace "
                            f"{spec.placement.netns!r}: {exc}"))
        return
    apply_env(spec.placement.env)
    # The simulated forward fills its layers with torch on its own thread. With torch's OpenMP pool, a worker spun
    # after each fill (libgomp's active wait): 200-300 ms/s of CPU that the bench counted as the connector's threads
    # while layers streamed (other_cpu_*; half of it), and a second core the connector's threads then lacked.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s {spec.side}{tuple(spec.rank)} "
                                                     f"%(levelname)s %(name)s: %(message)s")
    from sparse_kv_lab.sim.rank import SimRank  # noqa: PLC0415 - torch and NIXL load only after apply_env()

    try:
        rank = SimRank(spec).open()
    except Exception as exc:  # noqa: BLE001 - the parent must hear about it
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
        return
    try:
        commands = PrefillCommands(rank) if spec.side == "prefill" else DecodeCommands(rank)
        conn.send(("ready", spec.port))
        _serve(conn, commands.handlers())
    except Exception as exc:  # noqa: BLE001 - the parent must hear about it
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
    finally:
        rank.close()


def keep_stdout_clean() -> None:
    """Send whatever this process writes to standard output to standard error instead. A worker answers its parent
    over a pipe only; its stdout is the parent's, where `demo --json` and `bench --json` print their one JSON object.
    UCX prints its own errors there (`UCX ERROR ...` lines after a cut link, measured), from C, so the file
    descriptor itself is redirected, before NIXL loads."""
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def _serve(conn: Any, handlers: dict[str, Any]) -> None:
    """Answer parent commands until "quit"; any failure is reported, never a silent hang."""
    while True:
        if not conn.poll(3600):
            return
        msg = conn.recv()
        if msg[0] == "quit":
            return
        try:
            conn.send(handlers[msg[0]](*msg[1:]))
        except Exception as exc:  # noqa: BLE001 - report to the parent, keep serving
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))


async def _native_id() -> int:
    import threading  # noqa: PLC0415

    return threading.get_native_id()


def pick_request_blocks(spec: RankSpec, tokens: int, seed: int) -> list[list[int]]:
    from sparse_kv_lab.sim.buffers import pick_blocks  # noqa: PLC0415 - torch

    return pick_blocks(tokens, spec.block_size, spec.num_blocks, seed=seed, run_blocks=spec.run_blocks)


def _noop() -> None:
    """What `bench` times where bulk runs have no hook: what a call costs this thread after a layer's sleep."""


class PrefillCommands:
    """start, chunk (compute layers and call the hooks), finish, raw (the bench's raw-NIXL baseline)."""

    def __init__(self, rank: Any) -> None:
        self.rank, self.spec = rank, rank.spec
        self.sender = rank.sender()
        self.blocks: dict[str, list[list[int]]] = {}
        self._nixl = (0, 0)
        """The transport's (posts, descriptors) when the last request finished: a request's share is the change."""
        self.loop_tid = rank.run(_native_id(), 10)
        """The event loop thread's native id (sparse_kv_lab.sim.costs counts its CPU apart)."""

    def handlers(self) -> dict[str, Any]:
        return {"start": self.start, "chunk": self.chunk, "finish": self.finish, "raw": self.raw, "state": self.state,
                "idle": self.idle}

    def idle(self, seconds: float) -> tuple:
        """The CPU this process's threads use over `seconds` with nothing to do (the baseline of `chunk`'s)."""
        from sparse_kv_lab.sim.costs import CpuWindow  # noqa: PLC0415

        with CpuWindow(self.loop_tid) as window:
            time.sleep(seconds)
        return ("idle", window.split)

    def state(self) -> tuple:
        """What this rank holds: requests, peers and connections (tests check they return to their baseline after
        an attack), NIXL handles and bytes in flight, and the transport's counters."""
        async def read() -> dict[str, int]:
            sender, server, t = self.sender, self.sender.server, self.rank.transport
            agents = sender._table.agents
            return {"peers": len(sender.peers), "agents": agents.in_use, "agents_loaded": len(t.peers),
                    "agents_idle": agents.loaded - agents.in_use, "agent_loads": agents.loads,
                    "agent_unloads": agents.unloads, "agents_refused": agents.refused,
                    "parked_bytes": sender.ownership.parked_bytes, "trims": sender._trim.trims,
                    "connections": len(server.connections) if server else 0, "parked": sender.parked_count,
                    "requests": len(sender.requests), "given_up": len(sender.ownership.given_up),
                    "open_by_host": sum(server.guard.open.values()) if server else 0,
                    "handshakes": server.guard.handshakes if server else 0,
                    "refused": dict(server.refusals.counts) if server else {},
                    "refusal_lines": server.refusals.lines if server else 0,
                    "connections_refused": sender.stats.connections_refused,
                    "capability_refusals": sender.stats.capability_refusals,
                    "open_handles": t.open_handles, "inflight_bytes": t.inflight_bytes,
                    "abandoned": t.stats.abandoned, "reconnects": t.stats.reconnects,
                    "sends_failed": sender.stats.sends_failed}
        return ("state", self.rank.run(read(), 10))

    def start(self, tid: str, tokens: int, index: int, secret: str = "") -> tuple:
        # Each TP rank of a stage uses the same block ids, as vLLM's scheduler gives all ranks one block table.
        self.blocks[tid] = pick_request_blocks(self.spec, tokens, seed=1000 + index)
        self.sender.start_request(tid, tokens, secret)
        return ("ok",)

    def chunk(self, tid: str, t0: int, t1: int, layer_ms: float, mode: str, hook_layers: str,
              fill_ahead: bool = False) -> tuple:
        """Compute layers (fill them, then sleep out the rest of `layer_ms`) and call the hooks as vLLM does. The
        reply's last item says what the connector cost this thread and the process (sparse_kv_lab.sim.costs).
        `fill_ahead`: write every layer's content before the compute starts, so a layer's compute is `layer_ms` of
        sleep alone (a GPU forward: the device computes, the thread waits) and any stretch is the connector's."""
        import torch  # noqa: PLC0415 - loaded already (SimRank)

        from sparse_kv_lab.sim.costs import CpuWindow, HookCosts  # noqa: PLC0415

        cuda = self.spec.device.startswith("cuda")
        costs, window = HookCosts(), CpuWindow(self.loop_tid)
        layers = range(*self.sender.me.stage)
        for layer in layers if fill_ahead else ():
            self.rank.bufs.fill(layer, self.blocks[tid], t0, t1)
        with window:
            self.sender.begin_chunk(tid, self.blocks[tid], t1)
            start_t, computed = time.time(), {}
            for layer in layers:
                began = time.perf_counter()
                if not fill_ahead:
                    self.rank.bufs.fill(layer, self.blocks[tid], t0, t1)
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record()
                filled = time.perf_counter() - began
                left = layer_ms / 1e3 - filled
                if left > 0:
                    time.sleep(left)
                computed[layer] = time.time()
                if mode == "stream" and (hook_layers == "all" or layer % 2 == 0):
                    costs.time_hook(self.sender.layer_ready, tid, layer, event)
                elif mode == "bulk":
                    costs.time_hook(_noop)  # the floor: any call timed the same way, after the same sleep
                costs.layer_s.append(time.perf_counter() - began)
                costs.nominal_s.append(max(layer_ms / 1e3, filled))
            if cuda:
                torch.cuda.synchronize()
            end_t = time.time()
        self.sender.end_chunk(tid)  # the sweep: layers without a hook, and the whole request in bulk mode
        return ("chunk_done", start_t, end_t, costs.wall_ns, computed, (costs, window.split))

    def finish(self, tid: str) -> tuple:
        timeout = self.spec.timeout_s
        ok = self.rank.run(self.sender.wait_finished(tid, timeout), timeout + 5)
        info = self.sender.finished_info(tid)
        timeline = [(t.layers, t.nbytes, t.posted, t.written, t.landed, t.staged_chunks)
                    for t in self.sender.writer.timeline.pop(tid, [])]
        stats = self.rank.transport.stats
        (posts, descs), self._nixl = self._nixl, (stats.posts, stats.descriptors)
        return ("finished", ok, info.first_write_at if info else 0.0, timeline,
                (stats.posts - posts, stats.descriptors - descs))

    def raw(self, seed: int, tokens: int, dst_blocks: dict[Rank, list[list[int]]], coalesced: bool = False,
            piece_bytes: int = 0) -> tuple:
        """Bench baseline: the descriptors the connector posts (built by the sender's own function), as one raw
        NIXL WRITE per decode rank. `coalesced`: the same bytes from blocks 0..n-1 into blocks 0..n-1 (one long
        descriptor per region part: what NIXL moves when nothing is scattered). `piece_bytes`: those long
        descriptors cut into pieces of this size, enough of them for NIXL to spread the WRITE over its threads."""
        from connector.core.descriptors import batch_descriptors, split_pieces  # noqa: PLC0415
        from sparse_kv_lab.sim.raw_nixl import raw_write  # noqa: PLC0415

        n = blocks_for(tokens, self.spec.block_size)
        src_blocks = pick_request_blocks(self.spec, tokens, seed=1000 + seed)
        if coalesced:
            src_blocks = [list(range(n)) for _ in src_blocks]
        seconds = nbytes = count = 0
        for (_engine, *dst), peer in self.sender.peers.items():
            layer_routes = peer.accepted.plan.layer_routes(self.spec.rank, tuple(dst))
            n_dst = blocks_for(tokens, peer.hello.block_size)
            dst_ids = [list(range(n_dst)) for _ in src_blocks] if coalesced else dst_blocks[tuple(dst)]
            src_regions, dst_regions, src_ids, unit = self.sender.me.by_key, peer.accepted.regions, src_blocks, \
                self.spec.block_size
            views = peer.accepted.views
            if views is not None:  # block sizes that differ: as the sender moves them, in sub-blocks
                layer_routes, src_regions, dst_regions, unit = views.routes(layer_routes), views.src.regions, \
                    views.dst.regions, views.unit
                src_ids = views.src.expand(src_blocks, self.sender.me.null_block)
                dst_ids = views.dst.expand(dst_ids, peer.hello.null_block)
            descs = batch_descriptors(src_regions, dst_regions, layer_routes,
                                      [(layer, 0, blocks_for(tokens, unit)) for layer in layer_routes], src_ids,
                                      dst_ids, unit=unit)
            if piece_bytes:
                descs = split_pieces(descs, piece_bytes)
            local, remote = descs.arrays()
            seconds += raw_write(self.rank.transport, peer.agent, local, remote, mem_type=self.spec.mem_type,
                                 timeout=self.spec.timeout_s)
            nbytes += descs.nbytes
            count += len(descs)
        return ("raw", seconds, nbytes, count)


class DecodeCommands:
    """receive (pick blocks, register them with every prefill rank), collect (wait, then verify every byte)."""

    def __init__(self, rank: Any) -> None:
        self.rank, self.spec = rank, rank.spec
        self.receiver = rank.receiver()
        self.pending: dict[str, Any] = {}
        self.requests: dict[str, tuple] = {}
        self.used: list[list[int]] = [[], []]

    def handlers(self) -> dict[str, Any]:
        return {"receive": self.receive, "collect": self.collect, "state": self.state, "digest": self.digest,
                "scratch": self.scratch}

    def state(self) -> tuple:
        return ("state", self.receiver.busy)

    def digest(self) -> tuple:
        """A hash of every byte of this rank's cache (to tell that nothing landed meanwhile)."""
        import hashlib  # noqa: PLC0415

        import torch  # noqa: PLC0415 - loaded already (SimRank)

        h = hashlib.sha256()
        for tensor in self.rank.bufs.tensors:
            h.update(tensor.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
        return ("digest", h.hexdigest())

    def scratch(self, tokens: int) -> tuple:
        """Blocks 0..n-1 may hold anything from now on (the bench's coalesced baseline writes there)."""
        n = blocks_for(tokens, self.spec.block_size)
        for g in self.used:
            g += range(n)
        return ("ok",)

    async def _timed_receive(self, spec: Any, checksum: bool | None) -> tuple[Any, float]:
        result = await self.receiver.receive(spec, checksum=checksum)
        return result, time.time()

    def receive(self, tid: str, tokens: int, first_token: int, address: str, index: int,
                checksum: bool | None = None) -> tuple:
        from connector.engine.receiver import RecvSpec  # noqa: PLC0415

        block_ids = pick_request_blocks(self.spec, tokens, seed=5000 + index * 7 + self.spec.rank[1])
        for g, ids in enumerate(block_ids):
            self.used[g] += ids
        # Fresh blocks hold nothing of this request (a baseline or an earlier request may have written the same
        # ids): only what this transfer moves can make them verify.
        self.rank.bufs.zero_blocks(block_ids)
        self.requests[tid] = (block_ids, first_token, tokens)
        self.pending[tid] = self.rank.loop.submit(
            self._timed_receive(RecvSpec(tid, address, tuple(block_ids), first_token, tokens), checksum=checksum))
        return ("registering", block_ids)

    def collect(self, tid: str) -> tuple:
        block_ids, first_token, tokens = self.requests.pop(tid)
        try:
            result, done_at = self.pending.pop(tid).result(self.spec.timeout_s + 5)
        except Exception as exc:  # noqa: BLE001 - a failed transfer is a result, not a crash
            return ("collected", [f"transfer failed: {exc}"], 0, 0, time.time(), 0, 0)
        bufs = self.rank.bufs
        problems = bufs.verify(block_ids, first_token, tokens)
        problems += bufs.verify_prefix_untouched(block_ids, first_token) if first_token else []
        problems += bufs.untouched(self.used)
        return ("collected", problems, result.bytes_written, result.descriptors, done_at, result.staged_chunks,
                result.checksummed_blocks)

