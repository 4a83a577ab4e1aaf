"""Predicted placement against measured evictions on demand: a managed step's plan (feedback off) runs its guided
steps at device = budget; its simulated timeline is placed best fit (capuchin_tf/policy/placement.py), and so are the
plans the other policies make from the same trace. Prints, per policy, the predicted step, byte peak, fragmentation
and placed peak against the budget; for the plan that ran, the bytes its guided steps evicted on demand.

    PYTHONPATH=. TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=79 \
        TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python tools/probe_fragmentation.py --model transformer --batch 32 \
        --budget-mb 79 --json out.json

--trace-in reads a trace written by an earlier run (--trace-out) and plans it offline, without TensorFlow's step.
"""

from __future__ import annotations

import json
import os
import sys
import time

from probe_common import step_parser

MiB = 1 << 20
POLICIES = ("capuchin", "swap-only", "recompute-only", "checkpoint", "swap-all")


def main() -> int:
    p = step_parser(__doc__, policy="capuchin")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--trace-out")
    p.add_argument("--trace-in")
    p.add_argument("--planned-layout", action="store_true", help="guided steps use the planned layout")
    p.add_argument("--plan-cache", help="a plan cache directory: a second run with it runs the first run's plan")
    a = p.parse_args()

    from capuchin_tf.core.access_trace import AccessTrace
    from capuchin_tf.core.device_model import DeviceModel
    from capuchin_tf.policy import make_plan
    from capuchin_tf.policy.placement import place
    from capuchin_tf.policy.simulator import simulate

    budget = a.budget_mb * MiB
    result = {"date": time.strftime("%Y-%m-%d"), "model": a.model, "batch": a.batch, "budget_mb": a.budget_mb,
              "link": a.link, "device_mb": int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", 0)),
              "command": "tools/probe_fragmentation.py " + " ".join(sys.argv[1:])}
    if a.trace_in:
        with open(a.trace_in) as f:
            trace = AccessTrace.from_json(json.load(f))
        device_model = DeviceModel.from_link(a.link, trace)
    else:
        import capuchin_tf
        from capuchin_tf.cli import models
        from capuchin_tf.cli.common import git_commit, machine

        setup = models.build(a.model, a.batch)
        step = capuchin_tf.function(setup.train_step, memory_budget=budget, policy=a.policy, link=a.link,
                                    feedback=False, planned_layout=a.planned_layout, plan_cache=a.plan_cache)
        for _ in range(a.steps):
            step(*setup.inputs)
        (state,) = step.states().values()
        (report,) = step.report().values()
        trace, device_model = state.trace, state.plan.device
        result.update(commit=git_commit(), machine=machine(), ran_policy=a.policy,
                      ran_options=dict(state.plan.options),
                      planned_layout=a.planned_layout, from_cache=bool(state.from_cache),
                      guided=[{k: s.get(k) for k in ("seconds", "peak_bytes", "passive_evicted_bytes",
                                                     "layout_bytes", "layout_misses")}
                              for s in report["steps"][1:]])
        if a.trace_out:
            with open(a.trace_out, "w") as f:
                json.dump(trace.to_json(), f)
    rows = {}
    for policy in POLICIES:
        try:
            plan = make_plan(trace, budget, policy, device_model)
            sim = simulate(trace, plan)
        except Exception as e:  # a policy that cannot plan this trace
            rows[policy] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{policy:15s} {type(e).__name__}: {e}")
            continue
        t0 = time.perf_counter()
        pl = place(sim.events)
        placing = time.perf_counter() - t0
        row = {"predicted_step_s": sim.step_time, "trace_step_s": trace.step_time, "peak_bytes": sim.peak_bytes,
               "fragmentation_bytes": pl.fragmentation, "placed_peak_bytes": sim.peak_bytes + pl.fragmentation,
               "live_peak_large_bytes": pl.live_peak, "extent_bytes": pl.extent, "placing_s": placing,
               "feasible": plan.feasible, "options": dict(plan.options)}
        rows[policy] = row
        print(f"{policy:15s} step {sim.step_time / trace.step_time:5.2f}x trace  peak {sim.peak_bytes / MiB:6.1f}  "
              f"frag {pl.fragmentation / MiB:5.1f}  placed {row['placed_peak_bytes'] / MiB:6.1f} MiB "
              f"(budget {a.budget_mb})  [{placing * 1000:.0f} ms]")
    result["policies"] = rows
    if "guided" in result:
        print("ran:", a.policy, "evicted on demand per guided step (MiB):",
              [round((s["passive_evicted_bytes"] or 0) / MiB, 1) for s in result["guided"]],
              "seconds:", [round(s["seconds"], 3) for s in result["guided"]])
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
