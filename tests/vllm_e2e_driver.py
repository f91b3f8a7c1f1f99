"""Driver of the vLLM end-to-end tests (see test_vllm_e2e.py): worker-process pool, instances, the step loop
and the byte checks. Not a test module."""


from __future__ import annotations

import math
import multiprocessing as mp
import pickle
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tests import vllm_harness as H

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402

import connector  # noqa: E402
from sparse_kv_lab.pd.servers import with_trust  # noqa: E402
from connector.protocol.auth import new_transfer_secret  # noqa: E402
from connector.transport.ports import free_ports  # noqa: E402
from connector.vllm import SparseKVConnector  # noqa: E402
from connector.vllm.metadata import RecvSpec, SendSpec, SparseKVMetadata  # noqa: E402
from tests import vllm_e2e_worker as W  # noqa: E402

BS = 16
NUM_BLOCKS = 64
POOL_SIZE = 3
REPLY_S = 90.0          # one worker command (setup includes NIXL agent creation)
DRIVE_WALL_S = 60.0     # one scenario's step loop
EXTRA = {"side_channel_host": "127.0.0.1", "lease_s": 20, "handshake_timeout_s": 10, "transfer_timeout_s": 30,
         "write_timeout_s": 20, "heartbeat_interval_s": 1, "dead_after_s": 10}

# ---------------------------------------------------------------------------------------------------------------
# worker processes

class Pool:
    """Worker processes (spawn), each able to host one rank at a time. Ended by PID, never by name."""

    def __init__(self, size: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.pending: list[int] = []
        """Commands sent to each worker whose answer was not read yet."""
        self.broken = False
        self.grow(size)

    def grow(self, size: int) -> None:
        """Start workers until there are `size` (a test needing more ranks than the module default)."""
        first = len(self.procs)
        try:
            for i in range(first, size):
                parent, child = self.ctx.Pipe()
                proc = self.ctx.Process(target=W.main, args=(child,), name=f"vllm-e2e-worker-{i}", daemon=True)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
                self.pending.append(1)  # its "ready"
            for i in range(first, size):  # they import vLLM in parallel
                self.reply(i, 180)
        except BaseException:
            self.close()
            raise

    def send(self, i: int, msg: tuple) -> None:
        self.conns[i].send(msg)
        self.pending[i] += 1

    def reply(self, i: int, timeout: float = REPLY_S) -> tuple:
        conn, proc = self.conns[i], self.procs[i]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            if not proc.is_alive():
                self.broken = True
                raise RuntimeError(f"worker {i} (pid {proc.pid}) died with exit code {proc.exitcode}")
            if time.monotonic() > deadline:
                self.broken = True
                raise TimeoutError(f"worker {i} (pid {proc.pid}) did not answer within {timeout:.0f} s")
        answer = conn.recv()
        self.pending[i] -= 1
        if answer[0] == "error":
            raise RuntimeError(f"worker {i} (pid {proc.pid}) failed: {answer[1]}")
        return answer

    def ask(self, i: int, msg: tuple, timeout: float = REPLY_S) -> tuple:
        self.send(i, msg)
        return self.reply(i, timeout)

    def drain(self, i: int) -> None:
        """Read the answers a failed test left unread, so the next command gets its own answer."""
        while self.pending[i] > 0:
            try:
                self.reply(i)
            except RuntimeError as exc:
                if self.broken:
                    raise
                del exc  # an error answer: consumed, go on

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("quit",))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 20
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()  # this very process, by its PID
                proc.join(5)
        for conn in self.conns:
            conn.close()


# ---------------------------------------------------------------------------------------------------------------
# one vLLM instance: scheduler here, ranks in worker processes

@dataclass
class Instance:
    name: str
    tp: int
    pp: int
    cfg: Any
    sched: Any
    workers: dict[tuple[int, int], int]
    """(pp, tp) rank -> pool worker index."""
    infos: dict[tuple[int, int], dict]
    aggregator: Any
    free0: int

    @property
    def connector(self) -> SparseKVConnector:
        return self.sched.connector

    def free(self) -> int:
        return H.free_block_count(self.sched)


