"""`python -m capuchin_tf bench`: training steps of a named model under a memory budget, measured (benchmarks.md).

    python -m capuchin_tf bench run --model cnn --batch 128 --budget-mb 117 --policy capuchin --steps 10
        [--link native|p100] --json out.json
    python -m capuchin_tf bench equal --model cnn --batch 128 (--budget-mb 117 | --transient-fraction 0.5)
        --policy capuchin --steps 5 [--link native|p100] [--device-mb 16384] --json out.json

`run` runs one configuration in a fresh process on a simulated device of --budget-mb MiB (design.md): the model's
training step wrapped in `capuchin_tf.function(memory_budget=budget, policy=..., link=...)`, called --steps times on
the model's synthetic batch (`--policy tf`: the plain `tf.function`, no decorator). It writes the measured peak,
persistent bytes, step times (median over the steps after the first, measured, one; and `settled_median_step_s`,
over the steps after the plan's last change, benchmarks.md's timing), losses, a digest of the variables, the plan's
counts and the run's metadata as JSON. Exit code 0 when every step ran, 1 on out of memory.

`equal` runs plain TensorFlow on a device of --device-mb MiB and the policy under --budget-mb MiB, each in its own
fresh process, on the same seed and data, and compares them bit for bit (losses and variables); it also writes
`throughput_ratio`, plain TensorFlow's settled median step time over the policy's. With
--transient-fraction F the budget is persistent + F x the plain run's transient peak (its largest step peak), rounded
up to a MiB (0.5: the protocol's "half the transient peak"). Exit code 0 when the budgeted run completed and is
bitwise equal to plain TensorFlow, 1 otherwise.

`maxbatch` finds the largest batch that runs under a budget (benchmarks.md): a batch runs when every step finished,
the peak stayed at or under the budget, and the last 3 steps ran without an out-of-memory error (guided or plain, no
retry, no passive-mode rescue). It doubles the batch from --start until a batch fails (or --max-batch), then bisects
down to --resolution; each trial is a `run` in a fresh process, and every trial is written to the JSON.

    python -m capuchin_tf bench maxbatch --model resnet50 --budget-mb 566 --policy capuchin --start 64
        [--max-batch 1024] [--resolution 8] [--steps 6] [--link native|p100] --json out.json

`zoo` runs the conformance zoo (capuchin_tf/zoo.py, docs/zoo.md): each case plain on a 16 GiB device, then under
`capuchin_tf.function` at persistent + --fraction x its transient peak on a device of that budget and of twice it,
each run a worker in a fresh process (killed after --timeout s), compared bit for bit and classified. Exit code 0
when no run is a mismatch or a crash.

    python -m capuchin_tf bench zoo [--cases NAME,...|--ci|--list] [--steps 5] [--fraction 0.5] [--timeout 900]
        [--json docs/results/zoo.json] [--markdown docs/zoo.md] [--keep-failures DIR]

`predictions` reads suite runs (their throughput points) and prints, per policy, the measured step beside the
planner's prediction two ways (against_prediction, on_the_trace_clock) and how many are within 15% each way; it runs
nothing.

    python -m capuchin_tf bench predictions docs/results/suite-DATE-quick-p100 [more suite directories or point
        JSONs] [--json out.json]

Budgets are MiB (2^20 bytes); a user mistake is exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys

from capuchin_tf.cli import host_store_bench, planner_bench
from capuchin_tf.cli.common import (
    SIZE_HELP,
    CliError,
    git_commit,
    machine,
    register_subcommand,
    run_worker,
    steal_s,
    whole_mib,
)
from capuchin_tf.core.budget import MiB, fraction_budget_mb
from capuchin_tf.core.device_model import LINK_NAMES
from capuchin_tf.tf.simulated_device import DEVICE

DEFAULT_DEVICE_MB = 16384
PLAN_COUNTS = ("swapped_tensors", "swapped_bytes", "recomputed_tensors", "recomputed_bytes", "replans", "settled")


# ---- the worker (runs inside the fresh process) ----------------------------------------------------------------------
def _add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--budget-mb", type=whole_mib, required=True)
    p.add_argument("--policy", required=True)
    p.add_argument("--link", required=True)
    p.add_argument("--link-clock-s", type=float, default=None,
                   help="p100: a plain step's time, which fixes the emulated link's rate (Options.link_clock_s)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--curve", help="write the last step's device-memory curve (JSON [[s, bytes], ...]) there (that "
                                   "step, under a memory callback, is left out of the medians)")
    p.add_argument("--stop-on-rescue", action="store_true",
                   help="stop at the first step that passive mode had to rescue (maxbatch: that batch does not run)")
    p.add_argument("--device-mb", type=whole_mib, default=None,
                   help="the simulated device's size, MiB, recorded (the parent sets it in the environment; default: "
                        "--budget-mb)")
    p.add_argument("--save-initial-values", metavar="PATH",
                   help="write the initial values of the model's Keras variables, as built, there (bench zoo: the "
                        "plain run)")
    p.add_argument("--load-initial-values", metavar="PATH",
                   help="build the model's Keras variables from the initial values written there by "
                        "--save-initial-values instead of running their initializers on the device (bench zoo: the "
                        "decorated runs, so that the initializers' temporaries do not decide whether the model builds "
                        "on a device of the budget's size)")
    p.add_argument("--record-errors", action="store_true",
                   help="record any error of the build or a step in the result (error_type, error, traceback) "
                        "instead of failing the process (bench zoo)")


def _run_worker(a: argparse.Namespace) -> int:
    import datetime
    import pickle
    import time
    import traceback
    import warnings

    import numpy as np
    import tensorflow as tf

    import capuchin_tf  # installs the allocator wrapper before the first op (the `tf` baseline runs through it too)
    from capuchin_tf.cli import models
    from capuchin_tf.frontend import decorator
    from capuchin_tf.runtime.errors import oom_line

    def error_line(e: Exception) -> str:
        return f"{type(e).__name__}: {oom_line(e)}"

    # capuchin_tf says with a RuntimeWarning "capuchin_tf: ..." when it leaves a step to plain TensorFlow: record
    # every such warning (and show it), whatever the warning filters would do with a repeated one.
    capuchin_warnings: list[str] = []
    show = warnings.showwarning

    def record_warning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if issubclass(category, RuntimeWarning) and text.startswith("capuchin_tf:"):
            capuchin_warnings.append(text)
            print(f"  warning: {text}", flush=True)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = record_warning
    warnings.filterwarnings("always", message="capuchin_tf:", category=RuntimeWarning)
    recorded = (Exception,) if a.record_errors else (tf.errors.ResourceExhaustedError, capuchin_tf.CapuchinError)

    def record_error(e: Exception) -> None:
        result.update(ok=False, error=error_line(e), error_type=type(e).__name__,
                      error_traceback=traceback.format_exc()[-6000:])
        if isinstance(e, capuchin_tf.CapuchinError):
            result["capuchin_error"] = str(e)

    budget = a.budget_mb * MiB
    device_mb = a.budget_mb if a.device_mb is None else a.device_mb
    result: dict = {
        "model": a.model, "batch": a.batch, "policy": a.policy, "link": a.link, "link_clock_s": a.link_clock_s,
        "steps": a.steps, "budget_mb": a.budget_mb, "budget_bytes": budget, "device_mb": device_mb,
        "device_limit_bytes": int(capuchin_tf.allocator_stats()["bytes_limit"]), "tf_version": tf.__version__,
        "capuchin_tf_version": capuchin_tf.__version__, "date": datetime.date.today().isoformat(),
        "machine": machine(), "ok": True, "error": None, "persistent_bytes": None, "peak_bytes": None,
        "step_peak_bytes": [], "step_s": [], "step_steal_s": [], "steal_share": None, "curve_step": None,
        "phases": [], "late_prefetches": [], "retries": [], "lowered_budget_bytes": [], "losses": [],
        "median_step_s": None, "samples_per_s": None, "swapped_tensors": 0, "swapped_bytes": 0,
        "recomputed_tensors": 0, "recomputed_bytes": 0, "replans": 0, "settled": None, "report": None,
        "settled_steps": 0, "settled_median_step_s": None, "settled_peak_bytes": None, "plan_steps": 0,
        "plan_median_step_s": None, "plan_peak_bytes": None, "predicted_plan_ran": None, "error_type": None,
        "error_traceback": None,
        "capuchin_error": None, "capuchin_warnings": capuchin_warnings,
    }
    try:
        load = None
        if a.load_initial_values:
            with open(a.load_initial_values, "rb") as f:
                load = pickle.load(f)
        with models.initial_values(load) as made:
            setup = models.build(a.model, a.batch)
        if a.save_initial_values:
            with open(a.save_initial_values, "wb") as f:
                pickle.dump([np.asarray(v.numpy()) for v in made], f, protocol=pickle.HIGHEST_PROTOCOL)
    except tf.errors.ResourceExhaustedError as e:
        record_error(e)
        result.update(error=f"the model does not build on this device: {error_line(e)}", losses_hex=[],
                      variables_sha256=None)
        pathlib.Path(a.result).write_text(json.dumps(result, indent=1))
        return 0
    except recorded as e:
        record_error(e)
        result.update(error=f"the model does not build: {error_line(e)}", losses_hex=[], variables_sha256=None)
        pathlib.Path(a.result).write_text(json.dumps(result, indent=1))
        return 0
    result["model_info"] = setup.info
    result["persistent_bytes"] = tf.config.experimental.get_memory_info(DEVICE)["current"]
    managed = None
    if a.policy != "tf":
        try:
            # CAPUCHIN_TF_VERBOSE=1: the decorator says what it does (plans, retries, passive rescues) as it goes.
            # --stop-on-rescue: a step passive mode would have to rescue ends the run at once.
            # CAPUCHIN_TF_BACKGROUND_BUILDS=0: plan changes are built in the step that asks (for comparisons).
            # CAPUCHIN_TF_PLANNED_LAYOUT=1 / 0: guided steps allocate by the planned layout always / never (for
            # comparisons; unset: "auto", Options.planned_layout).
            # CAPUCHIN_TF_KEEP_FAILURES=DIR: a planning failure's trace and error are kept there (Options).
            layout = {"": "auto", "auto": "auto", "0": False}.get(os.environ.get("CAPUCHIN_TF_PLANNED_LAYOUT", ""),
                                                                    True)
            options = decorator.make_options(budget, policy=a.policy, link=a.link, link_clock_s=a.link_clock_s,
                                             passive_rescue=not a.stop_on_rescue,
                                             background_builds=os.environ.get("CAPUCHIN_TF_BACKGROUND_BUILDS",
                                                                              "1") != "0",
                                             planned_layout=layout,
                                             verbose=os.environ.get("CAPUCHIN_TF_VERBOSE", "") not in ("", "0"),
                                             keep_failures=os.environ.get("CAPUCHIN_TF_KEEP_FAILURES") or None)
            managed = decorator.wrap_step(setup.train_step, options)
        except recorded as e:
            record_error(e)
            result.update(losses_hex=[], variables_sha256=setup.variables_sha256())
            pathlib.Path(a.result).write_text(json.dumps(result, indent=1))
            return 0
    step = setup.train_step if managed is None else managed
    try:
        for i in range(a.steps):
            tf.config.experimental.reset_memory_stats(DEVICE)
            stolen = steal_s()
            t0 = time.perf_counter()
            if a.curve and i == a.steps - 1:
                from capuchin_tf.tf.measure import memory_curve

                loss, curve = memory_curve(lambda: step(*setup.inputs))
                pathlib.Path(a.curve).write_text(json.dumps(curve))
            else:
                loss = step(*setup.inputs)
            seconds = time.perf_counter() - t0
            if stolen is not None:
                result["step_steal_s"].append(steal_s() - stolen)
            peak = tf.config.experimental.get_memory_info(DEVICE)["peak"]
            record = next(iter(managed.report().values()))["steps"][-1] if managed is not None else None
            phase, late = (record["phase"], record["late_prefetches"]) if record else ("plain", 0)
            evicted = record.get("passive_evicted_bytes", 0) if record and phase == "guided" else 0
            result["losses"].append(float(loss))
            result["step_s"].append(seconds)
            result["step_peak_bytes"].append(peak)
            result["phases"].append(phase)
            result["late_prefetches"].append(late)
            result["retries"].append(record["retried"] if record else 0)
            lowered = record.get("lowered_budget_bytes", 0) if record else 0  # the measured step's retry's budget
            result["lowered_budget_bytes"].append(lowered)
            print(f"  step {i + 1}/{a.steps} ({phase}): {seconds:.2f} s, peak {peak / MiB:.1f} MiB"
                  + (f", run again under {lowered / MiB:.1f} MiB after split free memory" if lowered else "")
                  + (f", {late} late prefetches" if late else "")
                  + (f", {evicted / MiB:.1f} MiB evicted on demand" if evicted else ""), flush=True)
    except recorded as e:
        record_error(e)
        print(f"  step {len(result['losses']) + 1}/{a.steps}: {result['error']}", flush=True)
    if result["step_peak_bytes"]:
        result["peak_bytes"] = max(result["step_peak_bytes"])
    # The step whose memory curve is recorded (--curve, the last) runs under a memory callback: it is not timed.
    if a.curve and len(result["step_s"]) == a.steps:
        result["curve_step"] = a.steps - 1
    timed = [i for i in range(len(result["step_s"])) if i != result["curve_step"]]
    result["steal_share"] = steal_share(result)
    if len(timed) > 1:
        result["median_step_s"] = statistics.median(result["step_s"][i] for i in timed[1:])
        result["samples_per_s"] = a.batch / result["median_step_s"]
    if managed is not None and managed.report():
        result["report"] = next(iter(managed.report().values()))
        result.update({k: result["report"][k] for k in PLAN_COUNTS})
        # benchmarks.md times steps after the plan settled: the steps after the last plan change or retry, less the
        # first of them (it instantiates the rewritten step), at least 3 of them. A step that ran while a plan change
        # was built in the background is no settled step either (the plan is about to change).
        steps = result["report"]["steps"][:len(result["step_s"])]
        changed = [i for i, r in enumerate(steps) if r["plan_changed"] or r["retried"] or r["phase"] == "measured"
                   or r.get("building")]
        first = changed[-1] + 2 if changed else 1
        after = [result["step_s"][i] for i in timed if i >= first]
        result["settled_steps"] = len(after)
        result["settled_median_step_s"] = statistics.median(after) if len(after) >= 3 else None
        result["settled_peak_bytes"] = max(result["step_peak_bytes"][first:], default=None)
        # The running plan's own steps: after its change (less the one that instantiated it), none beside a build
        # (StepRecord.building: no measurement of its plan); what against_prediction sets beside the plan's prediction
        # where the run has too few settled steps.
        own = [i for i in plan_step_indices(steps) if i in timed]
        # Whether any step ran the plan the report predicts (a plan changed at the last step never ran).
        result["predicted_plan_ran"] = not (steps and (steps[-1]["plan_changed"] or steps[-1]["phase"] == "measured"))
        result["plan_steps"] = len(own)
        result["plan_median_step_s"] = statistics.median(result["step_s"][i] for i in own) if len(own) >= 2 else None
        result["plan_peak_bytes"] = max((result["step_peak_bytes"][i] for i in own), default=None)
    elif len(timed) >= 4:
        result["settled_steps"] = len(timed) - 1
        result["settled_median_step_s"] = statistics.median(result["step_s"][i] for i in timed[1:])
    result.update(losses_hex=[float.hex(x) for x in result["losses"]], variables_sha256=setup.variables_sha256())
    pathlib.Path(a.result).write_text(json.dumps(result, indent=1))
    return 0


# ---- bench run / bench equal -----------------------------------------------------------------------------------------
def _add_common_arguments(p: argparse.ArgumentParser, fraction: bool = False) -> None:
    p.add_argument("--model", required=True, help="a model name (python -c 'from capuchin_tf.cli import models; "
                                                    "print(models.describe())')")
    p.add_argument("--batch", type=int, required=True)
    if fraction:
        budget = p.add_mutually_exclusive_group(required=True)
        budget.add_argument("--budget-mb", type=whole_mib, help=f"device memory and budget: {SIZE_HELP}")
        budget.add_argument("--transient-fraction", type=float,
                            help="budget as persistent + this fraction of the plain run's transient peak (0.5: the "
                                 "protocol's 'half the transient peak'), rounded up to a MiB")
    else:
        p.add_argument("--budget-mb", type=whole_mib, required=True, help=f"device memory and budget: {SIZE_HELP}")
    p.add_argument("--policy", required=True, help="a registered policy (capuchin, swap-only, recompute-only, "
                                                   "swap-all, checkpoint) or tf (plain TensorFlow, no decorator)")
    p.add_argument("--steps", type=int, required=True, help="training steps (the first is the measured one)")
    p.add_argument("--link", default="native", help="link regime: native or p100 (default native)")
    p.add_argument("--json", required=True, help="where to write the result")


def batch_runs(r: dict, budget_bytes: int, clean_steps: int = 3) -> bool:
    """benchmarks.md: a batch runs when the steps finished under the budget and the last `clean_steps` ran without
    an out-of-memory error (not a retry, not a step rescued by passive mode)."""
    if not r["ok"] or r["peak_bytes"] is None or r["peak_bytes"] > budget_bytes or len(r["phases"]) < clean_steps + 1:
        return False
    tail = list(zip(r["phases"], r["retries"]))[-clean_steps:]
    return all(phase in ("guided", "plain") and retries == 0 for phase, retries in tail)


def run_maxbatch(a: argparse.Namespace) -> int:
    """The largest batch that runs (benchmarks.md): doubling from --start, then bisecting; every trial written to
    --json as it ends. Exit code 0 when the start batch runs."""
    if a.start < 1 or a.max_batch < a.start or a.resolution < 1:
        raise CliError("need 1 <= --start <= --max-batch and --resolution >= 1")
    if a.steps < 4:
        raise CliError("--steps must be at least 4 (the measured step and 3 clean steps)")
    budget = a.budget_mb * MiB
    trials: list[dict] = []
    data = {"model": a.model, "policy": a.policy, "link": a.link, "budget_mb": a.budget_mb, "budget_bytes": budget,
            "steps": a.steps, "start": a.start, "max_batch": a.max_batch, "resolution": a.resolution,
            "max_batch_found": None, "first_failing_batch": None, "trials": trials}

    def trial(batch: int) -> bool:
        print(f"  batch {batch}: {a.steps} steps ...", flush=True)
        args = ["--model", a.model, "--batch", str(batch), "--budget-mb", str(a.budget_mb), "--policy", a.policy,
                "--link", a.link, "--steps", str(a.steps), "--stop-on-rescue"]
        r = run_worker("bench-worker", args, a.budget_mb)
        runs = batch_runs(r, budget)
        r.pop("report", None)
        trials.append({"batch": batch, "runs": runs, **{k: r.get(k) for k in (
            "ok", "error", "peak_bytes", "persistent_bytes", "phases", "retries", "step_s", "step_peak_bytes",
            "median_step_s", "samples_per_s", "swapped_tensors", "swapped_bytes", "recomputed_tensors",
            "recomputed_bytes", "replans", "date", "machine", "tf_version")}})
        print(f"  batch {batch}: {'runs' if runs else 'does not run'} ({_summary(r)})", flush=True)
        _write(a.json, data)
        return runs

    lo, hi = None, None
    batch = a.start
    while batch <= a.max_batch:
        if trial(batch):
            lo = batch
            batch *= 2
        else:
            hi = batch
            break
    if lo is not None and hi is None and lo < a.max_batch and lo * 2 > a.max_batch:
        if trial(a.max_batch):
            lo = a.max_batch
        else:
            hi = a.max_batch
    while lo is not None and hi is not None and hi - lo > a.resolution:
        mid = (lo + hi) // 2
        if trial(mid):
            lo = mid
        else:
            hi = mid
    data.update(max_batch_found=lo, first_failing_batch=hi)
    _write(a.json, data)
    found = "none (the start batch does not run)" if lo is None else str(lo)
    print(f"{a.model}, policy {a.policy}, link {a.link}, {a.budget_mb} MiB: largest batch that runs {found}"
          + (f"; batch {hi} does not" if hi is not None else f" (the search stopped at --max-batch {a.max_batch})"))
    print(f"  result written to {a.json}")
    return 0 if lo is not None else 1


def _add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    run = sub.add_parser("run", help="one configuration in a fresh process")
    _add_common_arguments(run)
    run.add_argument("--curve", help="also write the last step's device-memory curve there (JSON [[s, bytes], ...]); "
                                     "that step is left out of the medians")
    equal = sub.add_parser("equal", help="plain TensorFlow with enough memory against the policy under the budget")
    _add_common_arguments(equal, fraction=True)
    equal.add_argument("--device-mb", type=whole_mib, default=DEFAULT_DEVICE_MB,
                       help=f"device memory of the plain run, MiB (default {DEFAULT_DEVICE_MB})")
    host_store_bench.add_arguments(sub.add_parser(
        "host-store", help="the host store's copy throughput and the link emulation's accuracy"))
    planner_bench.add_table_arguments(sub.add_parser(
        "plan-table", help="the planner alone: predicted peak and step time per policy on recorded traces"))
    planner_bench.add_speed_arguments(sub.add_parser(
        "plan-speed", help="the planner alone: planning time per policy on a BERT-base-sized synthetic trace"))
    maxbatch = sub.add_parser("maxbatch", help="the largest batch that runs under the budget")
    maxbatch.add_argument("--model", required=True)
    maxbatch.add_argument("--budget-mb", type=whole_mib, required=True, help=f"device memory and budget: {SIZE_HELP}")
    maxbatch.add_argument("--policy", required=True)
    maxbatch.add_argument("--link", default="native", help="link regime: native or p100 (default native)")
    maxbatch.add_argument("--start", type=int, required=True, help="the first batch tried")
    maxbatch.add_argument("--max-batch", type=int, default=4096, help="the largest batch tried (default 4096)")
    maxbatch.add_argument("--resolution", type=int, default=8,
                          help="stop bisecting when the runs/does-not-run gap is this small (default 8)")
    maxbatch.add_argument("--steps", type=int, default=6, help="steps per trial (default 6; the last 3 must be "
                                                                "clean)")
    maxbatch.add_argument("--json", required=True, help="where to write the result")
    from capuchin_tf.cli import interleaved, suite

    predictions = sub.add_parser(
        "predictions", help="the planner's predicted step against the measured one, per policy, from suite runs "
                            "(two ways: against plain TensorFlow's step and on the trace's own clock)")
    predictions.add_argument("paths", nargs="+", metavar="PATH", help="suite directories (their throughput-*.json) "
                                                                      "or point JSONs")
    predictions.add_argument("--json", help="also write the rows here")
    interleaved.add_arguments(sub.add_parser(
        "interleaved", help="policies in turn in one fresh process on a device of the budget's size, every step bit "
                            "for bit with plain TensorFlow: their steps without the spread between processes"))
    suite.add_arguments(sub.add_parser(
        "suite", help="the paper's tables: throughput per policy at one budget, the largest batch per policy, the "
                      "decorator at plain TensorFlow's largest batch; fresh process and bit check per point"))
    zoo = sub.add_parser("zoo", help="the conformance zoo: each case plain, then decorated at persistent + fraction x "
                                     "transient peak on a device of the budget and of twice it, bit for bit "
                                     "(docs/zoo.md)")
    which = zoo.add_mutually_exclusive_group()
    which.add_argument("--cases", help="comma-separated case names or groups (applications, layers, setups, tiers); "
                                       "default: every case")
    which.add_argument("--ci", action="store_true", help="the fast cases CI runs (tests/test_zoo.py)")
    which.add_argument("--list", action="store_true", help="print the cases and exit")
    which.add_argument("--table-from", metavar="JSON", help="run nothing: classify the runs of this zoo JSON again "
                                                            "and write the table (--markdown) and the JSON (--json)")
    zoo.add_argument("--steps", type=int, default=5, help="steps per run (default 5; the first is the measured one)")
    zoo.add_argument("--fraction", type=float, default=0.5,
                     help="budget = persistent + this fraction of the plain transient peak (default 0.5)")
    zoo.add_argument("--timeout", type=float, default=900.0,
                     help="seconds per process before it is killed and the run counted a crash (default 900)")
    zoo.add_argument("--json", help="write the results here (after every case)")
    zoo.add_argument("--markdown", help="write the table into this file, between its zoo-table markers "
                                        "(docs/zoo.md)")
    zoo.add_argument("--keep-failures", metavar="DIR",
                     help="keep each planning failure's trace and error in DIR/CASE-budget|double/ (default: "
                          "JSON.failures/ beside --json; `python -m capuchin_tf plan --replay` plans one again)")


def _validate(a: argparse.Namespace) -> None:
    from capuchin_tf.policy import POLICIES

    if a.batch < 1:
        raise CliError(f"--batch must be at least 1, got {a.batch}")
    if a.budget_mb is not None and a.budget_mb < 1:
        raise CliError(f"--budget-mb must be at least 1, got {a.budget_mb}")
    fraction = getattr(a, "transient_fraction", None)
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise CliError(f"--transient-fraction must be in (0, 1], got {fraction}")
    if a.steps < 1:
        raise CliError(f"--steps must be at least 1, got {a.steps}")
    if getattr(a, "device_mb", 1) < 1:
        raise CliError(f"--device-mb must be at least 1, got {a.device_mb}")
    policies = sorted({*POLICIES, "tf"})
    if a.policy not in policies:
        raise CliError(f"unknown policy {a.policy!r}; valid policies: {', '.join(policies)}")
    if a.link not in LINK_NAMES:
        raise CliError(f"unknown link {a.link!r}; valid links: {', '.join(LINK_NAMES)}")
    if not pathlib.Path(a.json).parent.is_dir():
        raise CliError(f"cannot write {a.json}: {pathlib.Path(a.json).parent} is not a directory")
    from capuchin_tf.cli.models import MODELS
    from capuchin_tf.cli.zoo import is_zoo_model

    if a.model not in MODELS and not is_zoo_model(a.model):
        raise CliError(f"unknown model {a.model!r}; valid models: {', '.join(MODELS)} (and the zoo's cases: "
                       "python -m capuchin_tf bench zoo --list)")


def _worker_args(a: argparse.Namespace, policy: str, budget_mb: int) -> list[str]:
    return ["--model", a.model, "--batch", str(a.batch), "--budget-mb", str(budget_mb), "--policy", policy,
            "--link", a.link, "--steps", str(a.steps)]


# A timed run whose steps lost more than STEAL_LIMIT of the machine's CPU time to the hypervisor (steal_share) is run
# again, up to STEAL_RERUNS more times, and the run that lost least is kept (every run's figures recorded in
# `steal_runs`): on the 2 shared cores, a run that lost 16% of the CPU ran its steps 60% slower than one that lost
# 1%, the same plan (docs/decisions.md, "Timed runs record what the hypervisor took").
STEAL_LIMIT = 0.03
STEAL_RERUNS = 2


def timed_worker(args: list[str], limit_mb: int, echo=None) -> dict:
    """`bench-worker` with `args` in a fresh process on a device of `limit_mb` MiB (common.run_worker), run again
    while the hypervisor took more than STEAL_LIMIT of the machine during its timed steps (see there)."""
    echo = echo or functools.partial(print, flush=True)
    runs = []
    while True:
        r = run_worker("bench-worker", args, limit_mb)
        runs.append(r)
        share = r.get("steal_share")
        if not r["ok"] or share is None or share <= STEAL_LIMIT or len(runs) > STEAL_RERUNS:
            break
        echo(f"  the hypervisor took {share:.0%} of the machine's CPU time during the timed steps (over "
             f"{STEAL_LIMIT:.0%}): the same run again")
    kept = min((r for r in runs if r["ok"]), key=lambda r: r.get("steal_share") or 0.0, default=runs[-1])
    kept["steal_runs"] = [{"steal_share": r.get("steal_share"), "median_step_s": r.get("median_step_s"),
                           "settled_median_step_s": r.get("settled_median_step_s"), "ok": r["ok"],
                           "kept": r is kept} for r in runs]
    return kept


def steal_share(r: dict) -> float | None:
    """The share of the machine's CPU time the hypervisor took from this machine (common.steal_s) during the timed
    steps (every step after the first), all cores together; None where the kernel does not say."""
    stolen, seconds = r.get("step_steal_s") or [], r.get("step_s") or []
    timed = [i for i in range(1, len(seconds)) if i != r.get("curve_step")]
    if len(stolen) != len(seconds) or not timed or sum(seconds[i] for i in timed) <= 0:
        return None
    return sum(stolen[i] for i in timed) / (sum(seconds[i] for i in timed) * (os.cpu_count() or 1))


def timing(plain: dict, managed: dict) -> dict:
    """`managed`'s times against plain TensorFlow's (`plain`, measured in the same run): throughput over the settled
    steps and over every step after the measured one (re-plans included), and against_prediction's figures."""
    def ratio(key: str) -> float | None:
        return plain[key] / managed[key] if plain.get(key) and managed.get(key) else None

    return {"plain_median_step_s": plain["median_step_s"],
            "plain_settled_median_step_s": plain["settled_median_step_s"],
            "throughput_ratio": ratio("settled_median_step_s"), "guided_throughput_ratio": ratio("median_step_s"),
            **against_prediction(plain, managed)}


