"""Kernel times of consecutive guided steps, each under the profiler: does the first guided step, the one the runtime
re-times the trace from (docs/decisions.md, "Kernel times from a guided step"), run its kernels slower than later ones?

    TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=158 TF_ENABLE_ONEDNN_OPTS=0 \
        PYTHONPATH=.:tools .venv/bin/python tools/probe_kernel_times.py --model transformer --batch 32 --budget-mb 79 \
        --policy capuchin --link native --steps 8 --json out.json

Feedback off: the plan made at the measured step runs every guided step. Guided steps 1-4 and every odd one after are
profiled (wall time, the summed kernel times of the trace's ops, the trace re-timed by them as ManagedStep._retime
does); the others run unprofiled (their wall time). Writes the rows as JSON, stamped.
"""

from __future__ import annotations

import time

from probe_common import step_parser, write_stamped


def main() -> int:
    p = step_parser(__doc__, policy="capuchin")
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()

    import capuchin_tf  # noqa: F401  (the allocator wrapper, before TensorFlow's first op)
    from capuchin_tf.cli import models
    from capuchin_tf.frontend import decorator
    from capuchin_tf.tf import measure, ops

    setup = models.build(a.model, a.batch)
    managed = decorator.wrap_step(setup.train_step, decorator.make_options(
        a.budget_mb * 2**20, policy=a.policy, link=a.link, feedback=False))
    t0 = time.perf_counter()
    managed(*setup.inputs)
    measured_s = time.perf_counter() - t0
    (state,) = managed.states().values()
    names = {o.name for o in state.trace.ops}
    rows = []
    for i in range(a.steps):
        profiled = i < 4 or i % 2 == 0
        ops.drain_stalls()
        t0 = time.perf_counter()
        if profiled:
            _, kernels, _, offset = measure.profiled_call(lambda: managed(*setup.inputs))
        else:
            managed(*setup.inputs)
        row = {"guided_step": i + 1, "wall_s": time.perf_counter() - t0, "profiled": profiled}
        if profiled:
            seconds = measure.kernel_seconds(kernels, offset, ops.drain_stalls())
            named = {op: s for op, s in seconds.items() if op in names}
            row.update(kernel_s=sum(named.values()),
                       retimed_step_s=state.trace.retimed(named, source="probe").step_time)
        rows.append(row)
        print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    write_stamped(a, {"policy": a.policy, "measured_call_s": measured_s, "measured_trace_step_s": state.trace.step_time,
                      "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
