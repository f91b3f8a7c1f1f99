"""SparseKVConnector end to end inside vLLM 0.33: two instances (prefill kv_producer, decode kv_consumer), each with
vLLM's REAL Scheduler here in the test process and its (pp, tp) worker ranks in separate OS processes
(tests/vllm_e2e_worker.py) that move every byte over real NIXL.

Per step of each instance: `so = scheduler.schedule()`, pickled to every worker of the instance (as vLLM's executor
does); each worker runs the model runner's connector hooks around a fake forward that writes deterministic KV for
the scheduled tokens; the KVConnectorOutputs are merged with vLLM's KVOutputAggregator (count = tp * pp) and fed to
`update_from_output`. Both instances step in one loop until every request finished and every block is back.

Checked: decode goes WAITING_FOR_REMOTE_KVS -> RUNNING -> finished (length); when it leaves WAITING, decode's
workers hold, byte for byte, what prefill computed for every (pool, layer, token, global head) of the request's
blocks; prefill keeps its blocks until finished_sending and then frees them; both block pools return to their
start; the bytes prefill wrote are exactly the blocks decode asked for.

The worker processes (3: enough for prefill PP=2 or TP=2 plus decode; grown to 5 for PP and TP at once) are
started once for the module and host a
fresh rank set (fresh connector, NIXL agent, KV caches) per test, as a fresh deployment would.
"""

from __future__ import annotations

import logging
import math
import socket

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm==0.33.0")
pytest.importorskip("nixl", reason="needs nixl")

from tests import vllm_harness as H  # noqa: E402

if H.VLLM_IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip(f"vllm import failed: {H.VLLM_IMPORT_ERROR!r}", allow_module_level=True)

from tests.vllm_e2e_driver import *  # noqa: E402,F403  (the driver: Pool, Pair, drive, checks, constants)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(240)]

@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    return H.write_m3_config(tmp_path_factory.mktemp("m3e2e"), num_layers=8, dense_layers=2, kv_heads=4,
                             head_dim=64, index_dim=64)


@pytest.fixture(scope="module")
def m3v_dir(tmp_path_factory):
    """The index-V variant: sparse layers 3 and 6 keep an index value (see vllm_harness.layer_specs)."""
    return H.write_m3_config(tmp_path_factory.mktemp("m3v_e2e"), num_layers=8, dense_layers=2, kv_heads=4,
                             head_dim=64, index_dim=64, index_value_layers=(3, 6))


@pytest.fixture(scope="module")
def dsv_dir(tmp_path_factory):
    return H.write_dsv32_config(tmp_path_factory.mktemp("dsv32_e2e"))


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory):
    """M3 and DeepSeek-V3.2 with one MTP draft layer each (vllm_harness.draft_layer_specs)."""
    return {"m3": H.write_m3_config(tmp_path_factory.mktemp("m3mtp"), num_layers=8, dense_layers=2, kv_heads=4,
                                    head_dim=64, index_dim=64, mtp_layers=1),
            "dsv32": H.write_dsv32_config(tmp_path_factory.mktemp("dsvmtp"), mtp_layers=1)}


@pytest.fixture(scope="module")
def pool_holder():
    holder: dict[str, Pool] = {}
    yield holder
    if "pool" in holder:
        holder["pool"].close()


@pytest.fixture
def pool(pool_holder) -> Pool:
    """The module's worker processes; restarted if a previous test left them broken."""
    current = pool_holder.get("pool")
    if current is None or current.broken or not all(p.is_alive() for p in current.procs):
        if current is not None:
            current.close()
        pool_holder["pool"] = Pool(POOL_SIZE)
    return pool_holder["pool"]