def make_instance(pool: Pool, first_worker: int, model_dir, *, role: str, tp: int, pp: int, by_name: bool,
                  base_port: int, max_num_batched_tokens: int = 256, policy: str = "fail",
                  prefix_caching: bool = True, extra_config: dict | None = None,
                  worker_opts: dict | None = None, dp_index: int = 0, name: str = "",
                  family: str = "", num_blocks: int = NUM_BLOCKS) -> Instance:
    """worker_opts: the rank spec's model options (vllm_e2e_worker: model_layers, layer_ms, hook_all_layers).
    dp_index: the instance is that data-parallel rank of its deployment (vLLM's data_parallel_index, and the
    `_dp<rank>` engine-id suffix vLLM's engine core adds)."""
    name = name or ("prefill" if role == "kv_producer" else "decode")
    engine_id = f"{name}-{uuid.uuid4().hex[:8]}_dp{dp_index}"
    extra = with_trust("kv_both", dict(EXTRA, side_channel_port=base_port, **(extra_config or {})))
    spec = {"model_dir": str(model_dir), "kv_role": role, "engine_id": engine_id, "extra_config": extra,
            "block_size": BS, "max_num_batched_tokens": max_num_batched_tokens, "tp": tp, "pp": pp,
            "kv_load_failure_policy": policy, "num_blocks": num_blocks, "by_name": by_name,
            "enable_prefix_caching": prefix_caching, "dp_index": dp_index, "family": family, **(worker_opts or {})}
    if family:  # a family of vLLM 0.33's tree (tests.vllm_e2e_family): its own config, specs and groups
        from tests import vllm_families as F
        from tests.vllm_e2e_family import family_config

        cfg = family_config(family, spec)
        cfg.parallel_config.data_parallel_index = dp_index
        kvc0 = F.family_kv_cache_config(family, tp=tp, pp=pp, num_blocks=num_blocks, vllm_config=cfg)[1]
    else:
        if by_name:
            connector.register()
            cfg = H.make_vllm_config(model_dir, kv_role=role, engine_id=engine_id, extra_config=extra,
                                     block_size=BS, max_num_batched_tokens=max_num_batched_tokens, tp=tp, pp=pp,
                                     kv_load_failure_policy=policy, enable_prefix_caching=prefix_caching)
            cfg.kv_transfer_config.kv_connector_module_path = None  # the registered name alone
        else:
            cfg = H.make_vllm_config(model_dir, kv_role=role, engine_id=engine_id, extra_config=extra,
                                     block_size=BS, kv_connector_module_path="connector.vllm",
                                     max_num_batched_tokens=max_num_batched_tokens, tp=tp, pp=pp,
                                     kv_load_failure_policy=policy, enable_prefix_caching=prefix_caching)
        cfg.parallel_config.data_parallel_index = dp_index
        if not cfg.model_config.use_mla:  # (MLA: one head, any layout works, so the connector asks for none)
            assert H.resolve_layout(cfg).name == "LBHNC"  # the connector's requirement wins over the sm90 default
        kvc0 = H.make_kv_cache_config(cfg, num_blocks=num_blocks, pp_rank=0)
    # The engine core hands the scheduler worker 0's (PP stage 0's) KV-cache config.
    sched = H.make_scheduler(cfg, kvc0)
    assert isinstance(sched.connector, SparseKVConnector)
    ranks = [(p, t) for p in range(pp) for t in range(tp)]
    workers = {rank: first_worker + i for i, rank in enumerate(ranks)}
    for rank, w in workers.items():
        pool.send(w, ("setup", dict(spec, rank=rank)))
    infos = {rank: pool.reply(w)[1] for rank, w in workers.items()}
    # What EngineCore._set_kv_connector_handshake_metadata does after the workers registered their caches.
    handshakes: dict[tuple[int, int], Any] = {}
    for info in infos.values():
        handshakes.update(info["handshake"] or {})
    sched.connector.set_xfer_handshake_metadata_pp_aware(handshakes)
    for rank, info in infos.items():
        assert info["num_blocks"] == num_blocks, info
        assert info["layout"] == "LBHNC" or cfg.model_config.use_mla or family, info
        assert info["connector"] == "connector.vllm.connector.SparseKVConnector"
        if role != "kv_consumer":  # (a kv_both decode listens too, on its own ports)
            port = base_port + dp_index * tp * pp + rank[0] * tp + rank[1]  # DP ranks take consecutive ranges
            assert handshakes[rank].side_channel_addr == f"127.0.0.1:{port}"
    aggregator = KVOutputAggregator.from_connector(sched.connector, tp * pp)  # as vLLM's executor builds it
    assert aggregator._expected_finished_count == tp * pp  # a request is done once EVERY rank reported it
    return Instance(name, tp, pp, cfg, sched, workers, infos, aggregator, H.free_block_count(sched))


