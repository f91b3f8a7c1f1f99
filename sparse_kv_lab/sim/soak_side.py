"""The two worker processes of a soak (sparse_kv_lab.sim.soak): a prefill rank that computes and sends requests back to
back, and a decode rank that receives and verifies them, each sampling itself every `plan.sample_every` requests.

They need no coordination per request: prefill starts request i only once request i-1 was released, decode registers
request i only once it received i-1, and a registration that comes before its request started waits for it (the
normal "decode registers first" flow). The parent only hears samples and the end; nothing per request crosses the
pipe, so what is measured is the connector, not the harness.

Content: the same pattern as every sim test (sparse_kv_lab.sim.buffers.content, per pool, layer and token), computed once
for the request's token range and written / compared with one indexing op per pool (RankBuffers.fill and verify do
one per layer, which would cost more than the transfer). Decode zeroes its blocks before each request, so only what
that transfer moved can verify.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import traceback
from typing import Any

from sparse_kv_lab.sim.env import apply_env
from sparse_kv_lab.sim.rank_process import keep_stdout_clean


def run(conn: Any, side: str, plan: Any, spec: Any) -> None:
    """Process entry point: ("ready", port or 0), then, for decode, wait for ("go", port); run the plan; send
    ("sample", dict) along the way and ("done", dict) at the end, or ("error", text)."""
    keep_stdout_clean()
    apply_env()
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s soak-{side} %(levelname)s %(name)s: %(message)s")
    try:
        worker = PrefillSide(conn, plan, spec) if side == "prefill" else DecodeSide(conn, plan, spec)
        try:
            conn.send(worker.result())
        finally:
            worker.close()
    except Exception as exc:  # noqa: BLE001 - the parent must hear about it
        conn.send(("error", f"soak {side}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))


class Pattern:
    """The expected bytes of tokens [0, tokens) of every pool a rank holds, laid out as the blocks hold them
    ([layers, parts, blocks, heads, block_size, row bytes]: `tokens` fills whole blocks), and the fill and check
    with them: one copy along the block dimension per pool, whatever the block ids."""

    def __init__(self, bufs: Any, tokens: int) -> None:
        import torch  # noqa: PLC0415 - loaded already (SimRank)

        from sparse_kv_lab.sim.buffers import content  # noqa: PLC0415

        self.bufs, self.tokens = bufs, tokens
        self.want = {}
        bs, n = bufs.block_size, tokens // bufs.block_size
        for name, buf in bufs.pools.items():
            per_layer = []
            for layer in buf.layers:  # [T, parts, heads, E] -> [parts, blocks, heads, block_size, E]
                data = content(name, layer, torch.arange(tokens), buf.heads, buf.parts, buf.row_bytes, bufs.device)
                per_layer.append(data.reshape(n, bs, *data.shape[1:]).permute(2, 0, 3, 1, 4))
            self.want[name] = torch.stack(per_layer).contiguous()
        self.nbytes = sum(w.numel() for w in self.want.values())
        """Bytes one request moves (every token of every layer of every pool: full blocks, as `tokens` is)."""

    def _ids(self, block_ids: list[list[int]], pool: str) -> Any:
        import torch  # noqa: PLC0415

        from sparse_kv_lab.sim.buffers import POOL_GROUP  # noqa: PLC0415

        ids = block_ids[POOL_GROUP[pool]][: self.tokens // self.bufs.block_size]
        return torch.tensor(ids, dtype=torch.int64, device=self.bufs.device)

    def fill(self, block_ids: list[list[int]]) -> None:
        for name, buf in self.bufs.pools.items():
            buf.tensor.index_copy_(2, self._ids(block_ids, name), self.want[name])

    def problems(self, block_ids: list[list[int]]) -> list[str]:
        out = []
        for name, buf in self.bufs.pools.items():
            got = buf.tensor.index_select(2, self._ids(block_ids, name))
            if not bool((got == self.want[name]).all()):
                bad = (got != self.want[name]).any(dim=(0, 1, 3, 5)).nonzero().tolist()  # [block, offset]
                out.append(f"{name}: {len(bad)} of {self.tokens} tokens differ, first at token "
                           f"{bad[0][0] * self.bufs.block_size + bad[0][1]}")
        return out


class _Side:
    def __init__(self, conn: Any, plan: Any, spec: Any) -> None:
        from sparse_kv_lab.sim.rank import SimRank  # noqa: PLC0415 - torch and NIXL load only after apply_env()
        from sparse_kv_lab.sim.soak_probe import Probe  # noqa: PLC0415

        import torch  # noqa: PLC0415

        # One intra-op thread: the soak's tensors are tiny, and OpenMP's workers spinning after each op took most
        # of a core per process (measured with perf: libgomp, 2 cores shared by both processes).
        torch.set_num_threads(1)
        self.conn, self.plan, self.spec = conn, plan, spec
        self.rank = SimRank(spec).open()
        self.pattern = Pattern(self.rank.bufs, plan.tokens)
        self.probe = Probe(spec.side, self.tables)
        self.failures: list[str] = []
        self.done = 0

    def tables(self) -> dict[str, int]:
        async def settled() -> dict[str, int]:
            # The request just released may still be referenced by the task that released it (sending its
            # Complete, say) for a loop iteration or two: let those tasks end before anything is counted.
            await asyncio.sleep(0.05)
            return await self._tables()

        return self.rank.run(settled(), 30)

    async def _tables(self) -> dict[str, int]:
        raise NotImplementedError

    def maybe_sample(self, extra: dict[str, Any] | None = None) -> None:
        if self.done % self.plan.sample_every == 0 or self.done == self.plan.requests:
            sample = self.probe.sample(self.done, self.done >= self.plan.warmup, extra)
            sample["failures"] = len(self.failures)
            self.conn.send(("sample", sample))

    def fail(self, i: int, why: str) -> None:
        self.failures.append(f"request {i}: {why}")

    def result(self) -> tuple:
        return ("done", {"side": self.spec.side, "requests": self.done, "failures": len(self.failures),
                         "first_failures": self.failures[:10]})

    def close(self) -> None:
        self.rank.close()


class PrefillSide(_Side):
    def __init__(self, conn: Any, plan: Any, spec: Any) -> None:
        from connector.engine.config import SenderConfig  # noqa: PLC0415

        super().__init__(conn, plan, spec)
        self.sender = self.rank.sender(SenderConfig(host=spec.placement.host, port=0, lease_s=plan.timeout_s,
                                                    write_timeout_s=plan.timeout_s, side_channel=spec.side_channel))
        if plan.released_max_ids is not None:  # a small memory, so a short run reaches its steady state
            self.sender.ownership.released.max_ids = plan.released_max_ids
        self._waiting: dict[str, concurrent.futures.Future] = {}
        self.sender.on_finished = self._finished  # (on the loop)
        conn.send(("ready", self.sender.port))

    def _finished(self, tid: str, ok: bool) -> None:
        fut = self._waiting.pop(tid, None)
        if fut is not None:
            fut.set_result(ok)

    async def _tables(self) -> dict[str, int]:
        s, t, own = self.sender, self.rank.transport, self.sender.ownership
        server = s.server
        return {"requests": len(s.requests), "parked": s.parked_count, "released_ids": len(own.released), "given_up": len(own.given_up), "peers": len(s.peers),
                "nixl_peers": s._table.agents.in_use, "nixl_loaded": len(t.peers), "xfer_handles": t.open_handles, "inflight_bytes": t.inflight_bytes,
                "connections": len(server.connections) if server else 0,
                "open_by_host": sum(server.guard.open.values()) if server else 0,
                "timeline": len(s.writer.timeline), "inbox": len(s._inbox), "streaming": len(s._inbox.streaming), "tasks": len(asyncio.all_tasks()),
                "sends_ok": s.stats.sends_ok, "sends_failed": s.stats.sends_failed,
                "nixl_posts": t.stats.posts, "nixl_reconnects": t.stats.reconnects}

    def result(self) -> tuple:
        from sparse_kv_lab.sim.rank_process import pick_request_blocks  # noqa: PLC0415

        plan, sender = self.plan, self.sender
        self.maybe_sample()
        for i in range(plan.requests):
            tid = f"soak-{i}"
            blocks = pick_request_blocks(self.spec, plan.tokens, seed=i)
            fut = self._waiting[tid] = concurrent.futures.Future()
            sender.start_request(tid, plan.tokens)
            sender.begin_chunk(tid, blocks, plan.tokens)
            self.pattern.fill(blocks)  # "compute" every layer, then the end-of-chunk sweep sends them
            sender.end_chunk(tid)
            try:
                if not fut.result(plan.timeout_s):
                    self.fail(i, "released as not completed (see this process's log)")
            except concurrent.futures.TimeoutError:
                self._waiting.pop(tid, None)
                self.fail(i, f"not released within {plan.timeout_s:g} s")
            self.done = i + 1
            self.maybe_sample()
        return super().result()


class DecodeSide(_Side):
    def __init__(self, conn: Any, plan: Any, spec: Any) -> None:
        super().__init__(conn, plan, spec)
        self.receiver = self._receiver()
        self.churns = self.restarts = 0
        conn.send(("ready", 0))
        if not conn.poll(plan.timeout_s):
            raise TimeoutError(f"the parent sent no prefill port within {plan.timeout_s:g} s")
        _go, port = conn.recv()
        from connector.protocol.addressing import PrefillAddress  # noqa: PLC0415

        self.address = PrefillAddress(spec.placement.host, port)

    def _receiver(self) -> Any:
        from connector.engine.config import ReceiverConfig  # noqa: PLC0415

        return self.rank.receiver(ReceiverConfig(self.spec.side_channel, transfer_timeout_s=self.plan.timeout_s,
                                                 stop_timeout_s=self.plan.timeout_s))

    async def _tables(self) -> dict[str, int]:
        r = self.receiver
        return {**r.busy, "sources": len(r.sources.by_address), "connecting_locks": len(r.sources._connecting),
                "nixl_peers": len(self.rank.transport.peers), "tasks": len(asyncio.all_tasks())}

    def churn(self) -> None:
        """Drop this decode rank's peer: every `restart_every`-th time a restart (a new NIXL agent, new memory,
        a new engine id: a decode instance that came back), else its side-channel connections closed (prefill
        releases the peer and unloads its agent; the next request connects and loads it again)."""
        from sparse_kv_lab.sim.rank import SimRank  # noqa: PLC0415

        self.churns += 1
        if self.plan.restart_every and self.churns % self.plan.restart_every == 0:
            self.restarts += 1
            self.rank.close()
            self.spec = dataclasses.replace(self.spec, run_id=f"{self.spec.run_id.split('.')[0]}.{self.restarts}")
            self.rank = SimRank(self.spec).open()
            self.pattern = Pattern(self.rank.bufs, self.plan.tokens)
            self.receiver = self._receiver()
            return
        engine = self.receiver.sources.by_address.get(self.address)
        if engine is not None:
            self.rank.run(self.receiver.sources.drop(engine, "soak: peer churn"), 30)

    def result(self) -> tuple:
        from connector.engine.receiver import RecvSpec  # noqa: PLC0415
        from sparse_kv_lab.sim.rank_process import pick_request_blocks  # noqa: PLC0415

        plan = self.plan
        self.maybe_sample(self._churn_counts())
        for i in range(plan.requests):
            if plan.churn_every and i and i % plan.churn_every == 0:
                self.churn()
            tid = f"soak-{i}"
            # seeds apart from prefill's: the two sides' block ids differ, as they do between two engines
            blocks = pick_request_blocks(self.spec, plan.tokens, seed=1_000_003 + i)
            self.rank.bufs.zero_blocks(blocks)
            try:
                spec = RecvSpec(tid, str(self.address), tuple(blocks), 0, plan.tokens)
                got = self.rank.run(self.receiver.receive(spec), plan.timeout_s + 5)
                if got.bytes_written != self.pattern.nbytes:
                    self.fail(i, f"{got.bytes_written} B written, expected {self.pattern.nbytes}")
                elif i % plan.verify_every == 0:
                    for problem in self.pattern.problems(blocks):
                        self.fail(i, problem)
            except Exception as exc:  # noqa: BLE001 - a failed transfer is counted, the soak goes on
                self.fail(i, f"{type(exc).__name__}: {exc}")
            self.done = i + 1
            self.maybe_sample(self._churn_counts())
        return super().result()

    def _churn_counts(self) -> dict[str, int]:
        return {"churns": self.churns, "restarts": self.restarts}