def test_tp1_to_tp1_by_module_path(pool, m3_dir):
    with Pair(pool, m3_dir, by_name=False) as pair:
        assert pair.P.cfg.kv_transfer_config.kv_connector_module_path == "connector.vllm"
        trace, job, sent = run_one(pair, "s1", 100)
        check_transfer(pair, trace, job)
        check_blocks_back(pair)
        assert trace.scheduled_prefill["s1"] == [100]
        # exactly the blocks decode asked for (tokens 0..98: 7 blocks), each byte once
        assert sent == block_bytes(pair.D) * math.ceil(99 / BS)
        # the transfer metrics, as vLLM's KVOutputAggregator merged the workers' get_kv_connector_stats
        p, d = trace.kv_stats[pair.P.name].data, trace.kv_stats[pair.D.name].data
        assert (p["bytes_sent"], p["sends_ok"], p["sends_failed"]) == (sent, 1, 0)
        # Every layer got its own signal in the one prefill step: dense 0-1 from vLLM's save_kv_layer, sparse 2-7
        # from the method the connector installed. Whether a WRITE leaves before the sweep depends on timing here
        # (this fake forward has no compute to hide behind; test_layers_vllm_never_hooks_stream... has some).
        assert pair.P.infos[(0, 0)]["signalled"] == [2, 3, 4, 5, 6, 7]
        assert (p["send_steps"], p["layers_signalled"], sum(p["layers_swept"]), p["signals_repeated"]) == \
            (1, [1] * 8, 0, 0)
        assert 0 <= p["bytes_sent_during_compute"] <= sent
        assert p["writes"] >= 1 and p["descriptors"] >= p["writes"]  # one WRITE when the sweep takes all layers
        # each WRITE is one NIXL post here (no staging), timed twice: its post, and post to completion
        assert len(p["post_seconds"]) == len(p["transfer_seconds"]) == p["writes"] and p["staged_chunks"] == 0
        assert (d["bytes_received"], d["recvs_ok"], d["recvs_failed"], len(d["recv_seconds"])) == (sent, 1, 0, 1)
        # the transfer's timeline (connector.engine.timeline): one sample per stage and side
        assert [len(p[s]) for s in ("compute_seconds", "exposed_seconds", "ack_seconds")] == [1, 1, 1]
        assert len(d["tell_seconds"]) == 1 and all(v >= 0 for v in p["exposed_seconds"] + d["tell_seconds"])
        # by pool, both sides agree and add up: the main KV and the index keys of the six sparse layers
        by_pool = {pool: p[f"bytes_sent_{pool}"] for pool in ("kv", "index_k", "index_v")}
        assert by_pool == {pool: d[f"bytes_received_{pool}"] for pool in by_pool} and sum(by_pool.values()) == sent
        assert by_pool["index_k"] > 0 and by_pool["index_v"] == 0  # vLLM 0.33's M3 keeps no index value
        summary = trace.kv_stats[pair.P.name].aggregate(trace.kv_stats[pair.D.name]).reduce()
        assert summary["sent_MB"] == summary["received_MB"] == round(sent / 1e6, 3) and summary["recvs_ok"] == 1


def test_pp2_prefill_to_pp1_decode_by_registered_name(pool, m3_dir):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with Pair(pool, m3_dir, prefill=(1, 2), by_name=True) as pair:
        assert "SparseKVConnector" in KVConnectorFactory._registry
        assert pair.P.cfg.kv_transfer_config.kv_connector_module_path is None
        stage_layers = {rank: {layer for _n, _p, layer in info["layers"]} for rank, info in pair.P.infos.items()}
        assert stage_layers == {(0, 0): set(range(0, 4)), (1, 0): set(range(4, 8))}
        assert pair.P.infos[(0, 0)]["hooked"] and not pair.P.infos[(1, 0)]["hooked"]  # dense 0-1 on stage 0
        trace, job, sent = run_one(pair, "s2", 90)
        check_transfer(pair, trace, job)
        check_blocks_back(pair)
        assert sent == block_bytes(pair.D) * math.ceil(89 / BS)


