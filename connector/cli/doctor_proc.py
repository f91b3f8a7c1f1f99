"""The process half of `doctor` (connector.cli.doctor): on prefill's and decode's host, which process serves each
engine URL (Linux /proc: the socket listening on its port, and the processes below it: vLLM's engine core and
workers), so that doctor can tell swapped --prefill-url/--decode-url apart before traffic (prefill's side channel
listens in a process of the engine behind the decode URL) and read UCX's settings from the engines themselves, not
from its own shell. Where that cannot be read (another host, another user's processes, no /proc), it says so."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from connector.cli.probe import port_state
from connector.transport.handshake import is_loopback

FAIL, WARN, OK = "FAIL", "warn", "ok"
Doctor = Any
"""connector.cli.doctor.Doctor: not imported, it imports us."""
PROC = Path("/proc")
UCX_VARS = ("UCX_NET_DEVICES", "UCX_TLS")
NIC_MAPPING = ("VLLM_GPU_NIC_PCIE_MAPPING", "VLLM_NIC_SELECTION_VARS")
"""With both set, vLLM sets UCX_NET_DEVICES in each worker itself (vllm/v1/executor/vllm_net_devices.py)."""


def _socket_inodes(port: int) -> set[str]:
    """Inodes of the TCP sockets listening on `port` (any address, IPv4 or IPv6)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                inodes.add(fields[9])
    return inodes


def listeners(port: int) -> set[int]:
    """PIDs of this host's processes holding a socket that listens on `port` (those this user may look into)."""
    inodes = {f"socket:[{i}]" for i in _socket_inodes(port)}
    pids: set[int] = set()
    if not inodes:
        return pids
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    pids.add(int(entry.name))
                    break
        except OSError:  # another user's process, or it ended while we looked
            continue
    return pids


def tree(pids: set[int]) -> set[int]:
    """`pids` and every process below them."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry.name))
    out, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


def environ(pid: int) -> dict[str, str]:
    """A process's environment as it was exec'd (raises OSError: PermissionError for another user's process; a
    process that retitled itself, as vLLM's engine core and workers do, overwrote it: OSError too)."""
    raw = (PROC / str(pid) / "environ").read_bytes()
    env = dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if b"=" in item)
    if "PATH" not in env:
        raise OSError(f"its environment was overwritten (process title {_title(pid)!r})")
    return env


