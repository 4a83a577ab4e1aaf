"""The recomputation policy (paper.md §1.7, §1.11, Algorithm 2): sources, MSPS, greedy selection, collective
recomputation, and when each replay runs.

**Sources.** A target is rebuilt just before its back-access by replaying its producer, and the producers of any of
their inputs that are not resident then, back to the nearest resident tensors: the sources. A tensor is resident
before op k when it is untracked (weights, inputs: outside the step's budget), or alive then in the measured
execution (produced before k, last accessed at or after k) and not inside an eviction chosen so far. Other candidates
count as resident until they are chosen (the paper's rule), so a chain never runs through a candidate. A chain that
reaches an op that cannot be replayed exactly (stateful, ``replayable`` False, or never measured) makes the target
unrecomputable through it.

**Algorithm 2, as read here.** Each candidate has ``srcs``, ``rp_time`` (the measured time of its chain's ops, summed
once each) and ``ext_time``. MSPS = memory saving / (rp_time + ext_time); this is our reading of the unwritten
``UpdateMSPS``. The greedy picks the largest MSPS; after picking t:

- every chosen target and every candidate that used t as a source, and for which t is no longer resident at its
  back-access, is re-derived: its sources replace t by what t is rebuilt from, and its chain and rp_time grow by
  t's chain (we recompute the chain exactly rather than adding rp_times, so shared ops are not counted twice);
- ``ext_time(c) = (number of chosen targets whose sources include c) * rp_time(c)``: if c were chosen too, each of
  those replays would have to rebuild c once more (Alg. 2 lines 23-28 and 30-32: ``ext_ct * rp_time``).

The same re-derivation runs when the hybrid policy swaps a tensor out (it stops being resident in that interval).

**Collective recomputation.** The final replays are laid out in back-access order: a replay that passes through
another chosen target which is evicted at that time keeps it (``keeps``), and that target's own decision replays
nothing (``regenerated_by``). O(n) work for a chain instead of O(n^2).

**When a replay runs.** On demand, just before the back-access's op (the paper). Beyond the paper, ``move_early``
moves a replay into an idle gap of the simulated timeline before its back-access (a stall waiting for a swap-in, a
gap in the trace) when its sources are resident there and the simulated memory there has room for what it rebuilds.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable

from capuchin_tf.core.plan import EARLY, ON_DEMAND, AccessRef, RecomputeDecision
from capuchin_tf.core.trace_index import TraceIndex
from capuchin_tf.policy.candidates import CandidatePair, Context

SWAP_EVICTION, RECOMPUTE_EVICTION = "swap", "recompute"
MAX_CHAIN_OPS = 4096  # a bound for baselines; the selector uses a much smaller one (max_chain_ops)


class Residency:
    """Which tensors are resident before an op position, given the evictions chosen so far."""

    def __init__(self, idx: TraceIndex):
        self.idx = idx
        self.evicted: dict[str, tuple[int, int, str]] = {}  # tensor -> (evicted-access pos, back-access pos, kind)

    def evict(self, tid: str, ev_pos: int, back_pos: int, kind: str) -> None:
        self.evicted[tid] = (ev_pos, back_pos, kind)

    def resident(self, tid: str, k: int, kept: dict[str, int] | None = None) -> bool:
        """Resident before op k. `kept`: tensors rebuilt early by another replay (collective recomputation), with
        the position from which they are back."""
        v = self.idx.tensors.get(tid)
        if v is None:
            return True  # untracked: persistent state, step inputs, host-side tensors
        if not v.alive_before(k):
            return False
        e = self.evicted.get(tid)
        if e is None:
            return True
        ev, back, kind = e
        if kind == SWAP_EVICTION:
            return not ev < k < back  # at its back-access the swap-in is there (or the replay waits for it)
        if not ev < k <= back:
            return True
        at = kept.get(tid) if kept else None
        return at is not None and at <= k


def chain(idx: TraceIndex, target: str, k: int, resident: Callable[[str, int], bool],
          max_ops: int = MAX_CHAIN_OPS) -> tuple[tuple[int, ...], frozenset[str]] | None:
    """Ops to replay (positions, in execution order) to rebuild `target` before op k, and their sources.

    None when the target cannot be rebuilt exactly from resident tensors."""
    p0 = idx.producer_pos(target)
    if p0 is None or p0 >= k or not idx.replayable[p0]:
        return None
    ops = {p0}
    srcs: set[str] = set()
    stack = [p0]
    while stack:
        p = stack.pop()
        for x in idx.op_inputs[p]:
            if x == target:
                return None
            if x in srcs:
                continue
            if resident(x, k):
                srcs.add(x)
                continue
            q = idx.producer_pos(x)
            if q is None or q >= k or not idx.replayable[q]:
                return None
            if q not in ops:
                if len(ops) >= max_ops:
                    return None
                ops.add(q)
                stack.append(q)
    return tuple(sorted(ops)), frozenset(srcs)


def replay_extra_bytes(idx: TraceIndex, ops: tuple[int, ...], target: str) -> int:
    """Peak bytes a replay holds besides its target: each replayed op allocates its outputs when it starts, and an
    intermediate is freed after the last replayed op that reads it."""
    last: dict[str, int] = {}
    for o in ops:
        for x in idx.op_inputs[o]:
            last[x] = o
    live = peak = 0
    for o in ops:
        outs = idx.op_outputs[o]
        for x in outs:
            if x != target:
                live += idx.tensors[x].nbytes
        peak = max(peak, live)
        for x in set(idx.op_inputs[o]).union(outs):
            if x != target and last.get(x, o) == o and x in idx.tensors and idx.tensors[x].prod_pos in ops:
                live -= idx.tensors[x].nbytes
    return peak


@dataclasses.dataclass
class RecomputeCandidate:
    pair: CandidatePair
    ops: tuple[int, ...]
    srcs: frozenset[str]
    rp_time: float
    ext_time: float = 0.0
    version: int = 0

    @property
    def tensor(self) -> str:
        return self.pair.tensor

    @property
    def cost(self) -> float:
        """Recompute overhead incl. repeats: rp_time + ext_time."""
        return self.rp_time + self.ext_time

    @property
    def msps(self) -> float:
        """Memory Saving Per Second (eq. 2), UpdateMSPS read as mem / (rp_time + ext_time)."""
        c = self.cost
        return self.pair.nbytes / c if c > 0 else float("inf")


class RecomputeSelector:
    """Algorithm 2's state: candidates with sources, rp_time, ext_time and MSPS; chosen targets; the updates."""

    def __init__(self, ctx: Context, pairs: Iterable[CandidatePair], residency: Residency,
                 max_replay_ratio: float = 2.0, max_chain_ops: int = 64):
        self.ctx = ctx
        # Replays longer than this are not considered (their MSPS would be poor anyway, and the search is costly).
        self.max_chain_ops = max_chain_ops
        # A replay that holds more than this many times its target's size in intermediates would raise memory at
        # the back-access more than evicting the target saves ("if memory allows"): not a candidate.
        self.max_replay_ratio = max_replay_ratio
        self.idx = ctx.idx
        self.res = residency
        self.cands: dict[str, RecomputeCandidate] = {}
        self.chosen: dict[str, RecomputeCandidate] = {}
        self.order: list[str] = []
        self.msps_at_pick: dict[str, float] = {}
        self.src_users: dict[str, set[str]] = {}  # source -> candidates using it
        self.chosen_src_users: dict[str, set[str]] = {}  # source -> chosen targets using it
        self._heap: list[tuple[float, int, str]] = []
        pairs = list(pairs)
        # Candidates count as resident: they are not evicted yet, so the residency rule already treats them so.
        for p in pairs:
            c = self._derive(p)
            if c is None:
                continue
            self.cands[p.tensor] = c
            for s in c.srcs:
                self.src_users.setdefault(s, set()).add(p.tensor)
        for c in self.cands.values():
            self._push(c)

    # ---- bookkeeping ----
    def _derive(self, p: CandidatePair) -> RecomputeCandidate | None:
        ch = chain(self.idx, p.tensor, p.back_pos, self.res.resident, self.max_chain_ops)
        if ch is None:
            return None
        ops, srcs = ch
        if not self._small_enough(p, ops):
            return None
        return RecomputeCandidate(p, ops, srcs, sum(self.idx.dur[o] for o in ops))

    def _small_enough(self, p: CandidatePair, ops: tuple[int, ...]) -> bool:
        return replay_extra_bytes(self.idx, ops, p.tensor) <= self.max_replay_ratio * p.nbytes

    def _push(self, c: RecomputeCandidate) -> None:
        c.version += 1
        heapq.heappush(self._heap, (-c.msps, c.version, c.tensor))

    def _update_ext(self, tid: str) -> None:
        c = self.cands.get(tid)
        if c is None:
            return
        ext = len(self.chosen_src_users.get(tid, ())) * c.rp_time
        if ext != c.ext_time:
            c.ext_time = ext
            self._push(c)

    def __len__(self) -> int:
        return len(self.cands)

    def top(self, accept: Callable[[RecomputeCandidate], bool] | None = None) -> RecomputeCandidate | None:
        """The candidate with the largest MSPS (that `accept` accepts), left in place."""
        skipped = []
        found = None
        while self._heap:
            neg, ver, tid = self._heap[0]
            c = self.cands.get(tid)
            if c is None or c.version != ver:
                heapq.heappop(self._heap)
                continue
            if accept is None or accept(c):
                found = c
                break
            skipped.append(heapq.heappop(self._heap))
        for e in skipped:
            heapq.heappush(self._heap, e)
        return found

    def discard(self, tid: str) -> None:
        """`tid` is no longer a recompute candidate (swapped instead, or useless)."""
        c = self.cands.pop(tid, None)
        if c is not None:
            for s in c.srcs:
                self.src_users.get(s, set()).discard(tid)

    # ---- Algorithm 2 ----
    def choose(self, tid: str) -> RecomputeCandidate:
        """Moves `tid` from the candidates to the chosen targets and applies the updates of Algorithm 2."""
        c = self.cands.pop(tid)
        for s in c.srcs:
            self.src_users.get(s, set()).discard(tid)
            self.chosen_src_users.setdefault(s, set()).add(tid)
        self.msps_at_pick[tid] = c.msps
        self.chosen[tid] = c
        self.order.append(tid)
        self.res.evict(tid, c.pair.ev_pos, c.pair.back_pos, RECOMPUTE_EVICTION)
        self.reroute(tid)
        for s in c.srcs:
            self._update_ext(s)
        return c

    def unchoose(self, tid: str) -> None:
        """Takes a chosen target back (it stays on the device) and it stops being a candidate: its replay raised the
        predicted peak more than evicting it lowered it. Chosen targets whose chains ran through it keep them (a
        chain through a resident tensor is still exact; the plan's replays are re-derived when it is assembled)."""
        c = self.chosen.pop(tid)
        self.order.remove(tid)
        self.msps_at_pick.pop(tid, None)
        self.res.evicted.pop(tid, None)
        for s in c.srcs:
            self.chosen_src_users.get(s, set()).discard(tid)
            self._update_ext(s)

    def would_break(self, tid: str, ev_pos: int, back_pos: int, kind: str = SWAP_EVICTION) -> bool:
        """Would evicting `tid` over (ev_pos, back_pos) leave a chosen target with no exact way to be rebuilt, or
        with a replay holding more intermediates than memory allows (see max_replay_ratio)?"""
        users = self.chosen_src_users.get(tid)
        if not users:
            return False
        saved = self.res.evicted.get(tid)
        self.res.evict(tid, ev_pos, back_pos, kind)
        try:
            for u in users:
                c = self.chosen[u]
                k = c.pair.back_pos
                if self.res.resident(tid, k):
                    continue
                ch = chain(self.idx, u, k, self.res.resident, self.max_chain_ops)
                if ch is None or not self._small_enough(c.pair, ch[0]):
                    return True
            return False
        finally:
            if saved is None:
                del self.res.evicted[tid]
            else:
                self.res.evicted[tid] = saved

    def evicted_by_swap(self, tid: str, ev_pos: int, back_pos: int) -> None:
        """The hybrid policy swaps `tid` out over (ev_pos, back_pos): it stops being a candidate and a source there."""
        self.discard(tid)
        self.res.evict(tid, ev_pos, back_pos, SWAP_EVICTION)
        self.reroute(tid)

    def reroute(self, tid: str) -> None:
        """Re-derive every chosen target and candidate that used `tid` as a source where it is no longer resident."""
        touched_sources: set[str] = set()
        for table, is_chosen in ((self.chosen_src_users, True), (self.src_users, False)):
            for u in list(table.get(tid, ())):
                c = (self.chosen if is_chosen else self.cands).get(u)
                if c is None:
                    continue
                k = c.pair.back_pos
                if self.res.resident(tid, k):
                    continue
                ch = chain(self.idx, u, k, self.res.resident, self.max_chain_ops if not is_chosen else MAX_CHAIN_OPS)
                users = self.chosen_src_users if is_chosen else self.src_users
                for s in c.srcs:
                    users.get(s, set()).discard(u)
                if ch is None or (not is_chosen and not self._small_enough(c.pair, ch[0])):
                    # guarded by would_break(); keep the old chain rather than lose the target
                    if is_chosen and ch is None:
                        for s in c.srcs:
                            users.setdefault(s, set()).add(u)
                        continue
                    del self.cands[u]
                    continue
                old = c.srcs
                c.ops, c.srcs = ch
                c.rp_time = sum(self.idx.dur[o] for o in c.ops)
                for s in c.srcs:
                    users.setdefault(s, set()).add(u)
                if is_chosen:
                    touched_sources.update(old.symmetric_difference(c.srcs))
                else:
                    c.ext_time = len(self.chosen_src_users.get(u, ())) * c.rp_time
                    self._push(c)
        for s in touched_sources:
            self._update_ext(s)