class Pair:
    """A prefill and a decode instance on the pool; tears every rank down on exit."""

    def __init__(self, pool: Pool, model_dir, *, prefill=(1, 1), decode=(1, 1), by_name=False,
                 prefill_max_batched=256, decode_prefix_caching=True, extra_config: dict | None = None,
                 prefill_opts: dict | None = None, prefill_dp_index: int = 0, kv_both: bool = False,
                 family: str = "", num_blocks: int = NUM_BLOCKS) -> None:
        """kv_both: both instances run kv_role kv_both (each its own side-channel ports); the requests' own
        kv_transfer_params make one the prefill and the other the decode."""
        self.pool = pool
        (ptp, ppp), (dtp, dpp) = prefill, decode
        assert ptp * ppp + dtp * dpp <= len(pool.procs)
        self.base_port = free_ports(ptp * ppp * (prefill_dp_index + 1))
        """The deployment's configured side_channel_port; prefill DP rank i listens from base + i * tp * pp."""
        self.instances: list[Instance] = []
        try:
            self.P = make_instance(pool, 0, model_dir, role="kv_both" if kv_both else "kv_producer", tp=ptp, pp=ppp, by_name=by_name,
                                   base_port=self.base_port, max_num_batched_tokens=prefill_max_batched,
                                   extra_config=extra_config, worker_opts=prefill_opts,
                                   dp_index=prefill_dp_index, name="prefill", family=family, num_blocks=num_blocks)
            self.instances.append(self.P)
            self.D = make_instance(pool, ptp * ppp, model_dir, role="kv_both" if kv_both else "kv_consumer", tp=dtp,
                                   pp=dpp, by_name=by_name,
                                   base_port=free_ports(dtp * dpp) if kv_both else self.base_port,
                                   prefix_caching=decode_prefix_caching, extra_config=extra_config, name="decode",
                                   family=family, num_blocks=num_blocks)
            self.instances.append(self.D)
        except BaseException:
            self.close()
            raise
        self.addr = f"127.0.0.1:{self.base_port + prefill_dp_index * ptp * ppp}"

    def __enter__(self) -> "Pair":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.pool.broken:
            return  # the pool fixture ends these processes (by PID) and starts new ones
        for w in range(len(self.pool.procs)):  # every worker: a failed setup may have reached any of them
            try:
                self.pool.drain(w)
                self.pool.ask(w, ("teardown",), 60)
            except Exception:  # noqa: BLE001 - a worker that cannot tear down is restarted for the next test
                self.pool.broken = True

    def logs(self, inst: Instance) -> list[str]:
        return [line for w in inst.workers.values() for line in self.pool.ask(w, ("logs",))[1]]

    def sender_bytes(self) -> int:
        return sum(self.pool.ask(w, ("stats",))[1].get("bytes_written", 0) for w in self.P.workers.values())

    def registered(self, transfer_id: str) -> bool:
        """Every prefill rank holds decode's registration for `transfer_id` (parked until prefill starts it)."""
        return all(self.pool.ask(w, ("parked", transfer_id))[1] for w in self.P.workers.values())


# ---------------------------------------------------------------------------------------------------------------
# the step loop

@dataclass
class Job:
    """One request as the proxy sends it: to decode always, to prefill when it has a transfer id to serve."""

    rid: str
    prompt: list[int]
    decode_params: dict
    to_prefill: bool = True
    max_tokens: int = 4

    @property
    def tid(self) -> str:
        return self.decode_params.get("transfer_id", "")


