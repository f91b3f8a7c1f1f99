"""Checks of command-line input, in one place: argparse `type=` callables with a range, a parser whose errors are one
line, and the checks of a demo/bench run that need the model (ranks, chunks, time, memory, device) before any
process starts or anything is allocated. Every refusal is one line naming the value and the fix, exit code 2."""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable, NoReturn

from connector.core.errors import CliError
from connector.core.layout import POOLS, ModelLayout, ParallelLayout, RankLayout

MAX_RANKS = 256
"""Ranks (tp x pp) one side may have in `plan`: the engines accept no more from a peer (SideChannelConfig's
max_peer_ranks default), and a plan's cost grows with the ranks."""
MAX_SIM_RANKS = 64
"""Ranks one side may have in `demo`/`bench`: each rank is an OS process with its own NIXL agent."""
MEMORY_FRACTION = 0.8
"""A demo/bench run may plan to use at most this share of the memory available now."""


class HelpFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the text already says it (or there is none to say)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (`error: ...`) and exit code 2 (its subparsers too:
    argparse builds them with the parent's class). Options must be spelt out (`--prefil` is an error, not
    `--prefill`), and `--help` shows each option's default."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - argparse's own signature
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse `type=` for an integer in lo..hi."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give an integer {lo}..{hi}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range: give an integer {lo}..{hi}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(lo: float, hi: float, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse `type=` for a finite number in [lo, hi] (or (lo, hi] with `lo_open`)."""
    span = f"{'above' if lo_open else 'from'} {lo:g} {'and up ' if lo_open else ''}to {hi:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: give a number {span}") from None
        if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a number {span}")
        return value

    parse.__name__ = "number"
    return parse


def check_ranks(layout: ParallelLayout, flag: str, most: int) -> None:
    if layout.tp * layout.pp > most:
        what = "a plan's cost grows with the ranks" if most == MAX_RANKS else "each rank is an OS process"
        raise CliError(f"{flag} tp={layout.tp},pp={layout.pp} is {layout.tp * layout.pp} ranks; at most {most} here "
                       f"({what}): use a smaller tp or pp")


def cache_bytes(model: ModelLayout, layout: ParallelLayout, num_blocks: int, block_size: int) -> int:
    """Bytes the simulated caches of every rank of one side take (connector.sim.buffers.RankBuffers)."""
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