# ---- the replays as laid out in the plan -----------------------------------------------------------------------------
def assemble(
    ctx: Context,
    targets: Iterable[CandidatePair],
    residency: Residency,
    *,
    collective: bool = True,
    no_keep: frozenset[str] | set[str] = frozenset(),
    msps: dict[str, float] | None = None,
    reasons: dict[str, str] | None = None,
) -> list[RecomputeDecision]:
    """On-demand RecomputeDecisions for the chosen targets, in back-access order, with collective recomputation
    (except for the targets in `no_keep`: memory did not allow keeping them).

    `residency` holds every eviction of the plan (swaps and recomputations). A target with no exact chain left
    (rare: later choices took its way back) is left out and stays on the device; it is removed from `residency`."""
    idx = ctx.idx
    targets = sorted(targets, key=lambda p: (p.back_pos, -idx.tensors[p.tensor].prod_pos))
    chosen = {p.tensor: p for p in targets}
    kept_by: dict[str, str] = {}
    kept: dict[str, int] = {}

    def resident(x: str, k: int) -> bool:
        return residency.resident(x, k, kept)

    out = []
    for p in targets:
        t = p.tensor
        ev = _ref(idx, t, p.k)
        back = _ref(idx, t, p.k + 1)
        why = (reasons or {}).get(t, "")
        if t in kept_by:
            out.append(RecomputeDecision(t, p.nbytes, ev, back, (), (), back, ON_DEMAND, 0.0,
                                         (msps or {}).get(t), (), kept_by[t], 0.0,
                                         (why + "; " if why else "")
                                         + f"rebuilt and kept by the replay of {kept_by[t]}"))
            continue
        ch = chain(idx, t, p.back_pos, resident)
        if ch is None:
            # Later picks left it no exact way back (rare): it stays on the device; the simulation sees that.
            residency.evicted.pop(t, None)
            continue
        ops, srcs = ch
        keeps = []
        if collective:
            for o in ops:
                for x in idx.op_outputs[o]:
                    if x == t or x not in chosen or x in kept_by or x in no_keep:
                        continue
                    e = residency.evicted.get(x)
                    if e is not None and e[0] < p.back_pos <= e[1]:  # evicted now and needed later: keep it (CR)
                        keeps.append(x)
                        kept_by[x] = t
                        kept[x] = p.back_pos
        out.append(
            RecomputeDecision(
                tensor=t,
                nbytes=p.nbytes,
                evicted_access=ev,
                back_access=back,
                sources=tuple(sorted(srcs)),
                replay_ops=tuple(idx.op_names[o] for o in ops),
                trigger=back,
                trigger_mode=ON_DEMAND,
                recompute_s=sum(idx.dur[o] for o in ops),
                msps=(msps or {}).get(t),
                keeps=tuple(keeps),
                reason=why,
            )
        )
    return out


