"""Proves tests/vllm_harness.py drives vLLM 0.33's real scheduler: a tiny async-load connector defined here is loaded
through kv_connector_module_path="tests.test_vllm_harness", exactly as an out-of-tree connector would be."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm==0.33.0")

from tests import vllm_harness as H  # noqa: E402

if H.VLLM_IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip(f"vllm import failed: {H.VLLM_IMPORT_ERROR!r}", allow_module_level=True)

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA)
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole, UniformTypeKVCacheSpecs  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]

MODULE = "tests.test_vllm_harness"


@dataclasses.dataclass
class TinyMeta(KVConnectorMetadata):
    to_recv: dict[str, tuple[list[int], ...]]
    step_view: dict[str, Any]


class TinyConnector(KVConnectorBase_V1, SupportsHMA):
    """Async-load consumer / delay-free producer. Records every scheduler-side call in self.calls."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls: list[tuple] = []
        self.pending: dict[str, tuple[list[int], ...]] = {}
        self.finished_results: list[tuple[str, tuple, dict | None]] = []
        self.delay_free = self._kv_transfer_config.get_from_extra_config("delay_free", False)

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        self.calls.append(("match", request.request_id, num_computed_tokens))
        if params.get("do_remote_prefill"):
            n = len(request.prompt_token_ids) - 1 - num_computed_tokens
            return (n, True) if n > 0 else (0, False)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.request_id, num_external_tokens,
                           blocks.get_unhashed_block_ids_all_groups()))
        if num_external_tokens > 0:
            self.pending[request.request_id] = tuple(blocks.get_unhashed_block_ids_all_groups())
            request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request (Nixl does this)

    def build_connector_meta(self, scheduler_output):
        view = {
            "new": {r.req_id: (r.block_ids, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs},
            "cached": dict(zip(scheduler_output.scheduled_cached_reqs.req_ids,
                               zip(scheduler_output.scheduled_cached_reqs.new_block_ids,
                                   scheduler_output.scheduled_cached_reqs.num_computed_tokens))),
            "num_scheduled": dict(scheduler_output.num_scheduled_tokens),
            "all_blocks": {r: self._kv_cache_manager.get_block_ids(r) for r in scheduler_output.num_scheduled_tokens},
        }
        meta, self.pending = TinyMeta(self.pending, view), {}
        self.calls.append(("meta", meta))
        return meta

    def request_finished_all_groups(self, request, block_ids):
        self.calls.append(("finished", request.request_id, block_ids, request.status))
        return self.delay_free, {"blocks": [list(g) for g in block_ids]} if self.delay_free else None

    def update_connector_output(self, connector_output):
        self.calls.append(("output", connector_output))

    # worker side
    def start_load_kv(self, forward_context, **kwargs):
        self.calls.append(("start_load_kv", sorted(kwargs)))

    def wait_for_layer_load(self, layer_name):
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self.calls.append(("save_kv_layer", layer_name, tuple(kv_layer.shape)))

    def wait_for_save(self):
        self.calls.append(("wait_for_save",))

    def get_finished(self, finished_req_ids):
        metadata = self._get_connector_metadata()
        return None, set(metadata.to_recv) or None  # "transfer" completes within the step


class TinyHNDConnector(TinyConnector):
    """Same, but asks for a layout; the value comes from extra_config "layout" ("HND", "LBHNC", "LHBNC", ...)."""

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return vllm_config.kv_transfer_config.get_from_extra_config("layout", None)


def names(calls, kind):
    return [c for c in calls if c[0] == kind]


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    return H.write_m3_config(tmp_path_factory.mktemp("m3"), num_layers=6, dense_layers=2)


def build(m3_dir, *, kv_role, num_blocks=40, **kw):
    cfg = H.make_vllm_config(m3_dir, kv_role=kv_role, kv_connector="TinyConnector",
                             kv_connector_module_path=MODULE, **kw)
    kvc = H.make_kv_cache_config(cfg, num_blocks=num_blocks)
    return cfg, kvc, H.make_scheduler(cfg, kvc)


def test_m3_kv_cache_config_is_one_group_with_real_names(m3_dir):
    cfg, kvc, sched = build(m3_dir, kv_role="kv_consumer")
    assert len(kvc.kv_cache_groups) == 1
    spec = kvc.kv_cache_groups[0].kv_cache_spec
    assert isinstance(spec, UniformTypeKVCacheSpecs)
    p = "language_model.model.layers"
    index = [n for n, s in spec.kv_cache_specs.items() if isinstance(s, MLAAttentionSpec)]
    assert index == [f"{p}.{i}.self_attn.attn.index_cache" for i in range(2, 6)]
    assert all(spec.kv_cache_specs[n].cache_role == SparseCacheRole.INDEXER for n in index)
    assert f"{p}.0.self_attn.attn" in spec.kv_cache_specs and f"{p}.5.self_attn.attn" in spec.kv_cache_specs
    assert kvc.kv_cache_layout == "LBNHC"  # sm90, no backend or connector preference, mixed page sizes
    # three KVCacheTensors (dense mains, index caches, sparse mains) over one shared backing allocation
    assert len(kvc.kv_cache_tensors) == 3 and len({t.size for t in kvc.kv_cache_tensors}) == 1
    # the scheduler (and its connector) sees the first layer's spec only
    assert not isinstance(sched.kv_cache_config.kv_cache_groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    assert H.hooked_layer_names(cfg) == [f"{p}.0.self_attn.attn", f"{p}.1.self_attn.attn"]


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLHNC"])
def test_allocated_tensors_match_layout(m3_dir, layout):
    cfg = H.make_vllm_config(m3_dir, kv_role="kv_both", kv_connector="TinyConnector",
                             kv_connector_module_path=MODULE)
    cfg.cache_config.kv_cache_layout = layout
    kvc = H.make_kv_cache_config(cfg, num_blocks=8)
    caches = H.allocate_kv_caches(kvc, cfg)
    p = "language_model.model.layers"
    main, index = caches[f"{p}.3.self_attn.attn"], caches[f"{p}.3.self_attn.attn.index_cache"]
    assert main.shape == (8, 4, 16, 128) and main.dtype == torch.bfloat16  # [B, H, N, K||V]
    assert index.shape == (8, 1, 16, 64) and index.dtype == torch.bfloat16
    assert main.untyped_storage().data_ptr() == index.untyped_storage().data_ptr()  # one backing buffer
    if layout == "LBNHC":
        assert (main.stride(2), main.stride(1)) == (4 * 128, 128)  # token-major inside a block
    else:
        assert (main.stride(1), main.stride(2)) == (16 * 128, 128)  # a head's block is one contiguous run
    main_page, index_page = 4 * 16 * 128 * 2, 16 * 64 * 2  # bytes
    if layout.startswith("L"):
        assert main.stride(0) * 2 == main_page and index.stride(0) * 2 == index_page
    else:  # block-outermost: block b of every layer sits together
        assert main.stride(0) * 2 == index.stride(0) * 2 == 6 * main_page + 4 * index_page
    # writing block 5 of one layer touches only that layer's page
    main[5].fill_(1.0)
    raw = torch.empty(0, dtype=torch.int8).set_(main.untyped_storage())
    assert int(raw.count_nonzero()) == main_page  # bf16 1.0 = 0x3F80: both bytes non-zero


@pytest.mark.parametrize("asked,got", [("HND", "LBHNC"), ("NHD", "LBNHC"), ("BLHNC", "BLHNC"),
                                       ("LHBNC", "LBNHC")])  # LHBNC is not block-compact: dropped with a warning
def test_connector_layout_preference(m3_dir, asked, got):
    cfg = H.make_vllm_config(m3_dir, kv_role="kv_both", kv_connector="TinyHNDConnector",
                             kv_connector_module_path=MODULE, extra_config={"layout": asked})
    assert H.resolve_layout(cfg).name == got


def test_tp2_halves_main_heads_not_index(m3_dir):
    cfg = H.make_vllm_config(m3_dir, kv_role="kv_both", kv_connector="TinyConnector",
                             kv_connector_module_path=MODULE, tp=2)
    caches = H.allocate_kv_caches(H.make_kv_cache_config(cfg, num_blocks=4), cfg)
    p = "language_model.model.layers.4.self_attn.attn"
    assert caches[p].shape[1] == 2 and caches[f"{p}.index_cache"].shape[1] == 1


def test_pp2_stage_configs(m3_dir):
    cfg = H.make_vllm_config(m3_dir, kv_role="kv_producer", kv_connector="TinyConnector",
                             kv_connector_module_path=MODULE, pp=2)
    stages = [H.make_kv_cache_config(cfg, num_blocks=8, pp_rank=r) for r in (0, 1)]
    layers = [s.kv_cache_groups[0].layer_names for s in stages]
    assert [n.split(".")[3] for n in layers[0]] == ["0", "1", "2", "2"]  # dense 0-1, then index+main of 2
    assert len(layers[1]) == 6 and not set(layers[0]) & set(layers[1])
    assert len(H.allocate_kv_caches(stages[1], cfg)) == 6
    sched = H.make_scheduler(cfg, stages[0])  # the engine hands the scheduler worker 0's (stage 0's) config
    assert sched.connector._kv_cache_config.kv_cache_groups[0].layer_names == layers[0]


def test_decode_waits_for_remote_kvs_then_decodes(m3_dir):
    cfg, kvc, sched = build(m3_dir, kv_role="kv_consumer")
    conn = sched.connector
    free0 = H.free_block_count(sched)
    sched.add_request(H.make_request("d1", 40, kv_transfer_params={"do_remote_prefill": True}, max_tokens=3))

    so, out = H.run_step(sched)
    req = sched.requests["d1"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and so.num_scheduled_tokens == {}
    assert req.num_computed_tokens == 39
    allocs = names(conn.calls, "alloc")
    assert allocs[0][2] == 39 and [len(g) for g in allocs[0][3]] == [3]
    assert names(conn.calls, "meta")[-1][1].to_recv == {"d1": tuple(allocs[0][3])}

    for _ in range(2):  # stays parked until finished_recving arrives
        so, _ = H.run_step(sched)
        assert sched.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS and not so.num_scheduled_tokens

    H.run_step(sched, finished_recving={"d1"})
    so, out = H.run_step(sched)
    assert so.num_scheduled_tokens == {"d1": 1}  # only the last prompt token is recomputed
    new = so.scheduled_new_reqs[0]
    assert new.req_id == "d1" and new.num_computed_tokens == 39 and new.block_ids == tuple(allocs[0][3])
    view = names(conn.calls, "meta")[-1][1].step_view  # built BEFORE num_computed_tokens advances
    assert view["all_blocks"]["d1"] == new.block_ids and view["num_scheduled"] == {"d1": 1}
    assert len(names(conn.calls, "alloc")) == 2 and names(conn.calls, "alloc")[1][2] == 0  # second call
    assert H.outputs_by_request(out)["d1"].new_token_ids == [1]
    for _ in range(2):
        so, out = H.run_step(sched)
    assert H.outputs_by_request(out)["d1"].finish_reason is not None
    assert names(conn.calls, "finished")[0][1] == "d1"
    assert H.free_block_count(sched) == free0


def test_prefill_holds_blocks_until_finished_sending(m3_dir):
    cfg, kvc, sched = build(m3_dir, kv_role="kv_producer", extra_config={"delay_free": True})
    free0 = H.free_block_count(sched)
    sched.add_request(H.make_request("p1", 70, kv_transfer_params={"do_remote_decode": True}, max_tokens=1))
    so, out = H.run_step(sched)
    assert so.num_scheduled_tokens == {"p1": 70}
    o = H.outputs_by_request(out)["p1"]
    fin = names(sched.connector.calls, "finished")[0]
    assert o.finish_reason is not None and o.kv_transfer_params == {"blocks": [list(g) for g in fin[2]]}
    assert [len(g) for g in fin[2]] == [5]  # ceil(70 / 16) blocks, one group
    held = H.free_block_count(sched)
    assert held < free0
    for _ in range(2):
        H.run_step(sched)
        assert H.free_block_count(sched) == held
    assert H.abort(sched, "p1") == [] and H.free_block_count(sched) == held  # already finished: abort is a no-op
    H.run_step(sched, finished_sending={"p1"})
    assert H.free_block_count(sched) == free0 and "p1" not in sched.requests


def test_abort_waiting_for_remote_kvs_frees_only_after_finished_recving(m3_dir):
    cfg, kvc, sched = build(m3_dir, kv_role="kv_consumer")
    free0 = H.free_block_count(sched)
    sched.add_request(H.make_request("d2", 50, kv_transfer_params={"do_remote_prefill": True}))
    H.run_step(sched)
    held = H.free_block_count(sched)
    assert held < free0
    H.abort(sched, "d2")
    assert names(sched.connector.calls, "finished")[0][3] == RequestStatus.FINISHED_ABORTED
    assert H.free_block_count(sched) == held and "d2" in sched.requests  # delay_free: load may still be writing
    H.run_step(sched, finished_recving={"d2"})
    assert H.free_block_count(sched) == free0 and "d2" not in sched.requests


def test_abort_running_producer_and_idle(m3_dir):
    cfg, kvc, sched = build(m3_dir, kv_role="kv_producer")
    free0 = H.free_block_count(sched)
    sched.add_request(H.make_request("p2", 30, max_tokens=5))
    H.run_step(sched)
    H.abort(sched, "p2")
    assert H.free_block_count(sched) == free0 and "p2" not in sched.requests


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_recving_policy(m3_dir, policy):
    cfg, kvc, sched = build(m3_dir, kv_role="kv_consumer", kv_load_failure_policy=policy)
    free0 = H.free_block_count(sched)
    sched.add_request(H.make_request("d3", 40, kv_transfer_params={"do_remote_prefill": True}, max_tokens=2))
    H.run_step(sched)
    # a worker reports a failed receive; failures also appear in finished_recving
    so, out = H.run_step(sched, finished_recving={"d3"}, failed_recving={"d3"})
    if policy == "fail":
        assert H.outputs_by_request(out)["d3"].finish_reason.name == "ERROR"
        assert H.free_block_count(sched) == free0 and "d3" not in sched.requests
    else:
        so, out = H.run_step(sched)
        assert so.num_scheduled_tokens == {"d3": 40}  # recomputed from scratch
        assert so.scheduled_new_reqs[0].num_computed_tokens == 0
        # the connector is asked again (it must not re-load: TinyConnector cleared do_remote_prefill)
        assert [c[2] for c in names(sched.connector.calls, "match")] == [0, 0]


def test_failed_recving_without_finished_recving_keeps_blocks(m3_dir):
    cfg, kvc, sched = build(m3_dir, kv_role="kv_consumer")
    free0 = H.free_block_count(sched)
    sched.add_request(H.make_request("d5", 40, kv_transfer_params={"do_remote_prefill": True}))
    H.run_step(sched)
    _, out = H.run_step(sched, failed_recving={"d5"})  # (the real aggregator never emits this alone)
    assert H.outputs_by_request(out)["d5"].finish_reason.name == "ERROR"
    assert H.free_block_count(sched) < free0 and "d5" in sched.requests  # held until finished_recving
    H.run_step(sched, finished_recving={"d5"})
    assert H.free_block_count(sched) == free0


def test_two_groups_hma(m3_dir):
    cfg = H.make_vllm_config(m3_dir, kv_role="kv_consumer", kv_connector="TinyConnector",
                             kv_connector_module_path=MODULE)
    cfg.cache_config.kv_cache_layout = "BLNHC"
    kvc = H.make_kv_cache_config(cfg, num_blocks=40, split_groups=True)
    assert len(kvc.kv_cache_groups) == 2
    sched = H.make_scheduler(cfg, kvc)
    free0 = H.free_block_count(sched)
    sched.add_request(H.make_request("g1", 40, kv_transfer_params={"do_remote_prefill": True}, max_tokens=2))
    H.run_step(sched)
    alloc = names(sched.connector.calls, "alloc")[0]
    assert [len(g) for g in alloc[3]] == [3, 3]
    H.run_step(sched, finished_recving={"g1"})
    for _ in range(3):
        H.run_step(sched)
    fin = names(sched.connector.calls, "finished")[0]
    assert len(fin[2]) == 2 and H.free_block_count(sched) == free0
    assert len(H.allocate_kv_caches(kvc, cfg)) == 10


def test_worker_step_and_parallel_groups(m3_dir):
    cfg, kvc, sched = build(m3_dir, kv_role="kv_consumer")
    worker = H.make_worker_connector(cfg, kvc)
    assert worker.role == KVConnectorRole.WORKER
    caches = H.allocate_kv_caches(kvc, cfg)
    worker.register_kv_caches(caches)
    sched.add_request(H.make_request("d4", 40, kv_transfer_params={"do_remote_prefill": True}, max_tokens=2))
    hooked = H.hooked_layer_names(cfg)
    so = sched.schedule()
    out = H.worker_step(worker, so, kv_caches=caches, hooked_layers=hooked)
    assert out.finished_recving == {"d4"}
    H.finish_step(sched, so, out)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"d4": 1}
    H.worker_step(worker, so, kv_caches=caches, hooked_layers=hooked)
    assert [c[1] for c in names(worker.calls, "save_kv_layer")] == hooked
    with H.fake_parallel_groups(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2):
        from vllm.distributed import parallel_state as ps
        assert ps.get_tensor_model_parallel_rank() == 1 and ps.get_pp_group().is_last_rank


def test_aggregator_counts_every_worker():
    agg = H.KVOutputAggregator(expected_finished_count=2)
    first = H.aggregate([H.kv_output(finished_sending={"a"}, failed_recving={"b"}), None], agg)
    assert not first.finished_sending and not first.failed_recving
    second = H.aggregate([None, H.kv_output(finished_sending={"a"})], agg)
    assert second.finished_sending == {"a"}
    third = H.aggregate([H.kv_output(finished_recving={"b"}), H.kv_output(finished_recving={"b"})], agg)
    assert third.finished_recving == {"b"} and third.failed_recving == {"b"}  # failure surfaces with completion


def test_dist_init_gives_real_groups(m3_dir):
    from vllm.distributed import parallel_state as ps
    cfg = H.make_vllm_config(m3_dir, kv_role="kv_both", kv_connector="TinyConnector",
                             kv_connector_module_path=MODULE)
    with pytest.raises(AssertionError):
        ps.get_tp_group()
    with H.dist_init(cfg):
        assert ps.get_tensor_model_parallel_rank() == 0 and ps.get_tensor_model_parallel_world_size() == 1
        assert ps.get_pp_group().is_first_rank and ps.get_pp_group().is_last_rank


def _regions_of(model_dir, *, drop_index_values: bool):
    """(regions, the layout vLLM's specs give) for a real vLLM allocation of the whole model (TP1/PP1),
    optionally without the index-value caches (what vLLM 0.33 itself builds for any M3 config)."""
    from connector.core.layout import ParallelLayout, RankLayout
    from connector.vllm.regions import build_regions, classify_layers
    from connector.vllm.worker import model_from_vllm

    cfg = H.make_vllm_config(model_dir, kv_role="kv_producer", kv_connector="TinyConnector",
                             kv_connector_module_path=MODULE)
    specs = {n: s for n, s in H.layer_specs(cfg).items()
             if not (drop_index_values and n.endswith(".index_value_cache"))}
    kvc = H.make_kv_cache_config(cfg, specs, num_blocks=4)
    caches = H.allocate_kv_caches(kvc, cfg)
    facts = classify_layers(kvc, cfg.model_config.get_total_num_kv_heads())
    with H.fake_parallel_groups():
        model, facts = model_from_vllm(facts, cfg)
    rank = RankLayout(model, ParallelLayout.build(model.num_layers, 1, 1), 0, 0)
    return build_regions(caches, facts, kvc.num_blocks, rank), model


def test_index_value_caches_become_the_index_v_pool(tmp_path):
    regions, _ = _regions_of(H.write_m3_config(tmp_path, index_value_layers=(3, 6)), drop_index_values=False)
    by_pool = {p: [(r.layer, r.slot) for r in regions if r.pool == p] for p in ("kv", "index_k", "index_v")}
    assert by_pool["index_v"] == [(3, 0), (6, 1)]  # slots are compacted per pool
    assert [layer for layer, _ in by_pool["index_k"]] == list(range(2, 8))
    assert len(by_pool["kv"]) == 8


def test_a_config_with_index_values_vllm_builds_no_cache_for_moves_what_vllm_built(tmp_path, caplog):
    # vLLM 0.33's M3 never builds an index-value cache (it ignores the values on both sides): the layout is what
    # vLLM's specs say, and the disagreement with config.json is logged.
    caplog.set_level("WARNING", logger="connector.vllm.worker")
    regions, model = _regions_of(H.write_m3_config(tmp_path, index_value_layers=(3, 6)), drop_index_values=True)
    assert model.pools["index_v"].layers == () and not [r for r in regions if r.pool == "index_v"]
    assert len(model.pools["index_k"].layers) == 6
    (record,) = [r for r in caplog.records if "config.json reads as" in r.getMessage()]
    assert "no index_v; the model's config.json reads as" in record.getMessage()
    assert "index_v on layers 3,6" in record.getMessage()


