"""The planner on its own, without running a step (imports no TensorFlow):

    python -m capuchin_tf bench plan-table TRACE.json [TRACE.json ...] [--link native --link p100]
        [--fractions 1.0,0.8,0.6,0.5,0.4,0.3] [--json out.json]
    python -m capuchin_tf bench plan-speed [--policy capuchin] [--repeat 3] [--json out.json]

plan-table: predicted peak and step time per policy, on measured traces (`python -m capuchin_tf profile ... --json
TRACE.json`), for budgets of persistent + fraction x transient peak (benchmarks.md): a row per budget, a column per
policy, each cell the predicted peak (! = over budget) and the predicted step time over the measured step.
plan-speed: the planning time of each policy on a BERT-base-sized synthetic trace (about 10,000 tensors), median of
--repeat runs, per link and budget fraction; the trace is built once, untimed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from capuchin_tf.cli.common import stamp
from capuchin_tf.core.budget import MiB


def add_table_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", help="access traces (JSON) of measured steps")
    p.add_argument("--link", action="append", help="native, p100 or bytes/s (default: native and p100)")
    p.add_argument("--fractions", default="1.0,0.8,0.6,0.5,0.4,0.3",
                   help="budgets as fractions of the transient peak, added to the persistent bytes")
    p.add_argument("--json", help="write the rows there")


def add_speed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", action="append", help="default: every registered policy")
    p.add_argument("--link", action="append", default=None, help="native, p100 or bytes/s (default: both named)")
    p.add_argument("--fraction", action="append", type=float, default=None, help="default: 0.7, 0.5, 0.3")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None, help="write the rows there")


def _write(path: str | None, kind: str, rows: list[dict], **extra) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"benchmark": kind, **stamp(), **extra, "rows": rows}, f, indent=1)
        print(f"result written to {path}")


def run_table(args: argparse.Namespace) -> int:
    from capuchin_tf.core.access_trace import AccessTrace
    from capuchin_tf.core.device_model import DeviceModel
    from capuchin_tf.policy import POLICIES, make_plan

    links = args.link or ["native", "p100"]
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = []
    for path in args.traces:
        trace = AccessTrace.load(path)
        name = f"{trace.meta.get('model', path)} b{trace.meta.get('batch', '?')}"
        peak = trace.replayed_peak_bytes()
        transient = peak - trace.persistent_bytes
        print(f"\n## {name}: ideal peak {peak / MiB:.1f} MiB, persistent {trace.persistent_bytes / MiB:.1f} MiB, "
              f"step {trace.step_time * 1e3:.0f} ms, {len(trace.tensors)} tensors")
        for link in links:
            try:
                device = DeviceModel.from_link(link, trace)
            except ValueError as e:
                print(f"  link {link}: skipped ({e})")
                continue
            print(f"\n| {name}, link {link} ({device.d2h_bytes_per_s / 1e9:.2f} GB/s) | " + " | ".join(POLICIES) + " |")
            print("|---|" + "---|" * len(POLICIES))
            for frac in fractions:
                budget = -int(-(trace.persistent_bytes + frac * transient) // 1)  # ceil: 1.0 is the peak itself
                cells = []
                for policy in POLICIES:
                    t0 = time.perf_counter()
                    plan = make_plan(trace, budget, policy, device)
                    dt = time.perf_counter() - t0
                    ratio = plan.predicted_step_s / trace.step_time if trace.step_time else float("nan")
                    cells.append(f"{plan.predicted_peak_bytes / MiB:.0f}{'' if plan.feasible else '!'} / {ratio:.2f}")
                    rows.append({"trace": path, "model": name, "link": link, "fraction": frac, "budget_bytes": budget,
                                 "policy": policy, "feasible": plan.feasible,
                                 "predicted_peak_bytes": plan.predicted_peak_bytes,
                                 "predicted_step_s": plan.predicted_step_s, "trace_step_s": trace.step_time,
                                 "swapped_bytes": plan.swapped_bytes, "recomputed_bytes": plan.recomputed_bytes,
                                 "n_swaps": len(plan.swaps), "n_recomputes": len(plan.recomputes), "planning_s": dt,
                                 "reason": plan.reason})
                print(f"| {frac:.1f} x transient: {budget / MiB:.0f} MiB | " + " | ".join(cells) + " |")
    print("\ncells: predicted peak MiB (! = not feasible: over budget) / predicted step time over the measured step")
    _write(args.json, "plan-table", rows)
    return 0


def run_speed(args: argparse.Namespace) -> int:
    from capuchin_tf.core import synthetic
    from capuchin_tf.core.device_model import DeviceModel
    from capuchin_tf.policy import POLICIES, make_plan

    unknown = [p for p in args.policy or [] if p not in POLICIES]
    if unknown:
        from capuchin_tf.cli.common import CliError

        raise CliError(f"unknown policy {unknown[0]!r}; valid policies: {', '.join(POLICIES)}")
    policies = args.policy or list(POLICIES)
    links = args.link or ["native", "p100"]
    fractions = args.fraction or [0.7, 0.5, 0.3]
    t0 = time.perf_counter()
    trace = synthetic.bert_base()
    print(f"synthetic bert_base: {len(trace.tensors)} tensors, {len(trace.ops)} ops, built in "
          f"{time.perf_counter() - t0:.2f} s")
    rows = []
    for link in links:
        dm = DeviceModel.from_link(link, trace)
        for frac in fractions:
            budget = synthetic.budget_fraction(trace, frac)
            for policy in policies:
                times = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    plan = make_plan(trace, budget, policy, dm)
                    times.append(time.perf_counter() - t0)
                med = statistics.median(times)
                rows.append({"policy": policy, "link": link, "fraction": frac, "budget_bytes": budget,
                             "seconds_median": med, "seconds": times, "feasible": plan.feasible,
                             "n_swaps": len(plan.swaps), "n_recomputes": len(plan.recomputes),
                             "predicted_overhead": plan.predicted_overhead})
                print(f"{policy:15s} link={link:7s} budget=persistent+{frac:.1f}*transient  {med:6.3f} s  "
                      f"feasible={plan.feasible!s:5s} swaps={len(plan.swaps):5d} recomputes={len(plan.recomputes):5d} "
                      f"overhead={plan.predicted_overhead * 100:+.1f}%")
    _write(args.json, "plan-speed", rows, tensors=len(trace.tensors), ops=len(trace.ops))
    return 0
