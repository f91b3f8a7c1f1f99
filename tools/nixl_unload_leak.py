"""Reproduce (and measure) the sockets NIXL leaves open when a remote agent is unloaded (issue 33, item 1).

A child "decode" process creates a Transport (the product's NIXL agent: UCX backend, connector.transport.nixl),
registers a DRAM buffer and prints its metadata. This ("prefill") process creates its own Transport and, N times,
loads the decode's agent (add_peer), optionally WRITEs 4 KiB to it, and unloads it (remove_peer); it counts its own
open fds by kind after the steps, then again after the decode process exited, and prints a table.

    UCX_NET_DEVICES=lo PYTHONPATH=. python tools/nixl_unload_leak.py --cycles 50 --threads 4 --write
    ... --tls tcp            (UCX_TLS for both processes; repeat --tls to compare several)
    ... --threads 0 --threads 4 (nixl_threads: NIXL's UCX thread pool; one UCX worker each, plus a shared one)
    ... --peer-dies          (the decode process exits before the last sample; its fds are sampled after)
    ... --no-fix             (prefill's unload_sweep_s=None: NIXL's thread-pool workers never swept; "before")

fd kinds: socket:tcp-<STATE> / socket:unix / socket (other), pipe, anon_inode:[eventfd] ... read from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time

import numpy as np

TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
              7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING"}
BUF_BYTES = 1 << 20


def _socket_table() -> dict[str, str]:
    """inode -> 'tcp-STATE' / 'unix' / 'udp' for this network namespace."""
    out: dict[str, str] = {}
    for proto in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{proto}") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    out[parts[9]] = "tcp-" + TCP_STATES.get(int(parts[3], 16), parts[3])
        except OSError:
            pass
    for proto in ("udp", "udp6"):
        try:
            with open(f"/proc/net/{proto}") as f:
                next(f)
                for line in f:
                    out[line.split()[9]] = "udp"
        except OSError:
            pass
    try:
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                parts = line.split()
                out[parts[6]] = "unix"
    except OSError:
        pass
    return out


def fd_kinds(pid: int | str = "self") -> collections.Counter:
    """Open fds of a process by kind (sockets split by protocol and TCP state)."""
    kinds: collections.Counter = collections.Counter()
    sockets = None
    base = f"/proc/{pid}/fd"
    for fd in os.listdir(base):
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            if sockets is None:
                sockets = _socket_table()
            kinds["socket:" + sockets.get(target[8:-1], "?")] += 1
        elif target.startswith("pipe:"):
            kinds["pipe"] += 1
        elif target.startswith("anon_inode:"):
            kinds[target] += 1
        elif target.startswith("/dev/"):
            kinds["dev"] += 1
        else:
            kinds["file"] += 1
    return kinds


def _config(name: str, threads: int, sweep_s: float | None = None):
    from connector.transport.nixl.settings import TransportConfig

    return TransportConfig(name=name, nixl_threads=threads, unload_sweep_s=sweep_s,
                           ucx_error_handling_mode=os.environ.get("LEAK_UCX_ERR_MODE", "peer"))


# ------------------------------------------------------------------ decode (child)
async def _decode_main(name: str, threads: int) -> None:
    from connector.transport.nixl.agent import Transport

    buf = np.zeros(BUF_BYTES, dtype=np.uint8)
    async with Transport(_config(name, threads)) as t:
        t.register(buf)
        print("@@" + json.dumps({"metadata": t.metadata.hex(), "addr": buf.ctypes.data, "pid": os.getpid()}), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or line.strip() == "quit":
                break
            if line.strip() == "sum":  # what the WRITEs left in the buffer
                print("@@" + json.dumps({"sum": int(buf.sum(dtype=np.uint64)), "fds": dict(fd_kinds())}), flush=True)


# ------------------------------------------------------------------ prefill (this process)
class Decode:
    def __init__(self, name: str, threads: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--role", "decode", "--name", name,
                                      "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        info = json.loads(self._line())
        self.metadata, self.addr, self.pid = bytes.fromhex(info["metadata"]), info["addr"], info["pid"]

    def _line(self) -> str:
        """The next line the decode process meant for us (NIXL writes its own lines to stdout too)."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"decode process exited ({self.proc.wait()})")
            if line.startswith("@@"):
                return line[2:]

    def ask_sum(self) -> dict:
        self.proc.stdin.write("sum\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # our own child, by its handle
                self.proc.wait()


def _sockets(k: collections.Counter) -> int:
    return sum(v for key, v in k.items() if key.startswith("socket"))


async def _prefill(args: argparse.Namespace, threads: int, tls: str | None) -> list[tuple[str, collections.Counter]]:
    from connector.transport.nixl.agent import Transport

    env = dict(os.environ)
    if tls:
        env["UCX_TLS"] = tls
        os.environ["UCX_TLS"] = tls
    else:
        os.environ.pop("UCX_TLS", None)
        env.pop("UCX_TLS", None)
    rows: list[tuple[str, collections.Counter]] = []
    src = np.full(4096, 1, dtype=np.uint8)
    decode = Decode(f"leak-decode-{os.getpid()}-{threads}", threads, env)
    try:
        sweep_s = None if args.no_fix else args.sweep_s
        async with Transport(_config(f"leak-prefill-{os.getpid()}-{threads}", threads, sweep_s)) as t:
            t.register(src)
            rows.append(("transport open", fd_kinds()))
            written = 0
            started = time.monotonic()
            for i in range(1, args.cycles + 1):
                peer = t.add_peer(decode.metadata)
                if i == 1:
                    rows.append(("after 1st load", fd_kinds()))
                if args.write:
                    await t.write(peer, [(src.ctypes.data, src.nbytes)], [(decode.addr + (i % 16) * 4096, 4096)])
                    written += 1
                    if i == 1:
                        rows.append(("after 1st write", fd_kinds()))
                t.remove_peer(peer)
                if i == 1 or i == args.cycles or i % args.sample_every == 0:
                    rows.append((f"after {i} unload(s)", fd_kinds()))
            elapsed = time.monotonic() - started
            await asyncio.sleep(args.settle_s)
            rows.append((f"+{args.settle_s:g} s idle", fd_kinds()))
            # A real transfer after all that: load once more, WRITE, check the bytes arrived.
            peer = t.add_peer(decode.metadata)
            check = np.full(4096, 7, dtype=np.uint8)
            t.register(check)
            await t.write(peer, [(check.ctypes.data, check.nbytes)], [(decode.addr + 17 * 4096, 4096)])
            got = decode.ask_sum()
            expected = 7 * 4096 + (min(written, 16) * 4096 if args.write else 0)
            ok = got["sum"] == expected
            t.remove_peer(peer)
            rows.append(("final load+WRITE+unload", fd_kinds()))
            if args.peer_dies:
                decode.stop()
                await asyncio.sleep(args.settle_s)
                rows.append((f"decode exited, +{args.settle_s:g} s", fd_kinds()))
            print(f"# threads={threads} UCX_TLS={tls or '(default)'} cycles={args.cycles} write={args.write} "
                  f"unload_sweep_s={sweep_s} sweeps={t.stats.sweeps} "
                  f"cycle={1000 * elapsed / max(1, args.cycles):.1f} ms; final WRITE byte-exact: {ok} "
                  f"(decode sum {got['sum']} expected {expected}); decode fds before it exited: {dict(got['fds'])}", flush=True)
    finally:
        decode.stop()
    return rows


def _table(rows: list[tuple[str, collections.Counter]]) -> str:
    kinds = sorted({k for _, c in rows for k in c})
    head = ["step", "fds", "sockets"] + kinds
    lines = [head] + [[step, str(sum(c.values())), str(_sockets(c))] + [str(c.get(k, 0)) for k in kinds]
                      for step, c in rows]
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("prefill", "decode"), default="prefill")
    p.add_argument("--name", default="leak-decode")
    p.add_argument("--threads", type=int, action="append", help="nixl_threads (repeatable; default 4)")
    p.add_argument("--tls", action="append", help="UCX_TLS value (repeatable; default: UCX's default)")
    p.add_argument("--cycles", type=int, default=50)
    p.add_argument("--sample-every", type=int, default=25)
    p.add_argument("--write", action="store_true", help="WRITE 4 KiB between each load and unload")
    p.add_argument("--peer-dies", action="store_true", help="sample again after the decode process exited")
    p.add_argument("--settle-s", type=float, default=1.0)
    p.add_argument("--err-mode", choices=("peer", "none"), default="peer", help="ucx_error_handling_mode")
    p.add_argument("--sweep-s", type=float, default=0.5, help="TransportConfig.unload_sweep_s of the prefill side")
    p.add_argument("--no-fix", action="store_true", help="unload_sweep_s=None: no sweeps (the before of before/after)")
    args = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ["LEAK_UCX_ERR_MODE"] = args.err_mode  # both processes (the decode child inherits it)
    if args.role == "decode":
        asyncio.run(_decode_main(args.name, (args.threads or [4])[0]))
        return
    for threads in args.threads or [4]:
        for tls in args.tls or [None]:
            try:
                rows = asyncio.run(_prefill(args, threads, tls))
            except Exception as exc:  # noqa: BLE001 - a UCX_TLS choice that cannot connect: say so, go on
                print(f"# threads={threads} UCX_TLS={tls}: failed: {exc!r}\n", flush=True)
                continue
            print(_table(rows), flush=True)
            first, last = rows[0][1], rows[-1][1]
            print(f"# sockets +{_sockets(last) - _sockets(first)}, fds +{sum(last.values()) - sum(first.values())} "
                  f"over {args.cycles} unload(s) (+1 final)\n", flush=True)


if __name__ == "__main__":
    main()
