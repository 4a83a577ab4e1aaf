"""Baseline policies (benchmarks.md): ``tf`` (nothing), ``swap-all`` (vDNN-like), ``checkpoint`` (Chen sqrt(n)).

They are static: they ignore the budget when deciding, and their plans report whether the simulator predicts the
budget holds.

**swap-all** (vDNN): every tensor the backward pass needs (produced by a forward op, read by a backward op) is swapped
out after its last use before the backward pass (its last forward use; its production if it has none) and swapped
back for its first backward use. Layers are delimited by conv/matmul ops (trace_index.LAYER_OP_TYPES) in the
backward pass; the prefetch is issued "one layer ahead": when the layer before the back-access's layer starts, i.e.
after the second-latest backward conv/matmul op before the back-access (else the first backward op before it, else
the evicted-access's op itself). vDNN's per-layer synchronisation is not modelled: swaps are decoupled from compute,
as for every policy here.

**checkpoint** (Chen et al. 2016, OpenAI gradient-checkpointing "memory" mode). Only *pure forward* ops count: forward
ops with no backward or optimizer op among their ancestors (the graph model roles by name scope, so gradient sums
outside ``gradient_tape/``, such as ``AddN``, are roled forward; rebuilding one would replay the backward pass).
Articulation points: pure forward tensors (at least 1% of the largest) that alone cross a cut of the forward ops
taken in an as-late-as-possible topological order (the executor runs independent work early, e.g. dropout masks
drawn from seeds, which in executed order crosses every cut up to its reader). Of those the backward pass reads,
len // round(sqrt(len)) are kept, on an even grid of the cumulative bytes the backward pass reads. Every other pure
forward tensor the backward pass reads is freed after its last use before the backward pass. Segment = the tensors
between two kept checkpoints; when the backward pass first needs a tensor of a segment, one replay runs the union of
the chains of all the segment's tensors still evicted then (each op once), keeps them (``keeps``) and the others
replay nothing (``regenerated_by``). Tensors whose producer cannot be replayed exactly stay.
"""

from __future__ import annotations

import bisect
import math
import time

from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.core.graph_model import Role
from capuchin_tf.core.plan import ON_DEMAND, Plan, RecomputeDecision
from capuchin_tf.core.trace_index import TraceIndex
from capuchin_tf.policy.candidates import CandidatePair, make_context
from capuchin_tf.policy.common import finalize, swap_decision
from capuchin_tf.policy.recompute import RECOMPUTE_EVICTION, Residency, _ref, chain


def plan_tf(trace: AccessTrace, budget_bytes: int, device_model: DeviceModel, **options) -> Plan:
    """Plain TensorFlow: no eviction. Feasible only if the step fits as it is."""
    started = time.perf_counter()
    ctx = make_context(trace, budget_bytes, device_model, index=options.get("index"),
                       margin_bytes=options.get("margin_bytes"))
    return finalize(ctx, "tf", [], options={"margin_bytes": options.get("margin_bytes")}, started=started)


def _backward_pair(idx: TraceIndex, tid: str, dm: DeviceModel) -> CandidatePair | None:
    """{last access before the first backward use, first backward use} of a forward tensor the backward pass reads."""
    v = idx.tensors[tid]
    if v.nbytes <= 0 or tid in idx.unmanaged or idx.op_role[v.prod_pos] != Role.FORWARD:
        return None
    for k in range(1, len(v.acc_pos)):
        if idx.op_role[v.acc_pos[k]] == Role.BACKWARD:
            ev, back = v.acc_pos[k - 1], v.acc_pos[k]
            if back <= ev:
                return None
            return CandidatePair(tid, k - 1, v.nbytes, ev, back, idx.end[ev], v.acc_time[k],
                                 dm.swap_out_time(v.nbytes), dm.swap_in_time(v.nbytes))
    return None


