"""Execution orders of a step's graph. Pure Python: imports no TensorFlow.

`schedule_order` estimates the order TensorFlow's executor runs a graph in (passive mode uses it before anything is
measured) or, given measured start times, turns the measured order into an order of the graph. `guided_order` is the
order a guided step is made to follow (rewrite.apply_plan pins it with control edges).
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Mapping

from capuchin_tf.core.control_flow import CONTROL_FLOW_OPS
from capuchin_tf.core.graph_model import ALLOCATES_NOTHING, VIEW_OPS, GraphModel, Role, fold_views

BACK_EDGE_OPS = frozenset({"NextIteration", "RefNextIteration"})
# Ops that write a variable (resource) in place.
VARIABLE_WRITER_PREFIXES = ("AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp", "ResourceApply",
                            "ResourceScatter", "ResourceSparseApply",
                            "Capuchin>AssignInPlace")  # what managed steps make of AssignVariableOp (rewrite.py)


def is_variable_writer(op_type: str) -> bool:
    return op_type.startswith(VARIABLE_WRITER_PREFIXES)


def schedule_order(graph: GraphModel, priority: Mapping[str, float] | None = None) -> list[str]:
    """A topological order of the ops (data and control edges).

    Without `priority`: ready ops first-in first-out, in graph order, as TensorFlow's executor runs them with one
    inter-op thread (its ready queue is first-in first-out). With `priority` (for example each op's measured start):
    among the ready ops, the one of lowest priority first, so that the order is the measured one wherever the
    measured one is an order of the graph. Ops without a priority come first, as soon as they are ready: in a
    measured step those are the ops the profiler saw no kernel of (TensorFlow runs inexpensive kernels such as
    Reshape inline, as soon as they are ready). Ranked last instead, one such op holds back everything that depends on
    it, and ops measured much later run before it (docs/decisions.md, "The executed order is pinned to the measured
    one").
    """
    index = {name: i for i, name in enumerate(graph.ops)}
    succ: dict[str, list[str]] = collections.defaultdict(list)
    missing = {}
    for op in graph.ops.values():
        # a lowered loop's back edge (NextIteration -> Merge) is not a dependency: Merge runs on its first input
        preds = {graph.tensors[t].op for t in op.inputs
                 if graph.ops[graph.tensors[t].op].type not in BACK_EDGE_OPS} | set(op.control_inputs)
        preds.discard(op.name)
        missing[op.name] = len(preds)
        for p in preds:
            succ[p].append(op.name)
    if priority is None:
        def key(name: str) -> tuple:
            return (index[name],)
    else:
        def key(name: str) -> tuple:
            return (priority[name], index[name]) if name in priority else (-math.inf, index[name])
    ready = [n for n, k in missing.items() if k == 0]
    order = []
    if priority is None:
        queue = collections.deque(sorted(ready, key=key))
        while queue:
            name = queue.popleft()
            order.append(name)
            for s in sorted(succ[name], key=key):
                missing[s] -= 1
                if missing[s] == 0:
                    queue.append(s)
    else:
        heap = [(key(n), n) for n in ready]
        heapq.heapify(heap)
        while heap:
            _, name = heapq.heappop(heap)
            order.append(name)
            for s in succ[name]:
                missing[s] -= 1
                if missing[s] == 0:
                    heapq.heappush(heap, (key(s), s))
    if len(order) != len(graph.ops):
        stuck = sorted(n for n, k in missing.items() if k > 0)[:5]
        raise ValueError(f"the graph has a cycle (ops never ready: {stuck} ...)")
    return order


def guided_order(graph: GraphModel, starts: Mapping[str, float]) -> list[str]:
    """The measured order made an order of the graph, with the state writes of the forward pass (Keras seed
    generators, BatchNorm's moving statistics: variable writes that are not the optimizer's) moved to just before
    the first optimizer op. Until then the step has written no variable, so an out-of-memory error there can be
    retried (design.md); those writes are small and read nothing large, so moving them costs no memory.
    """
    order = schedule_order(graph, priority=starts)
    deferred = [n for n in order if is_variable_writer(graph.ops[n].type) and graph.ops[n].role != Role.OPTIMIZER
                and graph.ops[n].always_runs and not _has_data_consumers(graph, n)]
    if not deferred:
        return order
    first_update = next((i for i, n in enumerate(order) if graph.ops[n].role == Role.OPTIMIZER
                         and n not in deferred), len(order))
    # A deferred write can only move down to where nothing after it depends on it in the graph.
    moved = set(deferred)
    rest = [n for n in order if n not in moved]
    cut = sum(1 for n in order[:first_update] if n not in moved)
    out = rest[:cut] + deferred + rest[cut:]
    return out if _is_topological(graph, out) else order


def _has_data_consumers(graph: GraphModel, name: str) -> bool:
    return any(graph.tensors[t].consumers for t in graph.ops[name].outputs)


def _is_topological(graph: GraphModel, order: list[str]) -> bool:
    pos = {n: i for i, n in enumerate(order)}
    for op in graph.ops.values():
        for t in op.inputs:
            p = graph.tensors[t].op
            if graph.ops[p].type not in BACK_EDGE_OPS and pos[p] > pos[op.name]:
                return False
        if any(pos[c] > pos[op.name] for c in op.control_inputs):
            return False
    return True


def _data_ancestors(graph: GraphModel, names: list[str]) -> set[str]:
    """`names` and every op whose output they read, directly or not (data edges only: a tf.function's results wait
    for every side effect of the step through control edges, which say nothing about what they are computed from)."""
    seen, stack = set(names), list(names)
    while stack:
        op = graph.ops[stack.pop()]
        for p in [graph.tensors[t].op for t in op.inputs]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def produced_bytes(graph: GraphModel, order: list[str]) -> list[int]:
    """produced[i]: transient bytes the first i ops of `order` produce (so produced[j] - produced[i + 1] is what the
    ops strictly between positions i and j allocate)."""
    produced = [0]
    for name in order:
        produced.append(produced[-1] + sum(max(graph.tensors[t].nbytes, 0) for t in graph.ops[name].outputs
                                           if not graph.tensors[t].persistent))
    return produced


# The largest allocation the device allocator's small-tensor pool takes
# (CapuchinAllocator::kSmallPoolMaxAllocationBytes, cc/kernels/device_allocator.h), and the granularity BFC rounds
# allocations up to.
SMALL_TENSOR_BYTES = 64 * 1024
ALLOCATION_GRANULE = 256


def small_tensor_peak(graph: GraphModel, max_bytes: int = SMALL_TENSOR_BYTES) -> int | None:
    """The most bytes of small tensors (at most `max_bytes` each, those the allocator's small-tensor pool takes) the
    step holds at once in the executor's estimated order (`schedule_order`), each rounded up as BFC rounds it; None
    for a graph with a loop, whose body's tensors are made once per iteration where the model has each once.

    A tensor lives from its producer to its last reader, reads through views counted as reads of the buffer viewed;
    one with no reader is freed as soon as it is made. Ops that allocate nothing of their own (views, constants,
    variable reads, arguments, control flow) and persistent tensors count nothing. Kernel temporaries are not in the
    graph, and the executor's order is not quite this one: the measured pool peak is higher, by 0-30% on the zoo's
    MobileNets, EfficientNets, GAN and small CNNs (docs/decisions.md, "Small tensors have a pool of their own")."""
    if any(op.type in BACK_EDGE_OPS for op in graph.ops.values()):
        return None
    folded = fold_views(graph)
    order = schedule_order(folded)
    position = {name: i for i, name in enumerate(order)}
    change = [0] * (len(order) + 1)
    for t in folded.tensors.values():
        producer = folded.ops[t.op]
        if (t.persistent or not 0 < t.nbytes <= max_bytes or producer.type in ALLOCATES_NOTHING
                or producer.type in CONTROL_FLOW_OPS):
            continue
        start = position[t.op]
        end = max((position[c] for c in t.consumers), default=start)
        size = -(-t.nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE
        change[start] += size
        change[end + 1] -= size
    live = peak = 0
    for c in change:
        live += c
        peak = max(peak, live)
    return peak


# An early op is deferred when its outputs hold at least this much and at least this much of other tensors is produced
# between it and its first reader.
DEFER_MIN_BYTES = 1 << 20


def deferral_gates(graph: GraphModel, min_bytes: int = DEFER_MIN_BYTES) -> dict[str, tuple[str, ...]]:
    """Gradient and optimizer ops the executor would run long before their outputs are read -> the ops each is to
    wait for.

    TensorFlow's executor runs an op as soon as its inputs are ready, and a gradient op that reads nothing of the
    backward pass is ready early: the gradient of a gather of labels (a dense UnsortedSegmentSum the size of the logits)
    reads only the labels, so it runs in the forward pass and its output waits there, one more large tensor held through
    everything in between (docs/decisions.md, "Ops outside the forward pass ready long before their readers are
    deferred"). Such ops are deferred as late as possible (in the executor's estimated order, `schedule_order`): an op X
    is deferred to just before its first reader R, where readers deferred themselves count at their new place; it is
    made to wait for the last op before R that neither depends on X nor is deferred nor is an optimizer op, so that it
    runs right before R.

    X is deferred when: it is not part of the forward pass (what the step's results depend on) and the estimate runs it
    before the forward pass's last op, not stateful and not a variable write, whose outputs hold at least `min_bytes` or
    which reads such an op's output; at least `min_bytes` of other tensors are produced between it and R; and its
    outputs are at least as large as the inputs it would keep alive longer (read last by X, or last by ops before its
    new place). An early op that is not deferred but reads a forward tensor of its own output's size waits for that
    tensor's forward readers instead. Only ops that always run (control_flow.py) are deferred or gate anything.
    Returns {X: the ops X waits for}.
    """
    order = schedule_order(graph)
    pos = {name: i for i, name in enumerate(order)}
    produced = produced_bytes(graph, order)
    control_consumers: dict[str, list[str]] = collections.defaultdict(list)
    for op in graph.ops.values():
        for c in op.control_inputs:
            control_consumers[c].append(op.name)

    def successors(name: str):
        for t in graph.ops[name].outputs:
            yield from graph.tensors[t].consumers
        yield from control_consumers.get(name, ())

    def depends_on(later: str, earlier: str) -> bool:
        """Whether `later` is reachable from `earlier` (only ops before `later` in the order can be on the way)."""
        limit, stack, seen = pos[later], [earlier], {earlier}
        while stack:
            for s in successors(stack.pop()):
                if s == later:
                    return True
                if s not in seen and pos[s] < limit:
                    seen.add(s)
                    stack.append(s)
        return False

    # The forward pass: what the step's results depend on (the loss). Ops outside it that the estimate runs before
    # its last op are early: gradient ops that read no gradient, and an optimizer's decay of its slots (rho x v reads
    # only the slot, so the executor computes it for every variable at the start of the step and the results wait
    # through the whole forward and backward pass). Roles by name scope would miss them (Keras names RMSprop's scope
    # "rm_sprop", and the decay's reader also reads the gradient; docs/decisions.md, "Ops outside the forward pass
    # ready long before their readers are deferred").
    results = [n for n, op in graph.ops.items() if op.type == "_Retval"]
    forward = (_data_ancestors(graph, results) if results  # a graph without results (a test's): roles by name
               else {n for n, op in graph.ops.items() if op.role == Role.FORWARD})
    # (its last computing op: a result's Identity waits for every side effect of the step, through control edges)
    forward_end = max((pos[n] for n in forward if graph.ops[n].type not in VIEW_OPS | {"_Retval"}), default=0)
    early = {n for n in order[:forward_end] if n not in forward and not graph.ops[n].stateful
             and not is_variable_writer(graph.ops[n].type) and graph.ops[n].always_runs
             and graph.ops[n].type not in ("_Arg", "_Retval")}

    def out_bytes(name: str) -> int:
        return sum(max(graph.tensors[t].nbytes, 0) for t in graph.ops[name].outputs)

    # Worth moving: early ops with large outputs, and the early readers of those (which must move for them to).
    large = {n for n in early if out_bytes(n) >= min_bytes}
    movable = large | {n for n in early
                       if any(graph.tensors[t].op in large and graph.tensors[t].nbytes >= min_bytes
                              for t in graph.ops[n].inputs)}

    target: dict[str, int] = {}  # deferred op -> position of the reader it now runs just before
    gates: dict[str, str] = {}
    for name in reversed(order):
        if name not in movable:
            continue
        op = graph.ops[name]
        readers = set(successors(name))
        if not readers:
            continue
        p_x = pos[name]
        p_r = min(target.get(r, pos[r]) for r in readers)
        if produced[p_r] - produced[p_x + 1] < min_bytes:
            continue
        gate = next((order[i] for i in range(p_r - 1, p_x, -1)
                     if order[i] not in gates and graph.ops[order[i]].role != Role.OPTIMIZER
                     and graph.ops[order[i]].always_runs and not depends_on(order[i], name)), None)
        if gate is None:
            continue
        extended = 0
        for t in dict.fromkeys(op.inputs):
            info = graph.tensors[t]
            if info.persistent or info.nbytes <= 0:
                continue
            # Without the deferral t is freed after its last reader; with it, not before X's new place.
            freed_after = max([target.get(c, pos[c]) for c in info.consumers if c != name] + [p_x])
            if freed_after < pos[gate]:
                extended += info.nbytes
        if out_bytes(name) < extended:
            continue
        gates[name], target[name] = gate, p_r
    out = {name: (gate,) for name, gate in gates.items()}
    # An early op that reads a forward tensor as large as its output waits for that tensor's forward readers: then
    # it reads it last and can compute in place instead of taking a buffer of its own while the tensor still lives
    # (an Exp of log-probabilities that runs before their other readers, for one).
    for name in early - set(gates):
        op = graph.ops[name]
        size = out_bytes(name)
        if size < min_bytes:
            continue
        after = [c for t in op.inputs if graph.tensors[t].nbytes == size and not graph.tensors[t].persistent
                 for c in graph.tensors[t].consumers
                 if c != name and c in forward and graph.ops[c].always_runs and not depends_on(c, name)]
        if after:
            out[name] = tuple(dict.fromkeys(after))
    return out
