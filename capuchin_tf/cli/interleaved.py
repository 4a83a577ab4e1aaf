"""Policies in turn in one process: `bench interleaved` and the suite's `interleaved` section.

    python -m capuchin_tf bench interleaved --model resnet50 --batch 32 --transient-fraction 0.5 \
        --policies capuchin,swap-only,recompute-only,checkpoint,swap-all --link p100 --rounds 6 --json out.json

One process can run the same plan 15-40% slower than another on the shared 2-core machine, with nothing stolen
(docs/decisions.md, "A suite point is the run of the median step of its rounds"): fresh processes per policy cannot
tell apart policies within issue 16's 3%. Here every policy's managed step wraps the same training step in one fresh
process on a device of the budget's size (its fragmentation is the device's, as in the throughput section): each
policy's measured step and first guided step, then `rounds` rounds in which every policy that still runs takes one
step, in a new order every round (seeded), so that a slow spell of the machine falls on every policy alike and no
policy always follows the same one. A plan change a step starts building in the background is waited for after that
step (recorded as `build_wait_s`, in neither step): it would otherwise share the machine with the next policy's step
(seen: the transformer's capuchin, which always followed swap-only under a rotated order, 0.24 s a step against
0.19 s with checkpoint alone beside it; swap-only re-planned 4 times).

Each step continues from the variables the step before left, whichever policy ran it: plain TensorFlow's run of as
many steps (a fresh process on a device it fits) must give every loss and the final variables bit for bit. A policy
whose step fails is left out from then on, with its error: passive mode's rescue is off, as in the suite's throughput
section (a step passive mode would have to rescue means the policy does not run at this budget), and a managed step
that fails leaves the variables as they were, so the run goes on. The link (p100) is clocked by plain TensorFlow's
step for every policy (bench.link_clock), as in the suite.

A policy named `policy+variant` (VARIANTS) is the policy with a variant's decorator options: `capuchin+layout` is
capuchin with its planned layout in every guided step (Options.planned_layout True; `+nolayout`: never; the policy
itself: "auto"), measured against capuchin in the same process;
a policy and its variants share a plan cache, so that all of them start from the plan the first of them made (the
others' first call is a guided step) and go on with their own feedback.

Per policy: the median of its steps from its first guided step on (its measured step left out, as the suite's
"median of steps 2-8"), against capuchin's; paired by round (each policy ran once in each), the median of its step
over capuchin's and in how many rounds capuchin's was the faster; its re-plans, the bytes its steps evicted on demand
and its plan. The worker's JSON (`run.per_policy`) keeps each step's time, evictions on demand, late prefetches and
planned-layout region and misses.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import random
import shutil
import statistics
import tempfile
import time

from capuchin_tf.cli.common import CliError, register_subcommand, run_worker, whole_mib
from capuchin_tf.core.budget import MiB

#: The policies `bench interleaved` compares by default: capuchin first (the others' medians are set against its).
DEFAULT_POLICIES = ("capuchin", "swap-only", "recompute-only", "checkpoint", "swap-all")

#: Variants of a policy, named `policy+variant` in --policies: the same policy with these decorator options, so that
#: an option is measured against the policy without it in one process (`capuchin,capuchin+layout`).
VARIANTS = {"layout": {"planned_layout": True}, "nolayout": {"planned_layout": False}}


def policy_variant(name: str) -> tuple[str, dict]:
    """`name` ("capuchin" or "capuchin+layout") as its policy and the decorator options of its variant; ValueError for
    an unknown variant."""
    policy, _, variant = name.partition("+")
    if variant and variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} of {policy!r}; valid variants: {', '.join(VARIANTS)}")
    return policy, dict(VARIANTS.get(variant, {}))


# ---- the worker (runs inside the fresh process) ----------------------------------------------------------------------
def _add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--budget-mb", type=whole_mib, required=True)
    p.add_argument("--policies", required=True)
    p.add_argument("--link", required=True)
    p.add_argument("--link-clock-s", type=float, default=None)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--result", required=True)


def _run_worker(a: argparse.Namespace) -> int:
    import tensorflow as tf

    import capuchin_tf  # installs the allocator wrapper before the first op
    from capuchin_tf.cli import bench, models
    from capuchin_tf.cli.common import machine
    from capuchin_tf.frontend import decorator
    from capuchin_tf.runtime.errors import oom_line
    from capuchin_tf.runtime.managed_step import wait_for_builds
    from capuchin_tf.tf.simulated_device import DEVICE

    budget = a.budget_mb * MiB
    policies = [p for p in a.policies.split(",") if p]
    setup = models.build(a.model, a.batch)
    # A policy and its variants share one plan cache: the first of them to run plans from its measured step, the
    # others start from that plan (their first call a guided step), so that the variant's options, not two plans
    # made from two traces, make the difference (each goes on with its own feedback).
    caches = {policy_variant(p)[0]: tempfile.mkdtemp(prefix="capuchin_interleaved_") for p in policies
              if policy_variant(p)[1]}
    steps = {p: decorator.wrap_step(setup.train_step, decorator.make_options(
        budget, policy=policy_variant(p)[0], link=a.link, link_clock_s=a.link_clock_s, passive_rescue=False,
        plan_cache=caches.get(policy_variant(p)[0]), **policy_variant(p)[1])) for p in policies}
    record: list[dict] = []  # every step that completed, in the order they ran
    errors: dict[str, str] = {}

    def call(policy: str, round_: int | None = None) -> None:
        managed = steps[policy]
        tf.config.experimental.reset_memory_stats(DEVICE)
        t0 = time.perf_counter()
        try:
            loss = managed(*setup.inputs)
        except (tf.errors.ResourceExhaustedError, capuchin_tf.CapuchinError) as e:
            # (a managed step that fails restores what it may have written: the run goes on without this policy)
            errors[policy] = f"{type(e).__name__}: {oom_line(e)}"
            print(f"  {policy}: {errors[policy]}", flush=True)
            return
        seconds = time.perf_counter() - t0
        # A plan change this step started building in the background is waited for here, so that it does not
        # share the machine with the next policy's step (it would with this policy's own next step in a run of its
        # own): its wait is recorded, not counted in either step.
        built = wait_for_builds()
        step = next(iter(managed.report().values()))["steps"][-1]
        record.append({"policy": policy, "round": round_, "seconds": seconds, "build_wait_s": built,
                       "loss_hex": float.hex(float(loss)),
                       "phase": step["phase"], "late_prefetches": step["late_prefetches"],
                       # the planned layout's region (0: the step ran without one) and its misses
                       "layout_bytes": step.get("layout_bytes", 0), "layout_misses": step.get("layout_misses", 0),
                       "evicted_on_demand_bytes": step.get("passive_evicted_bytes", 0) if step["phase"] == "guided"
                       else 0, "peak_bytes": tf.config.experimental.get_memory_info(DEVICE)["peak"]})
        print(f"  {policy} ({step['phase']}): {seconds:.3f} s", flush=True)

    for policy in policies:
        for _ in range(2):  # the measured step and the first guided step
            if policy not in errors:
                call(policy)
    for r in range(a.rounds):
        running = [p for p in policies if p not in errors]
        if not running:
            break
        # A new order every round (seeded: the same on every run), so that no policy always follows the same one.
        for policy in random.Random(r).sample(running, len(running)):
            call(policy, r)
    per_policy = {}
    for policy in policies:
        mine = [s for s in record if s["policy"] == policy]
        timed = [s["seconds"] for s in mine[1:]]
        report = next(iter(steps[policy].report().values()), None)
        # The running plan's own steps (bench.plan_step_indices: after its last change, less the step that
        # instantiated it, none beside a build): what its prediction is set beside.
        own = [mine[i]["seconds"] for i in bench.plan_step_indices(report["steps"]) if i < len(mine)] if report else []
        per_policy[policy] = {
            "ok": policy not in errors, "error": errors.get(policy), "steps": len(mine), "step_s": [s["seconds"] for s
                                                                                                   in mine],
            "phases": [s["phase"] for s in mine], "median_step_s": statistics.median(timed) if timed else None,
            "round_s": {s["round"]: s["seconds"] for s in mine if s["round"] is not None},
            "build_wait_s": [s["build_wait_s"] for s in mine],
            "evicted_on_demand_bytes": [s["evicted_on_demand_bytes"] for s in mine],
            "late_prefetches": [s["late_prefetches"] for s in mine],
            "layout_bytes": [s["layout_bytes"] for s in mine], "layout_misses": [s["layout_misses"] for s in mine],
            "peak_bytes": max((s["peak_bytes"] for s in mine[1:]), default=None),
            "plan_median_step_s": statistics.median(own) if own else None, "plan_steps": len(own),
            "prediction": report.get("prediction") if report else None,
            **({k: report[k] for k in ("replans", "swapped_tensors", "swapped_bytes", "recomputed_tensors",
                                       "recomputed_bytes", "plan_fallback")} if report else {})}
    result = {"model": a.model, "batch": a.batch, "budget_mb": a.budget_mb, "link": a.link,
              "link_clock_s": a.link_clock_s, "rounds": a.rounds, "policies": policies, "machine": machine(),
              "tf_version": tf.__version__, "order": [s["policy"] for s in record],
              "losses_hex": [s["loss_hex"] for s in record], "variables_sha256": setup.variables_sha256(),
              "per_policy": per_policy}
    pathlib.Path(a.result).write_text(json.dumps(result, indent=1))
    for cache in caches.values():
        shutil.rmtree(cache, ignore_errors=True)
    return 0


# ---- the parent ------------------------------------------------------------------------------------------------------
def interleaved_point(model: str, batch: int, policies: list[str], link: str, rounds: int,
                      budget_mb: int | None = None, fraction: float | None = None, echo=None) -> dict:
    """The run described in the module docstring, at `budget_mb` or at persistent + `fraction` x plain TensorFlow's
    transient peak: plain TensorFlow first (its peak, its step for the link's clock, and the losses of as many steps
    as the run will take), then the policies in one process, then their steps checked bit for bit against plain's.
    What `bench interleaved` writes and the suite's `interleaved` section records."""
    from capuchin_tf.cli import bench
    from capuchin_tf.cli.suite import BIG_DEVICE_MB
    from capuchin_tf.core.budget import fraction_budget_mb

    echo = echo or functools.partial(print, flush=True)
    total = (2 + rounds) * len(policies)
    echo(f"  plain TensorFlow, {total} steps on {BIG_DEVICE_MB} MiB ...")
    plain = bench.plain_run(model, batch, link, total, BIG_DEVICE_MB)
    if budget_mb is None:
        budget_mb = fraction_budget_mb(plain["persistent_bytes"], plain["peak_bytes"], fraction)
    clock = bench.link_clock(plain)
    echo(f"  {', '.join(policies)} in turn, {rounds} rounds, on {budget_mb} MiB ...")
    args = ["--model", model, "--batch", str(batch), "--budget-mb", str(budget_mb), "--policies", ",".join(policies),
            "--link", link, "--rounds", str(rounds)]
    if clock is not None:
        args += ["--link-clock-s", repr(clock)]
    run = run_worker("interleaved-worker", args, budget_mb)
    steps = len(run["losses_hex"])
    if steps == total:
        same_variables = run["variables_sha256"] == plain["variables_sha256"]
    else:  # a policy was left out: plain TensorFlow's run of as many steps as were taken has the variables to match
        echo(f"  plain TensorFlow again, {steps} steps (a policy was left out) ...")
        same_variables = run["variables_sha256"] == bench.plain_run(model, batch, link, steps,
                                                                  BIG_DEVICE_MB)["variables_sha256"]
    equal = run["losses_hex"] == plain["losses_hex"][:steps] and same_variables
    mine = run["per_policy"].get("capuchin", {}).get("median_step_s")
    capuchin_rounds = run["per_policy"].get("capuchin", {}).get("round_s", {})
    rows = []
    for policy in policies:
        p = run["per_policy"][policy]
        # Paired by round (every policy ran once in it): capuchin's step over this policy's, and in how many rounds
        # capuchin's was the faster.
        paired = [(capuchin_rounds[r], s) for r, s in p["round_s"].items() if r in capuchin_rounds]
        rows.append({"model": model, "batch": batch, "policy": policy, "budget_mb": budget_mb, "link": link,
                     "ok": p["ok"], "error": p["error"], "median_step_s": p["median_step_s"],
                     "vs_capuchin": p["median_step_s"] / mine if mine and p["median_step_s"] else None,
                     "rounds_paired": len(paired), "rounds_capuchin_faster": sum(c < s for c, s in paired),
                     "median_round_ratio": statistics.median(s / c for c, s in paired) if paired else None,
                     "plain_median_step_s": plain["median_step_s"], "steps": p["steps"],
                     "replans": p.get("replans"), "swapped_tensors": p.get("swapped_tensors"),
                     "recomputed_tensors": p.get("recomputed_tensors"), "plan_fallback": p.get("plan_fallback"),
                     "evicted_on_demand_bytes": max(p["evicted_on_demand_bytes"][1:], default=0),
                     "peak_bytes": p["peak_bytes"], "bitwise_equal": equal,
                     **_against_prediction(p, plain["median_step_s"])})
    return {"model": model, "batch": batch, "budget_mb": budget_mb, "link": link, "link_clock_s": clock,
            "rounds": rounds, "policies": policies, "steps": steps, "bitwise_equal": equal, "rows": rows,
            "plain": {k: plain[k] for k in ("median_step_s", "peak_bytes", "persistent_bytes", "losses_hex",
                                            "variables_sha256", "steal_share")},
            "run": run}


