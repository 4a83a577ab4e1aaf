"""The swap policy (paper.md §1.6): free time, in-trigger choice with per-direction link queues, swap decisions.

For a pair {evicted-access, back-access}:

- the swap-out is queued at the end of the evicted-access's op; ``SwapOutEnd`` is when its copy ends, after the
  copies already queued in that direction (one copy at a time per direction);
- the ideal ``SwapInStart = t_back - SwapTime``; walking the trigger candidates (ops with a recorded access) backwards
  from it, the **in-trigger** is the first one whose prefetch, queued behind the tensor's own swap-out and behind the
  prefetches already queued, ends by the back-access without making any queued copy late, and whose op does not end
  inside the peak period. The prefetch is issued when the trigger's op ends (the rewriter orders it after that op);
- if no trigger hides it, the one with the least lateness (own stall + lateness pushed onto queued copies) is kept,
  and that lateness is the swap's overhead (§1.8, "swap overhead").

``LinkSchedule`` keeps one direction's queue (issue time, duration, start, end, deadline) in issue order, and answers
"what if this copy were queued at time t" without changing anything (``trial``), walking only the copies it pushes.
"""

from __future__ import annotations

import bisect
import dataclasses

from capuchin_tf.policy.candidates import CandidatePair, Context

EPS = 1e-12
MAX_TRIGGER_STEPS = 32


@dataclasses.dataclass(frozen=True)
class Trial:
    pos: int
    issue: float
    dur: float
    start: float
    end: float
    pushed: tuple[tuple[int, float, float], ...]  # (queue index, new start, new end) of copies pushed later
    extra_lateness: float  # how much later than their deadlines the pushed copies now end (sum, seconds)
    complete: bool = True  # False: the walk stopped once extra_lateness exceeded the caller's budget (inf then)


class LinkSchedule:
    """One direction of the link: copies in issue order, first come first served, one at a time."""

    def __init__(self):
        self.issue: list[float] = []
        self.dur: list[float] = []
        self.start: list[float] = []
        self.end: list[float] = []
        self.deadline: list[float] = []
        self.owner: list[str] = []

    def __len__(self) -> int:
        return len(self.issue)

    def start_if_queued(self, issue: float) -> tuple[int, float]:
        """(queue position, start) of a copy queued at `issue`, without walking the copies it would push."""
        p = bisect.bisect_right(self.issue, issue)
        return p, (max(issue, self.end[p - 1]) if p else issue)

    def trial(self, issue: float, dur: float, budget: float = float("inf")) -> Trial:
        """A copy queued at `issue`: its start and end, and what it does to the copies queued after it. Stops (and
        reports infinite lateness) as soon as the lateness pushed onto them exceeds `budget`."""
        p, start = self.start_if_queued(issue)
        end = start + dur
        cur, extra, pushed = end, 0.0, []
        issues, starts, durs, ends, deadlines = self.issue, self.start, self.dur, self.end, self.deadline
        for j in range(p, len(issues)):
            ns = issues[j] if issues[j] > cur else cur
            if ns <= starts[j] + EPS:
                break
            ne = ns + durs[j]
            dl = deadlines[j]
            if ne > dl:
                extra += ne - dl - (ends[j] - dl if ends[j] > dl else 0.0)
                if extra > budget:
                    return Trial(p, issue, dur, start, end, (), float("inf"), complete=False)
            pushed.append((j, ns, ne))
            cur = ne
        return Trial(p, issue, dur, start, end, tuple(pushed), extra)

    def remove(self, owner: str) -> None:
        """Takes `owner`'s copy out of the queue; the copies queued behind it move earlier where they can."""
        try:
            p = self.owner.index(owner)
        except ValueError:
            return
        for a in (self.issue, self.dur, self.start, self.end, self.deadline, self.owner):
            del a[p]
        for j in range(p, len(self.issue)):
            ns = max(self.issue[j], self.end[j - 1]) if j else self.issue[j]
            if ns >= self.start[j] - EPS:
                break
            self.start[j], self.end[j] = ns, ns + self.dur[j]

    def commit(self, t: Trial, deadline: float, owner: str) -> None:
        if not t.complete:
            raise ValueError("cannot commit an incomplete trial")
        for j, ns, ne in t.pushed:
            self.start[j], self.end[j] = ns, ne
        p = t.pos
        self.issue.insert(p, t.issue)
        self.dur.insert(p, t.dur)
        self.start.insert(p, t.start)
        self.end.insert(p, t.end)
        self.deadline.insert(p, deadline)
        self.owner.insert(p, owner)


@dataclasses.dataclass(frozen=True)
class SwapOption:
    """A pair with its chosen in-trigger and the planner's timing, ready to commit."""

    pair: CandidatePair
    trigger_pos: int | None
    out_trial: Trial
    in_trial: Trial | None
    stall: float  # own lateness at the back-access
    overhead: float  # stall + lateness pushed onto queued copies

    @property
    def out_end(self) -> float:
        return self.out_trial.end

    @property
    def in_start(self) -> float:
        return self.in_trial.start if self.in_trial is not None else self.pair.t_back

    @property
    def hidden(self) -> bool:
        return self.overhead <= EPS

    def off_device(self) -> tuple[float, float]:
        """When the tensor's bytes are off the device: from the swap-out's end to the swap-in's start."""
        return (self.out_end, self.in_start)