def test_tp2_prefill_to_tp1_decode_head_slicing(pool, m3_dir):
    with Pair(pool, m3_dir, prefill=(2, 1)) as pair:
        # each prefill TP rank holds 2 of the 4 KV heads: decode's heads 0-1 come from tp0, 2-3 from tp1
        for (pp, tp), info in pair.P.infos.items():
            assert info["block_bytes"] < block_bytes(pair.D)
        trace, job, sent = run_one(pair, "s3", 77)
        check_transfer(pair, trace, job)
        check_blocks_back(pair)
        assert sent == block_bytes(pair.D) * math.ceil(76 / BS)  # index cache from ONE prefill rank


@pytest.mark.parametrize("prefill", [(1, 2), (2, 1)], ids=["prefill-pp2", "prefill-tp2"])
def test_index_value_pool_moves_with_the_rest(pool, m3v_dir, prefill):
    # index_v exists on layers 3 and 6 only. Prefill PP=2 (layers 0-3 | 4-7) holds it at stage-local slot 0 on
    # both stages; decode PP=1 holds it at slots 0 and 1: routed by (pool, global layer), never by position.
    # Prefill TP=2: the replicated index pools come from exactly one of the two prefill ranks.
    with Pair(pool, m3v_dir, prefill=prefill) as pair:
        def pool_layers(inst, name):
            return {rank: sorted(layer for _n, p, layer in info["layers"] if p == name)
                    for rank, info in inst.infos.items()}

        assert pool_layers(pair.D, "index_v") == {(0, 0): [3, 6]}
        if prefill == (1, 2):
            assert pool_layers(pair.P, "index_v") == {(0, 0): [3], (1, 0): [6]}
        else:
            assert pool_layers(pair.P, "index_v") == {(0, 0): [3, 6], (0, 1): [3, 6]}
        trace, job, sent = run_one(pair, "v1", 90)
        check_transfer(pair, trace, job)  # byte-exact on every pool, index_v included
        check_blocks_back(pair)
        assert sent == block_bytes(pair.D) * math.ceil(89 / BS)  # each decode byte written once


@pytest.mark.parametrize("model, prefill, decode", [("m3", (1, 1), (1, 2)), ("dsv32", (1, 2), (1, 1))],
                         ids=["m3-tp1-to-pp2", "dsv32-pp2-to-pp1"])
def test_mtp_draft_layers_move_with_the_rest(pool, mtp_dirs, model, prefill, decode):
    # The drafter's caches are ordinary layers of the KVCacheConfig, on the last PP stage, numbered after the
    # hidden layers: M3's `model.layers.0.self_attn.attn` (+ its index cache) is global layer 8, DeepSeek's
    # `model.layers.6.self_attn.attn` (+ indexer keys) layer 6.
    hidden, pools = (8 if model == "m3" else 6), ("kv", "index_k")
    with Pair(pool, mtp_dirs[model], prefill=prefill, decode=decode) as pair:
        for inst in (pair.P, pair.D):
            last = {(p, layer) for rank, info in inst.infos.items() if rank[0] == inst.pp - 1
                    for _n, p, layer in info["layers"]}
            assert {(p, hidden) for p in pools} <= last, inst.name
            others = {layer for rank, info in inst.infos.items() if rank[0] != inst.pp - 1
                      for _n, _p, layer in info["layers"]}
            assert hidden not in others  # the drafter runs on the last stage only
        trace, job, sent = run_one(pair, f"mtp-{model}", 80)
        check_transfer(pair, trace, job)  # byte-exact on every layer, the draft layer's included
        check_blocks_back(pair)
        one_rank = pair.D if decode == (1, 1) else pair.P
        assert sent == block_bytes(one_rank) * math.ceil(79 / BS)  # each byte once, the draft layer's included


