"""``python -m capuchin_tf plan``: plans a recorded trace under a budget with a registered policy::

    python -m capuchin_tf plan --trace T.json --budget-mb 512 --policy capuchin --link p100 --json plan.json
"""

from __future__ import annotations

import argparse
import pathlib

from capuchin_tf.cli.common import SIZE_HELP, CliError, mib_arg, register_subcommand


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from capuchin_tf.policy import POLICIES

    p.add_argument("--trace", required=True, help="access trace (JSON) of a measured step")
    p.add_argument("--budget-mb", required=True, help=f"device memory budget: {SIZE_HELP}")
    p.add_argument(
        "--policy", default="capuchin", help=f"registered policy: {', '.join(POLICIES)} (default: capuchin)"
    )
    p.add_argument(
        "--link",
        default="native",
        help="link model: native (6e9 bytes/s per direction), p100 (the trace's FLOP rate / 258), or bytes/s",
    )
    p.add_argument("--margin-mb", default=None, help=f"kept free for allocations the trace does not model: {SIZE_HELP}")
    p.add_argument("--json", default=None, metavar="PATH", help="write the plan here (JSON)")


def _run_plan(args: argparse.Namespace) -> int:
    from capuchin_tf.core.access_trace import AccessTrace, TraceError
    from capuchin_tf.core.device_model import DeviceModel, DeviceModelError
    from capuchin_tf.policy import POLICIES, get_policy

    budget = mib_arg(args.budget_mb, "--budget-mb", positive=True)
    margin = None if args.margin_mb is None else mib_arg(args.margin_mb, "--margin-mb")
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