def plan_step_indices(steps: list[dict]) -> list[int]:
    """Positions, in a report's step records, of the running plan's own steps: guided, after the step that changed
    the plan (or was retried, or measured) less the one after it (it instantiated the plan), none beside a build."""
    last = max((i for i, r in enumerate(steps) if r["plan_changed"] or r["retried"] or r["phase"] == "measured"),
               default=-1)
    return [i for i in range(last + 2, len(steps)) if steps[i]["phase"] == "guided" and not steps[i].get("building")]


def against_prediction(plain: dict, managed: dict) -> dict:
    """The policy's settled step and peak beside what its planner predicted (the plan's ratios of the trace's step,
    times plain TensorFlow's settled step measured in the same run), and beside the plan's lower bound
    (simulator.lower_bound_s): `overhead_vs_lower_bound` is what the schedule and the implementation cost beyond what
    the decisions must. Timed over the settled steps; where there are too few of them, over the running plan's own
    steps (`plan_median_step_s`: none beside a build, at least 2), else over every step after the measured one
    (`prediction_timed_over`); where the plan predicted never ran (changed at the last step), the prediction alone.
    Empty for plain TensorFlow."""
    prediction = (managed.get("report") or {}).get("prediction")
    if prediction and managed.get("predicted_plan_ran") is False:
        # No step ran the plan predicted: nothing measured to set beside it.
        return {"prediction_timed_over": "none: the plan predicted never ran",
                "predicted_step_ratio": prediction["predicted_step_ratio"],
                "simulated_step_ratio": prediction.get("simulated_step_ratio"),
                "lower_bound_ratio": prediction["lower_bound_ratio"],
                "predicted_peak_bytes": prediction["predicted_peak_bytes"]}
    if managed.get("settled_median_step_s"):
        timed, key, plain_key, peak = ("settled", "settled_median_step_s", "settled_median_step_s",
                                       managed.get("settled_peak_bytes"))
    elif managed.get("plan_median_step_s"):
        timed, key, plain_key, peak = ("the plan's own steps", "plan_median_step_s", "settled_median_step_s",
                                       managed.get("plan_peak_bytes"))
    else:
        timed, key, plain_key, peak = ("after the measured step", "median_step_s", "median_step_s",
                                       max(managed.get("step_peak_bytes", [])[1:], default=None))
    plain_s, step_s = plain.get(plain_key), managed.get(key)
    if not prediction or not plain_s or not step_s:
        return {}
    predicted_s = plain_s * prediction["predicted_step_ratio"]
    bound_s = plain_s * prediction["lower_bound_ratio"]
    return {
        **on_the_trace_clock(prediction, step_s, plain_s),
        "prediction_timed_over": timed,
        "measured_step_ratio": step_s / plain_s,
        "predicted_step_ratio": prediction["predicted_step_ratio"],
        # the simulator's step alone, and the bytes moved on demand that the prediction adds (Plan.prediction)
        "simulated_step_ratio": prediction.get("simulated_step_ratio"),
        "on_demand_bytes": prediction.get("on_demand_bytes"),
        "on_demand_from": prediction.get("on_demand_from"),
        "predicted_step_s": predicted_s,
        "step_prediction_error": step_s / predicted_s - 1.0,
        "lower_bound_ratio": prediction["lower_bound_ratio"],
        "lower_bound_s": bound_s,
        "overhead_vs_lower_bound": step_s / bound_s,
        "predicted_peak_bytes": prediction["predicted_peak_bytes"],
        "settled_peak_bytes": peak,
        "peak_prediction_error": peak / prediction["predicted_peak_bytes"] - 1.0 if peak else None,
    }


