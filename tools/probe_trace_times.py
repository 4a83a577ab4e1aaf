"""The measured step's times against the guided steps' own: the trace's step time (kernel times, stalls removed), the
simulator's prediction for the plan made from it, and the guided steps' measured times and peaks, in one process.

    PYTHONPATH=. TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=158 \
        TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python tools/probe_trace_times.py --model transformer --batch 32 \
        --budget-mb 79 --json out.json

Feedback off (the plan made at the measured step runs every guided step).
"""

from __future__ import annotations

import json
import os
import sys
import time

from probe_common import step_parser

MiB = 1 << 20


def main() -> int:
    p = step_parser(__doc__, policy="capuchin")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()

    import capuchin_tf
    from capuchin_tf.cli import models
    from capuchin_tf.cli.common import git_commit, machine
    from capuchin_tf.policy.simulator import simulate

    setup = models.build(a.model, a.batch)
    step = capuchin_tf.function(setup.train_step, memory_budget=a.budget_mb * MiB, policy=a.policy, link=a.link,
                                feedback=False)
    t0 = time.perf_counter()
    step(*setup.inputs)
    first = time.perf_counter() - t0
    for _ in range(a.steps - 1):
        step(*setup.inputs)
    (state,) = step.states().values()
    (report,) = step.report().values()
    sim = simulate(state.trace, state.plan)
    guided = [s["seconds"] for s in report["steps"][1:]]
    result = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": a.model,
              "batch": a.batch, "budget_mb": a.budget_mb, "policy": a.policy, "link": a.link,
              "device_mb": int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", 0)),
              "first_call_s": first, "trace_step_s": state.trace.step_time,
              "measured_wall_s": state.trace.meta.get("measured_wall_s"), "predicted_step_s": sim.step_time,
              "guided_step_s": guided, "predicted_peak_bytes": state.plan.predicted_peak_bytes,
              "peak_bytes": [s["peak_bytes"] for s in report["steps"]],
              "command": "tools/probe_trace_times.py " + " ".join(sys.argv[1:])}
    peaks = ", ".join(f"{s['peak_bytes'] / MiB:.1f}" for s in report["steps"])
    print(f"{a.model} b{a.batch} @{a.budget_mb} MiB: first call {first:.2f} s, trace step "
          f"{state.trace.step_time:.3f} s, predicted guided step {sim.step_time:.3f} s, guided "
          f"{', '.join(f'{s:.3f}' for s in guided)} s; predicted peak {state.plan.predicted_peak_bytes / MiB:.1f} MiB, "
          f"peaks {peaks} MiB")
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