def test_kv_both_on_both_sides_moves_as_producer_and_consumer_do(pool, m3v_dir):
    # Both engines kv_both (vLLM's NixlConnector launch scripts): the request's kv_transfer_params make the first
    # a prefill and the second a decode; prefill TP2 -> decode TP1, every pool byte-exact.
    with Pair(pool, m3v_dir, prefill=(2, 1), kv_both=True) as pair:
        assert pair.D.connector._worker is None  # (the scheduler's connector; the workers run in their processes)
        assert pair.D.sched.connector._scheduler.prefill is not None  # the decode engine could prefill too
        trace, job, sent = run_one(pair, "both1", 90)
        check_transfer(pair, trace, job)
        check_blocks_back(pair)
        assert sent == block_bytes(pair.D) * math.ceil(89 / BS)


def test_a_data_parallel_rank_is_an_engine_of_its_own(pool, m3_dir):
    # Prefill DP rank 1 of a TP2 deployment whose ranks all have side_channel_port P: vLLM names its engine
    # `<id>_dp1`, its ranks listen on P+2 and P+3 (DP rank 0's take P, P+1), and its response names the DP rank
    # and that address. Decode (any DP rank) just follows prefill_addr.
    with Pair(pool, m3_dir, prefill=(2, 1), prefill_dp_index=1) as pair:  # make_instance checks the ports
        assert pair.P.connector.engine_id.endswith("_dp1")
        assert pair.P.sched.connector._scheduler.side_channel_addr() == f"127.0.0.1:{pair.base_port + 2}"
        trace, job, sent = run_one(pair, "dp1", 60)
        check_transfer(pair, trace, job)
        check_blocks_back(pair)
        assert sent == block_bytes(pair.D) * math.ceil(59 / BS)


@pytest.mark.parametrize("decode", [(2, 1), (1, 2)], ids=["decode-tp2", "decode-pp2"])
def test_decode_with_more_ranks_than_prefill(pool, m3_dir, decode):
    # decode TP=2: each decode rank gets its two heads from the one prefill rank (head slicing the other way),
    # plus its own copy of the replicated index cache; decode PP=2: each stage registers its own layer range.
    with Pair(pool, m3_dir, decode=decode) as pair:
        trace, job, sent = run_one(pair, "s8", 70)
        check_transfer(pair, trace, job)
        check_blocks_back(pair)


@pytest.mark.parametrize("prefill,decode", [((2, 2), (1, 1)), ((1, 2), (2, 1))],
                         ids=["prefill-tp2pp2-to-tp1", "prefill-pp2-to-decode-tp2"])
def test_pp_and_tp_together(pool, m3_dir, prefill, decode):
    # PP and TP at once: each prefill stage sends its own compacted layer range, and each of its TP ranks its own
    # heads (prefill tp2pp2: 4 prefill ranks into one decode rank); or PP on one side and TP on the other.
    pool.grow(prefill[0] * prefill[1] + decode[0] * decode[1])
    with Pair(pool, m3_dir, prefill=prefill, decode=decode) as pair:
        assert len(pair.P.infos) == prefill[0] * prefill[1] and len(pair.D.infos) == decode[0] * decode[1]
        trace, job, sent = run_one(pair, "s9", 83)
        check_transfer(pair, trace, job)
        check_blocks_back(pair)
        if decode == (1, 1):
            assert sent == block_bytes(pair.D) * math.ceil(82 / BS)


@pytest.mark.parametrize("prefill,decode", [((1, 2), (1, 1)), ((2, 1), (1, 2))],
                         ids=["prefill-pp2-to-pp1", "prefill-tp2-to-decode-pp2"])