class SwapPlanner:
    """Evaluates and commits swaps against the two link queues."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.d2h = LinkSchedule()
        self.h2d = LinkSchedule()
        self.chosen: dict[str, SwapOption] = {}
        self.order: list[str] = []
        self.version = 0  # bumped on every commit: evaluations made at an older version are stale

    def evaluate(
        self, pair: CandidatePair, max_steps: int = MAX_TRIGGER_STEPS, *, not_before: int | None = None
    ) -> SwapOption | None:
        """The pair's best in-trigger (hidden if any), or None if no trigger candidate exists.

        With `not_before` (an op position), the in-trigger must be that op or a later one, and the peak-period rule is
        waived: the swap is meant to keep the tensor away during that op (the simulator judges the memory)."""
        ctx, idx = self.ctx, self.ctx.idx
        lo = pair.ev_pos if not_before is None else max(pair.ev_pos, not_before)

        def excluded(e: float) -> bool:
            return not_before is None and ctx.in_trigger_window(e)

        out = self.d2h.trial(pair.t_evict_end, pair.swap_out_s)
        out_end = out.end
        # d2h lateness imposed on queued swap-outs delays their prefetches
        out_extra = out.extra_lateness
        ideal = pair.t_back - pair.swap_in_s
        ends, poss, reach = idx.trigger_ends, idx.trigger_pos, idx.trigger_pos_max
        i = bisect.bisect_right(ends, ideal) - 1
        best = None
        steps = 0
        while i >= 0 and steps < max_steps and reach[i] >= lo:  # (else every trigger left is before `lo`)
            j = poss[i]
            e = ends[i]
            i -= 1
            if j < lo or j >= pair.back_pos or excluded(e):
                continue
            steps += 1
            issue = max(e, out_end)
            _, start = self.h2d.start_if_queued(issue)
            stall = max(0.0, start + pair.swap_in_s - pair.t_back)
            if best is not None and stall + out_extra >= best.overhead - EPS:
                if e <= out_end:
                    break
                continue  # cannot beat the best so far, whatever it pushes
            budget = best.overhead - EPS - stall - out_extra if best is not None else float("inf")
            tr = self.h2d.trial(issue, pair.swap_in_s, budget)
            if tr.complete:
                over = stall + tr.extra_lateness + out_extra
                best = SwapOption(pair, j, out, tr, stall, over)
                if over <= EPS:
                    break  # hidden
            if e <= out_end:
                break  # every earlier trigger would issue at the swap-out's end all the same
        if best is None:
            # No trigger candidate at or before the ideal start (or all in the peak period): take the latest
            # allowed trigger after it (the prefetch will be late, the stall is its overhead).
            k = bisect.bisect_right(ends, ideal)
            while k < len(ends):
                j, e = poss[k], ends[k]
                k += 1
                if lo <= j < pair.back_pos and not excluded(e):
                    tr = self.h2d.trial(max(e, out_end), pair.swap_in_s)
                    stall = max(0.0, tr.end - pair.t_back)
                    best = SwapOption(pair, j, out, tr, stall, stall + tr.extra_lateness + out_extra)
                    break
        return best

    def evaluate_at(self, pair: CandidatePair, trigger_pos: int) -> SwapOption:
        """The swap of `pair` with the in-trigger at op `trigger_pos`, against the current queues."""
        out = self.d2h.trial(pair.t_evict_end, pair.swap_out_s)
        tr = self.h2d.trial(max(self.ctx.idx.end[trigger_pos], out.end), pair.swap_in_s)
        stall = max(0.0, tr.end - pair.t_back)
        return SwapOption(pair, trigger_pos, out, tr, stall, stall + tr.extra_lateness + out.extra_lateness)

    def commit(self, opt: SwapOption) -> None:
        t = opt.pair.tensor
        self.d2h.commit(opt.out_trial, opt.in_trial.issue if opt.in_trial else opt.pair.t_back, t)
        if opt.in_trial is not None:
            self.h2d.commit(opt.in_trial, opt.pair.t_back, t)
        if t not in self.chosen:
            self.order.append(t)
        self.chosen[t] = opt
        self.version += 1

    def _uncommit(self, t: str) -> SwapOption:
        self.d2h.remove(t)
        self.h2d.remove(t)
        self.version += 1
        return self.chosen[t]

    def retrigger_option(self, t: str, not_before: int) -> SwapOption | None:
        """What the chosen swap of `t` would become with its in-trigger at op `not_before` or later (beyond the
        paper: an in-trigger moved later, to keep the tensor away during that op). Changes nothing."""
        version = self.version
        old = self._uncommit(t)
        try:
            return self.evaluate(old.pair, not_before=not_before)
        finally:
            self.commit(self.evaluate_at(old.pair, old.trigger_pos))
            self.version = version  # the queues are as they were: cached evaluations stay valid

    def retrigger(self, opt: SwapOption) -> None:
        """Replaces the chosen swap of the same tensor by `opt` (from retrigger_option)."""
        self._uncommit(opt.pair.tensor)
        self.commit(self.evaluate_at(opt.pair, opt.trigger_pos))
