"""Measure how long each side takes to give a request up when the link between prefill and decode is cut mid-WRITE.

Prefill runs in one network namespace, decode in another, a veth pair between them (sparse_kv_lab.sim.netns), UCX over
TCP. The link is slowed (tbf) so the request is still on the wire, then cut on one side and left down. Printed, as
one JSON line: when prefill handed the request's blocks back (its WRITE failed, nothing reads them any more) and
when decode failed the transfer (after it made sure nothing more lands), both in seconds after the cut.

    python tools/cut_link.py --side a --tcp-retries2 15                      # connector defaults, kernel default
    python tools/cut_link.py --side b --tcp-retries2 3 --tcp-user-timeout 0  # no UCX user timeout: the kernel decides

Root only (namespaces). A side that has not settled within --limit is reported as null, with what it still holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.core.hf_config import load_model  # noqa: E402
from connector.core.layout import ParallelLayout  # noqa: E402
from connector.engine.config import SideChannelConfig  # noqa: E402
from sparse_kv_lab.sim import netns  # noqa: E402
from sparse_kv_lab.sim.cluster import Cluster, Scenario  # noqa: E402
from sparse_kv_lab.sim.spec import Placement  # noqa: E402


def measure(args: argparse.Namespace, net: netns.TwoNodes) -> dict:
    model = load_model("minimax-m3")
    one = ParallelLayout.build(model.num_layers, 1, 1)
    user_timeout = args.tcp_user_timeout or None
    sc = Scenario(model=model, prefill=one, decode=one, tokens=256, layer_ms=0.0, timeout_s=args.limit + 30,
                  prefill_node=Placement.node(net.a.host, net.a.netns, net.a.dev),
                  decode_node=Placement.node(net.b.host, net.b.netns, net.b.dev),
                  side_channel=SideChannelConfig(heartbeat_interval_s=args.heartbeat, dead_after_s=args.dead_after),
                  tcp_user_timeout_s=user_timeout, write_timeout_s=args.write_timeout)
    net.sysctl("net.ipv4.tcp_retries2", args.tcp_retries2)
    with Cluster(sc) as cluster:
        assert cluster.run_request(0).verified, "the warm-up request failed"
        net.shape("a", "40mbit", "32kb", "1mb")
        tid, (_, pconn), (_, dconn) = f"{cluster.run_id}-cut", cluster.prefill[(0, 0)], cluster.decode[(0, 0)]
        cluster.ask(dconn, ("receive", tid, sc.tokens, 0, str(cluster.prefill_address), 1), 30, "decode")
        cluster.ask(pconn, ("start", tid, sc.tokens, 1), 30, "prefill")
        pconn.send(("chunk", tid, 0, sc.tokens, 30.0, "stream", "all"))
        time.sleep(1.5)
        cut_at = time.monotonic()
        net.link(args.side, False)
        dconn.send(("collect", tid))
        cluster.reply(pconn, 60, "prefill")
        pconn.send(("finish", tid))
        out: dict = {"prefill_s": None, "decode_s": None}
        waiting = {"prefill": pconn, "decode": dconn}
        while waiting and time.monotonic() - cut_at < args.limit:
            for name, conn in list(waiting.items()):
                if conn.poll(0.02):
                    answer = conn.recv()
                    out[f"{name}_s"] = round(time.monotonic() - cut_at, 2)
                    out[f"{name}_answer"] = answer[1] if name == "prefill" else answer[1][:1]
                    del waiting[name]
        if "prefill" in waiting:  # still held: say what (its stuck WRITE has not ended)
            out["prefill_still_holds"] = cluster.ask(pconn, ("state",), 30, "prefill")[1]
        net.link(args.side, True)
        for conn in waiting.values():  # let them answer before the processes go
            conn.poll(args.limit)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=["a", "b"], default="a", help="cut on prefill's node (a) or decode's (b)")
    p.add_argument("--tcp-retries2", type=int, default=15, help="net.ipv4.tcp_retries2 in both namespaces")
    p.add_argument("--tcp-user-timeout", type=float, default=10.0, help="connector tcp_user_timeout_s (0: none)")
    p.add_argument("--dead-after", type=float, default=15.0)
    p.add_argument("--heartbeat", type=float, default=2.0)
    p.add_argument("--write-timeout", type=float, default=60.0)
    p.add_argument("--limit", type=float, default=90.0, help="seconds after the cut to wait for each side")
    args = p.parse_args()
    why = netns.available()
    if why:
        print(f"cannot measure: {why}", file=sys.stderr)
        return 2
    with netns.TwoNodes() as net:
        result = measure(args, net)
    print(json.dumps({k: v for k, v in vars(args).items()} | result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
