"""Two "nodes" on one machine: Linux network namespaces joined by a veth pair, and a fresh process entering one.

Why: on 127.0.0.1, and even across namespaces unless `UCX_TLS=tcp` is forced, UCX moves the bytes through shared
memory (cma), so a transfer test there exercises nothing of a network. Two namespaces with a veth between them
and TCP forced make the bytes cross a link that can be cut (`ip link set ... down`) or shaped (`tc ... tbf`),
and the veth's counters show that they did.

`enter(name)` does for the calling process what `ip netns exec NAME` does: join the namespace's network, then a
private mount namespace with /sys remounted, so UCX sees that namespace's interfaces. It must run before NIXL (or
anything that starts a thread) loads: namespaces are per thread, and a mount namespace cannot be unshared by a
process that already has several. `TwoNodes` makes and removes the namespaces (root only)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import threading
from dataclasses import dataclass

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2
PREFIX = "skv"
"""Every namespace TwoNodes makes is named `skv<pid>x<n>a|b`: unique per process, and the pid tells whether its
maker is still alive (see `remove_stale`)."""


def _libc_call(fn: str, *args: object) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, fn)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{fn}{args!r}: {os.strerror(err)}")


def enter(name: str) -> None:
    """Move this process into network namespace `name` (one `ip netns add` made) with /sys remounted, as
    `ip netns exec` does. Call it first thing in a fresh process, before NIXL or any thread starts."""
    if threading.active_count() > 1:
        raise RuntimeError(f"cannot enter network namespace {name!r}: this process already runs "
                           f"{threading.active_count()} threads (enter it first thing, before NIXL or torch load)")
    try:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    except FileNotFoundError:
        raise RuntimeError(f"network namespace {name!r} does not exist (create it with `ip netns add {name}`)") \
            from None
    try:
        _libc_call("setns", fd, _CLONE_NEWNET)
    finally:
        os.close(fd)
    # A private view of /sys: sysfs shows the devices of the namespace that mounts it, and UCX reads
    # /sys/class/net to list interfaces (without this it reports the namespace's veth as unavailable).
    _libc_call("unshare", _CLONE_NEWNS)
    _libc_call("mount", b"none", b"/", None, _MS_SLAVE | _MS_REC, None)
    _libc_call("umount2", b"/sys", _MNT_DETACH)
    _libc_call("mount", name.encode(), b"/sys", b"sysfs", 0, None)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> str | None:
    """None if this process can make namespaces, else why not (for a skip message)."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process runs as uid %d)" % os.geteuid()
    try:
        probe = _ip("netns", "list", check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()}"
    return None


def remove_stale() -> list[str]:
    """Delete namespaces named by TwoNodes whose maker process is gone (a test run killed before its cleanup)."""
    gone = []
    for line in _ip("netns", "list").stdout.splitlines():
        m = re.match(rf"({PREFIX}(\d+)x\d+[ab])\b", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            _ip("netns", "del", m.group(1), check=False)
            gone.append(m.group(1))
    return gone


@dataclass(frozen=True)
class Node:
    """One end: its namespace, the veth inside it, and that veth's address."""

    netns: str
    dev: str
    host: str


class TwoNodes:
    """Namespaces `a` and `b` joined by a veth pair (a: 10.77.0.1, b: 10.77.0.2). Use as `with TwoNodes() as net:`;
    both namespaces (and with them the veth) are deleted on exit, also after a failure. Processes still inside a
    deleted namespace keep it alive until they exit."""

    _count = 0

    def __init__(self) -> None:
        TwoNodes._count += 1
        tag = f"{PREFIX}{os.getpid()}x{TwoNodes._count}"
        self.a = Node(f"{tag}a", f"{tag}a", "10.77.0.1")
        self.b = Node(f"{tag}b", f"{tag}b", "10.77.0.2")
        self._made: list[str] = []

    def __enter__(self) -> "TwoNodes":
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        remove_stale()
        for node in (self.a, self.b):
            _ip("netns", "add", node.netns)
            self._made.append(node.netns)
            _ip("-n", node.netns, "link", "set", "lo", "up")
        _ip("link", "add", self.a.dev, "type", "veth", "peer", "name", self.b.dev)
        for node in (self.a, self.b):
            _ip("link", "set", node.dev, "netns", node.netns)
            _ip("-n", node.netns, "addr", "add", f"{node.host}/30", "dev", node.dev)
            _ip("-n", node.netns, "link", "set", node.dev, "up")

    def close(self) -> None:
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()

    def node(self, side: str) -> Node:
        return {"a": self.a, "b": self.b}[side]

    def link(self, side: str, up: bool) -> None:
        """Cut (`up=False`) or restore one end of the link."""
        node = self.node(side)
        _ip("-n", node.netns, "link", "set", node.dev, "up" if up else "down")

    def sysctl(self, key: str, value: object) -> None:
        """Set a per-namespace sysctl in both namespaces (e.g. net.ipv4.tcp_retries2)."""
        for node in (self.a, self.b):
            _ip("netns", "exec", node.netns, "sysctl", "-qw", f"{key}={value}")

    def shape(self, side: str, rate: str, burst: str, limit: str) -> None:
        """Rate-limit what `side` sends with a token bucket (`tc qdisc ... tbf`); a small `limit` drops packets,
        which stands in for a lossy link (netem is not in every kernel)."""
        node = self.node(side)
        subprocess.run(["tc", "-n", node.netns, "qdisc", "replace", "dev", node.dev, "root", "tbf", "rate", rate,
                        "burst", burst, "limit", limit], capture_output=True, text=True, check=True, timeout=30)

    def counters(self, side: str) -> dict[str, int]:
        """The veth's byte and packet counters on `side` (rx_bytes, tx_bytes, tx_dropped, ...)."""
        node = self.node(side)
        out = json.loads(_ip("-n", node.netns, "-s", "-j", "link", "show", "dev", node.dev).stdout)[0]
        stats = out["stats64"]
        return {f"rx_{k}": v for k, v in stats["rx"].items()} | {f"tx_{k}": v for k, v in stats["tx"].items()}

    def qdisc_drops(self, side: str) -> int:
        node = self.node(side)
        out = subprocess.run(["tc", "-n", node.netns, "-s", "-j", "qdisc", "show", "dev", node.dev],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return sum(q.get("drops", 0) for q in json.loads(out))
