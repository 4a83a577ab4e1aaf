"""What a guided step really keeps live, against what its plan predicts: the plan made for a budget, run with the
budget lifted after the measured step, so that nothing is evicted on demand and the device's peak is the plan's own
working set; then the step's allocations of more than 64 KiB as the allocator recorded them (the planned layout's
record, `capuchin_tf.ops.layout_record`; recorded only, placed by BFC as without a layout unless `--place`), and the
ones live at once at their most, each with what the plan decided for the tensor its op made; and when each swapped
tensor's device buffer went, against the simulator's swap-out end.

    PYTHONPATH=. TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=400 \
        TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python tools/probe_live_set.py --model resnet50 --batch 32 \
        --budget-mb 207 --policy capuchin --link p100 --json out.json

The simulated device (TF_CPU_BFC_MEM_LIMIT_IN_MB) must be larger than the plan's real peak (twice the budget does).
`--keep-budget` leaves the budget in place (the steps then evict on demand where the working set passes it). Prints
the predicted and measured peaks per step and the live set at the record's peak; writes them as JSON, stamped;
`--save out.json.gz` also writes the trace and the plan that ran.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from probe_common import step_parser

MiB = 1 << 20


def live_at_peak(record: dict) -> tuple[int, list[tuple[str, int, int, int]]]:
    """The most bytes the recorded allocations kept live at once, and those live then (key, bytes, allocated, freed;
    largest first). An allocation live at the step's end counts until then."""
    end = int(max(list(record["allocated"]) + list(record["freed"]) + [0])) + 1
    spans = [(str(k), int(b), int(a), int(f) if f >= 0 else end)
             for k, b, a, f in zip(record["keys"], record["bytes"], record["allocated"], record["freed"]) if f != -2]
    events = sorted([(a, 1, b) for _, b, a, _ in spans] + [(f, 0, -b) for _, b, _, f in spans])
    level = best = 0
    at = 0
    for t, _, delta in events:
        level += delta
        if level > best:
            best, at = level, t
    live = sorted((s for s in spans if s[2] <= at < s[3]), key=lambda s: -s[1])
    return best, live


def simulated_live(trace, sim, at: float) -> list[tuple[str, int]]:
    """The trace's tensors the simulation has on the device at time `at` (its own clock), from the simulator's
    labelled events (policy/placement.py `live_at`): allocated and not freed or evicted by then. Replays' own
    intermediates (labels of their own) and persistent releases are left out; largest first."""
    from capuchin_tf.policy.placement import live_at

    return sorted(((t, n) for t, n in live_at(sim.events, at).items() if t in trace.tensors), key=lambda r: -r[1])


