"""Where a guided step's device memory departs from what the simulator predicted for its plan: per op of the trace,
the bytes in use when it started, measured (TensorFlow's profiler, allocator events of one guided step) against
simulated (policy.simulator.simulate on the plan and trace the step runs); and, at the op of the largest gap, the
buffers of at least 1 MiB alive in the measured step, by the op that allocated them.

    TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=600 TF_ENABLE_ONEDNN_OPTS=0 \
        .venv/bin/python tools/probe_prediction_gap.py --model dropout-bn --batch 128 --budget-mb 102 --json out.json

The measured step runs under --budget-mb; the guided steps run with the budget not enforced (the device's size,
TF_CPU_BFC_MEM_LIMIT_IN_MB, larger than the budget) and the feedback off, so that the plan's own memory shows, not
what the safety net evicted; --safety-net off also leaves out the pool. The step after --warm guided steps is profiled.
Writes the per-op rows and the live buffers as JSON, stamped.
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import json
import os
import shutil
import tempfile
import time

from probe_common import step_parser


def main() -> int:
    p = step_parser(__doc__, policy="capuchin")
    p.add_argument("--safety-net", choices=("on", "off"), default="on")
    p.add_argument("--warm", type=int, default=2)
    a = p.parse_args()

    import tensorflow as tf

    import capuchin_tf
    from capuchin_tf import policy as policies
    from capuchin_tf.cli import models
    from capuchin_tf.cli.common import git_commit, machine
    from capuchin_tf.policy import placement
    from capuchin_tf.policy.simulator import simulate
    from capuchin_tf.runtime import managed_step
    from capuchin_tf.tf import measure

    base = policies.POLICIES[a.policy]
    name = f"{a.policy}{'+' if a.safety_net == 'on' else '-'}net"
    policies.register_policy(name, base.plan, safety_net=a.safety_net == "on",
                             runtime_options=dict(base.runtime_options))
    enforce = managed_step.ManagedStep._budget
    calls = [0]

    @contextlib.contextmanager
    def measured_step_only(self, plain: bool = False, lowered: int | None = None):  # the measured step's only
        calls[0] += 1
        if calls[0] == 1:
            with enforce(self, plain=plain, lowered=lowered):
                yield
        else:
            yield

    managed_step.ManagedStep._budget = measured_step_only
    setup = models.build(a.model, a.batch)
    step = capuchin_tf.function(setup.train_step, memory_budget=a.budget_mb * 2**20, policy=name, link=a.link,
                                feedback=False)
    for _ in range(1 + a.warm):
        step(*setup.inputs)
    (state,) = step.states().values()
    logdir = tempfile.mkdtemp(prefix="capuchin_gap_")
    try:
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0,
                                                           device_tracer_level=0)
        tf.profiler.experimental.start(logdir, options=options)
        try:
            step(*setup.inputs)
        finally:
            tf.profiler.experimental.stop()
        path = max(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
        kernels, memory, _ = measure.read_xspace(path)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    plan, trace = state.plan, state.trace
    sim = simulate(trace, plan)
    levels = sorted((m.time, m.in_use_after) for m in memory if m.in_use_after >= 0)
    times = [t for t, _ in levels]
    sim_times = [t for t, _ in sim.curve]

    def measured_at(t):
        i = bisect.bisect_right(times, t) - 1
        return levels[i][1] if i >= 0 else 0

    def simulated_at(t):
        i = bisect.bisect_right(sim_times, t) - 1
        return sim.curve[i][1] if i >= 0 else 0

    started: dict[str, int] = {}
    for k in sorted(kernels, key=lambda k: k.start):
        started.setdefault(k.op, k.start)
    rows = sorted((started[o.name], o.name, measured_at(started[o.name]), simulated_at(sim.op_start[i]), i)
                  for i, o in enumerate(trace.ops) if o.name in started)
    t_first = rows[0][0] if rows else 0
    rows = [{"op": op, "pos": i, "measured_bytes": m, "simulated_bytes": s, "measured_start_s": (t - t_first) / 1e9,
             "simulated_start_s": sim.op_start[i]} for t, op, m, s, i in rows]
    worst = max(rows, key=lambda r: r["measured_bytes"] - r["simulated_bytes"])
    t_worst = started[worst["op"]]
    alive, lives = {}, []
    for m in sorted(memory, key=lambda m: m.time):
        if m.allocation:
            alive[m.addr] = (m.time, m.nbytes, m.op, m.region)
        elif m.addr in alive:
            t0, nbytes, op, region = alive.pop(m.addr)
            lives.append((t0, m.time, nbytes, op, region))
    lives += [(t0, None, nbytes, op, region) for t0, nbytes, op, region in alive.values()]
    live_at_worst = sorted(({"bytes": b, "op": op, "region": r} for t0, t1, b, op, r in lives
                            if b >= 2**20 and t0 <= t_worst and (t1 is None or t1 > t_worst)),
                           key=lambda x: -x["bytes"])
    measured_peak = max(b for _, b in levels)
    # Placement, measured against predicted: the step's allocations of more than SMALL_BYTES as BFC placed them (the
    # highest end above the lowest start: the run of device they needed; the most of their bytes live at once) and
    # the plan's simulated buffers placed by policy/placement.py.
    spans, live_now, live_big_peak = [], 0, 0
    addr_of = {}
    for m in sorted(memory, key=lambda m: m.time):
        if m.nbytes <= placement.SMALL_BYTES and m.addr not in addr_of:
            continue
        if m.allocation:
            addr_of[m.addr] = m.nbytes
            spans.append((m.addr, m.addr + m.nbytes))
            live_now += m.nbytes
            live_big_peak = max(live_big_peak, live_now)
        elif m.addr in addr_of:
            live_now -= addr_of.pop(m.addr)
    measured_extent = (max(e for _, e in spans) - min(a for a, _ in spans)) if spans else 0
    first = min(memory, key=lambda m: m.time)
    at_start = first.in_use_after - (first.nbytes if first.allocation else -first.nbytes)
    if spans:
        print(f"large allocations between {min(a for a, _ in spans):#x} and {max(e for _, e in spans):#x}; "
              f"{at_start / 2**20:.1f} MiB in use at the step's start")
    predicted = placement.place(sim.events)
    print(f"placement: measured run {measured_extent / 2**20:.1f} MiB for {live_big_peak / 2**20:.1f} MiB live at "
          f"most (+{(measured_extent - live_big_peak) / 2**20:.1f}); predicted {predicted.extent / 2**20:.1f} MiB for "
          f"{predicted.live_peak / 2**20:.1f} (+{predicted.fragmentation / 2**20:.1f})")
    print(f"plan: {plan.summary().splitlines()[0]}")
    print(f"predicted peak {plan.predicted_peak_bytes / 2**20:.1f} MiB; measured peak {measured_peak / 2**20:.1f} MiB")
    for r in rows[::max(1, len(rows) // 40)]:
        print(f"  {r['op'][:72]:72s} measured {r['measured_bytes'] / 2**20:7.1f}  simulated "
              f"{r['simulated_bytes'] / 2**20:7.1f}  gap {(r['measured_bytes'] - r['simulated_bytes']) / 2**20:+6.1f}")
    print(f"largest gap at {worst['op']}: "
          f"{(worst['measured_bytes'] - worst['simulated_bytes']) / 2**20:+.1f} MiB; buffers alive there:")
    for x in live_at_worst:
        print(f"  {x['bytes'] / 2**20:6.2f} MiB  {x['op']} ({x['region']})")
    # The simulator's buffers alive at the same op (its events: +/- bytes per tensor), of at least 1 MiB, by the op
    # that produced them, beside the measured ones: which tensors make the gap.
    t_sim = sim.op_start[worst["pos"]]
    sim_live: dict[str, int] = {}
    for t, delta, tensor in sorted(sim.events, key=lambda e: e[0]):
        if t > t_sim:
            break
        sim_live[tensor] = sim_live.get(tensor, 0) + delta
    sim_big = {k: v for k, v in sim_live.items() if v >= 2**20}
    sim_ops = {k.rsplit(":", 1)[0]: v for k, v in sim_big.items()}
    meas_ops: dict[str, int] = {}
    for x in live_at_worst:
        meas_ops[x["op"]] = meas_ops.get(x["op"], 0) + x["bytes"]
    only_measured = sorted(((b, o) for o, b in meas_ops.items() if o not in sim_ops), reverse=True)
    only_simulated = sorted(((b, o) for o, b in sim_ops.items() if o not in meas_ops), reverse=True)
    print(f"alive there (>= 1 MiB), measured only: {sum(b for b, _ in only_measured) / 2**20:.1f} MiB; simulated only: "
          f"{sum(b for b, _ in only_simulated) / 2**20:.1f} MiB")
    for b, o in only_measured:
        print(f"  measured only  {b / 2**20:6.2f} MiB  {o}")
    for b, o in only_simulated:
        print(f"  simulated only {b / 2**20:6.2f} MiB  {o}")
    evictions = eviction_lags(plan, trace, sim, kernels, memory, started)
    late = [e for e in evictions if e["measured_free_pos"] is not None and e["lag_ops"] > 0]
    print(f"evicted tensors whose device buffer was freed later than simulated: {len(late)} of {len(evictions)}, "
          f"{sum(e['nbytes'] for e in late) / 2**20:.1f} MiB")
    for e in sorted(late, key=lambda e: -e["lag_ops"] * e["nbytes"])[:15]:
        print(f"  {e['kind']:9s} {e['nbytes'] / 2**20:6.2f} MiB freed at op {e['measured_free_pos']:5d}, simulated "
              f"{e['simulated_free_pos']:5d} (evicted after {e['evicted_pos']:5d}): {e['tensor'][:70]}")
    result = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": a.model,
              "batch": a.batch, "budget_mb": a.budget_mb, "policy": a.policy, "safety_net": a.safety_net,
              "device_mb": int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", 0)), "link": a.link,
              "predicted_peak_bytes": plan.predicted_peak_bytes, "measured_peak_bytes": measured_peak,
              "measured_extent_bytes": measured_extent, "measured_large_live_peak_bytes": live_big_peak,
              "predicted_extent_bytes": predicted.extent, "predicted_large_live_peak_bytes": predicted.live_peak,
              "swapped_tensors": len(plan.swaps), "recomputed_tensors": len(plan.recomputes),
              "largest_gap_op": worst["op"], "live_at_largest_gap": live_at_worst, "evictions": evictions,
              "measured_only_at_largest_gap": [{"op": o, "bytes": b} for b, o in only_measured],
              "simulated_only_at_largest_gap": [{"op": o, "bytes": b} for b, o in only_simulated],
              "rows": rows}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def eviction_lags(plan, trace, sim, kernels, memory, started) -> list[dict]:
    """Per evicted tensor of the plan: the op position at which the measured step freed the device buffer its
    producer allocated (the first allocation of at least its bytes by its producing op; None when none is found or
    it was never freed) and the position at which the simulator freed it, with the lag between them in ops."""
    positions = sorted((started[o.name], i) for i, o in enumerate(trace.ops) if o.name in started)
    starts = [t for t, _ in positions]

    def measured_pos(t: int) -> int:
        return positions[max(bisect.bisect_right(starts, t) - 1, 0)][1]

    def simulated_pos(t: float) -> int:
        return max(bisect.bisect_right(sim.op_start, t) - 1, 0)

    frees: dict[int, list[int]] = {}
    for m in memory:
        if not m.allocation:
            frees.setdefault(m.addr, []).append(m.time)
    ends: dict[str, int] = {}
    for k in kernels:
        ends[k.op] = max(ends.get(k.op, 0), k.end)
    pos = {o.name: i for i, o in enumerate(trace.ops)}
    out = []
    for d in (*plan.swaps, *plan.recomputes):
        producer = d.tensor.rsplit(":", 1)[0]
        allocs = sorted((m.time, m.addr) for m in memory if m.allocation and m.op == producer and m.nbytes >= d.nbytes)
        freed = None
        if allocs:
            t0, addr = allocs[0]
            later = [t for t in frees.get(addr, ()) if t > t0]
            freed = min(later) if later else None
        m_pos = None if freed is None else measured_pos(freed)
        s_pos = simulated_pos(sim.swap_out_end.get(d.tensor, 0.0))
        e_pos = pos[d.evicted_access.op]
        evicted_end = ends.get(d.evicted_access.op)
        out.append({"tensor": d.tensor, "kind": str(d.kind), "nbytes": d.nbytes,
                    "evicted_pos": e_pos, "simulated_free_pos": s_pos,
                    "measured_free_pos": m_pos, "lag_ops": None if m_pos is None else m_pos - s_pos,
                    # seconds from the end of the evicted access to the free: simulated on the trace's clock
                    "simulated_free_after_s": sim.swap_out_end.get(d.tensor, sim.op_end[e_pos]) - sim.op_end[e_pos],
                    "measured_free_after_s": None if freed is None or evicted_end is None
                    else (freed - evicted_end) / 1e9})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
