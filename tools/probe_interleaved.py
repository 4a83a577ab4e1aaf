"""A plan's guided step against plain TensorFlow's, the two alternated in one process: the ratio of their median
steps without the spread between processes (one process can run 15-40% slower than another with the same plan on
the shared 2-core machine; docs/decisions.md, "A suite point is the run of the median step of its rounds").

    PYTHONPATH=. TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=1000 \
        TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python tools/probe_interleaved.py --model resnet50 --batch 32 \
        --budget-mb 207 --policy checkpoint --json out.json

The managed step runs with `memory_budget` = --budget-mb and the feedback off (the plan made at the measured step
runs every guided step) on a device larger than the budget (TF_CPU_BFC_MEM_LIMIT_IN_MB), so that plain TensorFlow's
step runs beside it; after one warm step of each, --pairs pairs are timed, plain first in even pairs and guided first
in odd ones. Prints both steps' times, the ratio of their medians and the planner's prediction; writes JSON, stamped.
"""

from __future__ import annotations

import statistics
import time

from probe_common import step_parser, write_stamped


def main() -> int:
    p = step_parser(__doc__, policy="capuchin")
    p.add_argument("--pairs", type=int, default=6)
    a = p.parse_args()

    import capuchin_tf
    from capuchin_tf.cli import models

    setup = models.build(a.model, a.batch)
    plain = setup.train_step
    plain(*setup.inputs)
    step = capuchin_tf.function(setup.train_step, memory_budget=a.budget_mb << 20, policy=a.policy, link=a.link,
                                feedback=False)
    step(*setup.inputs)  # the measured step
    step(*setup.inputs)  # the first guided step instantiates the rewritten step
    plain_s, guided_s = [], []
    for i in range(a.pairs):
        pair = [(plain, plain_s), (step, guided_s)]
        for fn, out in pair if i % 2 == 0 else pair[::-1]:
            t0 = time.perf_counter()
            fn(*setup.inputs)
            out.append(time.perf_counter() - t0)
    (state,) = step.states().values()
    plan = state.plan
    ratio = statistics.median(guided_s) / statistics.median(plain_s)
    predicted = plan.predicted_step_s / state.trace.step_time
    print(f"{a.model} b{a.batch} {a.policy} @{a.budget_mb} MiB ({a.link}): plain {[round(x, 3) for x in plain_s]}, "
          f"guided {[round(x, 3) for x in guided_s]}; guided / plain {ratio:.3f} by the medians, predicted "
          f"{predicted:.3f} of the trace's step ({len(plan.swaps)} swapped, {len(plan.recomputes)} recomputed, "
          f"fallback {dict(plan.options).get('fallback')})")
    write_stamped(a, {"policy": a.policy, "pairs": a.pairs, "plain_step_s": plain_s, "guided_step_s": guided_s,
                      "ratio_of_medians": ratio, "predicted_step_ratio": predicted,
                      "swapped_tensors": len(plan.swaps), "recomputed_tensors": len(plan.recomputes),
                      "fallback": dict(plan.options).get("fallback")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
