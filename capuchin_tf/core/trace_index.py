"""Positions, times, lifetimes and lineage of an AccessTrace, precomputed once. Pure Python: imports no TensorFlow.

The policies and the simulator both reason in *op positions*: the index of an op in the trace's executed order.
Positions avoid comparing floating-point times where the paper compares accesses ("the first access after...",
"lives longer than the back-access"). For a tensor:

- ``prod_pos``: position of its producer (its access 0, the production at the end of that op);
- ``acc_pos[k]``: position of the op of its access ``k`` (reads happen at that op's start);
- ``last_pos``: position of its last access; it is freed at the end of that op.

So a tensor is *alive before op k* (could feed work inserted before op k) when ``prod_pos < k <= last_pos``.

Lineage (for recomputation) comes from the graph model: an op's inputs in order. An input that the trace does not
record as a transient tensor (weights, optimizer slots, the step's inputs, host-side shape tensors) lives outside the
step's device budget and is always available; this module calls those *untracked*.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

from capuchin_tf.core.access_trace import AccessTrace, TraceError
from capuchin_tf.core.graph_model import Role

# Op types the paper and vDNN call a "layer": convolutions and matrix products, forward or backward.
LAYER_OP_TYPES = frozenset(
    {
        "Conv2D",
        "Conv2DBackpropInput",
        "Conv2DBackpropFilter",
        "Conv3D",
        "Conv3DBackpropInputV2",
        "Conv3DBackpropFilterV2",
        "DepthwiseConv2dNative",
        "DepthwiseConv2dNativeBackpropInput",
        "DepthwiseConv2dNativeBackpropFilter",
        "MatMul",
        "BatchMatMul",
        "BatchMatMulV2",
        "BatchMatMulV3",
        "_FusedConv2D",
        "_FusedMatMul",
        "_FusedBatchMatMul",
        "Einsum",
    }
)


@dataclasses.dataclass(frozen=True)
class TensorView:
    """What the planner needs of one transient tensor."""

    id: str
    nbytes: int
    alloc: float
    free: float | None
    acc_pos: tuple[int, ...]  # op position of each access (index 0: the production)
    acc_time: tuple[float, ...]  # time of each access, as recorded

    @property
    def prod_pos(self) -> int:
        return self.acc_pos[0]

    @property
    def last_pos(self) -> int:
        return self.acc_pos[-1]

    def alive_before(self, k: int) -> bool:
        """Resident (unless evicted) for work inserted just before op position k."""
        return self.acc_pos[0] < k <= self.acc_pos[-1]


class TraceIndex:
    """Precomputed views of one AccessTrace (built once per planning call; the trace is immutable)."""

    def __init__(self, trace: AccessTrace):
        self.trace = trace
        ops = trace.ops
        self.n_ops = len(ops)
        self.op_names: list[str] = [o.name for o in ops]
        self.pos: dict[str, int] = {}
        for i, o in enumerate(ops):
            if o.name in self.pos:
                raise TraceError(f"op {o.name!r} appears twice in the trace's executed ops")
            self.pos[o.name] = i
        self.start: list[float] = [o.start for o in ops]
        self.dur: list[float] = [o.duration for o in ops]
        self.end: list[float] = [o.start + o.duration for o in ops]
        self.op_type: list[str] = [o.type for o in ops]
        self.op_role: list[Role] = [o.role for o in ops]
        self.step_time = trace.step_time

        graph = trace.graph
        self.graph = graph
        # Replayable = the graph model says so, and not stateful, and we have a measured duration (it ran).
        self.replayable: list[bool] = []
        self.op_inputs: list[tuple[str, ...]] = []
        for o in ops:
            info = graph.ops.get(o.name)
            self.replayable.append(info is not None and info.replayable and not info.stateful)
            self.op_inputs.append(info.inputs if info is not None else ())

        # Tensors.
        self.tensors: dict[str, TensorView] = {}
        self.op_reads: list[list[str]] = [[] for _ in ops]  # tensor ids read by each op (with repeats)
        self.op_outputs: list[list[str]] = [[] for _ in ops]  # trace tensors produced by each op
        for tid, rec in trace.tensors.items():
            if not rec.accesses:
                continue
            positions = []
            for a in rec.accesses:
                p = self.pos.get(a.op)
                if p is None:
                    raise TraceError(f"tensor {tid!r}: access {a.index} names op {a.op!r}, which the trace never ran")
                positions.append(p)
            view = TensorView(
                id=tid,
                nbytes=rec.nbytes,
                alloc=rec.alloc,
                free=rec.free,
                acc_pos=tuple(positions),
                acc_time=tuple(a.time for a in rec.accesses),
            )
            self.tensors[tid] = view
            self.op_outputs[positions[0]].append(tid)
            for p in positions[1:]:
                self.op_reads[p].append(tid)
        # Op inputs for ops the graph does not describe: what the trace saw them read.
        for i, o in enumerate(ops):
            if o.name not in graph.ops:
                self.op_inputs[i] = tuple(self.op_reads[i])

        # Producer position of every tensor we know of: the trace's production, else the graph's producer if it ran.
        self._producer: dict[str, int] = {}
        for tid, info in graph.tensors.items():
            p = self.pos.get(info.op)
            if p is not None:
                self._producer[tid] = p
        for tid, v in self.tensors.items():
            self._producer[tid] = v.prod_pos

        # Persistent tensors per the graph model.
        self.persistent = frozenset(t.id for t in graph.tensors.values() if t.persistent)
        # Never candidates: persistent tensors, and tensors made or read in cond branches or loop bodies, or by lowered
        # control flow (GraphModel.manageable).
        self.unmanaged = frozenset(tid for tid in graph.tensors if not graph.manageable(tid))
        # Ops that always run (control_flow.py): only they may trigger or order anything.
        self.always_runs: list[bool] = [graph.ops[o.name].always_runs if o.name in graph.ops else False for o in ops]

        # Ops that can serve as triggers (they always run and have at least one recorded access), sorted by their
        # end time.
        self._trig = sorted(
            (self.end[i], i) for i in range(self.n_ops)
            if (self.op_outputs[i] or self.op_reads[i]) and self.always_runs[i]
        )
        self.trigger_ends: list[float] = [e for e, _ in self._trig]
        self.trigger_pos: list[int] = [i for _, i in self._trig]
        # trigger_pos_max[k]: the latest op among the triggers 0..k (a walk backwards from k past an op position can
        # stop once this is before it).
        self.trigger_pos_max: list[int] = list(itertools.accumulate(self.trigger_pos, max))
        self._curve: list[tuple[float, int]] | None = None
        self._curve_times: list[float] | None = None
        self._curve_max: list[list[int]] | None = None  # sparse table: [j][i] = max of levels i .. i + 2**j - 1

    # ---- tensors -------------------------------------------------------------------------------------------------
    def is_tracked(self, tid: str) -> bool:
        return tid in self.tensors

    def access(self, tid: str, k: int):
        return self.trace.tensors[tid].accesses[k]

    def access_op(self, tid: str, k: int) -> str:
        return self.op_names[self.tensors[tid].acc_pos[k]]

    def representative_access(self, pos: int):
        """An access recorded at op `pos`, for naming the op as a trigger: its first output's production if any
        (the op has finished), else its first read."""
        if self.op_outputs[pos]:
            return self.trace.tensors[self.op_outputs[pos][0]].accesses[0]
        tid = self.op_reads[pos][0]
        for a in self.trace.tensors[tid].accesses:
            if a.op == self.op_names[pos] and a.index > 0:
                return a
        raise TraceError(f"op {self.op_names[pos]!r} has no recorded access")  # pragma: no cover (guarded)

    def has_access(self, pos: int) -> bool:
        return bool(self.op_outputs[pos] or self.op_reads[pos])

    # ---- time <-> position ---------------------------------------------------------------------------------------
    def pos_at(self, time: float) -> int:
        """Position of the last op that started at or before `time` (0 if none)."""
        return max(bisect.bisect_right(self.start, time) - 1, 0)

    def evict_time(self, tid: str, k: int) -> float:
        """When the evicted-access `k` is over: the end of its op (a production ends with its op too)."""
        return self.end[self.tensors[tid].acc_pos[k]]

    # ---- memory --------------------------------------------------------------------------------------------------
    def replayed_curve(self) -> list[tuple[float, int]]:
        if self._curve is None:
            self._curve = self.trace.replayed_curve()
        return self._curve

    def replayed_peak(self) -> int:
        return max(b for _, b in self.replayed_curve())

    def curve_max(self, t0: float, t1: float) -> int:
        """The highest level of the ideal (replayed) curve over [t0, t1): the level in force at t0 and every level
        reached before t1. O(1) after a sparse table built at the first call."""
        curve = self.replayed_curve()
        if self._curve_max is None:
            self._curve_times = [t for t, _ in curve]
            table = [[b for _, b in curve]]
            span = 1
            while 2 * span <= len(curve):
                prev = table[-1]
                table.append([max(prev[i], prev[i + span]) for i in range(len(prev) - span)])
                span *= 2
            self._curve_max = table
        i = max(bisect.bisect_right(self._curve_times, t0) - 1, 0)
        j = max(bisect.bisect_left(self._curve_times, t1) - 1, i)
        k = (j - i + 1).bit_length() - 1
        row = self._curve_max[k]
        return max(row[i], row[j - (1 << k) + 1])

    def window(self, threshold_bytes: int) -> tuple[float, float] | None:
        """First to last time the ideal (replayed) curve is above `threshold_bytes`; None if it never is."""
        curve = self.replayed_curve()
        first = last = None
        for i, (_, b) in enumerate(curve):
            if b > threshold_bytes:
                if first is None:
                    first = i
                last = i
        if first is None:
            return None
        end = curve[last + 1][0] if last + 1 < len(curve) else self.step_time
        return (curve[first][0], end)

    def working_sets(self) -> list[int]:
        """Per op: persistent bytes + every transient tensor it reads or writes (the floor no plan can go below)."""
        persistent = self.trace.persistent_bytes
        out = []
        for i in range(self.n_ops):
            seen = set(self.op_outputs[i])
            seen.update(self.op_reads[i])
            out.append(persistent + sum(self.tensors[t].nbytes for t in seen))
        return out

    # ---- ops ------------------------------------------------------------------------------------------------------
    def is_layer_op(self, pos: int) -> bool:
        return self.op_type[pos] in LAYER_OP_TYPES

    def producer_pos(self, tid: str) -> int | None:
        """Position of the op that produces `tid` (from the trace, else from the graph model), None if it never ran."""
        return self._producer.get(tid)
