"""Execution orders of a step's graph. Pure Python: imports no TensorFlow.

`schedule_order` estimates the order TensorFlow's executor runs a graph in (passive mode uses it before anything is
measured) or, given measured start times, turns the measured order into an order of the graph. `guided_order` is the
order a guided step is made to follow (rewrite.apply_plan pins it with control edges).
"""

from __future__ import annotations

import collections
import math
import heapq
from typing import Mapping

from capuchin_tf.graph_model import GraphModel, Role

BACK_EDGE_OPS = frozenset({"NextIteration", "RefNextIteration"})
# Ops that write a variable (resource) in place.
VARIABLE_WRITER_PREFIXES = ("AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp", "ResourceApply",
                            "ResourceScatter", "ResourceSparseApply")


def is_variable_writer(op_type: str) -> bool:
    return op_type.startswith(VARIABLE_WRITER_PREFIXES)


def schedule_order(graph: GraphModel, priority: Mapping[str, float] | None = None) -> list[str]:
    """A topological order of the ops (data and control edges).

    Without `priority`: ready ops first-in first-out, in graph order, as TensorFlow's executor runs them with one
    inter-op thread (its ready queue is first-in first-out). With `priority` (for example each op's measured start):
    among the ready ops, the one of lowest priority first, so that the order is the measured one wherever the
    measured one is an order of the graph. Ops without a priority come first, as soon as they are ready: in a
    measured step those are the ops the profiler saw no kernel of (TensorFlow runs inexpensive kernels such as
    Reshape inline, as soon as they are ready). Ranking them last instead held back everything behind them: on
    ResNet50 an optimizer update measured at the end of the step ran before a gradient's Reshape and its backward
    chain, 582 inversions in all.
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
                and not _has_data_consumers(graph, n)]
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
