"""``python -m capuchin_tf plan``: plans a recorded trace under a budget with a registered policy::

    python -m capuchin_tf plan --trace T.json --budget-mb 512 --policy capuchin --link p100 --json plan.json
    python -m capuchin_tf plan --replay DIR     # a planning failure the runtime kept (Options.keep_failures)
"""

from __future__ import annotations

import argparse
import pathlib

from capuchin_tf.cli.common import SIZE_HELP, CliError, mib_arg, register_subcommand


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from capuchin_tf.policy import POLICIES

    p.add_argument("--trace", help="access trace (JSON) of a measured step")
    p.add_argument("--budget-mb", help=f"device memory budget: {SIZE_HELP}")
    p.add_argument("--replay", metavar="DIR",
                   help="a planning failure the runtime kept (Options.keep_failures): plan its trace again with the "
                        "budget, policy, options and device model the runtime had (no other argument is read)")
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

    if args.replay:
        return _replay(pathlib.Path(args.replay), args.json)
    if args.trace is None or args.budget_mb is None:
        raise CliError("--trace and --budget-mb are required (or --replay DIR)")
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


def _replay(directory: pathlib.Path, json_path: str | None) -> int:
    """Plans a kept planning failure again (runtime.errors.keep_planning_failure); 1 when it fails again (its
    traceback printed), 0 when it plans."""
    import json
    import traceback

    from capuchin_tf.core.access_trace import AccessTrace, TraceError
    from capuchin_tf.core.device_model import DeviceModel
    from capuchin_tf.policy import make_plan
    from capuchin_tf.runtime.errors import FAILURE_KIND

    try:
        record = json.loads((directory / "failure.json").read_text())
        trace = AccessTrace.load(directory / "trace.json")
    except (OSError, ValueError, TraceError) as e:
        raise CliError(f"cannot read the planning failure in {directory}: {e}") from None
    if record.get("kind") != FAILURE_KIND:
        raise CliError(f"{directory / 'failure.json'} is not a {FAILURE_KIND} record")
    model = DeviceModel(**record["device_model"])
    print(f"replaying: {record['policy']} for {record['budget_bytes']} bytes, options {record['planner_options']}; "
          f"it failed with {record['error'][:300]}")
    try:
        plan = make_plan(trace, record["budget_bytes"], record["policy"], model, **record["planner_options"])
    except Exception:  # noqa: BLE001  (the failure, again: what the replay is for)
        traceback.print_exc()
        return 1
    print(f"planned this time: {plan.summary()}")
    if json_path:
        plan.save(pathlib.Path(json_path))
    return 0


register_subcommand("plan", _add_plan_arguments, _run_plan, help="plan a recorded trace under a memory budget")