@dataclass
class Trace:
    steps: int = 0
    statuses: dict[str, list[str]] = field(default_factory=dict)
    """decode request -> its distinct statuses after each schedule(), then the finish reason."""
    finish: dict[tuple[str, str], FinishReason] = field(default_factory=dict)
    """(instance, request) -> finish reason."""
    finish_step: dict[tuple[str, str], int] = field(default_factory=dict)
    finished_sending: dict[str, int] = field(default_factory=dict)
    finished_recving: dict[str, int] = field(default_factory=dict)
    failed_recving: dict[str, int] = field(default_factory=dict)
    recv_specs: dict[str, RecvSpec] = field(default_factory=dict)
    send_specs: dict[str, list[SendSpec]] = field(default_factory=dict)
    scheduled_prefill: dict[str, list[int]] = field(default_factory=dict)
    left_waiting: dict[str, tuple[int, tuple[list[int], ...]]] = field(default_factory=dict)
    verified: dict[str, tuple[list[str], int]] = field(default_factory=dict)
    kv_stats: dict[str, Any] = field(default_factory=dict)
    """instance -> its workers' kv_connector_stats as vLLM's aggregator merged them, summed over the steps."""
    prefill_held: dict[str, list[tuple[int, bool, int]]] = field(default_factory=dict)
    """prefill request -> (step, still in the scheduler, free blocks) after each update_from_output from its
    finish on."""

    def dump(self) -> str:
        return (f"steps={self.steps} statuses={self.statuses} finish={self.finish} "
                f"finished_sending={self.finished_sending} finished_recving={self.finished_recving} "
                f"failed_recving={self.failed_recving} left_waiting={self.left_waiting}")


def _step_workers(pair: Pair, items: list[tuple[Instance, Any]]) -> dict[str, Any]:
    """Ship each SchedulerOutput (pickled) to every worker of its instance, all at once; aggregate per instance."""
    for inst, so in items:
        blob = pickle.dumps(so)
        for w in inst.workers.values():
            pair.pool.send(w, ("step", blob))
    merged = {}
    for inst, so in items:
        outs = [pair.pool.reply(w)[1] for w in inst.workers.values()]
        merged[inst.name] = H.aggregate(outs, inst.aggregator)
    return merged


