"""SparseKVConnector's scheduler side inside vLLM 0.33's REAL Scheduler (CPU, local config.json, no hub).

The workers are not run here: their results (finished_sending / finished_recving / failed_recving) are fed back
as vLLM's KVConnectorOutput, which is what this half reacts to. Transfers themselves are tested end to end with
real NIXL in test_vllm_e2e.py and test_stream*.py."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm==0.33.0")

from tests import vllm_harness as H  # noqa: E402

if H.VLLM_IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip(f"vllm import failed: {H.VLLM_IMPORT_ERROR!r}", allow_module_level=True)

from vllm.v1.request import RequestStatus  # noqa: E402

import connector  # noqa: E402
from connector.vllm import SparseKVConnector  # noqa: E402
from connector.vllm.metadata import SparseKVMetadata  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
BS = 16


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    return H.write_m3_config(tmp_path_factory.mktemp("m3"), num_layers=6, dense_layers=2)


def build(m3_dir, kv_role, *, by_name=False, num_blocks=64, **kw):
    if by_name:
        connector.register()
        cfg = H.make_vllm_config(m3_dir, kv_role=kv_role, kv_connector="SparseKVConnector", block_size=BS, **kw)
        cfg.kv_transfer_config.kv_connector_module_path = None  # the harness fills it in; resolve by name
    else:
        cfg = H.make_vllm_config(m3_dir, kv_role=kv_role, block_size=BS, **kw)
    sched = H.make_scheduler(cfg, H.make_kv_cache_config(cfg, num_blocks=num_blocks))
    assert isinstance(sched.connector, SparseKVConnector)
    return sched


def decode_params(tid="t1", addr="127.0.0.1:5600"):
    return {"do_remote_prefill": True, "transfer_id": tid, "prefill_addr": addr}


def meta_of(so) -> SparseKVMetadata:
    assert isinstance(so.kv_connector_metadata, SparseKVMetadata)
    return so.kv_connector_metadata


@pytest.mark.parametrize("by_name", [False, True])
def test_decode_waits_for_remote_kv_then_decodes(m3_dir, by_name):
    sched = build(m3_dir, "kv_consumer", by_name=by_name)
    free0 = H.free_block_count(sched)
    req = H.make_request("d1", 40, kv_transfer_params=decode_params(), max_tokens=3)
    sched.add_request(req)
    so, _ = H.run_step(sched)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    spec = meta_of(so).recvs["d1"]
    assert (spec.transfer_id, spec.prefill_addr, spec.first_token, spec.num_tokens) == ("t1", "127.0.0.1:5600", 0, 39)
    assert len(spec.block_ids) == 1 and len(spec.block_ids[0]) == 3  # 39 tokens in 16-token blocks
    assert spec.error == ""
    for _ in range(3):  # no completion yet: it keeps waiting
        so, _ = H.run_step(sched)
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and "d1" not in meta_of(so).recvs
    H.run_step(sched, finished_recving={"d1"})
    steps = 0
    while not req.is_finished() and steps < 10:
        so, _ = H.run_step(sched)
        steps += 1
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert H.free_block_count(sched) == free0


def test_prefill_streams_every_chunk_and_holds_blocks_until_finished_sending(m3_dir):
    sched = build(m3_dir, "kv_producer", max_num_batched_tokens=32)
    free0 = H.free_block_count(sched)
    req = H.make_request("p1", 100, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t1"},
                         max_tokens=1)
    sched.add_request(req)
    sends, steps = [], 0
    while not req.is_finished() and steps < 10:
        so, _ = H.run_step(sched)
        sends.append(meta_of(so).sends.get("p1"))
        steps += 1
    chunks = [s for s in sends if s is not None]
    assert [s.computed_after_step for s in chunks] == [32, 64, 96, 100]
    assert [s.new for s in chunks] == [True, False, False, False]
    assert len(chunks[-1].block_ids[0]) == 7 and chunks[-1].num_prompt_tokens == 100
    assert chunks[0].block_ids[0] == chunks[-1].block_ids[0][:2]  # the same blocks, growing
    # finished, but its blocks stay until every worker reports the transfer finished
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert H.free_block_count(sched) < free0
    assert sched.connector.has_pending_push_work()
    H.run_step(sched)
    assert H.free_block_count(sched) < free0
    H.run_step(sched, finished_sending={"p1"})
    assert H.free_block_count(sched) == free0
    assert not sched.connector.has_pending_push_work()


def test_prefill_without_transfer_params_is_a_plain_request(m3_dir):
    sched = build(m3_dir, "kv_producer")
    free0 = H.free_block_count(sched)
    req = H.make_request("p2", 20, max_tokens=1)
    sched.add_request(req)
    so, _ = H.run_step(sched)
    assert meta_of(so).sends == {}
    assert req.is_finished() and H.free_block_count(sched) == free0


def test_prefill_abort_while_running_aborts_the_transfer_and_holds_blocks(m3_dir):
    sched = build(m3_dir, "kv_producer", max_num_batched_tokens=32)
    free0 = H.free_block_count(sched)
    req = H.make_request("p3", 100, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t3"})
    sched.add_request(req)
    H.run_step(sched)
    H.abort(sched, "p3")
    so, _ = H.run_step(sched)
    assert meta_of(so).aborts == {"p3": "t3"}
    # WRITEs may still read the blocks: held until the workers report the transfer finished
    assert H.free_block_count(sched) < free0
    H.run_step(sched, finished_sending={"p3"})
    assert H.free_block_count(sched) == free0


def test_decode_abort_while_waiting_releases_only_after_prefill_stopped(m3_dir):
    sched = build(m3_dir, "kv_consumer")
    free0 = H.free_block_count(sched)
    req = H.make_request("d2", 40, kv_transfer_params=decode_params("t2"))
    sched.add_request(req)
    H.run_step(sched)
    H.abort(sched, "d2")
    so, _ = H.run_step(sched)
    assert meta_of(so).aborts == {"d2": "t2"}
    assert H.free_block_count(sched) < free0  # a WRITE may still land in them
    H.run_step(sched, finished_recving={"d2"})  # the worker reports once every source confirmed Stopped
    assert H.free_block_count(sched) == free0


def test_decode_abort_after_the_registration_shipped(m3_dir):
    sched = build(m3_dir, "kv_consumer")
    req = H.make_request("d3", 40, kv_transfer_params=decode_params("t3"))
    sched.add_request(req)
    so = sched.schedule()  # registration built into this step's metadata
    assert "d3" in meta_of(so).recvs
    H.finish_step(sched, so)
    H.abort(sched, "d3")
    so, _ = H.run_step(sched)
    assert meta_of(so).aborts == {"d3": "t3"}


def test_decode_abort_before_the_registration_shipped_still_tells_prefill():
    """Allocation and metadata happen inside one schedule() call, so drive the scheduler half directly: an abort
    in between ships the registration marked aborted, and the workers only tell prefill to let go."""
    from types import SimpleNamespace

    from connector.vllm.scheduler import SchedulerSide

    side = SchedulerSide("kv_consumer", "d")
    req = SimpleNamespace(request_id="d5", num_prompt_tokens=40, num_computed_tokens=0,
                          kv_transfer_params=decode_params("t5"), status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert side.get_num_new_matched_tokens(req, 0) == (39, True)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 39)
    req.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(req) == (False, None)
    meta = side.build_connector_meta(SimpleNamespace())
    assert meta.recvs["d5"].aborted and meta.recvs["d5"].transfer_id == "t5" and not meta.aborts


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_load_failure_policy(m3_dir, policy):
    sched = build(m3_dir, "kv_consumer", kv_load_failure_policy=policy)
    free0 = H.free_block_count(sched)
    req = H.make_request("d4", 40, kv_transfer_params=decode_params("t4"), max_tokens=2)
    sched.add_request(req)
    H.run_step(sched)
    so, outs = H.run_step(sched, finished_recving={"d4"}, failed_recving={"d4"})
    steps = 0
    scheduled, registrations = [], []
    while not req.is_finished() and steps < 10:
        so, outs = H.run_step(sched)
        scheduled.append(so.num_scheduled_tokens.get("d4", 0))
        registrations += list(meta_of(so).recvs)
        steps += 1
    assert registrations == []  # one transfer per request: never registered again
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR
    else:
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert 40 in scheduled  # recomputed locally from token 0
    assert H.free_block_count(sched) == free0


@pytest.mark.parametrize("params, needle", [
    ({"do_remote_prefill": True, "prefill_addr": "127.0.0.1:5600"}, "has no transfer_id (keys given"),
    ({"do_remote_prefill": True, "transfer_id": 7, "prefill_addr": "127.0.0.1:5600"}, "unusable transfer_id (7)"),
    ({"do_remote_prefill": True, "transfer_id": "t5"}, "has no prefill_addr (keys given: ['do_remote_prefill', "
                                                       "'transfer_id'])"),
    ({"do_remote_prefill": True, "transfer_id": "t5", "prefill_addr": "nohost"}, "is not host:port"),
    ({"do_remote_prefill": True, "transfer_id": "t5", "prefill_addr": "10.0.0.1:99999"}, "is not host:port"),
])
def test_bad_params_fail_only_that_request(m3_dir, params, needle, caplog):
    sched = build(m3_dir, "kv_consumer")
    free0 = H.free_block_count(sched)
    bad = H.make_request("bad", 40, kv_transfer_params=params, max_tokens=2)
    good = H.make_request("good", 40, kv_transfer_params=decode_params("tg"), max_tokens=2)
    sched.add_request(bad)
    sched.add_request(good)
    so, _ = H.run_step(sched)
    spec = meta_of(so).recvs["bad"]
    assert needle in spec.error and needle in caplog.text
    assert meta_of(so).recvs["good"].error == ""
    # the workers fail the bad one at once (see WorkerSide), the good one completes
    H.run_step(sched, finished_recving={"bad", "good"}, failed_recving={"bad"})
    steps = 0
    while not (bad.is_finished() and good.is_finished()) and steps < 10:
        H.run_step(sched)
        steps += 1
    assert bad.status == RequestStatus.FINISHED_ERROR
    assert good.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert H.free_block_count(sched) == free0


def test_unknown_extra_config_key_is_a_clear_startup_error(m3_dir):
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \['side_chanel_port'\]"):
        build(m3_dir, "kv_consumer", extra_config={"side_chanel_port": 5600})


@pytest.mark.parametrize("extra, needle", [
    ({"side_channel_port": True}, "['side_channel_port']=True is refused: Expected `int`, got `bool`"),
    ({"staging_mb": 1.5}, "['staging_mb']=1.5 is refused: Expected `int | null`, got `float`"),
    ({"lease_s": 0}, "['lease_s']=0 is refused: Expected `float` > 0.0"),
    ({"side_channel_port": 70000}, "['side_channel_port']=70000 is refused: Expected `int` <= 65535"),
    ({"auth_token": 5}, "['auth_token']=5 is refused: Expected `str`, got `int`"),
    ({"nixl_threads": 65}, "['nixl_threads']=65 is refused: Expected `int` <= 64"),
])
def test_extra_config_values_are_type_checked_naming_the_key(extra, needle):
    from connector.core.errors import ConfigError
    from connector.vllm.config import ConnectorSettings

    with pytest.raises(ConfigError) as err:
        ConnectorSettings.from_extra_config(extra)
    assert needle in str(err.value)


def test_extra_config_defaults_are_the_engines_and_build_their_configs():
    from connector.engine.config import ReceiverConfig, SenderConfig, SideChannelConfig
    from connector.vllm.config import ConnectorSettings

    default = ConnectorSettings.from_extra_config(None)
    assert default.sender_config("h", 1) == SenderConfig(host="h", port=1)
    assert default.receiver_config() == ReceiverConfig()
    # numbers spelled as strings (configs built from environment variables) are still accepted
    s = ConnectorSettings.from_extra_config({"side_channel_port": "5601", "dead_after_s": "4.5", "auth_token": "t",
                                             "staging_slot_mb": 2, "transfer_timeout_s": 9})
    side = SideChannelConfig(auth_token="t", dead_after_s=4.5)
    assert s.side_channel_port == 5601
    assert s.sender_config("h", 2).side_channel == side == s.receiver_config().side_channel
    assert s.receiver_config() == ReceiverConfig(side, transfer_timeout_s=9.0, staging_slot_bytes=2 << 20)
    assert s.transport_config("agent").progress_delay_us == 10_000
    assert s.transport_config("agent").nixl_threads == 4  # NIXL's UCX thread pool, as vLLM's NixlConnector
    assert ConnectorSettings.from_extra_config({"nixl_threads": "0"}).transport_config("a").nixl_threads == 0
    # a cut link: UCX's TCP user timeout, and decode's hold on a lost prefill rank that follows from it
    link = ConnectorSettings.from_extra_config({"tcp_user_timeout_s": 3, "heartbeat_interval_s": 0.5})
    assert link.transport_config("agent").tcp_user_timeout_s == 3.0
    assert link.transport_config("agent").ucx_config() == {"TCP_USER_TIMEOUT": "3000ms"}
    assert link.receiver_config().lost_source_hold_s == 3 + 0.5 + 1
    assert ConnectorSettings.from_extra_config({"tcp_user_timeout_s": None}).transport_config("a").ucx_config() == {}


def test_kv_both_is_prefill_or_decode_per_request(m3_dir):
    # One kv_both engine, as vLLM's NixlConnector runs it: a request with do_remote_decode is a prefill (it sends
    # and its blocks are held until finished_sending), one with do_remote_prefill a decode (it waits for remote
    # KV), and a plain request neither, all in the same steps.
    sched = build(m3_dir, "kv_both", extra_config={"side_channel_host": "10.1.2.3", "side_channel_port": 5700})
    free0 = H.free_block_count(sched)
    sched.add_request(H.make_request("p1", 40, kv_transfer_params={"do_remote_decode": True}, max_tokens=1))
    sched.add_request(H.make_request("d1", 40, kv_transfer_params=decode_params(), max_tokens=2))
    sched.add_request(H.make_request("plain", 40, max_tokens=1))
    so, out = H.run_step(sched)
    meta = meta_of(so)
    assert set(meta.sends) == {"p1"} and set(meta.recvs) == {"d1"}
    assert meta.recvs["d1"].num_tokens == 39 and meta.recvs["d1"].error == ""
    outputs = H.outputs_by_request(out)
    assert outputs["p1"].kv_transfer_params["prefill_addr"] == "10.1.2.3:5700"
    assert "plain" in outputs and not (outputs["plain"].kv_transfer_params or {}).get("do_remote_prefill")
    assert sched.connector.has_pending_push_work()  # p1's blocks held for decode
    so, _ = H.run_step(sched, finished_sending={"p1"}, finished_recving={"d1"})
    for _ in range(4):
        H.run_step(sched)
    assert H.free_block_count(sched) == free0 and not sched.connector.has_pending_push_work()


def test_pp_aware_handshake_metadata_is_accepted(m3_dir):
    from connector.vllm.metadata import SparseKVHandshake

    sched = build(m3_dir, "kv_producer")
    hs = {(pp, tp): SparseKVHandshake("e", pp, tp, "f" * 16, f"127.0.0.1:{5600 + pp * 2 + tp}")
          for pp in range(2) for tp in range(2)}
    sched.connector.set_xfer_handshake_metadata_pp_aware(hs)  # vLLM's default raises for pp_rank > 0
    bad = dict(hs)
    bad[(1, 1)] = SparseKVHandshake("e", 1, 1, "0" * 16, "127.0.0.1:5603")
    with pytest.raises(ValueError, match="disagree on the model layout fingerprint"):
        sched.connector.set_xfer_handshake_metadata_pp_aware(bad)


def test_installed_package_registers_by_name_through_the_vllm_plugin_entry_point():
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["sparse_kv_connector"].value == "connector:register"
    plugins["sparse_kv_connector"].load()()  # what vLLM's load_general_plugins() does in every process
    plugins["sparse_kv_connector"].load()()  # idempotent
    assert KVConnectorFactory.get_connector_class_by_name("SparseKVConnector") is SparseKVConnector


def test_sequential_flow_prefill_makes_a_transfer_id_and_answers_with_what_decode_needs(m3_dir):
    # vLLM's proxy pattern (and llm-d): prefill gets only {"do_remote_decode": true}, and its response's
    # kv_transfer_params go to decode unchanged.
    sched = build(m3_dir, "kv_producer", extra_config={"side_channel_host": "10.1.2.3", "side_channel_port": 5700,
                                                       "lease_s": 30})
    free0 = H.free_block_count(sched)
    req = H.make_request("p9", 40, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    sched.add_request(req)
    so, out = H.run_step(sched)
    assert meta_of(so).sends["p9"].transfer_id == "p9"  # vLLM's own request id
    params = H.outputs_by_request(out)["p9"].kv_transfer_params
    ours = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "p9",
            "prefill_addr": "10.1.2.3:5700", "prefill_engine_id": sched.connector.engine_id,
            "prefill_dp_rank": 0, "prefill_finished": True, "lease_s": 30.0}
    assert {k: params.get(k) for k in ours} == ours  # (vLLM adds keys of its own, e.g. cached-token counts)
    secret = params["transfer_secret"]  # minted here: nobody could register the id before this response
    assert len(secret) == 22 and meta_of(so).sends["p9"].transfer_secret == secret
    assert H.free_block_count(sched) < free0  # held for decode
    H.run_step(sched, finished_sending={"p9"})
    assert H.free_block_count(sched) == free0
    # decode takes that dict as is
    dec = build(m3_dir, "kv_consumer")
    dreq = H.make_request("d9", 40, kv_transfer_params=dict(params), max_tokens=2)
    dec.add_request(dreq)
    so, _ = H.run_step(dec)
    spec = meta_of(so).recvs["d9"]
    assert (spec.transfer_id, spec.prefill_addr, spec.prefill_finished, spec.error) == ("p9", "10.1.2.3:5700",
                                                                                        True, "")
    assert spec.transfer_secret == secret and meta_of(so).engine_key  # (decode's engine key, the same each step)


@pytest.mark.parametrize("given, require, secret", [
    ({"transfer_secret": "from-the-proxy"}, False, "from-the-proxy"),  # concurrent flow: the proxy minted it
    ({}, False, ""),        # a router that names the id but mints no secret: an open transfer
    ({}, True, "minted"),   # require_transfer_secret: minted anyway (that decode leg is then refused)
])
def test_concurrent_flow_prefill_takes_the_proxys_secret_or_none(m3_dir, given, require, secret):
    sched = build(m3_dir, "kv_producer", extra_config={"require_transfer_secret": require})
    req = H.make_request("c1", 40, kv_transfer_params={"do_remote_decode": True, "transfer_id": "tid-c1", **given},
                         max_tokens=1)
    sched.add_request(req)
    so, out = H.run_step(sched)
    got = meta_of(so).sends["c1"].transfer_secret
    assert (len(got) == 22) if secret == "minted" else got == secret
    assert H.outputs_by_request(out)["c1"].kv_transfer_params.get("transfer_secret") == (got or None)


def test_a_transfer_secret_of_the_wrong_type_fails_the_decode_leg_naming_it(m3_dir):
    dec = build(m3_dir, "kv_consumer")
    dec.add_request(H.make_request("d1", 40, kv_transfer_params={**decode_params(), "transfer_secret": 7},
                                   max_tokens=2))
    so, _ = H.run_step(dec)
    assert "transfer_secret must be a string" in meta_of(so).recvs["d1"].error


def test_prefill_side_channel_address_comes_from_the_workers_when_they_report_it(m3_dir):
    from connector.vllm.metadata import SparseKVHandshake

    sched = build(m3_dir, "kv_producer")
    sched.connector.set_xfer_handshake_metadata_pp_aware(
        {(0, 0): SparseKVHandshake("e", 0, 0, "f", "192.0.2.7:5600"), (0, 1): SparseKVHandshake("e", 0, 1, "f",
                                                                                               "192.0.2.7:5601")})
    sched.add_request(H.make_request("p8", 20, kv_transfer_params={"do_remote_decode": True}, max_tokens=1))
    _, out = H.run_step(sched)
    assert H.outputs_by_request(out)["p8"].kv_transfer_params["prefill_addr"] == "192.0.2.7:5600"


def test_aborted_prefill_hands_out_no_params(m3_dir):
    sched = build(m3_dir, "kv_producer", max_num_batched_tokens=32)
    sched.add_request(H.make_request("p7", 100, kv_transfer_params={"do_remote_decode": True}))
    H.run_step(sched)
    H.abort(sched, "p7")
    so, out = H.run_step(sched)
    assert meta_of(so).aborts == {"p7": "p7"}
    assert all(o.kv_transfer_params is None for o in H.outputs_by_request(out).values())


def test_decode_request_that_ends_before_allocation_still_tells_prefill(m3_dir):
    # The client left before decode's scheduler ever allocated the request's blocks: it never registered, and
    # prefill would keep the KV for its lease unless the workers tell it (nothing is reported back to vLLM).
    sched = build(m3_dir, "kv_consumer")
    free0 = H.free_block_count(sched)
    sched.add_request(H.make_request("d10", 40, kv_transfer_params=decode_params("t10")))
    H.abort(sched, "d10")
    so, _ = H.run_step(sched)
    spec = meta_of(so).recvs["d10"]
    assert (spec.transfer_id, spec.prefill_addr, spec.aborted, spec.finished) == ("t10", "127.0.0.1:5600", True, True)
    assert H.free_block_count(sched) == free0 and not sched.connector.has_pending_push_work()
    so, _ = H.run_step(sched)
    assert meta_of(so).recvs == {}