def on_the_trace_clock(prediction: dict, step_s: float, plain_s: float) -> dict:
    """The planner's prediction in its own seconds beside the measured step: the running plan's predicted ratio times
    the step of the trace it was simulated on (`trace_step_s`: the measured step's ops, re-timed by the first guided
    step's kernels where the run has feedback; the policy's own process). `step_prediction_error` sets the ratio
    beside plain TensorFlow's step measured in another process; the two differ by `trace_clock_ratio` (the trace's
    step over plain's), which is not the schedule's error but how much slower the plan's own kernels ran in that
    process, under the profiler, than plain's did in its own (docs/decisions.md, "Predictions on the trace's clock").
    Empty without a trace step."""
    trace_s = prediction.get("trace_step_s")
    if not trace_s or not step_s or not plain_s:
        return {}
    predicted_s = trace_s * prediction["predicted_step_ratio"]
    return {"measured_step_s": step_s, "trace_step_s": trace_s, "trace_clock_ratio": trace_s / plain_s,
            "predicted_trace_clock_s": predicted_s, "step_prediction_error_trace_clock": step_s / predicted_s - 1.0}


def prediction_line(c: dict) -> str:
    """One line of `against_prediction`'s figures."""
    if "step_prediction_error" not in c:  # no step ran the plan predicted
        return f"step predicted {c['predicted_step_ratio']:.2f}x plain (lower bound {c['lower_bound_ratio']:.2f}x)"
    moved = ""
    if c.get("on_demand_bytes"):
        moved = (f", with {c['on_demand_bytes'] / MiB:.1f} MiB a step moved on demand ({c['on_demand_from']}; "
                 f"the simulator alone {c['simulated_step_ratio']:.2f}x)")
    line = (f"step {c['measured_step_ratio']:.2f}x plain (predicted {c['predicted_step_ratio']:.2f}x{moved}, "
            f"{c['step_prediction_error'] * 100:+.0f}%; lower bound {c['lower_bound_ratio']:.2f}x, measured "
            f"{c['overhead_vs_lower_bound']:.2f}x the bound)")
    if "step_prediction_error_trace_clock" in c:
        line += (f"; on the trace's clock {c['predicted_trace_clock_s']:.3f} s predicted, "
                 f"{c['step_prediction_error_trace_clock'] * 100:+.0f}% (the trace's step "
                 f"{c['trace_clock_ratio']:.2f}x plain's)")
    if c["settled_peak_bytes"]:
        line += (f"; peak {c['settled_peak_bytes'] / MiB:.1f} MiB (predicted {c['predicted_peak_bytes'] / MiB:.1f} "
                 f"MiB, {c['peak_prediction_error'] * 100:+.0f}%)")
    return line