def drive(pair: Pair, jobs: list[Job], *, max_steps: int = 400, wall_s: float = DRIVE_WALL_S,
          prefill_after_register: bool = False) -> Trace:
    """Add the jobs to both instances and step both until every request finished and every block is back.
    prefill_after_register: prefill gets a request only once decode's registration for it reached every prefill
    rank, so its layers can stream from the first (the proxy sends both legs at once; a real prefill computes long
    enough for the registration to arrive, this fake one does not)."""
    P, D = pair.P, pair.D
    bs = P.cfg.cache_config.block_size  # BS, or a family's own (tests.vllm_e2e_family)
    trace = Trace()
    to_prefill = []
    for job in jobs:
        D.sched.add_request(H.make_request(job.rid, len(job.prompt), kv_transfer_params=dict(job.decode_params),
                                           max_tokens=job.max_tokens, prompt_token_ids=job.prompt, block_size=bs))
        if job.to_prefill:
            to_prefill.append(job)
        trace.statuses[job.rid] = []
    by_rid = {job.rid: job for job in jobs}
    began = time.monotonic()
    while True:
        for job in [j for j in to_prefill if not prefill_after_register or pair.registered(j.tid)]:
            # The proxy's prefill leg: one output token, KV pushed to decode.
            P.sched.add_request(H.make_request(job.rid, len(job.prompt), max_tokens=1, prompt_token_ids=job.prompt,
                                               kv_transfer_params=prefill_leg(job), block_size=bs))
            to_prefill.remove(job)
        trace.steps += 1
        step = trace.steps
        so_p, so_d = P.sched.schedule(), D.sched.schedule()
        meta_p, meta_d = so_p.kv_connector_metadata, so_d.kv_connector_metadata
        assert isinstance(meta_p, SparseKVMetadata) and isinstance(meta_d, SparseKVMetadata)
        for rid, spec in meta_p.sends.items():
            trace.send_specs.setdefault(rid, []).append(spec)
        for rid, n in so_p.num_scheduled_tokens.items():
            trace.scheduled_prefill.setdefault(rid, []).append(n)
        for rid, spec in meta_d.recvs.items():
            assert rid not in trace.recv_specs, f"{rid} registered twice"
            trace.recv_specs[rid] = spec
        for rid, seen in trace.statuses.items():
            req = D.sched.requests.get(rid)
            if req is None:
                continue
            status = req.status.name
            if seen and seen[-1] == "WAITING_FOR_REMOTE_KVS" and status != "WAITING_FOR_REMOTE_KVS" \
                    and rid not in trace.left_waiting:
                # It left WAITING_FOR_REMOTE_KVS in this schedule(): check decode's cache before its forward.
                blocks = D.sched.kv_cache_manager.get_block_ids(rid)
                trace.left_waiting[rid] = (step, tuple(list(g) for g in blocks))
                trace.verified[rid] = verify_decode(pair, rid, blocks, by_rid[rid].prompt)
            if not seen or seen[-1] != status:
                seen.append(status)
        kv = _step_workers(pair, [(P, so_p), (D, so_d)])
        for inst, so in ((P, so_p), (D, so_d)):
            agg = kv[inst.name]
            for rid in (agg.finished_recving or ()) if agg is not None else ():
                # vLLM's Scheduler asserts this (_update_from_kv_xfer_finished); failing it kills the engine core
                assert rid in inst.sched.requests, \
                    f"step {step}: {inst.name} workers report finished_recving for {rid!r}, which vLLM already " \
                    f"finished and freed (reported before at step {trace.finished_recving.get(rid)}); " \
                    f"{trace.dump()}"
            if agg is not None and agg.kv_connector_stats is not None:
                if inst.name in trace.kv_stats:
                    trace.kv_stats[inst.name].aggregate(agg.kv_connector_stats)
                else:
                    trace.kv_stats[inst.name] = agg.kv_connector_stats
            if agg is not None:
                for rid in agg.finished_sending or ():
                    trace.finished_sending.setdefault(rid, step)
                for rid in agg.finished_recving or ():
                    trace.finished_recving.setdefault(rid, step)
                for rid in agg.failed_recving or ():
                    trace.failed_recving.setdefault(rid, step)
            outputs = H.outputs_by_request(H.finish_step(inst.sched, so, agg))
            for rid, out in outputs.items():
                if out.finish_reason is not None:
                    trace.finish.setdefault((inst.name, rid), out.finish_reason)
                    trace.finish_step.setdefault((inst.name, rid), step)
                    if inst is D:
                        trace.statuses[rid].append(f"finished:{out.finish_reason.name}")
        for job in jobs:
            if ("prefill", job.rid) in trace.finish:
                trace.prefill_held.setdefault(job.rid, []).append((step, job.rid in P.sched.requests, P.free()))
        if not P.sched.requests and not D.sched.requests and not P.connector.has_pending_push_work() \
                and not to_prefill and all(("decode", j.rid) in trace.finish for j in jobs):
            return trace
        if step >= max_steps or time.monotonic() - began > wall_s:
            raise AssertionError(f"not finished after {step} steps / {time.monotonic() - began:.1f} s: "
                                 f"{trace.dump()}; prefill requests {list(P.sched.requests)}, decode requests "
                                 f"{list(D.sched.requests)}\nprefill logs: {pair.logs(P)}\n"
                                 f"decode logs: {pair.logs(D)}")
        if not so_p.total_num_scheduled_tokens and not so_d.total_num_scheduled_tokens:
            time.sleep(0.005)  # waiting on the transfer: do not starve the NIXL threads of the 2 cores


def verify_decode(pair: Pair, rid: str, blocks, prompt: list[int]) -> tuple[list[str], int]:
    """Every decode rank checks tokens [0, prompt_len - 1) of the request's blocks (decode's own prefix hits and
    what was transferred) against the expected bytes."""
    problems, checked = [], 0
    for w in pair.D.workers.values():
        _ok, probs, n = pair.pool.ask(w, ("verify", [list(g) for g in blocks], 0, len(prompt) - 1, prompt))
        problems += probs
        checked += n
    return problems, checked


