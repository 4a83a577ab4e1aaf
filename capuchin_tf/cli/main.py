"""Command line: ``python -m capuchin_tf <subcommand> ...``.

The subcommands live in ``plan``, ``profile`` and ``bench`` of this package and register themselves in
``common``; this module builds the parser from that registry and runs one. Nothing here imports TensorFlow; a
subcommand that needs it imports it inside its ``run``.
"""

from __future__ import annotations

import argparse
import sys

from capuchin_tf.cli.common import SUBCOMMANDS, CliError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m capuchin_tf",
        description="capuchin_tf: Capuchin-style memory management (swapping and recomputation) for TensorFlow.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in SUBCOMMANDS.values():
        # A hidden (worker) subcommand is given no `help`: argparse then leaves it out of the list.
        p = sub.add_parser(cmd.name, description=cmd.help) if cmd.hidden else sub.add_parser(
            cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Each module registers its subcommands; none imports TensorFlow until its subcommand runs.
    from capuchin_tf.cli import bench, plan, profile  # noqa: F401

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
