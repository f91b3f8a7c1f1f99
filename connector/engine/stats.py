"""What the sender counts, under the names connector.vllm.stats exports (`vllm:sparse_kv_<name>`), and the one
generic way to turn it into per-interval reports: counters as deltas, samples drained.

Written on the event loop thread only; read from others. Plain ints and deques need no lock for that: a reader
sees each int whole, and deque append/popleft are atomic."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, fields
from typing import Any

from connector.core.layout import POOLS
from connector.transport.nixl import WriteTiming

SAMPLES_KEPT = 4096
"""Samples of a series kept until someone takes them (older ones are dropped: an unread series stays bounded)."""


def _samples() -> collections.deque[float]:
    return collections.deque(maxlen=SAMPLES_KEPT)


@dataclass
class SenderStats:
    """Cumulative counters (ints) and recent samples (deques of seconds) of one prefill rank."""

    bytes_sent: int = 0
    """Bytes of completed WRITEs."""
    bytes_sent_during_compute: int = 0
    """... of those, posted while their request was still computing (streamed, not swept afterwards)."""
    bytes_sent_kv: int = 0
    """... of those, the main KV cache's (connector.core.layout.POOLS)."""
    bytes_sent_index_k: int = 0
    """... the index keys'."""
    bytes_sent_index_v: int = 0
    """... the index values'."""
    writes: int = 0
    """WRITE batches (each one NIXL post, or one run of staged chunks)."""
    descriptors: int = 0
    """Byte ranges in them."""
    staged_chunks: int = 0
    """NIXL posts that went through staging (one descriptor each) instead of their descriptors."""
    sends_ok: int = 0
    """Requests every decode rank completed."""
    sends_failed: int = 0
    """Requests aborted, failed or expired."""
    sends_expired: int = 0
    """... of those, whose lease ran out before every decode rank completed (a router that never sent the decode
    leg, a decode that died): their KV was freed unread."""
    connections_refused: int = 0
    """Side-channel connections refused or failed before they authenticated: limits, evictions, deadlines, bad
    frames, wrong proofs... (connector.transport.refusals; logged at a bounded rate, counted here in full)."""
    auth_failures: int = 0
    """... of those, whose proof of the auth token was wrong."""
    capability_refusals: int = 0
    """Registrations and Aborts refused because they did not prove the transfer's secret (a token holder that is
    not the request's decode, or a router that did not pass `transfer_secret` on): connector.engine.ownership."""
    bytes_by_cache: dict[str, int] = field(default_factory=dict)
    """Bytes of completed WRITEs per pool, every pool (a cache of its own included: `self_attn.swa_cache`)."""
    post_seconds: collections.deque[float] = field(default_factory=_samples)
    """Per NIXL WRITE: creating and posting it (on DRAM the copy itself runs in the post)."""
    transfer_seconds: collections.deque[float] = field(default_factory=_samples)
    """Per NIXL WRITE: from the post until it completed."""
    compute_seconds: collections.deque[float] = field(default_factory=_samples)
    """Per transfer (connector.engine.timeline): the rank heard of the request until it computed every token."""
    exposed_seconds: collections.deque[float] = field(default_factory=_samples)
    """Per transfer: every token computed until its last WRITE completed (what streaming did not hide)."""
    ack_seconds: collections.deque[float] = field(default_factory=_samples)
    """Per transfer: its last WRITE completed until every decode rank completed it."""

    def add_pool_bytes(self, pool: str, nbytes: int) -> None:
        name = f"bytes_sent_{pool}"
        if pool in POOLS:
            setattr(self, name, getattr(self, name) + nbytes)
        self.bytes_by_cache[pool] = self.bytes_by_cache.get(pool, 0) + nbytes

    def record_write(self, timing: WriteTiming) -> None:
        self.post_seconds.append(timing.post_s)
        self.transfer_seconds.append(timing.transfer_s)


def counter_names(stats_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(stats_type) if f.type in (int, "int"))


def series_names(stats_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(stats_type) if str(f.type).startswith(("collections.deque", "deque")))


class StatsDelta:
    """Reads a stats object every interval: what each counter gained since the last read, and the samples
    recorded since (taken out of the object)."""

    def __init__(self, stats: SenderStats) -> None:
        self.stats = stats
        self._counters = counter_names(type(stats))
        self._series = series_names(type(stats))
        self._seen = self._read()

    def _read(self) -> dict[str, Any]:
        return {**{name: getattr(self.stats, name) for name in self._counters},
                "bytes_sent_by_cache": dict(self.stats.bytes_by_cache)}

    def take(self) -> tuple[dict[str, Any], dict[str, list[float]]]:
        """(counter gains, with `bytes_sent_by_cache`: pool -> bytes gained; samples since the last take)."""
        now = self._read()
        counts: dict[str, Any] = {name: now[name] - self._seen[name] for name in self._counters}
        seen = self._seen["bytes_sent_by_cache"]
        counts["bytes_sent_by_cache"] = {pool: n - seen.get(pool, 0) for pool, n in now["bytes_sent_by_cache"].items()
                                         if n != seen.get(pool, 0)}
        self._seen = now
        samples = {}
        for name in self._series:
            queue = getattr(self.stats, name)
            samples[name] = [queue.popleft() for _ in range(len(queue))]
        return counts, samples