def _against_prediction(p: dict, plain_s: float | None) -> dict:
    """A policy's prediction beside its own steps in this process: its running plan's predicted ratio of the trace's
    step, in seconds of that trace (the measured step in this process, re-timed by its first guided step's kernels:
    bench.on_the_trace_clock) and times plain TensorFlow's step from its own process, each against the median of the
    plan's own steps here (`plan_median_step_s`). In one process every policy's trace and steps share the machine's
    spells, which fresh processes per policy do not (docs/decisions.md, "Predictions in one process"). Empty when
    the plan's own steps are fewer than two or there is no prediction."""
    prediction, measured = p.get("prediction"), p.get("plan_median_step_s")
    if not prediction or not measured or p.get("plan_steps", 0) < 2:
        return {}
    ratio = prediction["predicted_step_ratio"]
    out = {"plan_median_step_s": measured, "plan_steps": p["plan_steps"], "predicted_step_ratio": ratio,
           "predicted_peak_bytes": prediction.get("predicted_peak_bytes")}
    if plain_s:
        out.update(predicted_step_s=ratio * plain_s, step_prediction_error=measured / (ratio * plain_s) - 1.0)
    from capuchin_tf.cli import bench

    clock = bench.on_the_trace_clock(prediction, measured, plain_s or 0.0)
    out.update({k: clock[k] for k in ("trace_step_s", "predicted_trace_clock_s", "step_prediction_error_trace_clock")
                if k in clock})
    return out


