"""Planning time on a BERT-base-sized synthetic trace (about 10,000 tensors), per policy, link and budget.

    CAPUCHIN_TF_PURE=1 python benchmarks/plan_speed.py [--policy capuchin] [--repeat 3] [--json out.json]

Budgets are persistent + a fraction of the transient peak (benchmarks.md). Prints the median wall time of
make_plan (candidates, the policy, the simulations) and the plan's outcome; the trace is built once, untimed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("CAPUCHIN_TF_PURE", "1")

from capuchin_tf.core import synthetic  # noqa: E402
from capuchin_tf.core.device_model import DeviceModel  # noqa: E402
from capuchin_tf.policy import POLICIES, make_plan  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", action="append", choices=list(POLICIES), help="default: every policy")
    ap.add_argument("--link", action="append", default=None, help="native, p100 or bytes/s (default: both named)")
    ap.add_argument("--fraction", action="append", type=float, default=None, help="default: 0.7, 0.5, 0.3")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    policies = args.policy or list(POLICIES)
    links = args.link or ["native", "p100"]
    fractions = args.fraction or [0.7, 0.5, 0.3]

    t0 = time.perf_counter()
    trace = synthetic.bert_base()
    build_s = time.perf_counter() - t0
    print(f"synthetic bert_base: {len(trace.tensors)} tensors, {len(trace.ops)} ops, built in {build_s:.2f} s")
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
                rows.append(
                    {
                        "policy": policy,
                        "link": link,
                        "fraction": frac,
                        "budget_bytes": budget,
                        "seconds_median": med,
                        "seconds": times,
                        "feasible": plan.feasible,
                        "n_swaps": len(plan.swaps),
                        "n_recomputes": len(plan.recomputes),
                        "predicted_overhead": plan.predicted_overhead,
                    }
                )
                print(
                    f"{policy:15s} link={link:7s} budget=persistent+{frac:.1f}*transient  {med:6.3f} s  "
                    f"feasible={plan.feasible!s:5s} swaps={len(plan.swaps):5d} recomputes={len(plan.recomputes):5d} "
                    f"overhead={plan.predicted_overhead * 100:+.1f}%"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "plan_speed",
                    "tensors": len(trace.tensors),
                    "ops": len(trace.ops),
                    "python": platform.python_version(),
                    "machine": platform.platform(),
                    "cpus": os.cpu_count(),
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