def _write(path: str, data: dict) -> None:
    """Writes a bench result, stamped with the commit it was measured on (common.git_commit)."""
    data = {"commit": git_commit(), **data}
    try:
        pathlib.Path(path).write_text(json.dumps(data, indent=1))
    except OSError as e:
        raise CliError(f"cannot write {path}: {e}") from None


def _summary(r: dict) -> str:
    if not r["ok"]:
        return f"failed ({len(r['losses'])} of {r['steps']} steps done): {r['error']}"
    peak = f"peak {r['peak_bytes'] / MiB:.1f} MiB of {r['budget_bytes'] / MiB:.0f} MiB"
    speed = (f"median step {r['median_step_s']:.3f} s ({r['samples_per_s']:.1f} samples/s)"
             if r["median_step_s"] is not None else "no step after the measured one to time")
    plan = "plain TensorFlow, no plan" if r["policy"] == "tf" else (
        f"swapped {r['swapped_tensors']} tensors ({r['swapped_bytes'] / MiB:.1f} MiB), recomputed "
        f"{r['recomputed_tensors']} ({r['recomputed_bytes'] / MiB:.1f} MiB), {r['replans']} re-plans, "
        f"{'settled' if r['settled'] else 'not settled'}")
    return f"{peak}, persistent {r['persistent_bytes'] / MiB:.1f} MiB; {speed}; {plan}"


