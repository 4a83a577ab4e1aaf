"""Replays a plan on an AccessTrace with a device model: predicted memory curve, peak and step time. Pure Python.

The model (docs/policy.md, "The simulator"):

- **Compute.** Ops run in the trace's executed order for their measured durations. An op starts at its ideal start
  plus the delay accumulated so far (stalls and inserted replays push every later op back; a delay is never
  recovered), and no earlier than the end of inserted replay work: ``S_i = max(s_i + D, barrier, inputs ready)``.
  Idle gaps in the trace absorb inserted work.
- **Swaps.** At the end of the evicted-access's op the swap-out is queued on the device-to-host link; the device
  buffer is freed when that copy ends (the host store frees it then). At the end of the in-trigger's op the prefetch
  is queued on the host-to-device link, behind the tensor's own swap-out; the device buffer is allocated when the copy
  starts. One copy at a time per direction, first come first served. The back-access's op waits for the copy: a late
  prefetch is a stall. A swap without an in-trigger is swapped in on demand at the back-access.
- **What copies take from compute** (DeviceModel.copy_compute_bytes_per_s; none on a GPU): on the CPU device a
  swap-out or a prefetch delays every later op by its memcpy's compute time from the moment it is queued; a swap-in
  on demand does not (the op that waits for it has nothing to run beside it).
- **Recomputation.** The tensor is freed at the end of its evicted-access's op. Its replay runs just before the
  back-access's op (on demand, as in the paper) or just after its trigger's op (early); the replayed ops take their
  measured durations on the compute stream and delay what follows unless an idle gap absorbs them. Each replayed op
  allocates its outputs when it starts, except an element-wise op (`FORWARDING_OPS`) whose input the replay made, of
  the output's size and read by no later replayed op: its output takes that input's buffer, as TensorFlow forwards a
  dead input (the replay's tensors are not in the safety net's pool, so nothing else holds them); intermediates are
  freed after the last replayed op that reads them; the target and the tensors the replay keeps (collective
  recomputation) stay until their normal free.
- **Memory.** Every other allocation and free of the trace (tensors, temporaries, released persistent buffers) moves
  with the delay of the op running at that time.

Infeasible plans raise InfeasiblePlanError naming the tensor: a recompute source not resident when the replay runs,
a tensor read while it is evicted with no swap-in or replay planned before that read, a trigger that does not precede
its back-access, a replayed op that cannot be replayed exactly.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence

from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.core.graph_model import FORWARDING_OPS
from capuchin_tf.core.plan import EARLY, ON_DEMAND, RECOMPUTE, SWAP, Decision, Plan, RecomputeDecision, SwapDecision
from capuchin_tf.core.trace_index import TraceIndex

_OUT, _IN_FLIGHT, _IN = "out", "in-flight", "in"


class InfeasiblePlanError(ValueError):
    """The plan cannot run on this trace; the message names the tensor (and op) at fault."""


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What the simulator predicts for one plan. Times in seconds, on the simulated timeline."""

    peak_bytes: int  # device bytes at the peak (persistent + live transient), without any margin
    peak_time: float
    peak_pos: int  # position of the op running at the peak (the op that starts next if the peak is in a replay)
    peak_op: str
    step_time: float
    stall_s: float  # total time ops waited for swap-ins
    recompute_s: float  # total time replays delayed the step
    curve: tuple[tuple[float, int], ...]  # (time, bytes) after each event
    stalls: Mapping[str, float]  # per decision: delay it caused (swap: wait at the back-access; recompute: replay)
    op_start: tuple[float, ...]  # simulated start of each op
    op_end: tuple[float, ...]
    idle_before: tuple[float, ...]  # compute idle time just before each op (gaps an early replay can fill)
    restore_time: Mapping[str, float]  # when each evicted tensor's memory came back (swap-in start, replay)
    swap_out_end: Mapping[str, float]
    # Every allocation and free of the step in time order: (time, +bytes or -bytes, label). An allocation labelled
    # with a tensor id gives that tensor a buffer (its production, a swap-in, a replay that keeps it) and a free with
    # that label frees it (its eviction, its last read); a replay's temporaries have labels of their own; a release
    # of persistent memory has the label "" (policy/placement.py pairs them into buffers).
    events: tuple[tuple[float, int, str], ...] = ()
    copy_compute_s: float = 0.0  # total delay the copies' compute caused (DeviceModel.copy_compute_time)

    @functools.cached_property
    def _curve_times(self) -> list[float]:
        return [t for t, _ in self.curve]

    def max_bytes_between(self, t0: float, t1: float) -> int:
        """Highest level of the curve over [t0, t1]."""
        times = self._curve_times
        i = max(bisect.bisect_right(times, t0) - 1, 0)
        j = max(bisect.bisect_right(times, t1), i + 1)
        return max(b for _, b in self.curve[i:j])


