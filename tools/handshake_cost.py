"""What the side channel's defences cost one handshake: a real prefill rank (its own process, real NIXL) and a decode
rank in this process, timed over N handshakes (TCP connect, both Hellos, both proofs, decode's Auth with its memory,
Welcome) in three settings:

  token            auth_token only (insecure_any_prefill: decode trusts any prefill that holds the token)
  token+keys       the README's settings: prefill signs with its key (prefill_key_file), decode checks it
                   (trusted_prefill_keys) and signs with its engine key
  token+keys+tls   the same over TLS (a self-signed CA made here)

Each prints p50/p90 of one handshake in ms, and prefill's open files and RSS before and after. Run:
  UCX_NET_DEVICES=lo .venv/bin/python tools/handshake_cost.py [--handshakes 200]"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparse_kv_lab.sim.env import apply_env  # noqa: E402

apply_env()  # before NIXL sees the environment

from connector.core.hf_config import load_model  # noqa: E402
from connector.engine.config import ReceiverConfig, SenderConfig  # noqa: E402
from connector.protocol.auth import engine_public_key, new_engine_key  # noqa: E402
from sparse_kv_lab.sim.cluster import Cluster  # noqa: E402
from sparse_kv_lab.sim.rank import SimRank  # noqa: E402
from connector.transport.client import connect  # noqa: E402
from connector.transport.side_channel import SideChannelConfig  # noqa: E402
from tests.adversary import TOKEN, Target, make_scenario  # noqa: E402


def self_signed(folder: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (the certificate is its own CA)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


def fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def measure(name: str, handshakes: int, prefill_side: SideChannelConfig, decode_side: SideChannelConfig) -> None:
    model = load_model("minimax-m3")
    config = SenderConfig(lease_s=10.0, side_channel=prefill_side)
    with Cluster(make_scenario(model, sender_config=config), spawn=("prefill",)) as cluster:
        target = Target(cluster)
        rank = SimRank(cluster.sc.rank_spec("decode", (0, 0), run_id=name)).open()
        try:
            engine_key = new_engine_key()
            hello = rank.receiver(ReceiverConfig(decode_side, transfer_timeout_s=30.0), engine_key=engine_key).hello

            async def run() -> list[float]:
                took = []
                for _ in range(handshakes):
                    began = time.perf_counter()
                    conn = await connect("127.0.0.1", target.port, hello, decode_side, timeout=20,
                                         engine_key=engine_key)
                    took.append((time.perf_counter() - began) * 1e3)
                    await conn.aclose()
                return took

            rank.run(run(), 30)  # warm-up: the first handshakes plan the pair
            fds0, rss0 = fds(target.pid), target.rss()
            took = rank.run(run(), 60 + handshakes)
            q = statistics.quantiles(took, n=10)
            print(f"{name:16s} {handshakes} handshakes: p50 {statistics.median(took):.2f} ms, p90 {q[8]:.2f} ms; "
                  f"prefill fds {fds0} -> {fds(target.pid)}, RSS {rss0 / 2**20:.1f} -> {target.rss() / 2**20:.1f} MiB")
        finally:
            rank.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handshakes", type=int, default=200)
    args = parser.parse_args()
    prefill_key = new_engine_key()
    trusted = frozenset({engine_public_key(prefill_key)})
    measure("token", args.handshakes, SideChannelConfig(auth_token=TOKEN), SideChannelConfig(auth_token=TOKEN))
    measure("token+keys", args.handshakes, SideChannelConfig(auth_token=TOKEN, prefill_key=prefill_key),
            SideChannelConfig(auth_token=TOKEN, trusted_keys=trusted))
    with tempfile.TemporaryDirectory() as folder:
        cert, key = self_signed(Path(folder))
        measure("token+keys+tls", args.handshakes,
                SideChannelConfig(auth_token=TOKEN, prefill_key=prefill_key, tls_cert_file=cert, tls_key_file=key),
                SideChannelConfig(auth_token=TOKEN, trusted_keys=trusted, tls_ca_file=cert))


if __name__ == "__main__":
    main()