def plan_swap_all(trace: AccessTrace, budget_bytes: int, device_model: DeviceModel, **options) -> Plan:
    """vDNN-like: swap every tensor the backward pass needs, prefetched one layer ahead."""
    started = time.perf_counter()
    ctx = make_context(trace, budget_bytes, device_model, index=options.get("index"),
                       margin_bytes=options.get("margin_bytes"))
    idx = ctx.idx
    backward = [i for i in range(idx.n_ops) if idx.op_role[i] == Role.BACKWARD]
    layers = [i for i in backward if idx.is_layer_op(i)]
    decisions = []
    for tid in sorted(idx.tensors, key=lambda t: (idx.tensors[t].prod_pos, t)):
        pair = _backward_pair(idx, tid, device_model)
        if pair is None:
            continue
        i = bisect.bisect_left(layers, pair.back_pos)  # layers[i-1]: the latest layer op before the back-access
        options_ = []
        if i >= 2:
            options_.append(layers[i - 2])
        j = bisect.bisect_left(backward, pair.ev_pos)
        if j < len(backward):
            options_.append(backward[j])
        options_.append(pair.ev_pos)
        trigger = next(
            (x for x in options_ if pair.ev_pos <= x < pair.back_pos and idx.has_access(x)), None
        )
        decisions.append(swap_decision(idx, pair, trigger, "swap-all: every tensor the backward pass needs"))
    return finalize(ctx, "swap-all", decisions, options={"margin_bytes": options.get("margin_bytes")},
                    started=started)


def pure_forward_ops(idx: TraceIndex) -> list[bool]:
    """Per op position: a forward op none of whose ancestors is a backward or optimizer op.

    The graph model's roles come from name scopes, so gradient sums outside ``gradient_tape/`` (``AddN``) are roled
    forward; replaying one would replay the backward pass that fed it. Only these ops' tensors are checkpointed or
    dropped."""
    n = idx.n_ops
    tainted = [False] * n
    for i in range(n):
        if idx.op_role[i] in (Role.BACKWARD, Role.OPTIMIZER):
            tainted[i] = True
            continue
        for x in idx.op_inputs[i]:
            q = idx.producer_pos(x)
            if q is not None and q < i and tainted[q]:
                tainted[i] = True
                break
    return [idx.op_role[i] == Role.FORWARD and not tainted[i] for i in range(n)]


def forward_order(idx: TraceIndex, pure: list[bool]) -> dict[int, int]:
    """Rank of each pure forward op in an as-late-as-possible topological order of the forward ops.

    The executor runs independent work early (dropout masks drawn from seeds, loss bookkeeping): in executed order
    such a tensor crosses every cut up to its reader and would hide the articulation points. As late as possible,
    it is produced just before its first reader."""
    n = idx.n_ops
    consumers: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        if not pure[i]:
            continue
        for x in idx.op_inputs[i]:
            q = idx.producer_pos(x)
            if q is not None and q < i and pure[q]:
                consumers[q].append(i)
    # latest position: just before the earliest latest position of its consumers (a unit of 1 / (n + 1) per step,
    # so that producers stay strictly before consumers); an op with no forward consumer stays where it ran
    unit = 1.0 / (n + 1)
    alap = [float(i) for i in range(n)]
    for i in range(n - 1, -1, -1):
        if pure[i] and consumers[i]:
            alap[i] = min(alap[c] for c in consumers[i]) - unit
    order = sorted((i for i in range(n) if pure[i]), key=lambda i: (alap[i], i))
    return {p: r for r, p in enumerate(order)}


ARTICULATION_MIN_FRACTION = 0.01  # crossers under this fraction of the largest forward tensor do not count
CHECKPOINT_COUNT_SPREAD = 1  # checkpoint counts tried on either side of Chen's sqrt(n) (plan_checkpoint)


def articulation_points(idx: TraceIndex, min_fraction: float = ARTICULATION_MIN_FRACTION) -> list[str]:
    """Pure forward tensors that alone cross some cut of the forward ops (as late as possible), in forward order.

    Crossers under `min_fraction` of the largest forward tensor are ignored (batch-norm statistics, loss
    bookkeeping: they stay resident, or are rebuilt cheaply)."""
    pure = pure_forward_ops(idx)
    rank = forward_order(idx, pure)
    m = len(rank)
    if not m:
        return []
    big = max((v.nbytes for v in idx.tensors.values() if pure[v.prod_pos]), default=0)
    thr = max(1, int(big * min_fraction))
    diff = [0] * (m + 1)
    sums = [0] * (m + 1)
    ids: list[str] = []
    for tid, v in idx.tensors.items():
        if not pure[v.prod_pos] or v.nbytes < thr:
            continue
        reads = [rank[p] for p in v.acc_pos[1:] if pure[p]]
        if not reads:
            continue
        a, b = rank[v.prod_pos], max(reads)
        if b <= a:
            continue
        ids.append(tid)
        num = len(ids)  # 1-based, so a sum identifies the single crosser
        diff[a] += 1
        diff[b] -= 1
        sums[a] += num
        sums[b] -= num
    out: list[str] = []
    seen: set[str] = set()
    count = total = 0
    for r in range(m):
        count += diff[r]
        total += sums[r]
        if count == 1:
            tid = ids[total - 1]
            if tid not in seen:
                seen.add(tid)
                out.append(tid)
    out.sort(key=lambda t: rank[idx.tensors[t].prod_pos])
    return out