def _zoo(a: argparse.Namespace) -> int:
    from capuchin_tf.cli import zoo

    if a.list:
        print(zoo.describe())
        return 0
    if a.table_from:
        try:
            data = zoo.reclassify(json.loads(pathlib.Path(a.table_from).read_text()))
        except (OSError, ValueError) as e:
            raise CliError(f"cannot read {a.table_from}: {e}") from None
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps(data, indent=1))
        if a.markdown:
            zoo.write_markdown(a.markdown, data)
        print(zoo.markdown_table(data))
        return 0
    if a.steps < 1:
        raise CliError(f"--steps must be at least 1, got {a.steps}")
    if not 0.0 < a.fraction <= 1.0:
        raise CliError(f"--fraction must be in (0, 1], got {a.fraction}")
    if a.timeout <= 0:
        raise CliError(f"--timeout must be positive, got {a.timeout}")
    for path in (a.json, a.markdown):
        if path and not pathlib.Path(path).parent.is_dir():
            raise CliError(f"cannot write {path}: {pathlib.Path(path).parent} is not a directory")
    try:
        cases = zoo.select(a.cases, a.ci)
    except ValueError as e:
        raise CliError(str(e)) from None
    if not cases:
        raise CliError("no case selected")
    arguments = " ".join(sys.argv[sys.argv.index("zoo") + 1:]) if "zoo" in sys.argv else ""
    print(f"bench zoo: {len(cases)} cases, {a.steps} steps per run, budget = persistent + {a.fraction:g} x transient "
          f"peak, timeout {a.timeout:g} s per process", flush=True)
    keep = a.keep_failures or (f"{a.json}.failures" if a.json else None)
    return zoo.run_zoo(cases, a.steps, a.fraction, a.json, a.markdown, a.timeout, arguments=arguments,
                       echo=lambda line: print(line, flush=True), keep_failures=keep)


