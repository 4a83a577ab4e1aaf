"""The hybrid policy (paper.md §1.8, Algorithm 1), and its two halves alone (swap-only, recompute-only).

1. Candidates and their pairs (candidates.py); the pairs ranked by free time FT, largest first.
2. Swaps that can be fully hidden (an in-trigger with zero expected stall, nothing queued made late), taken from the
   top of the ranking, each tensor at most once, until the saving target is met.
3. While the target is not met (Algorithm 1's loop): s = the best remaining swap, with its in-trigger and overhead
   (the stall left after overlap plus the lateness it pushes onto queued copies): walking the FT ranking, the first
   that can be hidden, else the least overhead per byte among the next few; r = the recompute candidate with the
   largest MSPS, whose overhead is rp_time + ext_time. The cheaper per byte saved is kept (ties go to the swap); the
   other stays a candidate. Sources, MSPS and swap feasibility are updated after each pick (Algorithm 2's updates).
4. Beyond the paper's scalar target: the plan is simulated; while its predicted peak exceeds the budget, first the
   tensors collective recomputation keeps at that moment are no longer kept ("if memory allows"), else the same
   choice is made among what would be off the device at the op of the predicted peak (new swaps, with the
   peak-period rule waived; recomputations; or a chosen swap's in-trigger moved after that op), enough bytes to
   cover the excess, and the plan is simulated again. If nothing is left, the plan is reported not feasible, naming
   the op (or, if an op's working set alone exceeds the budget, that op).
5. Beyond the paper, on request (``place_within``): the plan's buffers are placed (policy/placement.py) and the
   allocation that first takes them past the device is covered at the op running then, as a peak is (4.).
6. Beyond the paper: replays are moved into idle gaps before their back-access when that hides them and memory
   allows (recompute.move_early); kept only if the simulation says the step is faster and the budget holds.
"""

from __future__ import annotations

import bisect
import dataclasses
import time

from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.core.plan import ON_DEMAND, Plan
from capuchin_tf.core.trace_index import TraceIndex
from capuchin_tf.policy import placement
from capuchin_tf.policy.baselines import plan_checkpoint
from capuchin_tf.policy.candidates import CandidatePair, candidate_pairs, make_context, recompute_pair
from capuchin_tf.policy.common import finalize, fits, simulate_feasible, swap_decision
from capuchin_tf.policy.recompute import (
    RECOMPUTE_EVICTION,
    SWAP_EVICTION,
    RecomputeSelector,
    Residency,
    assemble,
    move_early,
    replay_extra_bytes,
)
from capuchin_tf.policy.simulator import InfeasiblePlanError, simulate
from capuchin_tf.policy.swap import SwapOption, SwapPlanner

HALF_MARGIN = 0.01  # another plan replaces a fitting hybrid plan only when predicted this much cheaper (plan_capuchin)
PLACED_ROUNDS = 2  # a greedy is planned again at most this often for its placement's needs (plan_capuchin)
COVER_ROUNDS = 4  # placement covers tried at most this often per plan (hybrid's place_within)
MAX_SCAN = 16  # swap pairs evaluated per pick when looking for one that covers the predicted peak (64 was
# slower and no better on the measured ResNet50, bert-4l and BERT-base traces: docs/results.md)