def simulate(
    trace: AccessTrace,
    plan: Plan | Sequence[Decision] = (),
    device_model: DeviceModel | None = None,
    *,
    index: TraceIndex | None = None,
) -> SimulationResult:
    """Replays `plan` (a Plan or a sequence of decisions, in plan order) on `trace`. Raises InfeasiblePlanError."""
    if isinstance(plan, Plan):
        decisions = plan.decisions
        device_model = device_model or plan.device
    else:
        decisions = tuple(plan)
    if device_model is None:
        if any(d.kind == SWAP for d in decisions):
            raise ValueError("simulating swaps needs a device model")
        device_model = DeviceModel.symmetric(1.0)
    idx = index if index is not None else TraceIndex(trace)
    check_decisions(idx, decisions)
    return _Walk(idx, decisions, device_model).run()


def lower_bound_s(trace: AccessTrace, plan: Plan) -> float:
    """The least step time `plan` allows on `trace`'s clock, whatever the schedule: at least the trace's step; at
    least the compute (the time some op of the trace runs, plus every replay, which runs its ops again on the same
    compute); either plus what the copies take from compute (DeviceModel.copy_compute_time); at least the busy time
    of each copy direction (one copy at a time per direction, at best hidden behind the whole step). The simulator
    never predicts less (tests/pure/test_properties.py); a measured step over it is the schedule's and the
    implementation's cost, not the decisions'."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((o.start, o.start + o.duration) for o in trace.ops):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    # The replayed ops' times on this trace, which may have been re-timed after the plan was made.
    dur = {o.name: o.duration for o in trace.ops}
    replays = sum(sum(dur.get(op, 0.0) for op in d.replay_ops) for d in plan.recomputes)
    out_busy = sum(plan.device.swap_out_time(d.nbytes) for d in plan.swaps)
    in_busy = sum(plan.device.swap_in_time(d.nbytes) for d in plan.swaps)
    # What the copies take from compute (the CPU device's memcpy; none on a GPU): every swap-out and every prefetch.
    copies = sum(plan.device.copy_compute_time(d.nbytes) * (1 + (d.in_trigger is not None)) for d in plan.swaps)
    return max(trace.step_time + copies, busy + replays + copies, out_busy, in_busy)


# ---- structural checks ----------------------------------------------------------------------------------------------
def check_decisions(idx: TraceIndex, decisions: Iterable[Decision]) -> None:
    """Checks what can be checked without running the plan. Raises InfeasiblePlanError naming the tensor."""
    seen: dict[str, Decision] = {}
    decisions = list(decisions)
    for d in decisions:
        t = d.tensor
        if t in seen:
            raise InfeasiblePlanError(f"tensor {t!r} has two decisions; each tensor is evicted at most once")
        seen[t] = d
        view = idx.tensors.get(t)
        if view is None:
            raise InfeasiblePlanError(f"the plan evicts tensor {t!r}, which the trace does not record")
        if t in idx.unmanaged:
            raise InfeasiblePlanError(f"the plan evicts tensor {t!r}, which is persistent, made or read in a cond "
                                      "branch or a loop body, or made by lowered control flow")
        ev, back = d.evicted_access, d.back_access
        n = len(view.acc_pos)
        for what, ref in (("evicted-access", ev), ("back-access", back)):
            if ref.tensor != t:
                raise InfeasiblePlanError(f"tensor {t!r}: its {what} names another tensor ({ref.tensor!r})")
            if not 0 <= ref.index < n:
                raise InfeasiblePlanError(f"tensor {t!r}: {what} index {ref.index} out of range (it has {n} accesses)")
            op = idx.access_op(t, ref.index)
            if ref.op != op:
                raise InfeasiblePlanError(f"tensor {t!r}: {what} {ref.index} is made by op {op!r}, not {ref.op!r}")
        if back.index <= ev.index:
            raise InfeasiblePlanError(f"tensor {t!r}: back-access {back.index} does not follow evicted-access "
                                      f"{ev.index}")
        if back.index > ev.index + 1:
            k = ev.index + 1
            raise InfeasiblePlanError(
                f"tensor {t!r} is read by op {idx.access_op(t, k)!r} (access {k}) while evicted after access "
                f"{ev.index}, and no swap-in or recomputation is planned before that read"
            )
        p_ev, p_back = view.acc_pos[ev.index], view.acc_pos[back.index]
        if p_back <= p_ev:
            raise InfeasiblePlanError(
                f"tensor {t!r}: back-access op {back.op!r} does not come after evicted-access op {ev.op!r}"
            )
        if d.kind == SWAP:
            if d.in_trigger is not None:
                p_tr = _trigger_pos(idx, t, d.in_trigger, "in-trigger")
                if p_tr >= p_back:
                    raise InfeasiblePlanError(
                        f"tensor {t!r}: in-trigger op {d.in_trigger.op!r} does not precede its back-access op "
                        f"{back.op!r}"
                    )
                if p_tr < p_ev:
                    raise InfeasiblePlanError(
                        f"tensor {t!r}: in-trigger op {d.in_trigger.op!r} precedes its evicted-access op {ev.op!r}"
                    )
        elif d.kind == RECOMPUTE:
            _check_recompute(idx, d, p_ev, p_back)
        else:
            raise InfeasiblePlanError(f"tensor {t!r}: unknown decision kind {d.kind!r}")
    for d in decisions:
        if d.kind == RECOMPUTE:
            if d.regenerated_by is not None:
                by = seen.get(d.regenerated_by)
                if by is None or by.kind != RECOMPUTE or d.tensor not in by.keeps:
                    raise InfeasiblePlanError(
                        f"tensor {d.tensor!r} says it is rebuilt by the replay of {d.regenerated_by!r}, which does "
                        "not keep it"
                    )
            for k in d.keeps:
                other = seen.get(k)
                if other is None or other.kind != RECOMPUTE:
                    raise InfeasiblePlanError(
                        f"the replay of {d.tensor!r} keeps {k!r}, which the plan does not recompute"
                    )


def _trigger_pos(idx: TraceIndex, t: str, ref, what: str) -> int:
    p = idx.pos.get(ref.op)
    if p is None:
        raise InfeasiblePlanError(f"tensor {t!r}: {what} names op {ref.op!r}, which the trace never ran")
    rec = idx.trace.tensors.get(ref.tensor)
    moved = ref.index == -1  # a trigger at an op (AccessRef): the op is all there is to check
    if not moved and (rec is None or not 0 <= ref.index < len(rec.accesses) or rec.accesses[ref.index].op != ref.op):
        raise InfeasiblePlanError(
            f"tensor {t!r}: {what} ({ref.tensor!r}, access {ref.index}, op {ref.op!r}) is not an access of the trace"
        )
    if not idx.always_runs[p]:
        raise InfeasiblePlanError(f"tensor {t!r}: {what} names op {ref.op!r}, which may not run (a cond branch or a "
                                  "loop body)")
    return p


def _check_recompute(idx: TraceIndex, d: RecomputeDecision, p_ev: int, p_back: int) -> None:
    t = d.tensor
    if d.trigger_mode == ON_DEMAND:
        tr = d.trigger
        if (tr.tensor, tr.index, tr.op) != (t, d.back_access.index, d.back_access.op):
            raise InfeasiblePlanError(f"tensor {t!r}: an on-demand recomputation is triggered by its back-access")
    elif d.trigger_mode == EARLY:
        p_tr = _trigger_pos(idx, t, d.trigger, "recompute trigger")
        if p_tr >= p_back:
            raise InfeasiblePlanError(
                f"tensor {t!r}: recompute trigger op {d.trigger.op!r} does not precede its back-access op "
                f"{d.back_access.op!r}"
            )
        if p_tr <= p_ev:
            raise InfeasiblePlanError(
                f"tensor {t!r}: recompute trigger op {d.trigger.op!r} does not follow its evicted-access op "
                f"{d.evicted_access.op!r}"
            )
    else:
        raise InfeasiblePlanError(f"tensor {t!r}: unknown trigger mode {d.trigger_mode!r}")
    if not d.replay_ops:
        if d.regenerated_by is None:
            raise InfeasiblePlanError(f"tensor {t!r}: recomputation with no ops to replay")
        return
    prev = -1
    produces = False
    for name in d.replay_ops:
        p = idx.pos.get(name)
        if p is None:
            raise InfeasiblePlanError(f"tensor {t!r}: replayed op {name!r} never ran in the trace")
        if not idx.replayable[p]:
            raise InfeasiblePlanError(
                f"tensor {t!r}: op {name!r} cannot be replayed exactly (stateful or not replayable)"
            )
        if p <= prev:
            raise InfeasiblePlanError(f"tensor {t!r}: replayed ops are not in execution order at {name!r}")
        prev = p
        produces = produces or t in idx.op_outputs[p]
    if not produces:
        raise InfeasiblePlanError(f"tensor {t!r}: none of its replayed ops produces it")


# ---- the walk ------------------------------------------------------------------------------------------------------
class _Walk:
    def __init__(self, idx: TraceIndex, decisions: Sequence[Decision], dm: DeviceModel):
        self.idx = idx
        self.dm = dm
        n = idx.n_ops
        self.evict_after: list[list[Decision]] = [[] for _ in range(n)]
        self.prefetch_after: list[list[SwapDecision]] = [[] for _ in range(n)]
        self.early_after: list[list[RecomputeDecision]] = [[] for _ in range(n)]
        self.back_before: list[list[Decision]] = [[] for _ in range(n)]
        self.by_tensor: dict[str, Decision] = {}
        for d in decisions:
            v = idx.tensors[d.tensor]
            self.by_tensor[d.tensor] = d
            self.evict_after[v.acc_pos[d.evicted_access.index]].append(d)
            self.back_before[v.acc_pos[d.back_access.index]].append(d)
            if d.kind == SWAP and d.in_trigger is not None:
                self.prefetch_after[idx.pos[d.in_trigger.op]].append(d)
            elif d.kind == RECOMPUTE and d.trigger_mode == EARLY:
                self.early_after[idx.pos[d.trigger.op]].append(d)

    def run(self) -> SimulationResult:
        idx, dm = self.idx, self.dm
        n = idx.n_ops
        S = [0.0] * n
        E = [0.0] * n
        idle = [0.0] * n
        D = 0.0  # accumulated delay
        barrier = 0.0  # end of the last inserted replay
        busy = 0.0  # latest end of anything run so far on the compute stream
        d2h_free = h2d_free = float("-inf")
        state: dict[str, str] = {}
        ready: dict[str, float] = {}
        out_end: dict[str, float] = {}
        restore: dict[str, float] = {}
        events: list[tuple[float, int, str]] = []  # (time, +/- bytes, the buffer's tensor: see `events`)
        stalls: dict[str, float] = {}
        stall_total = 0.0
        recompute_total = 0.0
        copy_total = 0.0
        pending_early: list[str] = []

        def swap_in(t: str, nbytes: int, issue: float) -> None:
            """Queues t's host-to-device copy at `issue` (one copy at a time on the link): back in flight."""
            nonlocal h2d_free
            cs = max(issue, h2d_free)
            h2d_free = ce = cs + dm.swap_in_time(nbytes)
            events.append((cs, nbytes, t))
            restore[t] = cs
            ready[t] = ce
            state[t] = _IN_FLIGHT

        for i in range(n):
            base = max(idx.start[i] + D, barrier)
            if pending_early:  # delay the early replays just run cause to this op
                delay = max(0.0, barrier - (idx.start[i] + D))
                stalls[pending_early[-1]] = stalls.get(pending_early[-1], 0.0) + delay
                recompute_total += delay
                pending_early = []
            # Work before op i: on-demand replays, then waits for swap-ins.
            for d in self.back_before[i]:
                t = d.tensor
                if d.kind != RECOMPUTE:
                    continue
                if not d.replay_ops:
                    if state.get(t) != _IN:
                        raise InfeasiblePlanError(
                            f"tensor {t!r} is needed by op {idx.op_names[i]!r} but the replay of "
                            f"{d.regenerated_by!r} did not rebuild it before"
                        )
                    stalls[t] = 0.0
                    continue
                if d.trigger_mode == EARLY:
                    continue
                w0 = base
                w1 = self._replay(d, i, w0, state, ready, restore, events)
                stalls[t] = w1 - w0
                recompute_total += w1 - w0
                base = barrier = w1
                busy = max(busy, w1)
            start = base
            for d in self.back_before[i]:
                t = d.tensor
                if d.kind != SWAP:
                    continue
                if state.get(t) == _OUT:  # no in-trigger (or it did not fire): swap in on demand
                    swap_in(t, d.nbytes, max(base, out_end[t]))
                wait = max(0.0, ready[t] - base)
                stalls[t] = wait
                start = max(start, ready[t])
            stall_total += start - base
            for d in self.back_before[i]:
                if state.get(d.tensor) != _IN:
                    if state.get(d.tensor) == _IN_FLIGHT:
                        state[d.tensor] = _IN
                    else:
                        raise InfeasiblePlanError(
                            f"tensor {d.tensor!r} is not back on the device for its back-access at op "
                            f"{idx.op_names[i]!r}"
                        )
            for x in idx.op_reads[i]:
                st = state.get(x)
                if st == _OUT or st == _IN_FLIGHT:
                    d = self.by_tensor.get(x)
                    raise InfeasiblePlanError(
                        f"tensor {x!r} is read by op {idx.op_names[i]!r} while evicted, and no swap-in or "
                        "recomputation is planned before that read"
                        + ("" if d is None else f" (its back-access is op {d.back_access.op!r})")
                    )
            idle[i] = max(0.0, start - busy)
            S[i] = start
            E[i] = start + idx.dur[i]
            D = start - idx.start[i]
            busy = max(busy, E[i])
            # After op i: evictions, prefetches, early replays.
            for d in self.evict_after[i]:
                t = d.tensor
                if state.get(t) in (_OUT, _IN_FLIGHT):
                    raise InfeasiblePlanError(f"tensor {t!r} is evicted at op {idx.op_names[i]!r} while not resident")
                if d.kind == SWAP:
                    cs = max(E[i], d2h_free)
                    ce = cs + dm.swap_out_time(d.nbytes)
                    d2h_free = ce
                    out_end[t] = ce
                    events.append((ce, -d.nbytes, t))
                    cost = dm.copy_compute_time(d.nbytes)
                    D += cost
                    copy_total += cost
                else:
                    out_end[t] = E[i]
                    events.append((E[i], -d.nbytes, t))
                state[t] = _OUT
            for d in self.prefetch_after[i]:
                t = d.tensor
                if state.get(t) != _OUT:
                    raise InfeasiblePlanError(f"tensor {t!r}: in-trigger at op {idx.op_names[i]!r} before its eviction")
                swap_in(t, d.nbytes, max(E[i], out_end[t]))
                cost = dm.copy_compute_time(d.nbytes)
                D += cost
                copy_total += cost
            for d in self.early_after[i]:
                w0 = max(E[i], barrier)
                if not d.replay_ops:
                    continue
                w1 = self._replay(d, i + 1, w0, state, ready, restore, events)
                stalls[d.tensor] = 0.0
                pending_early.append(d.tensor)
                barrier = w1
                busy = max(busy, w1)

        if pending_early:  # replays after the last op lengthen the step by what sticks out
            tail = max(0.0, barrier - (idx.step_time + D))
            stalls[pending_early[-1]] += tail
            recompute_total += tail
            D += tail

        # Shift the trace's own allocations and frees with the delay of the op running then.
        starts = idx.start
        delta = [S[i] - starts[i] for i in range(n)]

        def shift_alloc(t: float) -> float:
            j = bisect.bisect_right(starts, t) - 1
            return t + (delta[j] if j >= 0 else 0.0)

        def shift_free(t: float) -> float:
            j = bisect.bisect_left(starts, t) - 1
            return t + (delta[j] if j >= 0 else 0.0)

        for tid, rec in idx.trace.tensors.items():
            if rec.nbytes == 0:
                continue
            events.append((shift_alloc(rec.alloc), rec.nbytes, tid))
            if rec.free is not None:
                events.append((shift_free(rec.free), -rec.nbytes, tid))
        for t, nbytes in idx.trace.released:
            events.append((shift_free(t), -nbytes, ""))
        events.sort()
        level = idx.trace.persistent_bytes
        curve = [(0.0, level)]
        peak, peak_time = level, 0.0
        for time, dlt, _ in events:
            level += dlt
            curve.append((time, level))
            if level > peak:
                peak, peak_time = level, time
        peak_pos = max(bisect.bisect_right(S, peak_time) - 1, 0) if n else 0
        step = idx.step_time + D
        return SimulationResult(
            peak_bytes=peak,
            peak_time=peak_time,
            peak_pos=peak_pos,
            peak_op=idx.op_names[peak_pos] if n else "",
            step_time=step,
            stall_s=stall_total,
            recompute_s=recompute_total,
            curve=tuple(curve),
            stalls=stalls,
            op_start=tuple(S),
            op_end=tuple(E),
            idle_before=tuple(idle),
            restore_time=restore,
            swap_out_end=out_end,
            events=tuple(events),
            copy_compute_s=copy_total,
        )

    def _replay(self, d: RecomputeDecision, k: int, w0: float, state, ready, restore, events) -> float:
        """Runs the replay of `d` starting at w0, before op position k. Returns its end."""
        idx = self.idx
        t = w0
        produced: dict[str, float] = {}
        last_use: dict[str, float] = {}
        keep = set(d.keeps)
        keep.add(d.tensor)
        if state.get(d.tensor) != _OUT:
            raise InfeasiblePlanError(
                f"tensor {d.tensor!r}: its replay runs before op {idx.op_names[min(k, idx.n_ops - 1)]!r} but it is "
                "not evicted then"
            )
        reads_left: dict[str, int] = {}  # replayed ops still to run that read each tensor
        for name in d.replay_ops:
            for x in idx.op_inputs[idx.pos[name]]:
                reads_left[x] = reads_left.get(x, 0) + 1
        forwarded: dict[str, str] = {}  # output -> the replay-made input whose buffer it took
        for name in d.replay_ops:
            p = idx.pos[name]
            for x in idx.op_inputs[p]:
                if x in produced:
                    continue
                v = idx.tensors.get(x)
                if v is None:
                    continue  # untracked: persistent state, step inputs, host-side tensors
                st = state.get(x)
                if st == _IN_FLIGHT:
                    t = max(t, ready[x])
                elif st == _OUT or not v.alive_before(k):
                    where = idx.op_names[k] if k < idx.n_ops else "the end of the step"
                    raise InfeasiblePlanError(
                        f"recomputation of {d.tensor!r}: source {x!r} (read by replayed op {name!r}) is not resident "
                        f"when the replay runs (before op {where!r})"
                    )
            t0 = t
            t += idx.dur[p]
            for x in idx.op_inputs[p]:
                reads_left[x] -= 1
                if x in produced:
                    last_use[x] = t
            for out in idx.op_outputs[p]:
                produced[out] = t0
                last_use.setdefault(out, t)
                if idx.op_type[p] in FORWARDING_OPS:
                    size = idx.tensors[out].nbytes
                    for x in idx.op_inputs[p]:
                        if (x in produced and x not in keep and x not in forwarded.values() and reads_left[x] == 0
                                and idx.tensors[x].nbytes == size):
                            forwarded[out] = x
                            break
        gave = set(forwarded.values())
        for out, t_alloc in produced.items():
            nbytes = idx.tensors[out].nbytes
            if out in gave:
                continue  # its buffer went on to the output that took it
            # A buffer handed on is allocated when its first holder was made.
            first = out
            while first in forwarded:
                first = forwarded[first]
            if out in keep:
                if state.get(out) != _OUT:
                    raise InfeasiblePlanError(
                        f"the replay of {d.tensor!r} keeps {out!r}, which is not evicted when the replay runs"
                    )
                state[out] = _IN
                restore[out] = t_alloc
                events.append((produced[first], nbytes, out))
            elif nbytes:
                label = f"{out}@replay{len(events)}"  # a temporary of this replay: a buffer of its own
                events.append((produced[first], nbytes, label))
                events.append((last_use[out], -nbytes, label))
        missing = keep.difference(produced)
        if missing:
            raise InfeasiblePlanError(f"the replay of {d.tensor!r} does not produce {sorted(missing)[0]!r}")
        return t