def _title(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return "?"


def is_local(host: str) -> bool:
    return is_loopback(host) or port_state(host, 0) == "free"


@dataclass
class Engine:
    """What doctor found of one engine: its processes (empty when not found) or why it could not look."""

    side: str
    url: str
    pids: set[int]
    """The process serving the URL and every process below it (vLLM's engine core, workers)."""
    top: set[int]
    """The process serving the URL (vLLM's API server): the others start from its environment."""
    why_not: str = ""


def engines(doc: Doctor) -> dict[str, Engine]:
    """The engines behind --prefill-url and --decode-url that run on this host."""
    out = {}
    for side, url in doc.urls.items():
        if not url:
            continue
        parts = urlsplit(url)
        if not is_local(parts.hostname or ""):
            out[side] = Engine(side, url, set(), set(),
                               f"{parts.hostname} is another host (run doctor there to read it)")
            continue
        if not PROC.is_dir():
            out[side] = Engine(side, url, set(), set(), "this system has no /proc")
            continue
        found = listeners(parts.port or 80)
        why = "" if found else (f"no process of this user listens on port {parts.port} (not running, or another "
                                f"user's: run doctor as the engine's user)")
        out[side] = Engine(side, url, tree(found), found, why)
    return out


def check_urls(doc: Doctor, found: dict[str, Engine]) -> None:
    """Swapped or identical --prefill-url/--decode-url: where prefill's side channel listens says which engine is
    prefill (on this host, before any request)."""
    pre, dec = found.get("prefill"), found.get("decode")
    if not (pre and dec and pre.pids and dec.pids):
        return
    if pre.pids & dec.pids:
        doc.add(FAIL, "engine URLs", f"--prefill-url {pre.url} and --decode-url {dec.url} are the same engine: give "
                                     f"each its own engine's URL")
        return
    port = getattr(doc.settings.get("prefill"), "side_channel_port", None)
    side_channel = listeners(port) if port else set()
    if side_channel & dec.pids and not side_channel & pre.pids:
        doc.add(FAIL, "engine URLs", f"swapped: prefill's side channel (port {port}) listens in the engine behind "
                                     f"--decode-url {dec.url}, so that one is prefill: swap --prefill-url and "
                                     f"--decode-url (and the router's --prefill and --decode)")
    elif side_channel & pre.pids:
        doc.add(OK, "engine URLs", f"prefill's side channel (port {port}) listens in the engine behind "
                                   f"--prefill-url {pre.url}")


def check_ucx(doc: Doctor) -> None:
    """UCX's settings where NIXL reads them: in the engine processes when doctor can read their environment, else
    in this shell (and it says so)."""
    found = engines(doc)
    check_urls(doc, found)
    read, unread = [], []
    for side, engine in found.items():
        envs: dict[tuple[str | None, ...], list[int]] = {}
        denied = []
        for pid in sorted(engine.top):
            try:
                env = environ(pid)
            except OSError as exc:
                denied.append(f"pid {pid}: {exc.strerror or exc}")
                continue
            envs.setdefault(tuple(env.get(v) for v in (*UCX_VARS, *NIC_MAPPING)), []).append(pid)
        if envs:
            read.append(side)
            for (devices, tls, mapping, selection), pids in envs.items():
                where = (f" ({side} engine: the environment of pid{'s' if len(pids) > 1 else ''} "
                         f"{', '.join(map(str, pids))}, serving {engine.url}, which its engine core and workers start "
                         f"with)")
                if mapping and "UCX_NET_DEVICES" in (selection or ""):
                    doc.add(OK, "UCX_NET_DEVICES", f"vLLM sets it per worker from VLLM_GPU_NIC_PCIE_MAPPING (its "
                                                   f"log's 'mapped to NIC' lines name each rank's NIC), before "
                                                   f"{devices or 'nothing'}{where}")
                    devices = devices or "per-worker"
                _judge(doc, devices, tls, where)
        else:
            unread.append(f"{side}: {engine.why_not or '; '.join(denied) or 'no process found'}")
    if read:
        return
    why = ("; ".join(unread) if unread else "no --prefill-url or --decode-url given")
    doc.add(WARN if unread else OK, "engine environment",
            f"cannot read the engines' UCX settings ({why}): the lines below are doctor's own shell's")
    _judge(doc, os.environ.get("UCX_NET_DEVICES"), os.environ.get("UCX_TLS"),
           " (this shell; export it for every prefill and decode process)")


def _judge(doc: Doctor, devices: str | None, tls: str | None, where: str) -> None:
    if doc.multi_node:
        if devices == "lo":
            doc.add(FAIL, "UCX_NET_DEVICES", "lo: UCX cannot reach another node over loopback; set it to the KV "
                                             "interface (e.g. mlx5_0:1 for RDMA, eth1 for TCP)" + where)
        elif not devices:
            doc.add(WARN, "UCX_NET_DEVICES", "unset: UCX listens on and advertises every interface; set it to the KV "
                                             "interface (e.g. mlx5_0:1, eth1)" + where)
        else:
            doc.add(OK, "UCX_NET_DEVICES", devices + where)
        names = set((tls or "").replace(",", " ").split())
        if doc.args.network == "tcp" and tls and not names & {"tcp", "all"}:
            doc.add(FAIL, "UCX_TLS", f"{tls}: no TCP transport, and the KV crosses TCP: add tcp (UCX_TLS=tcp)" + where)
        elif doc.args.network == "rdma" and names and names <= {"tcp", "self", "sm", "shm", "cma"}:
            doc.add(WARN, "UCX_TLS", f"{tls}: TCP only over an RDMA network (far slower): leave it unset or name "
                                     f"rc/dc/ud (and cuda_ipc on GPU nodes)" + where)
        else:
            doc.add(OK, "UCX_TLS", (tls or "unset: UCX picks the fastest transport it finds") + where)
    elif devices and devices != "lo":
        doc.add(OK, "UCX_NET_DEVICES", devices + where)
    elif devices == "lo":
        doc.add(OK, "UCX_NET_DEVICES", "lo: prefill and decode on this machine" + where)
    else:
        doc.add(WARN, "UCX_NET_DEVICES", "unset: each NIXL agent listens on every interface; on one machine set "
                                         "UCX_NET_DEVICES=lo" + where)
