"""examples/proxy.py (the concurrent flow: both legs at once, decode told prefill's side channel before prefill runs)
in front of a prefill started with `--data-parallel-size 2` (vLLM's own load balancer, two engine cores behind one
API server, each with its own side channel). The router picks the DP rank, pins the prefill leg to it with vLLM's
X-data-parallel-rank header and tells decode that rank's side channel: every request is token-equal to decode
alone, whichever rank served it, and both ranks serve some. The engines are the other-archs pool's DP prefill and
its GPT-NeoX decode (tests.real_engine.arch_engines); a few short requests."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from sparse_kv_lab.pd.client import RequestFailed, complete, completion_body, prompt_ids
from sparse_kv_lab.pd.servers import VllmServer
from tests.real_engine.arch_engines import DP_SIZE
from tests.real_engine.conftest import MACHINE_STALL_S, Proxy, RouterPool, fresh_salt
from tests.real_engine.test_real_pd import wait_for

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]


class DpView(RouterPool):
    """The other-archs pool's prefill with --data-parallel-size 2 (the GPT-NeoX model, side channels side_port and
    side_port + 1) and its GPT-NeoX decode (tests.real_engine.arch_engines): one pool start serves the DP tests of
    both files. Its routers are its own; the servers are the pool's (it stops them)."""

    def __init__(self, pool) -> None:
        self.log_dir = pool.log_dir
        self.prefill = pool.dp_prefill
        self.decode = pool.pairs["gpt_neox"].decode
        self.servers = []
        self.proxies: list[Proxy] = []

    def router(self, *args: str) -> Proxy:
        return self.shared("proxy.py", list(args))


def sends_by_rank(server: VllmServer) -> dict[int, float]:
    """vllm:sparse_kv_sends_ok_total per DP rank (vLLM labels each engine core's stats with engine="N")."""
    out = {rank: 0.0 for rank in range(DP_SIZE)}
    for key, value in server.metrics().items():
        found = re.search(r'engine="(\d+)"', key) if key.startswith("vllm:sparse_kv_sends_ok_total{") else None
        if found:
            out[int(found[1])] = out.get(int(found[1]), 0.0) + value
    return out


def test_concurrent_router_in_front_of_a_dp2_prefill_is_token_equal_on_both_ranks(dp_router):
    pair = dp_router
    started = time.monotonic()
    router = pair.router("--prefill", f"{pair.prefill.url},{pair.prefill.side_channel},dp={DP_SIZE}",
                         "--decode", pair.decode.url)
    listening_s = time.monotonic() - started
    log = Path(router.log.name).read_text(errors="replace")
    assert log.count("start-up check: ") == DP_SIZE and "DP rank 1 ->" in log, log  # one PD request per rank
    before = sends_by_rank(pair.prefill.server)
    for i in range(4):
        prompt = prompt_ids(40 + 60 * i, seed=1400 + i)
        got = complete(router.url, completion_body(prompt, 8, stream=i % 2 == 1, cache_salt=fresh_salt()))
        assert got.token_ids == pair.reference(prompt, 8), f"request {i} ({len(prompt)} tokens)"

    def per_rank() -> dict[int, float] | None:
        now = sends_by_rank(pair.prefill.server)
        delta = {r: now[r] - before[r] for r in range(DP_SIZE)}
        return delta if sum(delta.values()) >= 4 else None
    delta = wait_for("prefill's sends_ok for 4 requests", per_rank)
    assert all(delta[r] >= 1 for r in range(DP_SIZE)), f"requests per DP rank: {delta}"
    print(f"router listening after {listening_s:.1f} s (start-up checks included); sends per rank {delta}")


def test_a_router_not_told_of_data_parallel_fails_fast_naming_why(dp_router):
    # The issue's setup: the router thinks prefill has one rank (no dp=), so it tells decode DP rank 0's side channel
    # and vLLM's balancer picks the rank. A request the balancer puts on rank 1 must fail at once (not leave the
    # client waiting on a decode that waits for KV no rank will send), naming the cause; rank 0's are token-equal.
    pair = dp_router
    router = pair.router("--prefill", f"{pair.prefill.url},{pair.prefill.side_channel}", "--decode", pair.decode.url,
                         "--no-startup-checks")
    outcomes = []
    for i in range(8):
        prompt = prompt_ids(50 + 20 * i, seed=1500 + i)
        started = time.monotonic()
        try:
            got = complete(router.url, completion_body(prompt, 8, cache_salt=fresh_salt()))
            assert got.token_ids == pair.reference(prompt, 8), f"request {i}"
            outcomes.append("token-equal")
        except RequestFailed as exc:
            took = time.monotonic() - started
            assert exc.status == 502 and "DP rank 1 served it (vLLM's load balancer chose it)" in exc.body and \
                ",dp=N, so the router picks the rank" in exc.body, exc
            assert took < 15 + MACHINE_STALL_S, f"request {i} failed after {took:.1f} s"
            outcomes.append(f"fail-fast {took:.1f} s")
        if "token-equal" in outcomes and any(o.startswith("fail-fast") for o in outcomes):
            break
    print(f"router without dp=: {outcomes}")
    assert any(o.startswith("fail-fast") for o in outcomes), f"vLLM's balancer put no request on rank 1: {outcomes}"
