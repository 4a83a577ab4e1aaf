"""Feedback from guided steps to the plan (paper.md §1.6). Pure Python: imports no TensorFlow.

The runtime (capuchin_tf.runtime.managed_step) reads, after each guided step, which swap-ins waited for their copy (and
how long) and which prefetched tensors passive mode evicted again before their swap-in claimed them;
`plan_after_step` (through `move_triggers`) turns that into the next plan. After an out-of-memory error or a peak
over the budget, `tighter_plan` chooses the plan for a tighter budget. The runtime installs what these return.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping

from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.plan import Plan, SwapDecision

LATE_TRIGGER_STEP = 0.05  # a late prefetch's in-trigger moves earlier by this fraction of its swap time (the paper)
# Late prefetches re-plan only when their waits add up to this fraction of the step's time: a new plan costs a rewrite
# and a new instantiation of the step (seconds on a large graph), more than waits of microseconds save.
LATE_REPLAN_FRACTION = 0.05
TIGHTEN = 0.95  # a guided step over budget, or out of memory, re-plans for this fraction of the budget in use
TIGHTEN_PROBES = 3  # if no plan fits that budget: plans bisecting toward the current one


def move_triggers(plan: Plan, trace: AccessTrace, earlier: Mapping[str, float], later: set[str]) -> Plan:
    """The plan with the in-trigger of each swap in `earlier` (tensor -> how long its swap-in waited, seconds) moved
    earlier by 5% of its swap-in time (the paper's step) or by the time it waited, whichever is more (beyond the
    paper: one step instead of many), and of each in `later` moved later by 5% of its swap-in time; to the op of the
    trace that started closest to that time, kept after the evicted-access and before the back-access. Unchanged:
    the same object."""
    starts = sorted((o.start, o.name) for o in trace.ops)
    # Times on this trace's clock (the plan's own are those of the trace it was made on, which the runtime may have
    # re-timed since: ManagedStep._retime): an access's, or for a moved trigger (index -1) its op's start.
    start_of = {name: s for s, name in starts}

    def at(ref) -> float:
        rec = trace.tensors.get(ref.tensor)
        if ref.index >= 0 and rec is not None and ref.index < len(rec.accesses):
            return rec.accesses[ref.index].time
        return start_of[ref.op]

    changed = False
    decisions = []
    for d in plan.decisions:
        if isinstance(d, SwapDecision) and d.in_trigger is not None and (d.tensor in earlier or d.tensor in later):
            step = LATE_TRIGGER_STEP * max(d.swap_in_s, 1e-6)
            if d.tensor in earlier:
                step = max(step, float(earlier[d.tensor]))
            lo, hi, trigger_at = at(d.evicted_access), at(d.back_access), at(d.in_trigger)
            if d.tensor in earlier:
                candidates = [(s, n) for s, n in starts if lo < s <= trigger_at - step]
                pick = candidates[-1] if candidates else None
            else:
                candidates = [(s, n) for s, n in starts if trigger_at + step <= s < hi]
                pick = candidates[0] if candidates else None
            if pick is not None and pick[1] != d.in_trigger.op:
                direction = "earlier: late" if d.tensor in earlier else "later: evicted before its use"
                trigger = dataclasses.replace(d.in_trigger, op=pick[1], time=pick[0], index=-1)
                d = dataclasses.replace(d, in_trigger=trigger, reason=f"{d.reason} (in-trigger moved {direction})")
                changed = True
        decisions.append(d)
    return dataclasses.replace(plan, decisions=tuple(decisions)) if changed else plan


def plan_after_step(plan: Plan, trace: AccessTrace, late: Mapping[str, float], early: set[str] | list[str],
                    seconds: float, earlier_frozen: bool = False,
                    early_waits: Mapping[str, float] | None = None) -> Plan:
    """The plan for the next guided step, from what the last one (of `seconds`) saw: `late` (tensor -> seconds its
    swap-in waited) and `early` (prefetched tensors evicted again before their swap-in; `early_waits`: tensor ->
    seconds bringing it back on demand took). The plan changes only when what these cost adds up to
    LATE_REPLAN_FRACTION of the step: a plan change costs a rewrite and a new instantiation (docs/decisions.md, "What
    a plan change costs"). With `early_waits` None an early prefetch counts whatever it cost. A prefetch evicted again
    came too early for the memory there: its trigger moves later (beyond the paper); a late one moves earlier (the
    paper), unless `earlier_frozen`. Eviction wins when a tensor was both. Unchanged: the same object."""
    early = set(early)
    cost = sum(late.values()) + sum((early_waits or {}).get(t, 0.0) for t in early)
    if cost < LATE_REPLAN_FRACTION * seconds:
        late = {}
        if early_waits is not None:
            early = set()
    if not late and not early:
        return plan
    earlier = {} if earlier_frozen else {t: w for t, w in late.items() if t not in early}
    return move_triggers(plan, trace, earlier=earlier, later=early)


def tighter_plan(plan_for: Callable[[int], Plan], current_budget: int,
                 current_plan: Plan | None) -> tuple[int, Plan] | None:
    """The (budget, plan) to run after an out-of-memory error or a peak over the budget; None: keep the current plan.

    The policies are greedy, so a plan for a tighter budget can be predicted far above the one that failed, even
    infeasible (docs/decisions.md, "Out of memory in a guided step: tighten, never upward, then back to the last
    plan that ran"). So the tightest budget of TIGHTEN x `current_budget`, then bisection toward the current one
    (TIGHTEN_PROBES plans of `plan_for`), whose plan fits is taken; if none fits, the lowest predicted peak, if below
    the current plan's; else None (what failed may have been a copy's timing or the allocator's layout, which vary
    from step to step)."""
    target = int(current_budget * TIGHTEN)
    tried = [(target, plan_for(target))]
    if not tried[0][1].feasible and current_plan is not None:
        lo, hi = target, current_budget  # lo: no plan fits; hi: the plan that failed
        for _ in range(TIGHTEN_PROBES):
            mid = (lo + hi) // 2
            tried.append((mid, plan_for(mid)))
            if tried[-1][1].feasible:
                hi = mid
            else:
                lo = mid
    fitting = [(b, p) for b, p in tried if p.feasible]
    if fitting:
        return min(fitting, key=lambda bp: bp[0])
    budget, plan = min(tried, key=lambda bp: bp[1].predicted_peak_bytes)
    if current_plan is not None and plan.predicted_peak_bytes >= current_plan.predicted_peak_bytes:
        return None
    return budget, plan


# ---- measured arbitration (beyond the paper) ------------------------------------------------------------------------
# The simulator models memory as bytes, not as the allocator's layout: a plan that fits by bytes can still wait for
# copies on demand every step, where a plan of another shape runs with room to spare (docs/decisions.md, "Measured
# arbitration"). So when a settled guided step waits for copies on demand for at least TRIAL_FRACTION of its time, the
# plans of the policy's `trials` (policy.Policy) are tried, each for TRIAL_STEPS measured steps (after the first,
# which instantiates the new step), and kept only when measured faster than the plan that ran. A trial is expected to
# take the incumbent's measured step times the ratio of the two plans' predicted steps with their placements' copies
# on demand (trial_expected_s); one not expected to be kept is not tried (trial_may_win), and of those that may win
# the one expected fastest is. The trial LEARNED_MARGIN is the policy's own plan made again with what the running
# plan's steps were measured to need beyond its predicted placement (placement_error; the policy's
# `placement_error_bytes`, hybrid.plan_capuchin): the plan's model learns from the measured step (docs/decisions.md,
# "A placement error, assumed then learned"). It may start from the first guided step of a plan (the bytes it
# evicted on demand are the evidence; its time, an instantiation, is not compared until a later step has run).
ON_DEMAND_KINDS = ("passive_eviction", "evicted_get", "copy_wait", "device_move")  # core/stalls.py, lower case
TRIAL_FRACTION = 0.05
# A trial predicted over the budget is tried only on evidence that the device holds the running plan with more: it
# may be over by at most what each of the running plan's steps evicted on demand, and by at most TRIAL_PEAK_SLACK of
# the budget (5% without that condition until 0bdc7aa, then none: plans run over their predicted peak,
# docs/decisions.md, "A learned margin", and a recompute-only trial ran out of memory in a CI run, the mlp b2048 at
# 46 MiB, its retry spoiling the step; the evidence condition since 2026-12-06, "Trials over the budget by less than
# was evicted").
TRIAL_PEAK_SLACK = 0.01
TRIAL_STEPS = 2
TRIAL_KEEP = 0.97  # the trial plan is kept when its median step is at most this fraction of the incumbent's
TRIAL_PREDICTION_SLACK = 0.0  # a trial expected slower than TRIAL_KEEP of the incumbent's step by more is not tried
LEARNED_MARGIN = "margin"  # a `trials` entry: the policy's own plan, with the placement error guided steps measured


def on_demand_s(waited: Mapping[str, float]) -> float:
    """Seconds a step waited for copies on demand (evictions, on-demand swap-ins, copies in flight, moves)."""
    return sum(float(waited.get(k, 0.0)) for k in ON_DEMAND_KINDS)


def wants_trial(waited: Mapping[str, float], seconds: float) -> bool:
    """Whether a settled guided step's waits for copies on demand justify measuring another plan."""
    return seconds > 0 and on_demand_s(waited) >= TRIAL_FRACTION * seconds


def trial_candidate(plan: Plan, budget: int, evicted_on_demand: int = 0, running: Plan | None = None) -> bool:
    """Whether a trial policy's `plan` may be tried under `budget`: nothing unreachable, and predicted within the
    budget, or over it by less than `evicted_on_demand` (the least any step of the running plan evicted on demand:
    the running plan already needs that much beyond the device every step, and its steps survive it) and by at most
    TRIAL_PEAK_SLACK of the budget (the cnn b128 at 117 MiB, p100: swap-only predicted 0.2 MiB over, its baseline
    0.607 s a step with 12 MiB on demand, against capuchin's hybrid at 0.72 s with 16-32 MiB), and then, given the
    `running` plan, placed no higher than it: the evidence is for the device the running plan needs, not more
    (dropout-bn b128 at 102 MiB, p100: the checkpoint plan, 0.5 MiB over and placed at 102.5 MiB against the running
    plan's 97.5, ran out of memory in each of five suites)."""
    if plan.unreachable_op is not None:
        return False
    over = plan.predicted_peak_bytes - int(budget)
    if over <= 0:
        return True
    if running is not None and plan.predicted_placed_peak_bytes > running.predicted_placed_peak_bytes:
        return False
    return over < int(evicted_on_demand) and over <= TRIAL_PEAK_SLACK * budget


def trial_expected_s(trial_cost_s: float, incumbent_cost_s: float, incumbent_s: float) -> float:
    """A trial plan's step as the incumbent's measured one predicts it: the incumbent's measured step `incumbent_s`
    times the trial's predicted cost over the incumbent's, both on one trace and device model and both placed
    (hybrid.placed_step_s: the simulated step plus a copy out and back of what the plan's placed peak needs beyond
    the device less the placement error, the one its steps were measured to have, at least the prior; the copies on
    demand the simulator does not have). A ratio of two predictions, so that the simulator's error common to both
    (the trace's clock against the guided steps', kernel times, per-step work) cancels (docs/decisions.md, "A trial
    must be expected to be kept", "A trial's expectation counts its placement")."""
    if incumbent_cost_s <= 0:
        return trial_cost_s
    return incumbent_s * trial_cost_s / incumbent_cost_s


def trial_may_win(expected_s: float, incumbent_s: float) -> bool:
    """Whether a trial plan expected to take `expected_s` a step (trial_expected_s) may be kept against an incumbent
    measured at `incumbent_s`: expected at most TRIAL_KEEP of it (with TRIAL_PREDICTION_SLACK of room). A trial
    that cannot be kept costs a plan change, the steps its build overlaps, and its measured steps (a margin plan of
    recomputations predicted 1.80x the trace's step on the mlp, against its incumbent measured at 1.2x)."""
    return expected_s <= (1 + TRIAL_PREDICTION_SLACK) * TRIAL_KEEP * incumbent_s


def trial_keeps(incumbent_s: float, trial_steps_s) -> bool:
    """Whether the trial plan stays: its median measured step at most TRIAL_KEEP of the incumbent's."""
    return statistics.median(trial_steps_s) <= TRIAL_KEEP * incumbent_s


def placement_error(plan: Plan, budget: int, evicted_on_demand: int) -> int:
    """What a plan's guided steps were measured to need beyond its predicted placed peak on a device of `budget`
    bytes: they needed the device and the bytes they evicted on demand (the most of any of its steps), so that much
    over the placed peak; 0 when nothing was evicted (no evidence either way) or the placement predicted more."""
    if evicted_on_demand <= 0:
        return 0
    return max(0, int(budget) + int(evicted_on_demand) - plan.predicted_placed_peak_bytes)


def margin_candidate(plan: Plan, incumbent: Plan | None, budget: int) -> bool:
    """Whether a LEARNED_MARGIN trial's `plan` may be tried: a trial candidate under the real `budget`, and placed
    below the plan that ran (else it is that plan again, or one the planner cannot bring lower)."""
    if not trial_candidate(plan, budget):
        return False
    return incumbent is None or plan.predicted_placed_peak_bytes < incumbent.predicted_placed_peak_bytes