# ---------------------------------------------------------------------------------------------------------------
# assertions shared by the scenarios

def prompt_of(rid: str, n: int, base: int | None = None) -> list[int]:
    start = base if base is not None else (sum(map(ord, rid)) * 7) % 500 + 10
    return [(start + 3 * i) % 1000 + 1 for i in range(n)]


def decode_job(pair: Pair, rid: str, prompt: list[int], **kw) -> Job:
    """The decode leg, as examples/proxy.py makes it: a transfer id and its secret (require_transfer_secret)."""
    params = {"do_remote_prefill": True, "transfer_id": f"{rid}-{uuid.uuid4().hex[:8]}", "prefill_addr": pair.addr,
              "transfer_secret": new_transfer_secret()}
    return Job(rid, prompt, params, **kw)


def prefill_leg(job: Job) -> dict:
    """The prefill leg's kv_transfer_params: the decode leg's transfer id and secret."""
    return {"do_remote_decode": True, "transfer_id": job.tid,
            **{k: v for k, v in job.decode_params.items() if k == "transfer_secret"}}


def block_bytes(inst: Instance) -> int:
    """Bytes one block holds over every pool and layer of the whole instance (decode is TP1/PP1 here)."""
    assert inst.tp == inst.pp == 1
    return next(iter(inst.infos.values()))["block_bytes"]


def check_transfer(pair: Pair, trace: Trace, job: Job, *, first_token: int = 0) -> None:
    rid, n = job.rid, len(job.prompt)
    # decode: registered once, WAITING_FOR_REMOTE_KVS -> RUNNING -> finished by length
    spec = trace.recv_specs[rid]
    assert (spec.transfer_id, spec.prefill_addr, spec.error) == (job.tid, pair.addr, "")
    assert (spec.first_token, spec.num_tokens) == (first_token, n - 1), spec
    assert trace.statuses[rid] == ["WAITING_FOR_REMOTE_KVS", "RUNNING", "finished:LENGTH"], \
        f"{rid}: {trace.statuses[rid]}\ndecode logs: {pair.logs(pair.D)}\nprefill logs: {pair.logs(pair.P)}"
    assert trace.finish[("decode", rid)] == FinishReason.LENGTH
    assert rid in trace.finished_recving and rid not in trace.failed_recving
    step, blocks = trace.left_waiting[rid]
    assert trace.finished_recving[rid] < step
    assert blocks == spec.block_ids, "decode's blocks changed between registration and use"
    assert len(blocks[0]) >= math.ceil(n / BS)
    problems, checked = trace.verified[rid]
    assert problems == [], problems
    assert checked > 0
    # prefill: held its blocks from its finish until finished_sending, then freed them
    assert trace.finish[("prefill", rid)] == FinishReason.LENGTH
    sends = trace.send_specs[rid]
    assert [s.transfer_id for s in sends] == [job.tid] * len(sends)
    assert [s.new for s in sends] == [True] + [False] * (len(sends) - 1)
    assert sends[-1].computed_after_step == n and sends[-1].num_prompt_tokens == n
    done = trace.finished_sending[rid]
    fin = trace.finish_step[("prefill", rid)]
    assert done >= fin, "finished_sending before prefill finished"
    for s, present, free in trace.prefill_held[rid]:
        assert present == (s < done), f"prefill request at step {s}: present={present}, finished_sending at {done}"
        if present:  # held: every prompt block still out (one prefill request at a time in these scenarios)
            assert pair.P.free0 - free == math.ceil(n / BS), (s, free, pair.P.free0)


def check_blocks_back(pair: Pair) -> None:
    for inst in (pair.P, pair.D):
        assert inst.free() == inst.free0, f"{inst.name}: {inst.free()} free blocks, started with {inst.free0}"
        assert not inst.sched.requests


def run_one(pair: Pair, rid: str, prompt_len: int, **kw) -> tuple[Trace, Job, int]:
    job = decode_job(pair, rid, prompt_of(rid, prompt_len), **kw)
    before = pair.sender_bytes()
    trace = drive(pair, [job])
    return trace, job, pair.sender_bytes() - before


# ---------------------------------------------------------------------------------------------------------------
# scenarios
