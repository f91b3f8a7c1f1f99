"""Builders for tests: model layouts made directly (no config files) for pure tests, and demo scenarios; CPU time
of processes and threads from /proc."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator

from connector.core.layout import ModelLayout, ParallelLayout, PoolSpec
from connector.sim.cluster import Scenario


def make_model(kinds: str, kv_heads: int = 4, mla: bool = False, head_dim: int = 128,
               index_dim: int = 128, name: str = "test") -> ModelLayout:
    """`kinds` has one letter per layer: d = dense, k = sparse K-only, v = sparse with an index value."""
    n = len(kinds)
    if mla:
        kv = PoolSpec("kv", tuple(range(n)), 1, 1152, 1, False)
    else:
        kv = PoolSpec("kv", tuple(range(n)), kv_heads, 2 * head_dim * 2, 2, True)
    index_k = PoolSpec("index_k", tuple(i for i, c in enumerate(kinds) if c in "kv"), 1, index_dim * 2, 1, False)
    index_v = PoolSpec("index_v", tuple(i for i, c in enumerate(kinds) if c == "v"), 1, index_dim * 2, 1, False)
    return ModelLayout(name=name, num_layers=n, pools={"kv": kv, "index_k": index_k, "index_v": index_v})


def m3_like() -> ModelLayout:
    return make_model("ddd" + "k" * 57, kv_heads=4, name="minimax-m3-like")


def side(model: ModelLayout, spec: str) -> ParallelLayout:
    """`tp=T,pp=P[,layers=a:b:c]` -> ParallelLayout (the CLI's format)."""
    fields = dict(item.split("=") for item in spec.split(","))
    counts = [int(c) for c in fields["layers"].split(":")] if "layers" in fields else None
    return ParallelLayout.build(model.num_layers, int(fields.get("tp", 1)), int(fields.get("pp", 1)), counts)


def scenario(model: ModelLayout, prefill: str = "tp=1,pp=1", decode: str = "tp=1,pp=1", **kw: Any) -> Scenario:
    """A demo Scenario; small and quick unless told otherwise (100 tokens, no simulated compute, 60 s timeouts)."""
    kw.setdefault("tokens", 100)
    kw.setdefault("layer_ms", 0.0)
    kw.setdefault("timeout_s", 60.0)
    return Scenario(model=model, prefill=side(model, prefill), decode=side(model, decode), **kw)


def cpu_ticks(stat_path: str) -> tuple[str, int] | None:
    """(name, user + system clock ticks) from a Linux `/proc/<pid>/stat` or `/proc/<pid>/task/<tid>/stat` file;
    None when that process or thread has ended."""
    try:
        with open(stat_path) as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses: split after its last ")"
    return stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]) + int(fields[12])


@contextmanager
def log_records(name: str) -> Iterator[list[logging.LogRecord]]:
    """Log records of logger `name` at INFO and above, whether or not it propagates (once connector.vllm is imported,
    vLLM's handlers have adopted the `connector` loggers and caplog sees nothing)."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = got.append
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield got
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
