"""Candidates (paper.md §1.8): tensors accessed more than once and alive in the peak window, and their pairs.

The planning context gathers what every policy derives from the trace and the budget once:

- ``limit``: the budget minus the margin (allocator bytes the tensor model does not see);
- ``target``: the memory-saving target (the larger of what passive mode evicted and ideal peak - limit; §1.9);
- ``need_window``: the period where the ideal curve is above the limit (the paper's "peak memory period" for
  choosing candidates: only there does evicting a tensor help);
- ``trigger_window``: the period in-triggers avoid (a prefetch there would raise the peak, as in passive mode): where
  the ideal curve's transient part is above ``peak_fraction`` (0.9) of its peak;
- the working-set floor: an op whose inputs + outputs + persistent state exceed the limit makes the budget
  unreachable by any plan (design.md, promise 2).

A candidate pair is two consecutive accesses {evicted-access k, back-access k+1} of a candidate tensor whose gap
overlaps the need window, with its free time FT (eq. 1).
"""

from __future__ import annotations

import dataclasses

from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.core.trace_index import TraceIndex


@dataclasses.dataclass(frozen=True)
class Context:
    """Everything a policy derives once from (trace, budget, device model, options)."""

    idx: TraceIndex
    dm: DeviceModel
    budget: int
    margin: int
    target: int
    need_window: tuple[float, float] | None
    trigger_window: tuple[float, float] | None
    min_bytes: int
    unreachable_op: str | None
    unreachable_bytes: int

    @property
    def trace(self) -> AccessTrace:
        return self.idx.trace

    @property
    def limit(self) -> int:
        return self.budget - self.margin

    def in_trigger_window(self, time: float) -> bool:
        w = self.trigger_window
        return w is not None and w[0] <= time <= w[1]


def default_margin(trace: AccessTrace) -> int:
    """Allocator bytes the tensor model does not explain: measured peak - replayed peak (0 when replay covers it)."""
    return max(0, int(trace.peak_bytes) - trace.replayed_peak_bytes())


def make_context(
    trace: AccessTrace,
    budget_bytes: int,
    device_model: DeviceModel,
    *,
    index: TraceIndex | None = None,
    margin_bytes: int | None = None,
    peak_fraction: float = 0.9,
    min_candidate_bytes: int | None = None,
) -> Context:
    if budget_bytes is None or budget_bytes < 0:
        raise ValueError(f"the budget must be a non-negative number of bytes, got {budget_bytes!r}")
    idx = index if index is not None else TraceIndex(trace)
    margin = default_margin(trace) if margin_bytes is None else int(margin_bytes)
    if margin < 0:
        raise ValueError(f"margin_bytes must be >= 0, got {margin_bytes!r}")
    limit = budget_bytes - margin
    peak = idx.replayed_peak()
    target = trace.saving_target(budget_bytes, margin, replayed_peak=peak)
    need = idx.window(limit) if peak > limit else None
    persistent = trace.persistent_bytes
    trig = idx.window(int(persistent + peak_fraction * (peak - persistent))) if peak > limit else None
    if min_candidate_bytes is None:
        # Tensors under 0.1% of the saving target cannot make a difference, and each planned action costs ops in
        # the rewritten graph; FT ranking would otherwise take thousands of tiny tensors first.
        min_candidate_bytes = max(1, target // 1000)
    worst_op, worst = None, 0
    for i, ws in enumerate(idx.working_sets()):
        if ws > worst:
            worst_op, worst = idx.op_names[i], ws
    unreachable = worst_op if worst > limit else None
    return Context(
        idx=idx,
        dm=device_model,
        budget=int(budget_bytes),
        margin=margin,
        target=target,
        need_window=need,
        trigger_window=trig,
        min_bytes=int(min_candidate_bytes),
        unreachable_op=unreachable,
        unreachable_bytes=worst if unreachable else 0,
    )


@dataclasses.dataclass(frozen=True)
class CandidatePair:
    """{evicted-access k, back-access k+1} of one candidate tensor, with its free time (eq. 1)."""

    tensor: str
    k: int  # evicted-access index; the back-access is k + 1
    nbytes: int
    ev_pos: int
    back_pos: int
    t_evict_end: float  # end of the evicted-access's op: the swap-out starts here
    t_back: float  # time of the back-access (its op's start)
    swap_out_s: float
    swap_in_s: float

    @property
    def free_time(self) -> float:
        """FT = SwapInStartTime - SwapOutEndTime = (t_back - SwapTime_in) - (t_evict_end + SwapTime_out)."""
        return (self.t_back - self.swap_in_s) - (self.t_evict_end + self.swap_out_s)

    @property
    def gap(self) -> float:
        return self.t_back - self.t_evict_end


def candidate_pairs(ctx: Context, min_bytes: int | None = None) -> dict[str, list[CandidatePair]]:
    """Per candidate tensor, its consecutive-access pairs whose gap overlaps the need window (time order).

    Tensors under `min_bytes` (default: the context's) are left out."""
    min_bytes = ctx.min_bytes if min_bytes is None else min_bytes
    out: dict[str, list[CandidatePair]] = {}
    w = ctx.need_window
    if w is None:
        return out
    idx, dm = ctx.idx, ctx.dm
    step_end = idx.step_time
    for tid, v in idx.tensors.items():
        if len(v.acc_pos) < 2 or v.nbytes < min_bytes or v.nbytes <= 0 or tid in idx.unmanaged:
            continue
        free = step_end if v.free is None else v.free
        if not (v.alloc < w[1] and free > w[0]):  # alive during the peak window
            continue
        pairs = []
        for k in range(len(v.acc_pos) - 1):
            ev, back = v.acc_pos[k], v.acc_pos[k + 1]
            if back < ev + 2:
                continue  # no op runs while it would be away: evicting it saves nothing
            t_ev, t_back = idx.end[ev], v.acc_time[k + 1]
            if t_ev >= w[1] or t_back <= w[0]:
                continue
            if idx.curve_max(t_ev, idx.start[back]) - idx.curve_max(t_ev, t_ev) < min_bytes:
                # Nothing of note (the smallest candidate's size) is allocated while it would be away, between the
                # evicted-access's op and the back-access's, so no peak falls there: the memory is highest at those
                # two ops, where it is on the device. (Seen: 91 of dropout-bn b128's 143 pairs, a
                # BatchNorm product evicted after the op that made it and rebuilt by a replay of up to 9 ops, 48 ms,
                # for the next op 47 us later, with only per-channel vectors made in between.)
                continue
            pairs.append(
                CandidatePair(tid, k, v.nbytes, ev, back, t_ev, t_back, dm.swap_out_time(v.nbytes),
                              dm.swap_in_time(v.nbytes))
            )
        if pairs:
            out[tid] = pairs
    return out


def recompute_pair(pairs: list[CandidatePair]) -> CandidatePair:
    """The pair a recomputation uses: the longest gap (typically the last forward use to the first backward use)."""
    return max(pairs, key=lambda p: (p.gap, -p.k))
