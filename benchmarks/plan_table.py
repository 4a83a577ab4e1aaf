"""Predicted peak and step time per policy, on measured traces, for budgets from the plain peak down to the floor.

    CAPUCHIN_TF_PURE=1 python benchmarks/plan_table.py TRACE.json [TRACE.json ...] [--link native --link p100]
        [--fractions 1.0,0.8,0.6,0.5,0.4,0.3] [--json out.json]

Traces come from `python -m capuchin_tf profile --model M --batch B --json TRACE.json`. Budgets are
persistent + fraction x transient peak of the trace (benchmarks.md). For each (trace, link, budget) it prints a row
per policy: feasible or not, predicted peak against the budget, and predicted step time as a ratio to the measured
step (1.00 = no overhead). The planner is pure Python; this command imports no TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("CAPUCHIN_TF_PURE", "1")

from capuchin_tf.core.device_model import DeviceModel  # noqa: E402
from capuchin_tf.policy import POLICIES, make_plan  # noqa: E402
from capuchin_tf.core.trace import AccessTrace  # noqa: E402

MiB = float(1 << 20)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--link", action="append", help="native, p100 or bytes/s (default: native and p100)")
    ap.add_argument("--fractions", default="1.0,0.8,0.6,0.5,0.4,0.3",
                    help="budgets as fractions of the transient peak, added to the persistent bytes")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
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
            print(f"\n| {name}, link {link} ({device.d2h_bytes_per_s / 1e9:.2f} GB/s) | " +
                  " | ".join(POLICIES) + " |")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "plan_table", "date": time.strftime("%Y-%m-%d"),
                       "machine": {"cores": os.cpu_count(), "platform": platform.platform()}, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
