"""Feedback from guided steps to the plan (paper.md §1.6). Pure Python: imports no TensorFlow.

The runtime (capuchin_tf.runtime.managed_step) reads, after each guided step, which swap-ins waited for their copy (and
how long) and which prefetched tensors passive mode evicted again before their swap-in claimed them; `move_triggers`
turns that into the next plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.plan import Plan, SwapDecision

LATE_TRIGGER_STEP = 0.05  # a late prefetch's in-trigger moves earlier by this fraction of its swap time (the paper)


def move_triggers(plan: Plan, trace: AccessTrace, earlier: Mapping[str, float], later: set[str]) -> Plan:
    """The plan with the in-trigger of each swap in `earlier` (tensor -> how long its swap-in waited, seconds) moved
    earlier by 5% of its swap-in time (the paper's step) or by the time it waited, whichever is more (beyond the
    paper: one step instead of many), and of each in `later` moved later by 5% of its swap-in time; to the op of the
    trace that started closest to that time, kept after the evicted-access and before the back-access. Unchanged:
    the same object."""
    starts = sorted((o.start, o.name) for o in trace.ops)
    changed = False
    decisions = []
    for d in plan.decisions:
        if isinstance(d, SwapDecision) and d.in_trigger is not None and (d.tensor in earlier or d.tensor in later):
            step = LATE_TRIGGER_STEP * max(d.swap_in_s, 1e-6)
            if d.tensor in earlier:
                step = max(step, float(earlier[d.tensor]))
            lo, hi = d.evicted_access.time, d.back_access.time
            if d.tensor in earlier:
                candidates = [(s, n) for s, n in starts if lo < s <= d.in_trigger.time - step]
                pick = candidates[-1] if candidates else None
            else:
                candidates = [(s, n) for s, n in starts if d.in_trigger.time + step <= s < hi]
                pick = candidates[0] if candidates else None
            if pick is not None and pick[1] != d.in_trigger.op:
                direction = "earlier: late" if d.tensor in earlier else "later: evicted before its use"
                trigger = dataclasses.replace(d.in_trigger, op=pick[1], time=pick[0], index=-1)
                d = dataclasses.replace(d, in_trigger=trigger, reason=f"{d.reason} (in-trigger moved {direction})")
                changed = True
        decisions.append(d)
    return dataclasses.replace(plan, decisions=tuple(decisions)) if changed else plan