def _run(a: argparse.Namespace) -> int:
    if a.action == "zoo":
        return _zoo(a)
    if a.action == "suite":
        from capuchin_tf.cli import suite

        return suite.run(a)
    if a.action == "interleaved":
        from capuchin_tf.cli import interleaved

        return interleaved.run(a)
    if a.action == "predictions":
        from capuchin_tf.cli import suite

        rows = suite.predictions(a.paths)
        if not rows:
            raise CliError("no throughput point that ran under " + ", ".join(a.paths))
        print("\n".join(suite.prediction_table(rows)))
        if a.json:
            _write(a.json, {"paths": a.paths, "tolerance": suite.PREDICTION_TOLERANCE, "rows": rows})
        return 0
    if a.action == "host-store":
        return host_store_bench.run(a)
    if a.action == "plan-table":
        return planner_bench.run_table(a)
    if a.action == "plan-speed":
        return planner_bench.run_speed(a)
    if a.action == "maxbatch":
        a.batch = a.start
        _validate(a)
        print(f"bench maxbatch: {a.model}, policy {a.policy}, link {a.link}, {a.budget_mb} MiB device ...", flush=True)
        return run_maxbatch(a)
    _validate(a)
    what = f"{a.model}, batch {a.batch}, policy {a.policy}, link {a.link}"
    if a.action == "run":
        print(f"bench run: {what}, {a.budget_mb} MiB device, steps: {a.steps} ...", flush=True)
        extra = ["--curve", a.curve] if getattr(a, "curve", None) else []
        result = timed_worker(_worker_args(a, a.policy, a.budget_mb) + extra, a.budget_mb)
        _write(a.json, result)
        print(f"{what}: {_summary(result)}")
        print(f"  result written to {a.json}")
        return 0 if result["ok"] else 1

    print(f"[1/2] plain TensorFlow, {a.device_mb} MiB device, steps: {a.steps} ...", flush=True)
    plain = plain_run(a.model, a.batch, a.link, a.steps, a.device_mb)
    if a.transient_fraction is not None:
        a.budget_mb = fraction_budget_mb(plain["persistent_bytes"], plain["peak_bytes"], a.transient_fraction)
        print(f"  plain peak {plain['peak_bytes'] / MiB:.1f} MiB, persistent {plain['persistent_bytes'] / MiB:.1f} "
              f"MiB: budget {a.budget_mb} MiB (persistent + {a.transient_fraction:g} x transient)", flush=True)
    print(f"[2/2] policy {a.policy}, {a.budget_mb} MiB device, steps: {a.steps} ...", flush=True)
    data = equal_point(plain, a.policy, a.budget_mb, a.device_mb, a.transient_fraction)
    _write(a.json, data)
    print(f"  result written to {a.json}")
    return 0 if data["bitwise_equal"] else 1