def _ref(idx: TraceIndex, tid: str, k: int) -> AccessRef:
    a = idx.access(tid, k)
    return AccessRef(tid, k, a.op, a.time)


def move_early(ctx: Context, decisions: list, sim, residency: Residency, max_look: int = 256) -> list:
    """Beyond the paper: runs replays in idle gaps of the simulated timeline ahead of their back-access.

    For each on-demand replay (latest back-access first), among the ops j after its evicted-access and before its
    back-access (at most `max_look` back), the one whose idle gap before op j+1 hides most of the replay (the latest
    on ties), provided its inputs are resident before j+1 and the simulated memory from j+1 to the back-access, plus
    what the replay rebuilds and keeps, stays within the limit. The replay then runs after op j (trigger mode
    ``early``); each gap is used once. Returns new decisions (the others unchanged); the caller keeps them only if
    the simulation says the step is faster and the budget still holds."""
    idx = ctx.idx
    idle = list(sim.idle_before)
    out = list(decisions)
    order = sorted(
        (i for i, d in enumerate(out) if d.kind == "recompute" and d.replay_ops and d.trigger_mode == ON_DEMAND),
        key=lambda i: -idx.pos[out[i].back_access.op],
    )
    limit = ctx.limit
    for i in order:
        d = out[i]
        v = idx.tensors[d.tensor]
        ev, back = v.acc_pos[d.evicted_access.index], v.acc_pos[d.back_access.index]
        need = d.recompute_s
        if need <= 0:
            continue
        hold = d.nbytes + sum(idx.tensors[k].nbytes for k in d.keeps)
        replay_pos = [idx.pos[o] for o in d.replay_ops]
        produced = {x for o in replay_pos for x in idx.op_outputs[o]}
        inputs = {x for o in replay_pos for x in idx.op_inputs[o]} - produced
        best_j, best_hidden = None, 0.0
        for j in range(back - 1, max(ev, back - 1 - max_look), -1):
            hidden = min(idle[j + 1], need)
            if hidden <= best_hidden + 1e-12 or not idx.has_access(j):
                continue
            if not all(residency.resident(x, j + 1) for x in inputs):
                continue
            if sim.max_bytes_between(sim.op_start[j + 1], sim.op_start[back]) + hold > limit:
                continue
            best_j, best_hidden = j, hidden
            if hidden >= need:
                break
        if best_j is None or best_hidden < 0.05 * need:
            continue
        a = idx.representative_access(best_j)
        idle[best_j + 1] -= best_hidden
        out[i] = dataclasses.replace(
            d,
            trigger=AccessRef(a.tensor, a.index, a.op, a.time),
            trigger_mode=EARLY,
            reason=(d.reason + "; " if d.reason else "") + f"replayed early after op {a.op} (idle compute)",
        )
    return out