def main() -> int:
    p = step_parser(__doc__, policy="capuchin")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--keep-budget", action="store_true")
    p.add_argument("--warm", action="store_true", help="one plain step before the managed step (warms the kernels)")
    p.add_argument("--place", action="store_true", help="place by the planned layout (default: record only)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--save", help="also write the trace and the plan that ran (JSON, gzipped) for offline reading")
    a = p.parse_args()

    import tensorflow as tf

    import capuchin_tf
    from capuchin_tf.cli import models
    from capuchin_tf.cli.common import git_commit, machine
    from capuchin_tf.core.plan import SwapDecision
    from capuchin_tf.tf.simulated_device import DEVICE

    setup = models.build(a.model, a.batch)
    budget = a.budget_mb * MiB
    if a.warm:
        setup.train_step(*setup.inputs)
    step = capuchin_tf.function(setup.train_step, memory_budget=budget, policy=a.policy, link=a.link, feedback=False,
                                planned_layout=True)
    if not a.place:  # the steps' allocations are recorded, and BFC places them as it would without a layout
        begin = capuchin_tf.ops.layout_begin
        capuchin_tf.ops.layout_begin = lambda function_id: begin(function_id, record_only=True)
    step(*setup.inputs)  # the measured step, under the budget: the plan is made for it
    if not a.keep_budget:
        # the guided steps run the same plan with the device's own limit
        step._budget = lambda plain=False: contextlib.nullcontext()
    for _ in range(a.steps - 1):
        step(*setup.inputs)
    (report,) = step.report().values()
    (state,) = step.states().values()
    plan = state.plan
    record = capuchin_tf.ops.layout_record()
    top, live = live_at_peak(record)
    decided = {}
    for d in plan.decisions:
        decided[d.tensor.split(":")[0]] = "swapped" if isinstance(d, SwapDecision) else "recomputed"
    rows = []
    for key, nbytes, allocated, freed in live:
        op = key.rsplit("#", 2)[0]
        base = op.split("/capuchin_")[0]
        what = decided.get(op) or decided.get(base) or ("replay" if op.startswith("capuchin/recompute/") else
                                                        "swap-in" if op.startswith("capuchin/") else "")
        rows.append(dict(key=key, mib=round(nbytes / MiB, 3), allocated=allocated, freed=freed, plan=what))
    # When each swapped tensor's device buffer went, against the simulator's swap-out end, both as fractions of
    # their step (the trace's clock is not the guided step's).
    from capuchin_tf.policy.simulator import simulate

    sim = simulate(state.trace, plan)
    seconds = report["steps"][-1]["seconds"]
    first = {}
    for key, freed_ns, allocated_ns in zip(record["keys"], record["freed_ns"], record["allocated_ns"]):
        first.setdefault(key.rsplit("#", 2)[0], (int(allocated_ns), int(freed_ns)))
    pos = {o.name: i for i, o in enumerate(state.trace.ops)}
    swaps = []
    for d in plan.decisions:
        op = d.tensor.split(":")[0]
        if isinstance(d, SwapDecision) and op in first and first[op][1] >= 0 and d.tensor in sim.swap_out_end:
            swaps.append(dict(tensor=d.tensor, mib=round(d.nbytes / MiB, 3),
                              predicted_free=round(sim.swap_out_end[d.tensor] / sim.step_time, 4),
                              measured_free=round(first[op][1] / 1e9 / seconds, 4),
                              predicted_made=round(sim.op_end[pos[d.evicted_access.op]] / sim.step_time, 4),
                              measured_made=round(first[op][0] / 1e9 / seconds, 4)))
    sim_live = simulated_live(state.trace, sim, sim.peak_time)
    measured_ops = {}
    for key, nbytes, _, _ in live:
        measured_ops[key.rsplit("#", 2)[0]] = measured_ops.get(key.rsplit("#", 2)[0], 0) + nbytes
    sim_ops = {}
    for tid, nbytes in sim_live:
        if nbytes <= 64 << 10:  # the record holds the allocations of more than 64 KiB
            continue
        sim_ops[tid.split(":")[0]] = sim_ops.get(tid.split(":")[0], 0) + nbytes
    only_measured = sorted(((op, b) for op, b in measured_ops.items() if op not in sim_ops), key=lambda r: -r[1])
    only_sim = sorted(((op, b) for op, b in sim_ops.items() if op not in measured_ops), key=lambda r: -r[1])
    persistent = state.start_bytes
    steps = [{k: s[k] for k in ("phase", "seconds", "peak_bytes", "passive_evicted_bytes", "layout_bytes",
                                "layout_misses")} for s in report["steps"]]
    print(f"plan: {plan.policy}, {len(plan.decisions)} decisions, predicted peak "
          f"{plan.predicted_peak_bytes / MiB:.1f} MiB at {plan.predicted_peak_op}; budget {budget / MiB:.1f} MiB; "
          f"persistent {persistent / MiB:.1f} MiB")
    for s in steps:
        print(f"  {s['phase']:9s} {s['seconds']:7.3f} s  peak {s['peak_bytes'] / MiB:6.1f} MiB  evicted on demand "
              f"{s['passive_evicted_bytes'] / MiB:5.1f} MiB  region {s['layout_bytes'] / MiB:5.1f} MiB")
    print(f"swapped tensors' device buffers freed, as a fraction of the step (simulated step {sim.step_time:.3f} s on "
          f"the trace's clock, peak at {sim.peak_time / sim.step_time:.3f}; last step {seconds:.3f} s):")
    for s in swaps:
        print(f"  {s['mib']:6.2f} MiB  made {s['measured_made']:.3f}, evicted access predicted at "
              f"{s['predicted_made']:.3f}, freed {s['measured_free']:.3f} (predicted {s['predicted_free']:.3f})  "
              f"{s['tensor']}")
    print(f"last step: {len(record['keys'])} allocations of more than 64 KiB recorded, at most {top / MiB:.1f} MiB "
          f"live at once ({len(live)} allocations):")
    for r in rows[:a.top]:
        print(f"  {r['mib']:8.3f} MiB  {r['allocated']:5d}-{r['freed']:5d}  {r['plan']:10s}  {r['key']}")
    released = sum(n for t, n in state.trace.released if t <= sim.peak_time)
    print(f"trace: persistent {state.trace.persistent_bytes / MiB:.1f} MiB, released before the simulated peak "
          f"{released / MiB:.1f} MiB; the simulated peak {sim.peak_bytes / MiB:.1f} MiB")
    print(f"simulated live set at its peak: {sum(b for _, b in sim_live) / MiB:.1f} MiB ({len(sim_live)} tensors); "
          f"live at the record's peak, not in it: {sum(b for _, b in only_measured) / MiB:.1f} MiB; in it, not live "
          f"then: {sum(b for _, b in only_sim) / MiB:.1f} MiB")
    for op, b in only_measured[:a.top]:
        print(f"  measured only {b / MiB:8.3f} MiB  {decided.get(op, '')}  {op}")
    for op, b in only_sim[:a.top]:
        print(f"  simulated only {b / MiB:8.3f} MiB  {decided.get(op, '')}  {op}")
    result = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": a.model,
              "batch": a.batch, "budget_bytes": budget, "policy": a.policy, "link": a.link,
              "device_mb": int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", 0)), "keep_budget": a.keep_budget,
              "persistent_bytes": persistent, "trace_persistent_bytes": state.trace.persistent_bytes,
              "trace_released_before_peak_bytes": released, "predicted_peak_bytes": plan.predicted_peak_bytes,
              "predicted_peak_op": plan.predicted_peak_op, "device_peak_bytes": tf.config.experimental.get_memory_info(
                  DEVICE)["peak"], "steps": steps, "swaps": swaps, "simulated_step_s": sim.step_time,
              "simulated_peak_fraction": sim.peak_time / sim.step_time, "recorded_live_max_bytes": top,
              "live_at_peak": rows, "simulated_live_at_peak": [[t, b] for t, b in sim_live],
              "measured_only": only_measured, "simulated_only": only_sim,
              "record": {k: [str(x) if k == "keys" else int(x) for x in v] for k, v in record.items()},
              "decisions": [f"{'swap' if isinstance(d, SwapDecision) else 'recompute'} {d.tensor}"
                            for d in plan.decisions],
              "command": "tools/probe_live_set.py " + " ".join(sys.argv[1:])}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    if a.save:
        import gzip

        with gzip.open(a.save, "wt") as f:
            json.dump({"trace": state.trace.to_json(), "plan": plan.to_json()}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