def plan_capuchin(
    trace: AccessTrace, budget_bytes: int, device_model: DeviceModel, *, fallback: bool = False,
    placement_error_bytes: int | None = None, **options
) -> Plan:
    """Capuchin's hybrid policy: free swaps first, then the cheaper of swap and recompute (Algorithm 1).

    Beyond the paper (``fallback``): the greedy can paint itself into a corner (a recomputation chosen early keeps
    its sources on the device where a swap was needed later), or pick a mix its own simulator predicts slower than one
    of its halves; and a plan whose bytes fit can still need more device than the budget once its buffers are placed
    (policy/placement.py), which a guided step pays in copies on demand. So more plans are made: the two halves, the
    hybrid and each half with the allocation that first takes its placement past the budget covered where it is
    placed (``covered``, ``swap-only covered``, ``recompute-only covered``: `hybrid`'s ``place_within``), the hybrid
    and each half for the budget less what its placement needs beyond it (``placed``, ``swap-only placed``,
    ``recompute-only placed``), and the checkpoint plan; each is
    costed at its predicted step plus the copies its placed peak over the budget would take (`placed_cost`), and the
    cheapest that fits is returned (the hybrid unless another is more than HALF_MARGIN cheaper; still named
    ``capuchin``, ``options["fallback"]`` says which plan it is); if none fits, the hybrid plan is returned.

    ``placement_error_bytes``: how much more device than their placed peak plans are taken to need (the runtime's
    feedback.placement_error, learned from guided steps; at least placement.reserve, the step's largest buffer, the
    default); every plan is costed, and placed again, as if the device were that much smaller."""
    started = time.perf_counter()
    report: dict = {}
    index = options.pop("index", None) or TraceIndex(trace)
    # With the fallback the hybrid's placement is covered too (`hybrid`'s place_within): the covered plan is one more
    # candidate, the plan as without it (report["uncovered"]) the hybrid's own.
    plan = hybrid(
        trace, budget_bytes, device_model, policy="capuchin", swap=True, recompute=True, _report=report, index=index,
        place_within=budget_bytes if fallback else None, **options,
    )
    covered_hybrid, plan = plan, report.get("uncovered", plan)
    placement_error_bytes = assumed_placement_error(trace, placement_error_bytes)
    learned = {"placement_error": placement_error_bytes} if placement_error_bytes > 0 else {}
    if not fallback or plan.unreachable_op is not None or report.get("hopeless"):
        # (hopeless: even evicting every candidate could not bring that op under the budget)
        return dataclasses.replace(plan, options=tuple(sorted(dict(plan.options, **learned).items())))
    device = budget_bytes - placement_error_bytes  # what the placement may use
    others = []
    for half, sw, rc in (("", True, True), ("swap-only", True, False), ("recompute-only", False, True)):
        if half:
            # the greedy, and the same greedy with the allocation that first takes its placement past the budget
            # covered where it is placed
            made_report: dict = {}
            covered = hybrid(trace, budget_bytes, device_model, policy="capuchin", swap=sw, recompute=rc,
                             index=index, place_within=budget_bytes, _report=made_report, **options)
            made = made_report.get("uncovered", covered)
            others.append((half, made))
        else:
            made, covered = plan, covered_hybrid
        if covered.decisions != made.decisions:
            others.append((f"{half} covered" if half else "covered", covered))
        # The same greedy planned again for the budget less what its placement needs beyond the device.
        for _ in range(PLACED_ROUNDS):
            excess = made.predicted_placed_peak_bytes - device
            if excess <= 0 or made.budget_bytes - excess <= trace.persistent_bytes:
                break
            made = hybrid(trace, made.budget_bytes - excess, device_model, policy="capuchin", swap=sw,
                          recompute=rc, index=index, **options)
            if not made.feasible:
                break
            others.append((f"{half} placed" if half else "placed", made))
    others.append(("checkpoint", plan_checkpoint(trace, budget_bytes, device_model, index=index,
                                                 margin_bytes=options.get("margin_bytes"))))
    own = placed_cost(plan, device) if plan.feasible else float("inf")
    fitting = [(placed_cost(p, device), name, p) for name, p in others
               if p.feasible and p.predicted_peak_bytes <= budget_bytes
               and placed_cost(p, device) < own * (1 - HALF_MARGIN)]
    if not fitting:
        return dataclasses.replace(plan, options=tuple(sorted(dict(plan.options, **learned).items())),
                                   planning_s=time.perf_counter() - started)
    _, name, best = min(fitting, key=lambda x: x[:2])
    return dataclasses.replace(
        best,
        policy="capuchin",
        budget_bytes=budget_bytes,
        options=tuple(sorted(dict(best.options, fallback=name, **learned).items())),
        planning_s=time.perf_counter() - started,
    )


def assumed_placement_error(trace: AccessTrace, learned_bytes: int | None = 0) -> int:
    """How much more device than their placed peak plans are taken to need: the error learned from guided steps
    (feedback.placement_error), at least the prior (placement.reserve, the step's largest buffer)."""
    return max(placement.reserve(t.nbytes for t in trace.tensors.values()), int(learned_bytes or 0))