def plan_checkpoint(trace: AccessTrace, budget_bytes: int, device_model: DeviceModel, **options) -> Plan:
    """Chen et al.'s sqrt(n) checkpointing over the articulation points of the forward chain, with Chen's search over
    the count: the grids of n // round(sqrt(n)) checkpoints and one fewer and one more (CHECKPOINT_COUNT_SPREAD)
    are each planned and simulated, and the fastest predicted to fit the budget is taken, else the lowest peak.
    Which point of two with the same backward bytes between them the grid lands on depends on the forward order the
    trace ran in, and one count's segments can keep a loss-sized tensor live where its neighbour's do not
    (docs/decisions.md, "Checkpoint counts searched")."""
    started = time.perf_counter()
    ctx = make_context(trace, budget_bytes, device_model, index=options.get("index"),
                       margin_bytes=options.get("margin_bytes"))
    idx = ctx.idx
    pure = pure_forward_ops(idx)
    rank = forward_order(idx, pure)
    pairs = {
        t: p
        for t in idx.tensors
        if pure[idx.tensors[t].prod_pos] and (p := _backward_pair(idx, t, device_model)) is not None
    }
    points = [t for t in articulation_points(idx) if t in pairs]
    grids: list[tuple[int, list[str]]] = []
    for count in _checkpoint_counts(len(points)):
        grid = _sqrt_grid(idx, rank, points, pairs, count)
        if all(grid != g for _, g in grids):
            grids.append((count, grid))
    plans = []
    for count, kept_points in grids:
        decisions = _checkpoint_decisions(ctx, rank, pairs, kept_points)
        plans.append(finalize(
            ctx,
            "checkpoint",
            decisions,
            options={"margin_bytes": options.get("margin_bytes"), "checkpoints": len(kept_points),
                     "articulation_points": len(points),
                     "counts_tried": tuple(c for c, _ in grids)},
            started=started,
        ))
    fitting = [q for q in plans if q.feasible]
    if fitting:
        return min(fitting, key=lambda q: (q.predicted_step_s, q.predicted_peak_bytes))
    return min(plans, key=lambda q: (q.predicted_peak_bytes, q.predicted_step_s))


def _checkpoint_counts(points: int) -> list[int]:
    """The checkpoint counts tried for `points` articulation points: Chen's n // round(sqrt(n)) first, then its
    neighbours within CHECKPOINT_COUNT_SPREAD (at least 1, at most n); [0] when there are none."""
    if points <= 0:
        return [0]
    k = points // max(1, round(math.sqrt(points)))
    return [c for c in range(k - CHECKPOINT_COUNT_SPREAD, k + CHECKPOINT_COUNT_SPREAD + 1) if 1 <= c <= points]


def _checkpoint_decisions(ctx, rank: dict[int, int], pairs: dict[str, CandidatePair],
                          kept_points: list[str]) -> list[RecomputeDecision]:
    """Every pure forward tensor that is not a kept checkpoint dropped and rebuilt by its segment's replay."""
    idx = ctx.idx
    keep = set(kept_points)
    dropped = {
        t: p
        for t, p in pairs.items()
        if t not in keep and p.nbytes >= ctx.min_bytes and idx.replayable[idx.tensors[t].prod_pos]
    }
    # Drop them all; a tensor that cannot be rebuilt exactly from what stays resident is kept instead (repeat
    # until stable: keeping one can make another rebuildable).
    while True:
        res = Residency(idx)
        for t, p in dropped.items():
            res.evict(t, p.ev_pos, p.back_pos, RECOMPUTE_EVICTION)
        bad = [t for t, p in dropped.items() if chain(idx, t, p.back_pos, res.resident) is None]
        if not bad:
            break
        for t in bad:
            del dropped[t]
    # Segment of a tensor: how many kept checkpoints precede it in forward order.
    cuts = sorted(rank[idx.tensors[t].prod_pos] for t in kept_points)
    segment = {t: bisect.bisect_left(cuts, rank[idx.tensors[t].prod_pos]) for t in dropped}
    reasons = {t: "checkpoint: not a kept articulation point; its segment is rebuilt from the previous checkpoint"
               for t in dropped}
    return _assemble_segments(ctx, dropped, segment, res, reasons)


