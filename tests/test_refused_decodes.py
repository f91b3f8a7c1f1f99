"""A decode refused at the handshake (another model, another token) frees prefill's KV within seconds, not after the
lease, and both sides name the real cause. Prefill runs as a worker process, decode in this process, on real NIXL
over loopback."""

from __future__ import annotations

import logging
import time

import pytest

from connector.core.errors import TransferFailed
from connector.engine.config import ReceiverConfig, SideChannelConfig
from connector.engine.receiver import RecvSpec
from connector.protocol.addressing import PrefillAddress
from sparse_kv_lab.sim.buffers import pick_blocks
from connector.transport.ports import free_ports
from tests.helpers import make_model, scenario

pytestmark = pytest.mark.slow
TOKENS, BLOCK, LEASE_S = 64, 16, 120.0
TOKEN = "the-prefill-token-0123456789abcdef"


def refused_by_prefill(m3, cluster, open_rank, decode_model, decode_token: str):
    """Prefill (TP1) computes a request and keeps its KV; a decode rank of `decode_model` with `decode_token` tries
    to receive it. Returns (the decode's error, seconds until decode failed, seconds from then until prefill
    released the request, prefill's answer)."""
    sc = scenario(m3, tokens=TOKENS, block_size=BLOCK, timeout_s=LEASE_S + 30, auth_token=TOKEN)
    prefills = cluster(sc, spawn=("prefill",))
    decode_sc = scenario(decode_model, tokens=TOKENS, block_size=BLOCK, timeout_s=30.0)
    decode = open_rank(decode_sc.rank_spec("decode", (0, 0), run_id="test-refused"))
    receiver = decode.receiver(ReceiverConfig(SideChannelConfig(auth_token=decode_token), transfer_timeout_s=30.0))
    _p, conn = prefills.prefill[(0, 0)]
    tid = "t-refused"
    prefills.ask(conn, ("start", tid, TOKENS, 0), 30, "prefill")
    prefills.ask(conn, ("chunk", tid, 0, TOKENS, 0.0, "stream", "all"), 30, "prefill")  # computed: KV held
    blocks = pick_blocks(TOKENS, BLOCK, decode.spec.num_blocks, seed=1)
    started = time.monotonic()
    with pytest.raises(TransferFailed) as failed:
        decode.run(receiver.receive(RecvSpec(tid, f"127.0.0.1:{prefills.base_port}", blocks, 0, TOKENS)), 30)
    decode_s = time.monotonic() - started
    refused_at = time.monotonic()
    finished = prefills.ask(conn, ("finish", tid), LEASE_S + 30, "prefill")
    prefill_s = time.monotonic() - refused_at
    held = prefills.ask(conn, ("state",), 30, "prefill")[1]
    assert held["requests"] == 0 and held["open_handles"] == 0, held
    assert receiver.busy == {"pending": 0, "confirming": 0}
    return str(failed.value), decode_s, prefill_s, finished


def test_a_decode_of_another_model_is_refused_and_prefill_frees_the_kv_within_seconds(m3, cluster, open_rank,
                                                                                     capfd):
    error, decode_s, prefill_s, finished = refused_by_prefill(m3, cluster, open_rank, make_model("ddkk"), TOKEN)
    logs = capfd.readouterr().err
    print(f"\nanother model: decode failed after {decode_s:.2f} s, prefill freed the KV {prefill_s:.2f} s later: "
          f"{error}")
    assert "fingerprint" in error, error  # decode compares the models (it speaks second) and tells prefill
    assert decode_s < 5 and prefill_s < 6, (decode_s, prefill_s)
    assert finished[1] is False  # released unsent
    assert "refused at the handshake" in logs and "fingerprint" in logs, logs[-3000:]
    assert "did the router send" not in logs  # the real cause, not the router


@pytest.mark.parametrize("decode_token", ["a-wrong-token-0123456789abcdef", ""])
def test_a_decode_with_another_token_is_refused_and_prefill_frees_the_kv_within_seconds(m3, cluster, open_rank,
                                                                                       capfd, decode_token):
    error, decode_s, prefill_s, finished = refused_by_prefill(m3, cluster, open_rank, m3, decode_token)
    logs = capfd.readouterr().err
    print(f"\ntoken {decode_token!r}: decode failed after {decode_s:.2f} s, prefill freed the KV {prefill_s:.2f} s "
          f"later: {error}")
    assert "token" in error, error
    assert decode_s < 5 and prefill_s < 6, (decode_s, prefill_s)
    assert finished[1] is False
    assert "refused at the handshake" in logs and "token" in logs, logs[-3000:]


def test_an_abort_for_a_prefill_decode_cannot_reach_is_one_warning(m3, open_rank, caplog):
    """vLLM's policy "fail" ends each failed decode leg with an abort of the unregistered transfer, against the same
    prefill it could not reach: one WARNING line each, no ERROR and no traceback."""
    decode = open_rank(scenario(m3, tokens=TOKENS, block_size=BLOCK).rank_spec("decode", (0, 0), run_id="t-abort"))
    receiver = decode.receiver(ReceiverConfig(SideChannelConfig(), transfer_timeout_s=10.0))
    nobody = PrefillAddress("127.0.0.1", free_ports(1))
    with caplog.at_level(logging.INFO):
        decode.loop.spawn(receiver.abort_unregistered("t-gone", nobody, "request failed on decode"),
                          "abort of unregistered transfer t-gone").result(15)
        time.sleep(0.2)  # (a failure would be logged from the future's callback)
    mine = [r for r in caplog.records if "t-gone" in r.getMessage()]
    assert [r.levelname for r in mine] == ["WARNING"], [(r.levelname, r.getMessage()) for r in caplog.records]
    assert mine[0].exc_info is None and "cannot connect" in mine[0].getMessage(), mine[0].getMessage()
