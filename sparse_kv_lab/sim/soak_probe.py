"""What a soak samples in its own process: memory, file descriptors, threads, live Python objects (all of them, and
those of the connector's per-transfer types by name), and the engine tables that could grow per transfer. Used by
both sides of sparse_kv_lab.sim.soak; no torch or NIXL here, the tables come from a callback the side passes in.
"""

from __future__ import annotations

import collections
import gc
import os
import time
from typing import Any, Callable

WATCHED_TYPES = (
    # prefill, per transfer
    "connector.engine.sender_state.SendRequest", "connector.engine.sender_state.Destination",
    "connector.engine.sender_state.Parked", "connector.engine.sender_state.FinishedInfo",
    "connector.engine.batch_writer.BatchTimes", "connector.transport.nixl.poller.Xfer",
    # decode, per transfer
    "connector.engine.receiver._Pending", "connector.engine.receiver.ReceiveResult",
    # per connection / peer (churn)
    "connector.engine.peers.PeerInfo", "connector.engine.sources.SourceEngine",
    "connector.transport.control.ControlConnection",
    # the loop's own
    "_asyncio.Task", "_asyncio.Future", "asyncio.locks.Event", "asyncio.queues.Queue",
    "concurrent.futures._base.Future",
)
"""Types counted by qualified name in every sample (those a per-transfer leak would pile up)."""
TOP_GROWERS = 8


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def fd_kinds() -> dict[str, int]:
    """This process's open fds by what they are ("socket", "anon_inode:[eventfd]", "pipe", a file path's first
    two parts...): a growing count says which kind leaks."""
    kinds: collections.Counter = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own fd)
        kind = target.split(":[")[0] if target.startswith(("socket:", "pipe:")) else target
        kinds["/".join(kind.split("/")[:3]) if kind.startswith("/") else kind] += 1
    return dict(kinds)


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon (bytes) and Threads (native, NIXL's and UCX's included) of this process."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024  # reported in kB
            elif key == "Threads":
                out[key] = int(value)
    return out


class Probe:
    """Samples this process. The first sample at or after the warm-up becomes the baseline that later samples'
    `grown` (the types whose live count rose most since then) is measured from."""

    def __init__(self, side: str, tables: Callable[[], dict[str, int]]) -> None:
        self.side, self.tables = side, tables
        self.started = time.monotonic()
        self._baseline: collections.Counter | None = None

    def sample(self, requests: int, warm: bool, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """One sample after `requests` requests; `warm`: past the warm-up (the first such is the baseline)."""
        tables = self.tables()  # first: it runs on the engine's loop, and may allocate
        gc.collect()
        objects = gc.get_objects()
        counts = collections.Counter(_type_name(type(o)) for o in objects)
        total = len(objects)
        del objects  # (the list itself would keep every object alive until the next sample)
        status = proc_status()
        sample = {"side": self.side, "requests": requests, "t_s": round(time.monotonic() - self.started, 3),
                  "rss_bytes": status.get("VmRSS", 0), "rss_anon_bytes": status.get("RssAnon", 0),
                  "fds": len(os.listdir("/proc/self/fd")), "fd_kinds": fd_kinds(), "threads": status.get("Threads", 0),
                  "gc_objects": total, "types": {name: counts.get(name, 0) for name in WATCHED_TYPES},
                  "tables": tables, **(extra or {})}
        if warm and self._baseline is None:
            self._baseline = counts
        if self._baseline is not None:
            grown = counts.copy()
            grown.subtract(self._baseline)
            sample["grown"] = {name: n for name, n in grown.most_common(TOP_GROWERS) if n > 0}
        return sample
