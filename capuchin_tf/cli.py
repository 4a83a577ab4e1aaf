"""Command line: ``python -m capuchin_tf <subcommand> ...``.

Subcommands register themselves with ``register_subcommand(name, add_arguments, run, help=...)``: ``add_arguments``
fills an argparse sub-parser, ``run(args)`` does the work and returns an exit code (or None for 0), raising
``CliError`` for a user mistake (printed as ``capuchin_tf <name>: error: ...``, exit code 2). This module imports no
TensorFlow; a subcommand that needs it imports it inside its ``run``.

``plan``: plans a recorded trace under a budget with a registered policy and prints a summary::

    python -m capuchin_tf plan --trace T.json --budget-mb 512 --policy capuchin --link p100 --json plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m capuchin_tf",
        description="capuchin_tf: Capuchin-style memory management (swapping and recomputation) for TensorFlow.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in SUBCOMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from capuchin_tf import profile_cli  # noqa: F401  (registers `profile`; imports TensorFlow only when run)
    from capuchin_tf import bench_cli  # noqa: F401  (registers `bench`; imports TensorFlow only when run)

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help(sys.stderr)
        return 2
    try:
        code = SUBCOMMANDS[args.command].run(args)
    except CliError as e:
        print(f"capuchin_tf {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0 if code is None else int(code)


# ---- plan ---------------------------------------------------------------------------------------------------------------
def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from capuchin_tf.policy import POLICIES

    p.add_argument("--trace", required=True, help="access trace (JSON) of a measured step")
    p.add_argument("--budget-mb", required=True, help="device memory budget in MiB (2^20 bytes)")
    p.add_argument(
        "--policy", default="capuchin", help=f"registered policy: {', '.join(POLICIES)} (default: capuchin)"
    )
    p.add_argument(
        "--link",
        default="native",
        help="link model: native (6e9 bytes/s per direction), p100 (the trace's FLOP rate / 258), or bytes/s",
    )
    p.add_argument("--margin-mb", default=None, help="MiB kept free for allocations the trace does not model")
    p.add_argument("--json", default=None, metavar="PATH", help="write the plan here (JSON)")


def _mib(text: str, what: str, *, positive: bool = False) -> int:
    """MiB given on the command line, in bytes: a finite number >= 0 (> 0, and at least one byte, when `positive`)."""
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise CliError(f"{what} must be a number of MiB, got {text!r}") from None
    kind = "positive" if positive else "non-negative"
    if not v >= 0 or v == float("inf") or (positive and int(v * MiB) <= 0):
        raise CliError(f"{what} must be a {kind} number of MiB, got {text!r}")
    return int(v * MiB)


def _run_plan(args: argparse.Namespace) -> int:
    from capuchin_tf.device_model import DeviceModel, DeviceModelError
    from capuchin_tf.policy import POLICIES, get_policy
    from capuchin_tf.trace import AccessTrace, TraceError

    budget = _mib(args.budget_mb, "--budget-mb", positive=True)
    margin = None if args.margin_mb is None else _mib(args.margin_mb, "--margin-mb")
    if args.policy not in POLICIES:
        raise CliError(f"unknown policy {args.policy!r}; valid policies: {', '.join(POLICIES)}")
    path = pathlib.Path(args.trace)
    if not path.is_file():
        raise CliError(f"trace file not found: {path}")
    try:
        trace = AccessTrace.load(path)  # validates the whole trace: TraceFormatError names the bad field
    except TraceError as e:
        raise CliError(f"cannot read trace {path}: {e}") from None
    except OSError as e:
        raise CliError(f"cannot read trace {path}: {e.strerror or e}") from None
    try:
        dm = DeviceModel.from_link(args.link, trace)
    except DeviceModelError as e:
        raise CliError(str(e)) from None
    try:
        plan = get_policy(args.policy)(trace, budget, dm, margin_bytes=margin)
    except TraceError as e:  # what the schema check cannot see and the planner's index refuses
        raise CliError(f"cannot plan trace {path}: {e}") from None
    print(plan.summary())
    if args.json:
        out = pathlib.Path(args.json)
        try:
            plan.save(out)
        except OSError as e:
            raise CliError(f"cannot write {out}: {e}") from None
        print(f"plan written to {out}")
    return 0


register_subcommand("plan", _add_plan_arguments, _run_plan, help="plan a recorded trace under a memory budget")