def placed_cost(plan: Plan, budget_bytes: int) -> float:
    """The step `plan` is predicted to take on a device of `budget_bytes`: its simulated step, plus a copy out and
    back of what its placed peak (Plan.predicted_placed_peak_bytes) needs beyond the device, which a guided step
    evicts on demand."""
    return placed_step_s(plan.predicted_step_s, plan.predicted_placed_peak_bytes, budget_bytes, plan.device)


def placed_step_s(step_s: float, placed_peak_bytes: int, device_bytes: int, device: DeviceModel) -> float:
    """`placed_cost` of a plan whose step was simulated as `step_s` on `device` (the runtime's measured arbitration
    simulates the running plan again on the trial's trace and device model)."""
    excess = max(0, int(placed_peak_bytes) - int(device_bytes))
    return step_s + device.swap_out_time(excess) + device.swap_in_time(excess)


def plan_swap_only(trace: AccessTrace, budget_bytes: int, device_model: DeviceModel, **options) -> Plan:
    """Capuchin's swap half alone: hidden swaps by FT, then the least-overhead swaps."""
    options.setdefault("early_recompute", False)
    return hybrid(trace, budget_bytes, device_model, policy="swap-only", swap=True, recompute=False, **options)


def plan_recompute_only(trace: AccessTrace, budget_bytes: int, device_model: DeviceModel, **options) -> Plan:
    """Capuchin's recomputation half alone: Algorithm 2's MSPS greedy with collective recomputation."""
    return hybrid(trace, budget_bytes, device_model, policy="recompute-only", swap=False, recompute=True, **options)