def test_deepseek_v32_mla_latent_and_indexer_keys(pool, dsv_dir, prefill, decode):
    # DeepSeek-V3.2 as vLLM 0.33 lays it out: per layer an MLA latent [B, 1, N, 192] bf16 and indexer keys
    # [B, 1, N, 132] uint8, both one replicated head (the connector leaves the layout to vLLM for MLA). No layer
    # runs vLLM's save_kv_layer; each signals from the DeepseekV32Attention._sparse_indexer_and_attn the connector
    # re-wrapped, on the prefill rank that holds it.
    pool.grow(prefill[0] * prefill[1] + decode[0] * decode[1])
    with Pair(pool, dsv_dir, prefill=prefill, decode=decode) as pair:
        assert not any(info["hooked"] for info in pair.P.infos.values())
        assert sorted(layer for info in pair.P.infos.values() for layer in info["signalled"]) == \
            sorted(layer for info in pair.P.infos.values() for _n, p, layer in info["layers"] if p == "kv")
        layers = {(p, layer) for info in pair.D.infos.values() for _n, p, layer in info["layers"]}
        assert layers == {(p, i) for p in ("kv", "index_k") for i in range(6)}
        trace, job, sent = run_one(pair, "ds1", 75)
        check_transfer(pair, trace, job)
        check_blocks_back(pair)
        if decode == (1, 1):
            assert sent == block_bytes(pair.D) * math.ceil(74 / BS)
            assert block_bytes(pair.D) == 6 * BS * (192 * 2 + 132)


def test_staging_moves_scattered_blocks_as_gathered_chunks(pool, m3v_dir):
    # staging_mb on both sides: the connector allocates and registers a staging buffer per worker; prefill TP2
    # (head slices) sends index_v/index_k/kv through 256 KiB slots, decode scatters them into vLLM's blocks.
    with Pair(pool, m3v_dir, prefill=(2, 1), extra_config={"staging_mb": 1, "staging_slot_mb": 1}) as pair:
        trace, job, sent = run_one(pair, "st1", 90)
        check_transfer(pair, trace, job)
        check_blocks_back(pair)
        assert sent == block_bytes(pair.D) * math.ceil(89 / BS)
        stats = [pair.pool.ask(w, ("stats",))[1] for w in pair.P.workers.values()]
        assert sum(s["staged_chunks"] for s in stats) > 0, stats
        # ... and they reach vLLM's metrics, each one NIXL post (the rank that got no slot posts directly)
        p = trace.kv_stats[pair.P.name].data
        assert p["staged_chunks"] == sum(s["staged_chunks"] for s in stats) <= len(p["post_seconds"])


def test_chunked_prefill_streams_each_chunk(pool, m3_dir):
    with Pair(pool, m3_dir, prefill_max_batched=40) as pair:
        trace, job, sent = run_one(pair, "s4", 100)
        assert trace.scheduled_prefill["s4"] == [40, 40, 20]  # chunk boundaries 40 and 80 fall inside blocks
        assert [s.computed_after_step for s in trace.send_specs["s4"]] == [40, 80, 100]
        check_transfer(pair, trace, job)
        check_blocks_back(pair)
        # a block sent partly filled is sent again when it fills: per layer, at most one extra block per chunk
        # boundary (layers go out at different times, so the extra count differs per layer)
        per_block = block_bytes(pair.D)
        assert 7 * per_block <= sent <= (7 + 2) * per_block, sent / per_block


