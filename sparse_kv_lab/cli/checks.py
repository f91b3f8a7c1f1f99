"""Checks of a demo/bench run (connector.cli.checks holds the shared ones): where a side's ranks run, and what needs
the model (time, memory, device) before any process starts or anything is allocated. Every refusal is one line
naming the value and the fix, exit code 2."""

from __future__ import annotations

import os
import re
from typing import Any

from connector.core.errors import CliError
from connector.core.layout import POOLS, ModelLayout, ParallelLayout, RankLayout

MAX_SIM_RANKS = 64
"""Ranks one side may have in `demo`/`bench`: each rank is an OS process with its own NIXL agent."""
MEMORY_FRACTION = 0.8
"""A demo/bench run may plan to use at most this share of the memory available now."""
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
"""A host, namespace, interface or UCX transport name: no spaces, slashes or shell characters."""


def parse_node(text: str | None, flag: str) -> Any:
    """`host=H[,netns=N][,dev=D][,tls=T]` -> where one side's ranks run. `netns`: a network namespace they enter
    (`ip netns add`); `dev`: the interface UCX uses (UCX_NET_DEVICES); `tls`: UCX_TLS, `tcp` by default once
    `netns` or `dev` is given (otherwise UCX moves the bytes through shared memory, network or not). Returns a
    sparse_kv_lab.sim.spec.Placement (imported here: `plan` loads nothing of the transport stack)."""
    from sparse_kv_lab.sim.spec import LOOPBACK, Placement  # noqa: PLC0415

    if not text:
        return Placement()
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in ("host", "netns", "dev", "tls") or not value:
            raise CliError(f"{flag} {text!r}: expected host=H[,netns=N][,dev=D][,tls=T], got {item!r}")
        if key in fields:
            raise CliError(f"{flag} {text!r}: {key} is given twice: give it once")
        if not NAME.fullmatch(value):
            raise CliError(f"{flag} {key}={value!r}: use letters, digits and . _ : - only (at most 64)")
        fields[key] = value
    if "netns" in fields and not os.path.exists(f"/run/netns/{fields['netns']}"):
        raise CliError(f"{flag} netns={fields['netns']}: no such network namespace: create it "
                       f"(`ip netns add {fields['netns']}`, see sparse_kv_lab/sim/netns.py) or drop netns")
    env = [("UCX_NET_DEVICES", fields["dev"])] if "dev" in fields else []
    tls = fields.get("tls", "tcp" if env or "netns" in fields else "")
    env += [("UCX_TLS", tls)] if tls else []
    return Placement(fields.get("host", LOOPBACK), fields.get("netns"), tuple(env))


def cache_bytes(model: ModelLayout, layout: ParallelLayout, num_blocks: int, block_size: int) -> int:
    """Bytes the simulated caches of every rank of one side take (sparse_kv_lab.sim.buffers.RankBuffers)."""
    total = 0
    for pp, tp in layout.ranks():
        rank = RankLayout(model, layout, pp, tp)
        total += sum(len(rank.layers(pool)) * rank.bytes_per_token(pool) for pool in POOLS)
    return total * num_blocks * block_size


def available_memory(device: str) -> int:
    """Bytes free now: on the GPU for cuda (every rank uses the current device), else MemAvailable (or free pages)."""
    if device == "cuda":
        import torch  # noqa: PLC0415

        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_device(device: str) -> None:
    if device != "cuda":
        return
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise CliError("--device cuda: torch is not installed: use --device cpu") from None
    if not torch.cuda.is_available():
        raise CliError("--device cuda: CUDA is not available on this machine (no GPU, or torch built without CUDA): "
                       "use --device cpu")


def check_memory(model: ModelLayout, prefill: ParallelLayout, decode: ParallelLayout, num_blocks: int,
                 block_size: int, staging_mb: int, device: str) -> None:
    """Refuse a run whose caches (both sides, every rank) and staging buffers do not fit, before anything starts."""
    ranks = prefill.tp * prefill.pp + decode.tp * decode.pp
    need = (cache_bytes(model, prefill, num_blocks, block_size) + cache_bytes(model, decode, num_blocks, block_size)
            + ranks * (staging_mb << 20))
    have = available_memory(device)
    if need > MEMORY_FRACTION * have:
        where = "GPU memory" if device == "cuda" else "memory"
        raise CliError(f"this run needs about {need / 2**30:.1f} GiB ({ranks} ranks: caches of {num_blocks} blocks "
                       f"of {block_size} tokens per pool, plus --staging-mb); {have / 2**30:.1f} GiB of {where} is "
                       f"available: use fewer --tokens or --requests, a smaller --staging-mb, or fewer ranks")


def check_time(model: ModelLayout, layer_ms: float, timeout_s: float) -> None:
    """A prefill stage's simulated compute for one chunk must end before the --timeout the parent waits for it."""
    chunk_s = model.num_layers * layer_ms / 1e3
    if chunk_s >= timeout_s:
        raise CliError(f"--layer-ms {layer_ms:g} x {model.num_layers} layers is {chunk_s:g} s of compute per chunk, "
                       f"over --timeout {timeout_s:g} s: use a smaller --layer-ms or a larger --timeout")