class _Hybrid:
    def __init__(self, ctx, swap: bool, recompute: bool, collective: bool):
        self.ctx = ctx
        self.idx = ctx.idx
        self.collective = collective
        self.pairs = candidate_pairs(ctx)
        self.ranking: list[CandidatePair] = sorted(
            (p for ps in self.pairs.values() for p in ps), key=lambda p: (-p.free_time, p.tensor, p.k)
        )
        # Lowering a predicted peak is a precise need: there, tensors of any size may help, the largest first (the
        # fewest actions for the bytes).
        self.cover_ranking = sorted(
            (p for ps in candidate_pairs(ctx, min_bytes=1).values() for p in ps),
            key=lambda p: (-p.nbytes, -p.free_time, p.tensor, p.k),
        )
        self.res = Residency(self.idx)
        self.sp = SwapPlanner(ctx) if swap else None
        self.rs = (
            RecomputeSelector(ctx, (recompute_pair(ps) for ps in self.pairs.values()), self.res) if recompute else None
        )
        self.taken: set[str] = set()
        self.reasons: dict[str, str] = {}
        self.recompute_pairs: dict[str, CandidatePair] = {}
        self._swap_ptr = 0
        self.no_keep: set[str] = set()
        self._evals: dict[tuple, tuple[int, SwapOption | None]] = {}

    def evaluate(self, p: CandidatePair, not_before: int | None = None) -> SwapOption | None:
        """SwapPlanner.evaluate, cached until the link queues change."""
        key = (p.tensor, p.k, not_before)
        hit = self._evals.get(key)
        if hit is not None and hit[0] == self.sp.version:
            return hit[1]
        opt = self.sp.evaluate(p, not_before=not_before)
        self._evals[key] = (self.sp.version, opt)
        return opt

    # ---- picks ----
    def _usable(self, opt: SwapOption | None, window) -> bool:
        if opt is None:
            return False
        a, b = opt.off_device()
        if b - a <= 0 or window is None:
            return False
        if a >= opt.pair.t_back:
            # The swap-out cannot end before the back-access (the link is too slow for the gap, or queued behind
            # other copies): the bytes would be off the device only while the step stalls for them, which lowers
            # the memory at no op, and the copy would hold the link: every later swap-out queues behind it and
            # keeps its device buffer meanwhile (docs/decisions.md, "A swap is chosen only if its swap-out can end
            # before its back-access").
            return False
        if a >= window[1] or b <= window[0]:
            return False
        p = opt.pair
        return self.rs is None or not self.rs.would_break(p.tensor, p.ev_pos, p.back_pos)

    def take_swap(self, opt: SwapOption, why: str) -> None:
        p = opt.pair
        self.sp.commit(opt)
        self.taken.add(p.tensor)
        self.reasons[p.tensor] = why
        if self.rs is not None:
            self.rs.evicted_by_swap(p.tensor, p.ev_pos, p.back_pos)
        else:
            self.res.evict(p.tensor, p.ev_pos, p.back_pos, SWAP_EVICTION)

    def recompute_ok(self, c) -> bool:
        """Choosing `c` must leave every chosen target that uses it as a source rebuildable within memory."""
        p = c.pair
        if self.rs.would_break(p.tensor, p.ev_pos, p.back_pos, RECOMPUTE_EVICTION):
            self.rs.discard(p.tensor)
            return False
        return True

    def best_recompute(self, accept=None):
        while True:
            r = self.rs.top(accept) if self.rs is not None else None
            if r is None or self.recompute_ok(r):
                return r

    def take_recompute(self, tid: str, why: str) -> None:
        c = self.rs.choose(tid)
        self.taken.add(tid)
        self.reasons[tid] = why
        self.recompute_pairs[tid] = c.pair

    def free_swaps(self, need: int) -> int:
        """Phase 2: swaps that can be fully hidden, by FT, until the target is met."""
        if self.sp is None:
            return need
        for p in self.ranking:
            if need <= 0 or p.free_time < 0:
                break  # FT < 0: no in-trigger can hide it (the ranking is by FT)
            if p.tensor in self.taken:
                continue
            opt = self.evaluate(p)
            if opt is None or not opt.hidden or not self._usable(opt, self.ctx.need_window):
                continue
            self.take_swap(opt, f"swap hidden by its in-trigger (FT {p.free_time * 1e3:.3f} ms)")
            need -= p.nbytes
        return need

    def best_swap(self, lookahead: int = 16) -> SwapOption | None:
        """The best remaining swap: walking the FT ranking, the first one that can be hidden, else the least overhead
        per byte among the next `lookahead` usable pairs (FT alone ignores the link queues)."""
        if self.sp is None:
            return None
        best, best_cost, seen = None, float("inf"), 0
        i = self._swap_ptr
        while i < len(self.ranking) and seen < lookahead:
            p = self.ranking[i]
            i += 1
            if p.tensor in self.taken:
                if i - 1 == self._swap_ptr:
                    self._swap_ptr = i
                continue
            opt = self.evaluate(p)
            if not self._usable(opt, self.ctx.need_window):
                if i - 1 == self._swap_ptr:
                    self._swap_ptr = i  # placed or not, it stays useless: skip it from now on
                continue
            seen += 1
            if opt.hidden:
                return opt
            cost = opt.overhead / p.nbytes
            if cost < best_cost:
                best, best_cost = opt, cost
        return best

    def covering_swap(self, pos: int) -> SwapOption | None:
        """A swap that keeps its tensor off the device during op `pos`: the largest tensor whose swap is hidden, else
        the least overhead per byte among the first MAX_SCAN that cover it."""
        if self.sp is None:
            return None
        idx = self.idx
        t0, t1 = idx.start[pos], idx.end[pos]
        scanned = 0
        best, best_cost = None, float("inf")
        for p in self.cover_ranking:
            if p.tensor in self.taken or not p.ev_pos < pos < p.back_pos or p.t_evict_end + p.swap_out_s > t0:
                continue
            opt = self.evaluate(p, not_before=pos)
            scanned += 1
            if opt is not None:
                a, b = opt.off_device()
                if a <= t0 and b >= t1 and self._usable(opt, (t0, t1)):
                    if opt.hidden:
                        return opt
                    cost = opt.overhead / p.nbytes
                    if cost < best_cost:
                        best, best_cost = opt, cost
            if scanned >= MAX_SCAN:
                break
        return best

    def covering_retrigger(self, pos: int) -> tuple[SwapOption, float] | None:
        """A chosen swap still on the device during op `pos` whose in-trigger can move to `pos` or later: the option
        with the least added overhead, and that added overhead."""
        if self.sp is None:
            return None
        idx = self.idx
        t0, t1 = idx.start[pos], idx.end[pos]
        best = None
        for t, opt in list(self.sp.chosen.items()):
            p = opt.pair
            if not p.ev_pos < pos < p.back_pos or opt.trigger_pos is None or opt.trigger_pos >= pos:
                continue
            if opt.in_start >= t1:
                continue  # already away during that op
            new = self.sp.retrigger_option(t, pos)
            if new is None:
                continue
            a, b = new.off_device()
            if a <= t0 and b >= t1:
                added = max(0.0, new.overhead - opt.overhead)
                if best is None or added < best[1]:
                    best = (new, added)
        return best

    def pick(self, s: SwapOption | None, r, where: str) -> int:
        """Keeps the cheaper per byte of swap `s` and recomputation `r`; returns the bytes it saves."""
        if s is None and r is None:
            return 0
        s_cost = s.overhead / s.pair.nbytes if s is not None else float("inf")
        r_cost = r.cost / r.pair.nbytes if r is not None else float("inf")
        if s is not None and s_cost <= r_cost:
            how = "hidden" if s.hidden else f"overhead {s.overhead * 1e3:.3f} ms"
            alt = f", cheaper than recomputing {r.tensor} ({r.cost * 1e3:.3f} ms)" if r is not None else ""
            self.take_swap(s, f"swap {where} (FT {s.pair.free_time * 1e3:.3f} ms, {how}{alt})")
            return s.pair.nbytes
        alt = f", cheaper than swapping {s.pair.tensor} ({s.overhead * 1e3:.3f} ms)" if s is not None else ""
        self.take_recompute(r.tensor, f"recompute {where} (MSPS {r.msps:.4g} B/s{alt})")
        return r.pair.nbytes

    def mixed(self, need: int) -> int:
        """Phase 3 (Algorithm 1's loop): the cheaper of the best swap and the best recomputation."""
        while need > 0:
            s = self.best_swap()
            r = self.best_recompute()
            got = self.pick(s, r, "for the saving target")
            if not got:
                break
            need -= got
        return need

    def unkeep_at_peak(self, decisions, sim) -> bool:
        """Collective recomputation keeps a target only if memory allows: drop the keeps alive at the predicted peak
        (rebuilt early and waiting for their back-access then). True if any was dropped."""
        idx = self.idx
        dropped = False
        for d in decisions:
            if d.kind != "recompute":
                continue
            for x in d.keeps:
                back = idx.tensors[x].acc_pos[self.recompute_pairs[x].k + 1]
                if sim.restore_time.get(x, float("inf")) <= sim.peak_time < sim.op_start[back]:
                    self.no_keep.add(x)
                    dropped = True
        return dropped

    def undo_replay_at_peak(self, decisions, sim) -> bool:
        """Beyond the paper: a predicted peak inside an on-demand replay (between the op before the back-access and
        the back-access itself) can be of the replay's own making: rebuilding the target needs intermediates (a
        log-softmax needs its logits back) at a moment where memory is already high. The target whose replay there
        holds the most besides itself is taken back: it stays on the device, and may still be swapped
        (docs/decisions.md, "A recomputation whose replay makes the predicted peak is taken back"). True if one was."""
        if self.rs is None:
            return False
        pos = _peak_op_pos(sim)
        if sim.peak_time >= sim.op_start[pos] or (pos > 0 and sim.peak_time < sim.op_end[pos - 1]):
            return False  # the peak is inside an op, not in the work inserted before it
        idx = self.idx
        best, best_extra = None, 0
        for d in decisions:
            if (d.kind != "recompute" or not d.replay_ops or d.trigger_mode != ON_DEMAND
                    or d.tensor not in self.rs.chosen or idx.pos[d.back_access.op] != pos):
                continue
            extra = replay_extra_bytes(idx, tuple(idx.pos[o] for o in d.replay_ops), d.tensor)
            if extra > best_extra:
                best, best_extra = d.tensor, extra
        if best is None:
            return False
        self.rs.unchoose(best)
        self.taken.discard(best)
        self.recompute_pairs.pop(best, None)
        self.reasons.pop(best, None)
        return True

    def floor_at(self, pos: int) -> int:
        """A lower bound of the memory during op `pos` under any plan made of these candidates: the ideal level then,
        minus every candidate tensor with a pair spanning it."""
        idx = self.idx
        curve = idx.replayed_curve()
        times = [t for t, _ in curve]
        i = max(bisect.bisect_right(times, idx.start[pos]) - 1, 0)
        j = max(bisect.bisect_right(times, idx.end[pos]), i + 1)
        ideal = max(b for _, b in curve[i:j])
        seen: set[str] = set()
        for p in self.cover_ranking:
            if p.ev_pos < pos < p.back_pos:
                seen.add(p.tensor)
        return ideal - sum(idx.tensors[t].nbytes for t in seen)

    def evictable_at(self, pos: int) -> int:
        """An upper bound of the bytes still to gain at op `pos`: tensors not chosen yet with a pair spanning it, and
        chosen swaps whose in-trigger could move after it."""
        seen = set()
        total = 0
        for p in self.cover_ranking:
            if p.tensor not in seen and p.tensor not in self.taken and p.ev_pos < pos < p.back_pos:
                seen.add(p.tensor)
                total += p.nbytes
        if self.sp is not None:
            for opt in self.sp.chosen.values():
                p = opt.pair
                if p.ev_pos < pos < p.back_pos and opt.trigger_pos is not None and opt.trigger_pos < pos:
                    total += p.nbytes
        return total

    def cover_peak(self, pos: int, excess: int, max_actions: int = 256) -> int:
        """Phase 4: evictions off the device at op `pos`, until `excess` bytes are covered (at most `max_actions`
        before the plan is simulated again). 0 if nothing can be done, or not enough to ever cover it."""
        if self.evictable_at(pos) < excess:
            return 0
        added = 0
        actions = 0
        while added < excess and actions < max_actions:
            actions += 1
            where = f"to lower the predicted peak at op {self.idx.op_names[pos]}"
            s = self.covering_swap(pos)
            r = self.best_recompute(lambda c: c.pair.ev_pos < pos < c.pair.back_pos)
            q = self.covering_retrigger(pos)
            if q is not None:
                opt, extra = q
                q_cost = extra / opt.pair.nbytes
                s_cost = s.overhead / s.pair.nbytes if s is not None else float("inf")
                r_cost = r.cost / r.pair.nbytes if r is not None else float("inf")
                if q_cost <= s_cost and q_cost <= r_cost:
                    t = opt.pair.tensor
                    self.sp.retrigger(opt)
                    self.reasons[t] += f"; in-trigger moved to op {self.idx.op_names[opt.trigger_pos]} {where}"
                    added += opt.pair.nbytes
                    continue
            got = self.pick(s, r, where)
            if not got:
                break
            added += got
        return added

    # ---- the plan ----
    def decisions(self) -> list:
        idx = self.idx
        out = []
        if self.sp is not None:
            planned = dict(zip(self.sp.h2d.owner, self.sp.h2d.start))
            for t in self.sp.order:
                opt = self.sp.chosen[t]
                out.append(swap_decision(idx, opt.pair, opt.trigger_pos, self.reasons[t], planned.get(t)))
        if self.rs is not None and self.recompute_pairs:
            out.extend(
                assemble(
                    self.ctx,
                    (self.recompute_pairs[t] for t in self.rs.order),
                    self.res,
                    collective=self.collective,
                    no_keep=self.no_keep,
                    msps=self.rs.msps_at_pick,
                    reasons=self.reasons,
                )
            )
        return out