def _prediction_cell(r: dict) -> str:
    if "predicted_step_ratio" not in r:
        return "-"
    cell = f"{r['plan_median_step_s']:.3f} ({r['plan_steps']} steps)"
    if "predicted_trace_clock_s" in r:
        cell += f": {r['predicted_trace_clock_s']:.3f} ({r['step_prediction_error_trace_clock'] * 100:+.0f}%)"
    if "predicted_step_s" in r:
        cell += f", {r['predicted_step_s']:.3f} ({r['step_prediction_error'] * 100:+.0f}%)"
    return cell


def prediction_summary(rows: list[dict]) -> str:
    """How many policies' predictions are within the suite's tolerance of their plan's steps in this process, each
    way (the rows with a prediction beside at least two of the plan's own steps)."""
    from capuchin_tf.cli.suite import PREDICTION_TOLERANCE

    clocked = [r for r in rows if "step_prediction_error_trace_clock" in r]
    timed = [r for r in rows if "step_prediction_error" in r]
    near = sum(abs(r["step_prediction_error_trace_clock"]) <= PREDICTION_TOLERANCE for r in clocked)
    near_plain = sum(abs(r["step_prediction_error"]) <= PREDICTION_TOLERANCE for r in timed)
    return (f"Predicted against the plan's own steps in this process, within {PREDICTION_TOLERANCE:.0%}: {near} of "
            f"{len(clocked)} on the trace's clock, {near_plain} of {len(timed)} from plain TensorFlow's step (its own "
            "process).")


