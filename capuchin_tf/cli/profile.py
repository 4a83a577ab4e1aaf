"""`python -m capuchin_tf profile`: the measured execution of a named model, compared with plain TensorFlow.

    python -m capuchin_tf profile --model cnn --batch 32 [--budget-mb 60 | --transient-fraction 0.5] --json trace.json
        [--plot curve.png]

Runs, each in a fresh process on the simulated device (design.md), on the same seed and data:
  1. a plain TensorFlow step with enough memory: its loss, variables and measured peak;
  2. with --budget-mb, a plain TensorFlow step on a device of that size (`plain_fits_budget`, `plain_budget_error`);
  3. capuchin_tf's measured step (passive mode on) on a device of --budget-mb MiB (default: enough memory).
Writes the trace (with `bitwise_equal`, `plain_peak_bytes` and the overhead beside it) and, with --plot, a PNG of the
memory curve with the peak window and the budget marked. Budgets are MiB (2^20 bytes).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from capuchin_tf.cli.common import SIZE_HELP, CliError, register_subcommand, run_worker, whole_mib
from capuchin_tf.core.budget import MiB, fraction_budget_mb
from capuchin_tf.tf.simulated_device import DEVICE

DEFAULT_DEVICE_MB = 16384


# ---- the worker (runs inside the fresh process) ----------------------------------------------------------------------
def _add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["plain", "measured"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--trace")
    p.add_argument("--budget-bytes", type=int)
    p.add_argument("--result", required=True)


def _run_worker(a: argparse.Namespace) -> int:
    import tensorflow as tf

    import capuchin_tf  # noqa: F401  (installs the allocator wrapper before the first op)
    from capuchin_tf.cli import models
    from capuchin_tf.runtime.errors import oom_line
    from capuchin_tf.tf import measure

    result = {"mode": a.mode, "ok": True, "error": None, "losses": [], "step_s": []}
    try:
        setup = models.build(a.model, a.batch)
    except tf.errors.ResourceExhaustedError as e:
        result.update(ok=False, error=f"the model does not build on this device: {oom_line(e)}")
        pathlib.Path(a.result).write_text(json.dumps(result))
        return 0
    result["persistent_bytes"] = tf.config.experimental.get_memory_info(DEVICE)["current"]
    try:
        for i in range(a.steps):
            t0 = time.perf_counter()
            if a.mode == "measured" and i == 0:
                flops = measure.count_flops(setup.train_step.get_concrete_function(*setup.inputs))
                loss, trace = measure.measure_step(
                    setup.train_step, setup.inputs, budget_bytes=a.budget_bytes,
                    meta={"model": a.model, "batch": a.batch, "flops": flops, **setup.info})
                trace.save(a.trace)
            else:
                tf.config.experimental.reset_memory_stats(DEVICE)
                loss = setup.train_step(*setup.inputs)
                result.setdefault("peaks", []).append(tf.config.experimental.get_memory_info(DEVICE)["peak"])
            result["losses"].append(float(loss))
            result["step_s"].append(time.perf_counter() - t0)
    except tf.errors.ResourceExhaustedError as e:
        result.update(ok=False, error=f"ResourceExhaustedError: {oom_line(e)}")
    result.update(losses_hex=[float.hex(x) for x in result["losses"]], variables_sha256=setup.variables_sha256())
    pathlib.Path(a.result).write_text(json.dumps(result))
    return 0


# ---- profile ---------------------------------------------------------------------------------------------------------
def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a model name (python -c 'from capuchin_tf.cli import models; "
                                                    "print(models.describe())')")
    p.add_argument("--batch", type=int, required=True)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-mb", type=whole_mib,
                        help=f"device memory of the measured run: {SIZE_HELP} (default: enough)")
    budget.add_argument("--transient-fraction", type=float,
                        help="budget as persistent + this fraction of the plain step's transient peak (0.5: the "
                             "protocol's 'half the transient peak'), rounded up to a MiB")
    p.add_argument("--json", required=True, help="where to write the trace")
    p.add_argument("--plot", help="where to write a PNG of the memory curve")
    p.add_argument("--device-mb", type=whole_mib, default=DEFAULT_DEVICE_MB,
                   help=f"device memory of the plain run, MiB (default {DEFAULT_DEVICE_MB})")


def _run(a: argparse.Namespace) -> int:
    from capuchin_tf.cli.models import MODELS

    if a.model not in MODELS:
        raise CliError(f"unknown model {a.model!r}; known: {', '.join(MODELS)}")
    if a.batch < 1:
        raise CliError("--batch must be at least 1")
    if a.budget_mb is not None and a.budget_mb < 1:
        raise CliError("--budget-mb must be at least 1")
    if a.transient_fraction is not None and not 0.0 < a.transient_fraction <= 1.0:
        raise CliError("--transient-fraction must be in (0, 1]")
    common = ["--model", a.model, "--batch", str(a.batch)]
    budgeted = a.budget_mb is not None or a.transient_fraction is not None
    print(f"[1/{3 if budgeted else 2}] plain TensorFlow step, {a.device_mb} MiB device ...", flush=True)
    plain = run_worker("profile-worker", [*common, "--mode", "plain"], a.device_mb)
    if not plain["ok"]:
        raise CliError(f"the plain step does not fit {a.device_mb} MiB: {plain['error']} (raise --device-mb)")
    if a.transient_fraction is not None:
        persistent, peak = plain["persistent_bytes"], plain["peaks"][0]
        a.budget_mb = fraction_budget_mb(persistent, peak, a.transient_fraction)
        print(f"  peak {peak / MiB:.1f} MiB, persistent {persistent / MiB:.1f} MiB: budget {a.budget_mb} MiB "
              f"(persistent + {a.transient_fraction:g} x transient)", flush=True)
    limit = a.budget_mb or a.device_mb
    steps = 3 if a.budget_mb else 2
    at_budget = None
    if a.budget_mb:
        print(f"[2/{steps}] plain TensorFlow step, {a.budget_mb} MiB device ...", flush=True)
        at_budget = run_worker("profile-worker", [*common, "--mode", "plain"], a.budget_mb)
        print(f"  {'fits' if at_budget['ok'] else at_budget['error']}", flush=True)
    print(f"[{steps}/{steps}] measured step (passive mode), {limit} MiB device ...", flush=True)
    budget_bytes = a.budget_mb * MiB if a.budget_mb else None
    extra = ["--budget-bytes", str(budget_bytes)] if budget_bytes else []
    measured = run_worker("profile-worker", [*common, "--mode", "measured", "--trace", a.json, *extra], limit)
    if not measured["ok"]:
        print(f"the measured step failed: {measured['error']}", file=sys.stderr)
        return 1
    data = json.loads(pathlib.Path(a.json).read_text())
    equal = (measured["losses_hex"] == plain["losses_hex"]
             and measured["variables_sha256"] == plain["variables_sha256"])
    if at_budget is not None:
        data.update(plain_fits_budget=at_budget["ok"], plain_budget_error=at_budget.get("error"))
    data.update(bitwise_equal=equal, plain_peak_bytes=plain["peaks"][0],
                plain_first_step_s=plain["step_s"][0], measured_first_step_s=measured["step_s"][0],
                measured_overhead=measured["step_s"][0] / plain["step_s"][0] - 1.0)
    pathlib.Path(a.json).write_text(json.dumps(data))
    from capuchin_tf.core.access_trace import AccessTrace

    trace = AccessTrace.from_json(data)
    print(f"model {a.model}, batch {a.batch}: {len(trace.ops)} ops, {len(trace.tensors)} tensors, "
          f"{sum(t.access_count for t in trace.tensors.values())} accesses")
    print(f"  BFC peak {data['peak_bytes'] / MiB:.1f} MiB (plain TF: {plain['peaks'][0] / MiB:.1f} MiB), "
          f"persistent {trace.persistent_bytes / MiB:.1f} MiB, replayed peak {data['replayed_peak_bytes'] / MiB:.1f} "
          f"MiB, evicted {trace.evicted_bytes / MiB:.1f} MiB, stalls removed {trace.stall_time:.3f} s")
    print(f"  first step: measured {measured['step_s'][0]:.3f} s vs plain {plain['step_s'][0]:.3f} s "
          f"({data['measured_overhead'] * 100:+.1f}%); bit-for-bit equal to plain TF: {'yes' if equal else 'NO'}")
    print(f"  trace written to {a.json}")
    if a.plot:
        from capuchin_tf.tf.measure import plot_memory_curve

        plot_memory_curve(trace, a.plot, title=f"{a.model}, batch {a.batch}")
        print(f"  memory curve written to {a.plot}")
    return 0 if equal else 1


register_subcommand("profile", _add_arguments, _run,
                    help="measured execution of a named model, compared with plain TensorFlow")
register_subcommand("profile-worker", _add_worker_arguments, _run_worker, hidden=True,
                    help="(internal) one run of `profile` in a fresh process")