def test_decode_prefix_hit_transfers_only_the_rest(pool, m3_dir):
    with Pair(pool, m3_dir) as pair:
        shared = prompt_of("prefix", 64)
        first = decode_job(pair, "s5a", shared + prompt_of("tail-a", 16))
        trace_a = drive(pair, [first])
        check_transfer(pair, trace_a, first)
        check_blocks_back(pair)
        second = decode_job(pair, "s5b", shared + prompt_of("tail-b", 36))
        before = pair.sender_bytes()
        trace_b = drive(pair, [second])
        sent = pair.sender_bytes() - before
        spec = trace_b.recv_specs["s5b"]
        assert spec.first_token == 64 > 0  # decode's own prefix-cache hit: 4 full blocks
        assert trace_b.scheduled_prefill["s5b"] == [36]  # prefill hits the same prefix in its own cache
        check_transfer(pair, trace_b, second, first_token=64)
        # decode reuses the first request's blocks for the shared prefix
        assert trace_b.left_waiting["s5b"][1][0][:4] == trace_a.left_waiting["s5a"][1][0][:4]
        check_blocks_back(pair)
        # only tokens 64..98 moved: blocks 4, 5, 6
        assert sent == block_bytes(pair.D) * (math.ceil(99 / BS) - 64 // BS)


def test_prefill_prefix_hit_is_still_sent_whole(pool, m3_dir):
    # Decode keeps no prefix cache, prefill does: the second request's first 64 tokens are prefill cache hits
    # (never computed in this request) and must still reach decode, from prefill's cached blocks.
    with Pair(pool, m3_dir, decode_prefix_caching=False) as pair:
        shared = prompt_of("prefix", 64)
        first = decode_job(pair, "s7a", shared + prompt_of("tail-a", 16))
        check_transfer(pair, drive(pair, [first]), first)
        second = decode_job(pair, "s7b", shared + prompt_of("tail-b", 36))
        before = pair.sender_bytes()
        trace = drive(pair, [second])
        sent = pair.sender_bytes() - before
        assert trace.scheduled_prefill["s7b"] == [36]  # prefill computed only the tail
        assert trace.recv_specs["s7b"].first_token == 0
        check_transfer(pair, trace, second)
        check_blocks_back(pair)
        assert sent == block_bytes(pair.D) * math.ceil(99 / BS)  # every block, prefix included


def test_bad_transfer_params_fail_alone(pool, m3_dir, caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    caplog.set_level(logging.INFO, logger="connector")
    with Pair(pool, m3_dir) as pair:
        good = decode_job(pair, "s6-good", prompt_of("s6-good", 60))
        no_tid = Job("s6-no-tid", prompt_of("s6-no-tid", 50), {"do_remote_prefill": True,
                                                                "prefill_addr": pair.addr}, to_prefill=False)
        bad_addr = Job("s6-bad-addr", prompt_of("s6-bad-addr", 50),
                       {"do_remote_prefill": True, "transfer_id": "t-bad-addr", "prefill_addr": "nohost"},
                       to_prefill=False)
        unknown = Job("s6-unknown-peer", prompt_of("s6-unknown-peer", 50),
                      {"do_remote_prefill": True, "transfer_id": "t-unknown",
                       "prefill_addr": f"127.0.0.1:{closed_port}"}, to_prefill=False)
        before = pair.sender_bytes()
        trace = drive(pair, [good, no_tid, bad_addr, unknown])
        sent = pair.sender_bytes() - before
        check_transfer(pair, trace, good)
        assert sent == block_bytes(pair.D) * math.ceil(59 / BS)
        d = trace.kv_stats[pair.D.name].data
        assert (d["recvs_ok"], d["recvs_failed"], d["bytes_received"]) == (1, 3, sent)
        for job in (no_tid, bad_addr, unknown):
            assert trace.finish[("decode", job.rid)] == FinishReason.ERROR, (job.rid, trace.finish)
            assert trace.statuses[job.rid] == ["WAITING_FOR_REMOTE_KVS", "finished:ERROR"], trace.statuses[job.rid]
            assert job.rid in trace.failed_recving and job.rid not in trace.left_waiting
        assert trace.recv_specs["s6-no-tid"].error and trace.recv_specs["s6-bad-addr"].error
        assert not trace.recv_specs["s6-unknown-peer"].error  # well-formed: fails only when it is tried
        check_blocks_back(pair)
        worker_log = "\n".join(pair.logs(pair.D))
        sched_log = "\n".join(r.getMessage() for r in caplog.records)
    # every failure names its request and why
    assert "s6-no-tid" in sched_log and "transfer_id" in sched_log
    assert "s6-bad-addr" in sched_log and "'nohost' is not host:port" in sched_log
    assert f"s6-unknown-peer: KV transfer failed: cannot reach prefill 127.0.0.1:{closed_port}" in worker_log
    for rid in ("s6-no-tid", "s6-bad-addr"):
        assert f"request {rid}: KV transfer failed" in worker_log
    assert "request s6-good:" not in worker_log  # the good one logged no failure


LAYER_MS = 30
"""Fake compute per prefill layer after its attention: time for a signalled layer's WRITE to leave before the next."""


@pytest.mark.parametrize("model_layers", [False, True], ids=["vllm-hooks-only", "layer-signals"])
@pytest.mark.parametrize("model", ["m3", "dsv32"])
def test_layers_vllm_never_hooks_stream_while_prefill_computes(pool, m3_dir, dsv_dir, model, model_layers):
    # Prefill spends LAYER_MS per layer, and decode registered before prefill starts, so a layer with a signal of
    # its own goes out while the later layers compute; a layer without one waits for the wait_for_save sweep after
    # the last layer. vllm-hooks-only is the connector before it re-wrapped the eager-break methods (the model's
    # modules are not registered, so it finds none): vLLM 0.33 runs save_kv_layer for M3's dense layers 0-1 only.
    model_dir, hooked, num_layers = (m3_dir, 2, 8) if model == "m3" else (dsv_dir, 0, 6)
    with Pair(pool, model_dir, prefill_opts={"layer_ms": LAYER_MS, "model_layers": model_layers}) as pair:
        job = decode_job(pair, f"ls-{model}", prompt_of(f"ls-{model}", 100))
        before = pair.sender_bytes()
        trace = drive(pair, [job], prefill_after_register=True)
        sent = pair.sender_bytes() - before
        check_transfer(pair, trace, job)  # byte-exact on every pool and layer
        check_blocks_back(pair)
        assert sent == block_bytes(pair.D) * math.ceil(99 / BS)  # each byte once
        stats = trace.kv_stats[pair.P.name]
        p, summary = stats.data, stats.reduce()
        print(f"{model} {'with' if model_layers else 'without'} layer signals: {summary}")
        assert trace.scheduled_prefill[job.rid] == [100] and p["send_steps"] == 1
        if model_layers:
            assert summary["signalled_layers_per_step"] == num_layers and summary["swept_layers_per_step"] == 0
            assert summary["streamed_pct"] >= 75, summary  # all of it, but for timing on a loaded machine
        else:
            assert summary["signalled_layers_per_step"] == hooked
            assert summary["swept_layers_per_step"] == num_layers - hooked
            # at most the hooked layers' bytes can leave during compute (M3: 2 of 8 layers, no index cache)
            sizes = pair.D.infos[(0, 0)]["layer_block_bytes"]
            hooked_bytes = sum(n for name, n in sizes.items() if name in pair.P.infos[(0, 0)]["hooked"])
            assert p["bytes_sent_during_compute"] <= hooked_bytes * math.ceil(99 / BS)


def test_a_layer_hooked_twice_in_a_step_goes_out_once(pool, m3_dir):
    # A vLLM that runs save_kv_layer for the sparse layers too (and the installed method still signals): every
    # sparse layer gets two signals a step; the second is dropped, counted, and no byte moves twice.
    with Pair(pool, m3_dir, prefill_max_batched=40, prefill_opts={"hook_all_layers": True}) as pair:
        trace, job, sent = run_one(pair, "tw1", 100)
        check_transfer(pair, trace, job)
        check_blocks_back(pair)
        p = trace.kv_stats[pair.P.name].data
        assert trace.scheduled_prefill["tw1"] == [40, 40, 20]
        assert (p["send_steps"], p["layers_signalled"], p["signals_repeated"]) == (3, [3] * 8, 6 * 3)
        per_block = block_bytes(pair.D)
        assert 7 * per_block <= sent <= (7 + 2) * per_block  # as test_chunked_prefill_streams_each_chunk
