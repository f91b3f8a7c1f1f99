"""A prefill whose NIXL load of decode's agent outlasts decode's handshake timeout still serves the request (issue
32). The load no longer runs in the handshake (issue 33: an agent loads at the first registration prefill serves),
so the handshake does not time out at all; the load runs off prefill's loop, the KV then arrives intact (end-to-end
checksum) over real NIXL between two OS processes, and prefill's loop never stalled meanwhile (its watchdog logs any
2 s stall). The delay is injected in a test subclass of the loader, in prefill's worker process only."""

from __future__ import annotations

import time

import pytest

from connector.engine.agents import LoadedAgents
from connector.engine.config import ReceiverConfig, SideChannelConfig
from connector.engine.receiver import RecvSpec
from sparse_kv_lab.sim import rank_process
from sparse_kv_lab.sim.buffers import pick_blocks
from tests.helpers import log_records, scenario

pytestmark = pytest.mark.slow
TOKENS, BLOCK = 64, 16
HANDSHAKE_S = 3.0
"""Decode's handshake timeout here."""
LOAD_DELAY_S = 4.5
"""Added to every NIXL load in prefill: past one handshake timeout, within two."""


class SlowLoadedAgents(LoadedAgents):
    def _add(self, metadata: bytes, name: str) -> float:
        time.sleep(LOAD_DELAY_S)  # (the load thread) a peer load as slow as one on two busy cores
        return super()._add(metadata, name)


def slow_loading_prefill(conn, spec) -> None:
    """Worker process entry point: sparse_kv_lab.sim.rank_process.run with the slow loader."""
    import connector.engine.peers as peers  # noqa: PLC0415

    peers.LoadedAgents = SlowLoadedAgents
    rank_process.run(conn, spec)


def test_a_load_slower_than_the_handshake_timeout_still_serves_the_request(m3, cluster, open_rank, capfd,
                                                                          monkeypatch):
    monkeypatch.setattr(rank_process, "run", slow_loading_prefill)  # what Cluster spawns
    sc = scenario(m3, tokens=TOKENS, block_size=BLOCK, timeout_s=60.0)
    prefills = cluster(sc, spawn=("prefill",))
    decode = open_rank(sc.rank_spec("decode", (0, 0), run_id="t-slow-load"))
    receiver = decode.receiver(ReceiverConfig(SideChannelConfig(handshake_timeout_s=HANDSHAKE_S),
                                              transfer_timeout_s=60.0, kv_checksum=True))
    _p, conn = prefills.prefill[(0, 0)]
    tid = "t-slow-load"
    prefills.ask(conn, ("start", tid, TOKENS, 0), 30, "prefill")
    prefills.ask(conn, ("chunk", tid, 0, TOKENS, 0.0, "stream", "all"), 30, "prefill")  # computed: KV held
    blocks = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=1)
    with log_records("connector.engine.sources") as records:
        result = decode.run(receiver.receive(RecvSpec(tid, str(prefills.prefill_address), blocks, 0, TOKENS)), 60)
    assert result.bytes_written > 0 and result.checksummed_blocks > 0, result
    retries = [r.getMessage() for r in records if "trying once more" in r.getMessage()]
    assert not retries, [r.getMessage() for r in records]  # the handshake did not wait for the load
    finished = prefills.ask(conn, ("finish", tid), 60, "prefill")
    assert finished[1] is True, finished
    logs = capfd.readouterr().err
    assert "loading NIXL agent" in logs and "in NIXL" in logs, logs[-3000:]  # said where the time went
    assert "has run nothing" not in logs, logs[-3000:]  # prefill's loop ran all along


def test_connecting_early_takes_the_slow_load_out_of_the_first_request(m3, cluster, open_rank, monkeypatch):
    """A decode that knows its prefill connects before the first request (StreamReceiver.connect_early): the
    request then needs no handshake at all (the agent's load comes with its first registration all the same)."""
    monkeypatch.setattr(rank_process, "run", slow_loading_prefill)
    sc = scenario(m3, tokens=TOKENS, block_size=BLOCK, timeout_s=60.0)
    prefills = cluster(sc, spawn=("prefill",))
    decode = open_rank(sc.rank_spec("decode", (0, 0), run_id="t-early"))
    receiver = decode.receiver(ReceiverConfig(SideChannelConfig(handshake_timeout_s=HANDSHAKE_S),
                                              transfer_timeout_s=60.0, kv_checksum=True))
    decode.run(receiver.connect_early(prefills.prefill_address), 60)
    engine = receiver.sources.by_address[prefills.prefill_address]
    _p, conn = prefills.prefill[(0, 0)]
    tid = "t-early"
    prefills.ask(conn, ("start", tid, TOKENS, 0), 30, "prefill")
    prefills.ask(conn, ("chunk", tid, 0, TOKENS, 0.0, "stream", "all"), 30, "prefill")
    blocks = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=1)
    with log_records("connector.transport.client") as client, log_records("connector.engine.sources") as sources:
        result = decode.run(receiver.receive(RecvSpec(tid, str(prefills.prefill_address), blocks, 0, TOKENS)), 60)
    assert result.checksummed_blocks > 0, result
    assert not [r for r in client + sources if "handshake" in r.getMessage()]  # no handshake in the request
    assert receiver.sources.by_address[prefills.prefill_address] is engine  # the early connections served it
    assert prefills.ask(conn, ("finish", tid), 60, "prefill")[1] is True
