"""One policy's plan made for the budget less a margin, run under the budget with the feedback off: what a learned
margin (policy.feedback.LEARNED_MARGIN) buys a plan, per step: seconds, peak, bytes evicted on demand, waits by kind.

    TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=207 TF_ENABLE_ONEDNN_OPTS=0 \
        .venv/bin/python tools/probe_plan_margin.py --model resnet50 --batch 32 --budget-mb 207 --margin-mb 28 \
        --policy capuchin --json out.json

The step runs under `capuchin_tf.function` with `memory_budget` = --budget-mb and `feedback=False`, so the plan made
after the measured step (for --budget-mb less --margin-mb) is the one every guided step runs. Prints one line per step
and writes them as JSON, stamped.
"""

from __future__ import annotations

import json
import os
import time

from probe_common import step_parser


def main() -> int:
    p = step_parser(__doc__, policy="capuchin")
    p.add_argument("--margin-mb", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()

    import capuchin_tf
    from capuchin_tf.cli import models
    from capuchin_tf.cli.common import git_commit, machine
    from capuchin_tf.runtime import managed_step

    make_plan = managed_step.make_plan

    def with_margin(trace, budget, policy, *args, **kwargs):
        return make_plan(trace, None if budget is None else int(budget - a.margin_mb * 2**20), policy, *args,
                         **kwargs)

    managed_step.make_plan = with_margin
    setup = models.build(a.model, a.batch)
    step = capuchin_tf.function(setup.train_step, memory_budget=a.budget_mb * 2**20, policy=a.policy, link=a.link,
                                feedback=False)
    for _ in range(a.steps):
        step(*setup.inputs)
    (report,) = step.report().values()
    rows = [{k: s[k] for k in ("phase", "seconds", "peak_bytes", "passive_evicted_bytes", "waited_s")}
            for s in report["steps"]]
    for r in rows:
        print(f"{r['phase']:9s} {r['seconds']:7.3f} s  peak {r['peak_bytes'] / 2**20:6.1f} MiB  evicted on demand "
              f"{r['passive_evicted_bytes'] / 2**20:5.1f} MiB  {r['waited_s']}")
    prediction = report["prediction"] or {}
    result = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": a.model,
              "batch": a.batch, "budget_mb": a.budget_mb, "margin_mb": a.margin_mb,
              "device_mb": int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", 0)), "policy": a.policy, "link": a.link,
              "swapped_tensors": report["swapped_tensors"], "recomputed_tensors": report["recomputed_tensors"],
              "predicted_peak_bytes": prediction.get("predicted_peak_bytes"),
              "predicted_step_ratio": prediction.get("predicted_step_ratio"), "steps": rows}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