def _peak_op_pos(sim) -> int:
    """The op the predicted peak belongs to: the one running then, or the next one if the peak falls between ops
    (inside a replay inserted before it, or a swap-in landing before it)."""
    p = sim.peak_pos
    if sim.peak_time >= sim.op_end[p] and p + 1 < len(sim.op_start):
        return p + 1
    return p


def hybrid(
    trace: AccessTrace,
    budget_bytes: int,
    device_model: DeviceModel,
    *,
    policy: str = "capuchin",
    swap: bool = True,
    recompute: bool = True,
    margin_bytes: int | None = None,
    peak_fraction: float = 0.9,
    min_candidate_bytes: int | None = None,
    collective: bool = True,
    early_recompute: bool = True,
    max_rounds: int = 64,
    place_within: int | None = None,
    index=None,
    _report: dict | None = None,
) -> Plan:
    """Algorithm 1 with the given halves enabled (see the module docstring). Returns a simulated Plan.

    ``place_within`` (beyond the paper): once the bytes fit, the plan's buffers are placed (policy/placement.py);
    while the placement passes that many bytes of device (persistent state included), the allocation that first
    passes it is covered as a peak is: at the op running then, tensors off the device for the bytes it lacked beside
    the largest free run (`_Hybrid.cover_peak`), and the plan is simulated and placed again, at most COVER_ROUNDS
    times, while that allocation comes later or needs less."""
    started = time.perf_counter()
    options = dict(
        margin_bytes=margin_bytes,
        peak_fraction=peak_fraction,
        min_candidate_bytes=min_candidate_bytes,
        collective=collective,
        early_recompute=early_recompute,
        max_rounds=max_rounds,
    )
    ctx = make_context(
        trace,
        budget_bytes,
        device_model,
        index=index,
        margin_bytes=margin_bytes,
        peak_fraction=peak_fraction,
        min_candidate_bytes=min_candidate_bytes,
    )
    if ctx.target <= 0:
        return finalize(ctx, policy, [], options=options, started=started)
    h = _Hybrid(ctx, swap, recompute, collective)
    need = h.free_swaps(ctx.target)
    h.mixed(need)

    decisions, sim = simulate_feasible(trace, h.decisions(), device_model, ctx.idx)
    reason = None
    for _ in range(max_rounds):
        if fits(ctx, sim):
            break
        excess = sim.peak_bytes + ctx.margin - ctx.budget
        if h.unkeep_at_peak(decisions, sim) or h.cover_peak(_peak_op_pos(sim), excess):
            pass
        elif not h.undo_replay_at_peak(decisions, sim):
            if _report is not None:
                _report["hopeless"] = h.floor_at(_peak_op_pos(sim)) + ctx.margin > ctx.budget
            reason = (
                f"predicted peak {sim.peak_bytes + ctx.margin} bytes at op {sim.peak_op!r} exceeds the budget "
                f"{ctx.budget} bytes, and no remaining candidate tensor can be off the device there"
            )
            break
        decisions, sim = simulate_feasible(trace, h.decisions(), device_model, ctx.idx)

    def finish(decisions, sim) -> Plan:
        if early_recompute and recompute and any(d.kind == "recompute" for d in decisions):
            moved = move_early(ctx, decisions, sim, h.res)
            if moved != decisions:
                try:
                    sim2 = simulate(trace, moved, device_model, index=ctx.idx)
                except InfeasiblePlanError:
                    sim2 = None
                if (
                    sim2 is not None
                    and sim2.step_time < sim.step_time
                    and sim2.peak_bytes <= max(sim.peak_bytes, ctx.budget - ctx.margin)
                ):
                    decisions, sim = moved, sim2
        return finalize(ctx, policy, decisions, options=options, started=started, sim=sim, reason=reason)

    if place_within is None or not fits(ctx, sim):
        return finish(decisions, sim)
    # The plan as without ``place_within`` first (for a caller that weighs both: `_report["uncovered"]`), then the
    # same greedy's state carried on by the covers.
    uncovered = finish(decisions, sim)
    if _report is not None:
        _report["uncovered"] = uncovered
    covered, covered_sim = _cover_placement(h, ctx, trace, decisions, sim, device_model, place_within)
    return uncovered if covered is decisions else finish(covered, covered_sim)


def _cover_placement(h: _Hybrid, ctx, trace, decisions: list, sim, device_model, place_within: int):
    """`hybrid`'s placement covers (see its ``place_within``): (decisions, simulation) of the last round whose bytes
    fit; the first ones if no cover was possible."""
    limit = place_within - trace.persistent_bytes
    last = None
    for _ in range(COVER_ROUNDS):
        over = placement.first_overflow(sim.events, limit)
        if over is None:
            break
        progress = (over.time, -(over.nbytes - over.largest_free))
        if last is not None and progress <= last:
            break  # the cover moved nothing later and made nothing smaller: stop
        last = progress
        pos = max(bisect.bisect_right(sim.op_start, over.time) - 1, 0)
        if not h.cover_peak(pos, max(over.nbytes - over.largest_free, over.top - limit)):
            break
        covered, covered_sim = simulate_feasible(trace, h.decisions(), device_model, ctx.idx)
        if not fits(ctx, covered_sim):
            break
        decisions, sim = covered, covered_sim
    return decisions, sim


__all__ = ["plan_capuchin", "plan_swap_only", "plan_recompute_only", "hybrid"]