def _sqrt_grid(idx: TraceIndex, rank: dict[int, int], points: list[str], pairs: dict[str, CandidatePair],
               k: int) -> list[str]:
    """`k` checkpoints among the articulation points, placed on an even grid of the bytes the backward pass reads
    (cumulative, in forward order) rather than of the point count: points bunch up where the graph is a plain chain
    (embeddings, dropout masks) and an even count grid would leave one segment with most of the activations."""
    if not points or k <= 0:
        return []
    sizes = sorted((rank[idx.tensors[t].prod_pos], p.nbytes) for t, p in pairs.items())
    ranks = [r for r, _ in sizes]
    cum = [0]
    for _, b in sizes:
        cum.append(cum[-1] + b)
    total = cum[-1]
    at = [cum[bisect.bisect_right(ranks, rank[idx.tensors[t].prod_pos])] for t in points]
    out: list[int] = []
    for j in range(1, k + 1):
        goal = total * j / (k + 1)
        lo = out[-1] + 1 if out else 0
        hi = len(points) - (k - j)  # leave room for the remaining checkpoints
        best = min(range(lo, hi), key=lambda i: (abs(at[i] - goal), i))
        out.append(best)
    return [points[i] for i in out]


def _assemble_segments(ctx, dropped: dict[str, CandidatePair], segment: dict[str, int], res: Residency,
                       reasons: dict[str, str]) -> list[RecomputeDecision]:
    """On-demand replays, one per segment (Chen): the first target of a segment needed in the backward pass replays
    the chains of every target of its segment still evicted then (their union, each op once) and keeps them; the
    others are ``regenerated_by`` it. A target with no exact chain left stays on the device."""
    idx = ctx.idx
    targets = sorted(dropped.values(), key=lambda p: (p.back_pos, -idx.tensors[p.tensor].prod_pos))
    members: dict[int, list[CandidatePair]] = {}
    for p in targets:
        members.setdefault(segment[p.tensor], []).append(p)
    kept_by: dict[str, str] = {}
    kept: dict[str, int] = {}

    def resident(x: str, k: int) -> bool:
        return res.resident(x, k, kept)

    out: list[RecomputeDecision] = []
    for p in targets:
        t = p.tensor
        ev, back = _ref(idx, t, p.k), _ref(idx, t, p.k + 1)
        why = reasons.get(t, "")
        if t in kept_by:
            out.append(RecomputeDecision(t, p.nbytes, ev, back, (), (), back, ON_DEMAND, 0.0, None, (), kept_by[t],
                                         0.0, f"{why}; rebuilt and kept by the replay of {kept_by[t]}"))
            continue
        ch = chain(idx, t, p.back_pos, resident)
        if ch is None:  # rare: its way back runs through a tensor evicted then; it stays on the device
            res.evicted.pop(t, None)
            continue
        ops, srcs = set(ch[0]), set(ch[1])
        keeps = []
        for q in members[segment[t]]:
            x = q.tensor
            if x == t or x in kept_by or x not in res.evicted:
                continue
            if not q.ev_pos < p.back_pos <= q.back_pos:  # not evicted now: it is rebuilt when it is needed
                continue
            cq = chain(idx, x, p.back_pos, resident)
            if cq is None:
                continue
            ops.update(cq[0])
            srcs.update(cq[1])
            keeps.append(x)
        produced = {y for o in ops for y in idx.op_outputs[o]}
        for x in keeps:
            kept_by[x] = t
            kept[x] = p.back_pos
        ordered = sorted(ops)
        out.append(
            RecomputeDecision(
                tensor=t,
                nbytes=p.nbytes,
                evicted_access=ev,
                back_access=back,
                sources=tuple(sorted(srcs - produced)),
                replay_ops=tuple(idx.op_names[o] for o in ordered),
                trigger=back,
                trigger_mode=ON_DEMAND,
                recompute_s=sum(idx.dur[o] for o in ordered),
                msps=None,
                keeps=tuple(keeps),
                reason=why,
            )
        )
    return out
