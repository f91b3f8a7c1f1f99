"""Checks of command-line input, in one place: argparse `type=` callables with a range, a parser whose errors are one
line, and a side's rank count (the lab's demo and bench add their own checks: sparse_kv_lab.cli.checks). Every
refusal is one line naming the value and the fix, exit code 2."""

from __future__ import annotations

import argparse
import math
from typing import Callable, NoReturn

from connector.core.errors import CliError
from connector.core.layout import ParallelLayout

MAX_RANKS = 256
"""Ranks (tp x pp) one side may have in `plan`: the engines accept no more from a peer (SideChannelConfig's
max_peer_ranks default), and a plan's cost grows with the ranks."""


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