def table(rows: list[dict]) -> list[str]:
    """Markdown lines: each policy's median step and its ratio to capuchin's, per model (no TensorFlow)."""
    lines = ["| model | batch | budget MiB | policy | median step s | vs capuchin | by round: median ratio, capuchin "
             "faster | re-plans | evicted on demand MiB (most a step) | peak MiB | swapped / recomputed tensors | run "
             "bit for bit | its plan's steps s: predicted on the trace's clock (error), from plain's step (error) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = f"{r['median_step_s']:.3f}" if r["median_step_s"] else f"- ({r['error']})"
        ratio = f"{r['vs_capuchin']:.3f}" if r["vs_capuchin"] else "-"
        peak = f"{r['peak_bytes'] / MiB:.1f}" if r["peak_bytes"] else "-"
        paired = (f"{r['median_round_ratio']:.3f}, {r['rounds_capuchin_faster']} of {r['rounds_paired']}"
                  if r.get("median_round_ratio") and r["policy"] != "capuchin" else "-")
        lines.append(f"| {r['model']} | {r['batch']} | {r['budget_mb']} | {r['policy']} | {step} | {ratio} | "
                     f"{paired} | "
                     f"{r['replans'] if r['replans'] is not None else '-'} | "
                     f"{r['evicted_on_demand_bytes'] / MiB:.1f} | {peak} | {r['swapped_tensors'] or 0} / "
                     f"{r['recomputed_tensors'] or 0} | {'yes' if r['bitwise_equal'] else 'NO'} | "
                     f"{_prediction_cell(r)} |")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--budget-mb", type=whole_mib, help="the budget and the device's size, MiB")
    which.add_argument("--transient-fraction", type=float,
                       help="budget = persistent + this fraction of plain TensorFlow's transient peak")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma-separated, capuchin first for the ratios (default {','.join(DEFAULT_POLICIES)}); "
                        f"policy+variant runs the policy with a variant's options (layout: planned_layout=True, "
                        "nolayout: False), e.g. capuchin,capuchin+layout")
    p.add_argument("--link", default="p100", help="link regime: native or p100 (default p100)")
    p.add_argument("--rounds", type=int, default=6, help="rounds after each policy's first two steps (default 6)")
    p.add_argument("--json", required=True, help="where to write the result")