def plain_run(model: str, batch: int, link: str, steps: int, device_mb: int) -> dict:
    """Plain TensorFlow (no decorator) in a fresh process on a device of `device_mb` MiB: the reference of
    `equal_point`. CliError when it does not run there."""
    plain = timed_worker(["--model", model, "--batch", str(batch), "--budget-mb", str(device_mb), "--policy", "tf",
                          "--link", link, "--steps", str(steps)], device_mb)
    if not plain["ok"]:
        raise CliError(f"plain TensorFlow does not run {model} b{batch} on {device_mb} MiB: {plain['error']} "
                       "(raise --device-mb)")
    return plain


def link_clock(plain: dict) -> float | None:
    """The clock of the emulated p100 link for every policy compared with `plain` (plain_run): its settled median
    step, so that they all run over one link whatever their own measured step's speed (Options.link_clock_s); None
    on other links."""
    if plain.get("link") != "p100":
        return None
    return plain.get("settled_median_step_s") or plain.get("median_step_s") or None


def equal_point(plain: dict, policy: str, budget_mb: int, device_mb: int, transient_fraction: float | None = None,
                echo=print, stop_on_rescue: bool = False) -> dict:
    """`policy` on `plain`'s model, batch, link and steps, in a fresh process on a device of `budget_mb` MiB,
    compared with `plain` (plain_run) bit for bit (losses and every variable), timed against it, and set beside its
    planner's prediction (against_prediction). What `bench equal` writes. `stop_on_rescue`: the run stops at the
    first step passive mode would have to rescue: the policy does not run at this budget (`ok` false, its error)."""
    args = ["--model", plain["model"], "--batch", str(plain["batch"]), "--budget-mb", str(budget_mb), "--policy",
            policy, "--link", plain["link"], "--steps", str(plain["steps"])]
    clock = link_clock(plain)
    if clock is not None:
        args += ["--link-clock-s", repr(clock)]
    if stop_on_rescue:
        args.append("--stop-on-rescue")
    managed = timed_worker(args, budget_mb, echo=echo)
    equal = (managed["ok"] and managed["losses_hex"] == plain["losses_hex"]
             and managed["variables_sha256"] == plain["variables_sha256"])
    meta = ("model", "batch", "policy", "link", "steps", "budget_mb", "budget_bytes", "tf_version",
            "capuchin_tf_version", "date", "machine")
    data = {**{k: managed[k] for k in meta}, "device_mb": device_mb,
            "transient_fraction": transient_fraction, "ok": managed["ok"],
            "error": managed["error"], "bitwise_equal": equal, "plain_peak_bytes": plain["peak_bytes"],
            "peak_bytes": managed["peak_bytes"], "persistent_bytes": managed["persistent_bytes"],
            "median_step_s": managed["median_step_s"], "samples_per_s": managed["samples_per_s"],
            "settled_median_step_s": managed["settled_median_step_s"], **timing(plain, managed),
            **{k: managed[k] for k in PLAN_COUNTS}, "plain": plain, "managed": managed}
    what = f"{plain['model']}, batch {plain['batch']}, policy {policy}, link {plain['link']}"
    echo(f"{what}: {_summary(managed)}")
    if data["throughput_ratio"] is not None:
        echo(f"  throughput after settling: {data['throughput_ratio']:.3f}x plain TensorFlow (median step "
             f"{managed['settled_median_step_s']:.3f} s over {managed['settled_steps']} steps, plain "
             f"{plain['settled_median_step_s']:.3f} s)")
    if data["guided_throughput_ratio"] is not None:
        echo(f"  throughput over every step after the measured one: {data['guided_throughput_ratio']:.3f}x plain")
    if "measured_step_ratio" in data:
        echo(f"  {data['prediction_timed_over']}: {prediction_line(data)}")
    compared = "yes" if equal else ("NO" if managed["ok"] else "not compared (the run failed)")
    echo(f"  plain TensorFlow: peak {plain['peak_bytes'] / MiB:.1f} MiB on {plain['device_mb']} MiB; losses and "
         f"variables bit-for-bit equal to it: {compared}")
    return data


register_subcommand("bench", _add_arguments, _run,
                    help="train a named model under a memory budget and measure it (run), compare it bit for bit "
                         "with plain TensorFlow (equal), find the largest batch that runs (maxbatch), run the "
                         "conformance zoo (zoo); measure the host store (host-store) or the planner alone "
                         "(plan-table, plan-speed)")
register_subcommand("bench-worker", _add_worker_arguments, _run_worker, hidden=True,
                    help="(internal) one run of `bench` in a fresh process")
from capuchin_tf.cli import interleaved as _interleaved  # noqa: E402,F401  (registers its worker subcommand)
