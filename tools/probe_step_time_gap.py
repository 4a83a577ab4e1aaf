"""Where a guided step's time goes against plain TensorFlow's step and the planner's prediction: both steps profiled
in one process under the same profiler, their kernels matched by op name.

    TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=1000 TF_ENABLE_ONEDNN_OPTS=0 \
        .venv/bin/python tools/probe_step_time_gap.py --model dropout-bn --batch 128 --budget-mb 102 \
        --policy recompute-only --json out.json

Plain TensorFlow's step (`tf.function` of the same training step) and the managed step (feedback off: the plan made
at the measured step runs every guided step) are each warmed, timed unprofiled `--steps` times and profiled `--profiled`
times. Per profiled step: wall time, the sum of its kernels, and the time no kernel ran (the executor, Python and the
call around the step). Kernels by kind: ops of plain's graph (their time in each), the plan's replays (ops whose
name is a clone of an original), the pool and copy ops, and the rest; the largest per-op differences. With the
simulator's prediction for the plan on the trace it was made from (trace step, replay and stall seconds). Writes
JSON, stamped.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from probe_common import step_parser, write_stamped

MiB = 1 << 20


def _profiled(call, n):
    from capuchin_tf.tf import measure

    runs = []
    for _ in range(n):
        def call_timed():
            t0 = time.perf_counter()
            call()
            return time.perf_counter() - t0

        wall, events, _, _ = measure.profiled_call(call_timed)
        calls = [k for k in events if k.op == "EagerLocalExecute"]  # the function call's own event
        kernels = [k for k in events if k.op != "EagerLocalExecute"]
        per_op: dict[str, float] = {}
        types: dict[str, str] = {}
        for k in kernels:
            per_op[k.op] = per_op.get(k.op, 0.0) + (k.end - k.start) / 1e9
            types[k.op] = k.type
        span = (max(k.end for k in kernels) - min(k.start for k in kernels)) / 1e9 if kernels else 0.0
        busy = _union_seconds([(k.start, k.end) for k in kernels])
        runs.append({"wall_s": wall, "call_s": sum(k.end - k.start for k in calls) / 1e9, "kernel_span_s": span,
                     "kernel_busy_s": busy, "per_op": per_op,
                     "types": types})
    return runs


def _union_seconds(spans):
    total, end = 0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e9


def _median_per_op(runs):
    ops = set().union(*(r["per_op"] for r in runs))
    return {o: statistics.median(r["per_op"].get(o, 0.0) for r in runs) for o in ops}


def main() -> int:
    p = step_parser(__doc__, policy="capuchin")
    p.add_argument("--steps", type=int, default=4, help="unprofiled steps timed, each kind")
    p.add_argument("--profiled", type=int, default=3, help="profiled steps, each kind")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--plain-json", help="plain TensorFlow's profile from an earlier run of this probe (on a device "
                   "plain fits), for a guided step on a device of the budget's size, where plain does not run")
    a = p.parse_args()

    import tensorflow as tf

    import capuchin_tf
    from capuchin_tf.cli import models
    from capuchin_tf.policy.simulator import simulate

    setup = models.build(a.model, a.batch)

    def timed(call, n):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
        return out

    # plain TensorFlow's own function of the same step (setup.train_step is the one the managed step wraps)
    plain_fn = tf.function(setup.train_step.python_function, input_signature=setup.input_spec, jit_compile=False)
    plain = lambda: plain_fn(*setup.inputs)  # noqa: E731
    if a.plain_json:
        with open(a.plain_json) as f:
            earlier = json.load(f)
        plain_s, plain_prof = earlier["plain_step_s"], earlier["plain_profiles"]
    else:
        timed(plain, 2)
        plain_s = timed(plain, a.steps)
        plain_prof = _profiled(plain, a.profiled)

    step = capuchin_tf.function(setup.train_step, memory_budget=a.budget_mb * MiB, policy=a.policy, link=a.link,
                                feedback=False)
    guided = lambda: step(*setup.inputs)  # noqa: E731
    timed(guided, 3)  # the measured step and two guided ones
    guided_s = timed(guided, a.steps)
    guided_prof = _profiled(guided, a.profiled)
    (state,) = step.states().values()
    (report,) = step.report().values()
    phases = [s["phase"] for s in report["steps"]]
    sim = simulate(state.trace, state.plan)
    trace_ops = {o.name for o in state.trace.ops}

    p_ops, g_ops = _median_per_op(plain_prof), _median_per_op(guided_prof)
    g_types = {}
    for r in guided_prof:
        g_types.update(r["types"])
    kinds: dict[str, float] = {}
    per_kind_ops: dict[str, list] = {}
    for o, s in g_ops.items():
        t = g_types.get(o, "")
        if o in p_ops:
            kind = "plain's ops"
        elif t.startswith("Capuchin"):
            kind = f"pool and copy ({t})"
        elif o.startswith("capuchin/recompute/"):
            kind = "replays"
        else:
            kind = f"other ({t})"
        kinds[kind] = kinds.get(kind, 0.0) + s
        per_kind_ops.setdefault(kind, []).append(o)
    common = [o for o in g_ops if o in p_ops]
    diffs = sorted(((g_ops[o] - p_ops[o], o) for o in common), reverse=True)
    missing = sorted(((p_ops[o], o) for o in p_ops if o not in g_ops), reverse=True)

    def summary(runs):
        keys = ("wall_s", "call_s", "kernel_span_s", "kernel_busy_s")
        return {k: statistics.median(r[k] for r in runs) for k in keys}

    ps, gs = summary(plain_prof), summary(guided_prof)
    fields = {
        "policy": a.policy, "phases": phases, "plain_step_s": plain_s, "guided_step_s": guided_s,
        "plain_profiled": ps, "guided_profiled": gs, "plain_profiles": plain_prof, "guided_profiles": guided_prof,
        "device_mb": int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", 0)),
        "plain_kernel_sum_s": sum(p_ops.values()), "guided_kernel_sum_s": sum(g_ops.values()),
        "guided_kernels_by_kind_s": kinds, "kind_op_counts": {k: len(v) for k, v in per_kind_ops.items()},
        "plain_ops_in_guided_s": sum(p_ops[o] for o in common), "plain_ops_in_guided_guided_s":
            sum(g_ops[o] for o in common),
        "largest_slower": [{"op": o, "plain_s": p_ops[o], "guided_s": g_ops[o]} for _, o in diffs[:a.top]],
        "largest_faster": [{"op": o, "plain_s": p_ops[o], "guided_s": g_ops[o]} for _, o in diffs[-a.top:]],
        "plain_only": [{"op": o, "plain_s": s} for s, o in missing[:a.top]],
        "plain_ops_count": len(p_ops), "guided_ops_count": len(g_ops), "trace_ops_count": len(trace_ops),
        "trace_step_s": state.trace.step_time, "predicted_step_s": sim.step_time,
        "predicted_recompute_s": sim.recompute_s, "predicted_stall_s": sim.stall_s,
        "recomputed_tensors": report["recomputed_tensors"], "swapped_tensors": report["swapped_tensors"],
        "command": "tools/probe_step_time_gap.py " + " ".join(sys.argv[1:]),
    }
    write_stamped(a, fields)
    med = statistics.median
    print(f"{a.model} b{a.batch} {a.policy} @{a.budget_mb} MiB ({a.link}); phases {','.join(phases)}")
    print(f"  unprofiled step: plain {med(plain_s):.3f} s, guided {med(guided_s):.3f} s "
          f"({med(guided_s) / med(plain_s):.2f}x)")
    for name, x, total in (("plain", ps, fields["plain_kernel_sum_s"]), ("guided", gs, fields["guided_kernel_sum_s"])):
        print(f"  profiled {name}: call {x['wall_s']:.3f} s, executing {x['call_s']:.3f} s, kernels busy "
              f"{x['kernel_busy_s']:.3f} s (sum {total:.3f})")
    print(f"  plain's ops: {fields['plain_ops_in_guided_s']:.3f} s in plain, "
          f"{fields['plain_ops_in_guided_guided_s']:.3f} s in the guided step; ops of plain not run guided: "
          f"{sum(s for s, _ in missing):.3f} s ({len(missing)})")
    for k, s in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  guided {k}: {s:.3f} s over {len(per_kind_ops[k])} ops")
    print(f"  prediction: trace step {state.trace.step_time:.3f} s, predicted {sim.step_time:.3f} s "
          f"(replays {sim.recompute_s:.3f}, stalls {sim.stall_s:.3f})")
    for _, o in diffs[:a.top]:
        print(f"    slower {o}: {p_ops[o] * 1e3:.1f} -> {g_ops[o] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
