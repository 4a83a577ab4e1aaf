"""Assembles an AccessTrace from the events of one measured step. Pure Python: imports no TensorFlow.

The measured step yields two streams (tf/measure.py reads them from TensorFlow's profiler):
- kernel events: each executed op's start and end;
- allocator events: every allocation (address, bytes, the op that allocated it, whether it is an output or a
  temporary) and every free (address), with the bytes in use after it.

From them: each op's outputs are matched to the output allocations the op made; an output that allocated nothing
took over an input's buffer (TensorFlow forwards a dead input's buffer to the output) or is a view of it; each
tensor's lifetime is its buffer's, split where ownership moves; temporaries and allocations no op claims are kept
as their own records, so that the memory replayed from the records is the memory the allocator saw. Every read of a
tensor is an access at the measured start of the op that read it. Times are moved onto the ideal timeline by
removing the stalls (passive-mode evictions) the step had.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from capuchin_tf.core import graph_model
from capuchin_tf.core.access_trace import Access, AccessTrace, OpRecord, TensorRecord, build_trace
from capuchin_tf.core.graph_model import GraphModel, split_tensor_id

# Ops whose output may share its input's buffer while the input lives on (no copy, no allocation): the view ops,
# and Snapshot when it forwards.
VIEW_OPS = graph_model.VIEW_OPS | {"Snapshot"}


POOL_OP_TYPES = ("Capuchin>Hold", "Capuchin>Get")


def fold_pool_ops(graph: GraphModel) -> tuple[GraphModel, dict[str, str]]:
    """The graph without capuchin_tf's pool ops (Hold, Get), consumers reading the original tensors again.

    Returns the folded graph and, for each Get node, the tensor it serves: a Get that brings an evicted tensor back
    allocates a new buffer for that same tensor.
    """
    holds = {o.name: o.inputs[0] for o in graph.ops.values() if o.type == "Capuchin>Hold"}
    gets = {o.name: holds[o.inputs[0].rsplit(":", 1)[0]] for o in graph.ops.values()
            if o.type == "Capuchin>Get" and o.inputs and o.inputs[0].rsplit(":", 1)[0] in holds}
    if not holds:
        return graph, {}
    pool_ops = set(holds) | {o.name for o in graph.ops.values() if o.type in POOL_OP_TYPES}
    rename = {f"{g}:0": t for g, t in gets.items()}
    # A reader that read the tensor through views reads clones of those views made on its Get
    # (`<get>/view/<view op>`, rewrite._rewire): it reads the original views again.
    for o in graph.ops.values():
        if o.type not in VIEW_OPS or not o.name.startswith("capuchin/get/"):
            continue
        cut = o.name.find("/view/")
        while cut >= 0 and o.name[:cut] not in gets:
            cut = o.name.find("/view/", cut + 1)
        if cut < 0:
            continue
        view = o.name[cut + len("/view/"):]
        original = view if view in graph.ops else view.rpartition("_")[0]
        if original in graph.ops:
            pool_ops.add(o.name)
            rename.update({t: f"{original}:{split_tensor_id(t)[1]}" for t in o.outputs})
    ops = []
    for o in graph.ops.values():
        if o.name in pool_ops:
            continue
        ops.append(dataclasses.replace(
            o, inputs=tuple(rename.get(i, i) for i in o.inputs),
            control_inputs=tuple(c for c in o.control_inputs if c not in pool_ops)))
    consumers: dict[str, list[str]] = {}
    for o in ops:
        for i in o.inputs:
            consumers.setdefault(i, []).append(o.name)
    tensors = [dataclasses.replace(t, consumers=tuple(dict.fromkeys(consumers.get(t.id, ()))))
               for t in graph.tensors.values() if t.op not in pool_ops]
    return GraphModel.build(ops, tensors), gets


@dataclasses.dataclass(frozen=True)
class KernelEvent:
    op: str
    type: str
    start: int  # ns, any clock shared by all events of the step
    end: int


@dataclasses.dataclass(frozen=True)
class MemoryEvent:
    time: int  # ns
    allocation: bool  # False: a free
    addr: int
    nbytes: int  # bytes the allocator charged (rounded)
    requested: int = 0
    in_use_after: int = -1  # allocator bytes in use after the event
    op: str = ""  # the op that allocated (allocations only)
    region: str = ""  # "output", "temp", ...


class _Timeline:
    """Maps measured times to the ideal timeline: relative to the step start, with stalls removed."""

    def __init__(self, t0: int, stalls: Sequence[tuple[int, int]]):
        self.t0 = t0
        merged: list[list[int]] = []
        for s, e in sorted(stalls):
            if e <= s:
                continue
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]
        self.cum = []
        total = 0
        for s, e in merged:
            total += e - s
            self.cum.append(total)

    def removed_before(self, t: int) -> int:
        i = bisect.bisect_right(self.starts, t) - 1
        if i < 0:
            return 0
        full = self.cum[i - 1] if i > 0 else 0
        return full + min(t, self.ends[i]) - self.starts[i]

    def __call__(self, t: int) -> float:
        return (t - self.t0 - self.removed_before(t)) / 1e9

    @property
    def total_s(self) -> float:
        return (self.cum[-1] if self.cum else 0) / 1e9


def stalled_within(stalls: Sequence[tuple[int, int]]):
    """(start, end) -> how much of [start, end] the `stalls` spans cover (overlapping spans counted once): what the
    measured step's timeline removes, for a guided step's kernels (tf/measure.py, kernel_seconds)."""
    timeline = _Timeline(0, stalls)
    return lambda start, end: timeline.removed_before(end) - timeline.removed_before(start)


@dataclasses.dataclass
class _Buffer:
    addr: int
    nbytes: int
    alloc: int
    free: int | None = None
    owner: str | None = None  # the tensor id that holds it now
    owned_since: int = 0


def _once_per_op(kernels: list[KernelEvent]) -> list[KernelEvent]:
    """One event per op: an op of a loop body runs once per iteration (and such ops are never managed,
    control_flow.py). It is recorded at its first start, for the time of all its runs; the allocations of its later
    runs stay in the trace as the op's own temporaries, so that the replayed memory is the allocator's."""
    total: dict[str, int] = {}
    for k in kernels:
        total[k.op] = total.get(k.op, 0) + (k.end - k.start)
    out, seen = [], set()
    for k in kernels:
        if k.op in seen:
            continue
        seen.add(k.op)
        out.append(k if total[k.op] == k.end - k.start else dataclasses.replace(k, end=k.start + total[k.op]))
    return out


def assemble_trace(
    graph: GraphModel,
    kernels: Iterable[KernelEvent],
    memory: Iterable[MemoryEvent],
    *,
    peak_bytes: int,
    persistent_bytes: int | None = None,
    stalls: Sequence[tuple[int, int]] = (),
    evicted_bytes: int = 0,
    budget_bytes: int | None = None,
    meta: Mapping | None = None,
    buffer_aliases: Mapping[str, str] | None = None,
) -> AccessTrace:
    """The AccessTrace of one step from its kernel and allocator events (see the module docstring).

    `buffer_aliases` maps ops outside the graph whose allocations belong to a graph tensor (a passive-mode Get that
    brought an evicted tensor back) to that tensor: on the ideal timeline the tensor never left.
    """
    buffer_aliases = dict(buffer_aliases or {})
    kernels = sorted((k for k in kernels if k.op in graph.ops), key=lambda k: (k.start, k.op))
    if not kernels:
        raise ValueError("no kernel event names an op of the graph: nothing was measured")
    t0, t_end = kernels[0].start, max(k.end for k in kernels)
    kernels = _once_per_op(kernels)
    timeline = _Timeline(t0, stalls)
    memory = sorted((m for m in memory if t0 <= m.time <= t_end), key=lambda m: (m.time, not m.allocation))

    if persistent_bytes is None:
        first = next((m for m in memory if m.in_use_after >= 0), None)
        if first is None:
            persistent_bytes = 0
        else:
            persistent_bytes = (first.in_use_after - first.nbytes if first.allocation
                                else first.in_use_after + first.nbytes)

    # Allocations per op, in time order, and the buffers they create.
    live: dict[int, _Buffer] = {}
    buffers: list[_Buffer] = []
    by_op_outputs: dict[str, list[_Buffer]] = {}
    by_op_other: dict[str, list[_Buffer]] = {}
    released: list[tuple[int, int]] = []
    for m in memory:
        if m.allocation:
            b = _Buffer(m.addr, m.nbytes, m.time)
            live[m.addr] = b
            buffers.append(b)
            if m.op in buffer_aliases:
                by_op_other.setdefault(("alias", buffer_aliases[m.op]), []).append(b)
            elif m.op in graph.ops and m.region == "output":
                by_op_outputs.setdefault(m.op, []).append(b)
            else:
                by_op_other.setdefault(m.op, []).append(b)
        else:
            b = live.pop(m.addr, None)
            if b is not None:
                b.free = m.time
            else:  # allocated before the step: persistent memory released (e.g. a variable's old buffer)
                released.append((m.time, m.nbytes))

    order = {k.op: i for i, k in enumerate(kernels)}
    last_reader: dict[str, int] = {}
    for k in kernels:
        for t in graph.ops[k.op].inputs:
            last_reader[t] = max(last_reader.get(t, -1), order[k.op])

    # Ownership of buffers by tensors: (tensor id) -> list of (buffer, since, until or None)
    holdings: dict[str, list[list]] = {}
    current: dict[str, _Buffer] = {}  # tensor -> buffer it is bound to (owned or viewed)
    views: set[str] = set()

    def take(tid: str, buf: _Buffer, since: int):
        if buf.owner is not None and buf.owner in holdings:
            holdings[buf.owner][-1][2] = since
        buf.owner = tid
        holdings.setdefault(tid, []).append([buf, since, None])

    for k in kernels:
        op = graph.ops[k.op]
        allocated = list(by_op_outputs.get(k.op, ()))
        # Some kernels allocate a temporary and then hand it out as an output (reductions, for one): a "temp"
        # allocation that outlives its op is an output too.
        others = by_op_other.get(k.op, [])
        allocated += [b for b in others if b.free is None or b.free > k.end]
        by_op_other[k.op] = [b for b in others if not (b.free is None or b.free > k.end)]
        for tid in op.outputs:
            info = graph.tensors[tid]
            pick = None
            for b in allocated:
                if info.nbytes < 0 or b.nbytes >= info.nbytes:
                    pick = b
                    break
            if pick is not None and (info.nbytes != 0):
                allocated.remove(pick)
                take(tid, pick, pick.alloc)
                current[tid] = pick
                continue
            # No allocation of its own: a forwarded input buffer, or a view of one. An input this op can forward
            # (its buffer's own tensor, read last here) comes first: TensorFlow forwards only such a buffer, and an
            # input of the same size that lives on (the residual of an AddN, say) is not the one the output took.
            candidates = []
            for inp in op.inputs:
                b = current.get(inp)
                if b is None or b.free is not None and b.free < k.start:
                    continue
                if info.nbytes < 0 or graph.tensors[inp].nbytes == info.nbytes or op.type in VIEW_OPS:
                    candidates.append(inp)
            if not candidates:
                continue
            source = next((inp for inp in candidates if last_reader.get(inp) == order[k.op]
                           and current[inp].owner == inp), candidates[0])
            b = current[source]
            current[tid] = b
            if last_reader.get(source) == order[k.op] and b.owner == source and op.type not in VIEW_OPS:
                take(tid, b, k.end)  # forwarded: the input is dead, the output owns the buffer now
            else:
                views.add(tid)
        # Temporaries of this op (and unclaimed output allocations) stay the op's own.
        for i, b in enumerate(by_op_other.get(k.op, []) + allocated):
            take(f"{k.op}:temp{i}", b, b.alloc)

    # Buffers of tensors brought back by passive mode belong to those tensors.
    for key, bufs in by_op_other.items():
        if isinstance(key, tuple):
            for b in bufs:
                take(key[1], b, b.alloc)

    # Allocations no executed op claims (function-call bookkeeping, outputs copied at the end, ...).
    for b in buffers:
        if b.owner is None:
            take(f"_unattributed:{b.addr}@{b.alloc}", b, b.alloc)

    # Accesses: production at the producer's end, reads at each consumer's start.
    accesses: dict[str, list[Access]] = {}
    for k in kernels:
        op = graph.ops[k.op]
        for tid in op.outputs:
            accesses.setdefault(tid, []).append(Access(tid, 0, timeline(k.end), k.op))
        for tid in dict.fromkeys(op.inputs):
            accesses.setdefault(tid, []).append(Access(tid, 0, timeline(k.start), k.op))

    records = []
    for tid, spans in holdings.items():
        nbytes = max(buf.nbytes for buf, _, _ in spans)
        since = min(s for _, s, _ in spans)
        ends = [(u if u is not None else buf.free) for buf, _, u in spans]
        free = None if any(e is None for e in ends) else max(ends)
        records.append(TensorRecord(tid, nbytes, timeline(since), None if free is None else timeline(free),
                                    tuple(accesses.get(tid, ()))))
    for tid in views:
        if tid not in holdings:
            acc = tuple(accesses.get(tid, ()))
            if acc:
                records.append(TensorRecord(tid, 0, acc[0].time, acc[-1].time, acc))

    curve = [(0.0, persistent_bytes)] + [(timeline(m.time), m.in_use_after) for m in memory if m.in_use_after >= 0]
    ops = [OpRecord(k.op, graph.ops[k.op].type, timeline(k.start),
                    max(timeline(k.end) - timeline(k.start), 0.0), graph.ops[k.op].role) for k in kernels]
    return build_trace(
        graph, ops, records,
        memory_curve=tuple(curve),
        step_time=timeline(t_end),
        peak_bytes=peak_bytes,
        persistent_bytes=persistent_bytes,
        evicted_bytes=evicted_bytes,
        stall_time=timeline.total_s,
        budget_bytes=budget_bytes,
        meta=dict(meta or {}),
        released=tuple((timeline(t), n) for t, n in released),
    )