def run(a: argparse.Namespace) -> int:
    from capuchin_tf.cli.common import git_commit
    from capuchin_tf.cli.models import MODELS
    from capuchin_tf.core.device_model import LINK_NAMES
    from capuchin_tf.policy import POLICIES

    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    try:
        bad = [p for p in policies if policy_variant(p)[0] not in POLICIES or policy_variant(p)[0] == "tf"]
    except ValueError as e:
        raise CliError(f"--policies: {e}") from None
    if not policies or bad:
        raise CliError(f"--policies takes capuchin_tf's policies (not tf: plain TensorFlow does not fit the budget), "
                       f"each optionally with a variant (policy+{'|'.join(VARIANTS)}); got {a.policies!r}; valid: "
                       f"{', '.join(sorted(set(POLICIES) - {'tf'}))}")
    if a.model not in MODELS:
        raise CliError(f"unknown model {a.model!r}; valid models: {', '.join(MODELS)}")
    if a.link not in LINK_NAMES:
        raise CliError(f"unknown link {a.link!r}; valid links: {', '.join(LINK_NAMES)}")
    if a.rounds < 1:
        raise CliError(f"--rounds must be at least 1, got {a.rounds}")
    if a.transient_fraction is not None and not 0.0 < a.transient_fraction <= 1.0:
        raise CliError(f"--transient-fraction must be in (0, 1], got {a.transient_fraction}")
    if not pathlib.Path(a.json).parent.is_dir():
        raise CliError(f"cannot write {a.json}: {pathlib.Path(a.json).parent} is not a directory")
    print(f"bench interleaved: {a.model}, batch {a.batch}, link {a.link} ...", flush=True)
    data = interleaved_point(a.model, a.batch, policies, a.link, a.rounds, budget_mb=a.budget_mb,
                             fraction=a.transient_fraction)
    import datetime

    data = {"commit": git_commit(), "date": datetime.date.today().isoformat(),
            "command": "python -m capuchin_tf bench interleaved " + " ".join(_argv_after("interleaved")), **data}
    pathlib.Path(a.json).write_text(json.dumps(data, indent=1))
    print("\n".join(table(data["rows"])))
    print(prediction_summary(data["rows"]))
    print(f"  every step bit for bit with plain TensorFlow's run of {data['steps']} steps: "
          f"{'yes' if data['bitwise_equal'] else 'NO'}; result written to {a.json}")
    return 0 if data["bitwise_equal"] else 1


def _argv_after(word: str) -> list[str]:
    import sys

    return sys.argv[sys.argv.index(word) + 1:] if word in sys.argv else []


register_subcommand("interleaved-worker", _add_worker_arguments, _run_worker, hidden=True,
                    help="(internal) the policies of `bench interleaved` in one fresh process")
