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

**checkpoint** (Chen et al. 2016, OpenAI gradient-checkpointing "memory" mode): articulation points of the forward
chain (a cut of the forward ops crossed by exactly one forward tensor, with a non-empty buffer, that the backward pass
reads) are the checkpoint candidates; one in every round(sqrt(n)) of them is kept. Every other tensor the backward
pass reads is freed after its last forward use and recomputed at its first backward use from the nearest resident
tensors (the previous checkpoint, typically), one segment at a time thanks to collective recomputation. Tensors whose
producer cannot be replayed exactly stay.
"""

from __future__ import annotations

import bisect
import math
import time

from capuchin_tf.device_model import DeviceModel
from capuchin_tf.graph_model import Role
from capuchin_tf.plan import Plan
from capuchin_tf.policy.candidates import CandidatePair, make_context
from capuchin_tf.policy.common import finalize, swap_decision
from capuchin_tf.policy.recompute import RECOMPUTE_EVICTION, Residency, assemble, chain
from capuchin_tf.trace import AccessTrace
from capuchin_tf.trace_index import TraceIndex


def plan_tf(trace: AccessTrace, budget_bytes: int, device_model: DeviceModel, **options) -> Plan:
    """Plain TensorFlow: no eviction. Feasible only if the step fits as it is."""
    started = time.perf_counter()
    ctx = make_context(trace, budget_bytes, device_model, index=options.get("index"),
                       margin_bytes=options.get("margin_bytes"))
    return finalize(ctx, "tf", [], options={"margin_bytes": options.get("margin_bytes")}, started=started)


def _backward_pair(idx: TraceIndex, tid: str, dm: DeviceModel) -> CandidatePair | None:
    """{last access before the first backward use, first backward use} of a forward tensor the backward pass reads."""
    v = idx.tensors[tid]
    if v.nbytes <= 0 or tid in idx.persistent or idx.op_role[v.prod_pos] != Role.FORWARD:
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


def articulation_points(idx: TraceIndex) -> list[str]:
    """Forward tensors that alone cross some cut of the forward ops (in production order)."""
    n = idx.n_ops
    diff = [0] * (n + 1)
    ids: list[str] = []
    sums = [0] * (n + 1)
    for tid, v in idx.tensors.items():
        if idx.op_role[v.prod_pos] != Role.FORWARD:
            continue
        last_fwd = max((p for p in v.acc_pos[1:] if idx.op_role[p] == Role.FORWARD), default=None)
        if last_fwd is None or last_fwd <= v.prod_pos:
            continue
        ids.append(tid)
        num = len(ids)  # 1-based, so a sum identifies the single crosser
        diff[v.prod_pos] += 1
        diff[last_fwd] -= 1
        sums[v.prod_pos] += num
        sums[last_fwd] -= num
    out: list[str] = []
    seen: set[str] = set()
    count = total = 0
    for i in range(n):
        count += diff[i]
        total += sums[i]
        if count == 1 and idx.op_role[i] == Role.FORWARD:
            tid = ids[total - 1]
            if tid not in seen:
                seen.add(tid)
                out.append(tid)
    out.sort(key=lambda t: idx.tensors[t].prod_pos)
    return out


def plan_checkpoint(trace: AccessTrace, budget_bytes: int, device_model: DeviceModel, **options) -> Plan:
    """Chen et al.'s sqrt(n) checkpointing over the articulation points of the forward chain."""
    started = time.perf_counter()
    ctx = make_context(trace, budget_bytes, device_model, index=options.get("index"),
                       margin_bytes=options.get("margin_bytes"))
    idx = ctx.idx
    pairs = {t: p for t in idx.tensors if (p := _backward_pair(idx, t, device_model)) is not None}
    points = [t for t in articulation_points(idx) if t in pairs]
    every = max(1, round(math.sqrt(len(points)))) if points else 1
    keep = set(points[every - 1 :: every])
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
    reasons = {t: "checkpoint: not a kept articulation point; rebuilt from the previous checkpoint" for t in dropped}
    decisions = assemble(ctx, dropped.values(), res, collective=True, reasons=reasons)
    return finalize(
        ctx,
        "checkpoint",
        decisions,
        options={"margin_bytes": options.get("margin_bytes"), "checkpoints": len(keep), "articulation_points": len(points)},
        started=started,
    )
