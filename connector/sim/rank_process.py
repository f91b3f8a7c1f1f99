"""Worker processes of the demo and bench: one per prefill rank and one per decode rank.

Each runs the process's one event loop in a LoopThread (transport, side channel, stream engine) and takes
commands from the parent on a pipe in its main thread, which also plays the model: it "computes" layers by writing
deterministic content into the simulated cache and calls the engine's hooks exactly as the vLLM adapter does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from types import SimpleNamespace
from typing import Any, Iterator

from connector.sim.env import apply_env


def _setup(cfg: dict[str, Any]) -> None:
    apply_env()
    logging.basicConfig(level=cfg["log_level"], format=f"%(asctime)s {cfg['side']}{tuple(cfg['rank'])} "
                                                       f"%(levelname)s %(name)s: %(message)s")


def _transport(cfg: dict[str, Any], lt: Any) -> Any:
    from connector.transport.nixl import Transport, TransportConfig

    name = f"{cfg['run_id']}-{cfg['side']}-{cfg['rank'][0]}-{cfg['rank'][1]}-{os.getpid()}"
    transport = Transport(TransportConfig(name=name))
    lt.run(transport.open(), 60)
    return transport


@contextlib.contextmanager
def _rank_process(conn: Any, cfg: dict[str, Any]) -> Iterator[SimpleNamespace]:
    """The parts every worker has: the event loop thread, a NIXL transport, this rank's simulated cache registered
    with it. Closes them (the engine set on `.engine` first) on the way out; a failure is reported to the parent."""
    _setup(cfg)
    from connector.transport.loop import LoopThread
    from connector.sim.buffers import RankBuffers

    lt = LoopThread().start()
    rank = SimpleNamespace(lt=lt, transport=None, bufs=None, engine=None, staging=None, rank=tuple(cfg["rank"]),
                           parallel=cfg[cfg["side"]])
    try:
        rank.transport = _transport(cfg, lt)
        rank.bufs = RankBuffers(cfg["model"], rank.parallel, rank.rank, cfg["block_size"], cfg["num_blocks"],
                                cfg["device"])
        for tensor in rank.bufs.tensors:
            rank.transport.register(tensor)
        if cfg.get("staging_mb"):
            import torch

            rank.staging = torch.empty(cfg["staging_mb"] << 20, dtype=torch.uint8, device=cfg["device"])
            rank.transport.register(rank.staging)
        yield rank
    except Exception as exc:  # noqa: BLE001 - the parent must hear about it
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
    finally:
        if rank.engine is not None:
            lt.run(rank.engine.aclose(), 30)
        if rank.transport is not None:
            lt.run(rank.transport.aclose(), 30)
        lt.stop()


def _local_rank(me: SimpleNamespace, cfg: dict[str, Any], engine_id: str) -> Any:
    from connector.engine.rank import LocalRank

    return LocalRank(engine_id, cfg["model"], me.parallel, me.rank, tuple(me.bufs.regions()), cfg["block_size"],
                     mem_type="VRAM" if cfg["device"].startswith("cuda") else "DRAM", staging=me.staging)


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


def prefill_main(conn: Any, cfg: dict[str, Any]) -> None:
    from connector.sim.buffers import pick_blocks
    from connector.engine.config import SenderConfig
    from connector.protocol.addressing import side_channel_port
    from connector.engine.sender import StreamSender

    with _rank_process(conn, cfg) as me:
        lt, transport, bufs, rank, parallel = me.lt, me.transport, me.bufs, me.rank, me.parallel
        port = side_channel_port(cfg["base_port"], rank, parallel.tp)
        sender = me.engine = StreamSender(
            _local_rank(me, cfg, f"prefill-{cfg['run_id']}"), transport,
            SenderConfig(port=port, write_timeout_s=cfg["timeout_s"]), lt.loop)
        lt.run(sender.start(), 30)
        blocks: dict[str, list[list[int]]] = {}
        stage = parallel.stages[rank[0]]
        cuda = cfg["device"].startswith("cuda")

        def start(tid: str, tokens: int, index: int) -> tuple:
            # Each TP rank of a stage uses the same block ids, as vLLM's scheduler gives all ranks one block table.
            blocks[tid] = pick_blocks(tokens, cfg["block_size"], cfg["num_blocks"], seed=1000 + index,
                                      run_blocks=cfg["run_blocks"])
            sender.start_request(tid, tokens)
            return ("ok",)

        def chunk(tid: str, t0: int, t1: int, layer_ms: float, mode: str, hook_layers: str) -> tuple:
            import torch

            sender.begin_chunk(tid, blocks[tid], t1)
            hooks, start_t = [], time.time()
            for layer in range(*stage):
                began = time.perf_counter()
                bufs.fill(layer, blocks[tid], t0, t1)
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record()
                left = layer_ms / 1e3 - (time.perf_counter() - began)
                if left > 0:
                    time.sleep(left)
                if mode == "stream" and (hook_layers == "all" or layer % 2 == 0):
                    h0 = time.perf_counter_ns()
                    sender.layer_ready(tid, layer, event)
                    hooks.append(time.perf_counter_ns() - h0)
            if cuda:
                torch.cuda.synchronize()
            end_t = time.time()
            sender.end_chunk(tid)  # the sweep: layers without a hook, and the whole request in bulk mode
            return ("chunk_done", start_t, end_t, hooks)

        def finish(tid: str) -> tuple:
            ok = lt.run(sender.wait_finished(tid, cfg["timeout_s"]), cfg["timeout_s"] + 5)
            info = sender.finished_info.get(tid)
            return ("finished", ok, info.first_write_at if info else 0.0)

        def raw(seed: int, tokens: int, dst_blocks: dict[tuple[int, int], list[list[int]]]) -> tuple:
            """Bench baseline: the descriptors the connector posts (built by the sender's own function), as one
            raw NIXL WRITE per decode rank."""
            from connector.core.descriptors import batch_descriptors
            from connector.core.layout import blocks_for
            from connector.sim.raw_nixl import raw_write

            src_blocks = pick_blocks(tokens, cfg["block_size"], cfg["num_blocks"], seed=1000 + seed,
                                     run_blocks=cfg["run_blocks"])
            n = blocks_for(tokens, cfg["block_size"])
            seconds = nbytes = count = 0
            for (_engine, dpp, dtp), peer in sender.peers.items():
                layer_routes = peer.accepted.plan.layer_routes(rank, (dpp, dtp))
                descs = batch_descriptors(sender.me.by_key, peer.accepted.regions, layer_routes,
                                          [(layer, 0, n) for layer in layer_routes], src_blocks, dst_blocks[(dpp, dtp)])
                local, remote = descs.arrays()
                seconds += raw_write(transport, peer.agent, local, remote, mem_type=sender.me.mem_type,
                                               timeout=cfg["timeout_s"])
                nbytes += descs.nbytes
                count += len(descs)
            return ("raw", seconds, nbytes, count)

        conn.send(("ready", port))
        _serve(conn, {"start": start, "chunk": chunk, "finish": finish, "raw": raw})


def decode_main(conn: Any, cfg: dict[str, Any]) -> None:
    from connector.protocol.addressing import PrefillAddress
    from connector.engine.config import ReceiverConfig
    from connector.engine.receiver import StreamReceiver
    from connector.sim.buffers import pick_blocks

    with _rank_process(conn, cfg) as me:
        lt, bufs, rank = me.lt, me.bufs, me.rank
        receiver = me.engine = StreamReceiver(
            _local_rank(me, cfg, f"decode-{cfg['run_id']}"), me.transport,
            ReceiverConfig(transfer_timeout_s=cfg["timeout_s"],
                           # every prefill rank connection gets its own slot
                           staging_slot_bytes=max(1, cfg.get("staging_mb", 0) << 20)
                           // (cfg["prefill"].pp * cfg["prefill"].tp)))
        pending: dict[str, Any] = {}
        requests: dict[str, tuple] = {}
        used: list[list[int]] = [[], []]

        async def timed_receive(*args: Any) -> tuple[Any, float]:
            result = await receiver.receive(*args)
            return result, time.time()

        def receive(tid: str, tokens: int, first_token: int, address: str, index: int) -> tuple:
            block_ids = pick_blocks(tokens, cfg["block_size"], cfg["num_blocks"], seed=5000 + index * 7 + rank[1],
                                    run_blocks=cfg["run_blocks"])
            for g, ids in enumerate(block_ids):
                used[g] += ids
            requests[tid] = (block_ids, first_token, tokens)
            pending[tid] = lt.submit(timed_receive(tid, PrefillAddress.parse(address), block_ids, first_token, tokens))
            return ("registering", block_ids)

        def collect(tid: str) -> tuple:
            block_ids, first_token, tokens = requests.pop(tid)
            try:
                result, done_at = pending.pop(tid).result(cfg["timeout_s"] + 5)
            except Exception as exc:  # noqa: BLE001 - a failed transfer is a result, not a crash
                return ("collected", [f"transfer failed: {exc}"], 0, 0, time.time(), 0)
            problems = bufs.verify(block_ids, first_token, tokens)
            problems += bufs.verify_prefix_untouched(block_ids, first_token) if first_token else []
            problems += bufs.untouched(used)
            return ("collected", problems, result.bytes_written, result.descriptors, done_at, result.staged_chunks)

        conn.send(("ready",))
        _serve(conn, {"receive": receive, "collect": collect})
