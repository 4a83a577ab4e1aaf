"""What every subcommand shares: the registry of subcommands and the one-line user error.

Subcommands register themselves with ``register_subcommand(name, add_arguments, run, help=...)``: ``add_arguments``
fills an argparse sub-parser, ``run(args)`` does the work and returns an exit code (or None for 0), raising
``CliError`` for a user mistake (printed as ``capuchin_tf <name>: error: ...``, exit code 2). Imports no TensorFlow.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

MiB = 1 << 20


class CliError(Exception):
    """A user mistake (bad argument, missing file...): reported in one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(
    name: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int | None],
    *,
    help: str = "",
    replace: bool = False,
) -> None:
    """Adds `name` to the command line (see the module docstring)."""
    if name in SUBCOMMANDS and not replace:
        raise ValueError(f"subcommand {name!r} is already registered")
    SUBCOMMANDS[name] = Subcommand(name, help, add_arguments, run)


def mib_arg(text: str, what: str, *, positive: bool = False) -> int:
    """MiB given on the command line, in bytes: a finite number >= 0 (> 0, and at least one byte, when `positive`)."""
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise CliError(f"{what} must be a number of MiB, got {text!r}") from None
    kind = "positive" if positive else "non-negative"
    if not v >= 0 or v == float("inf") or (positive and int(v * MiB) <= 0):
        raise CliError(f"{what} must be a {kind} number of MiB, got {text!r}")
    return int(v * MiB)
