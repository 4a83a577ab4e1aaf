"""Which tensors passive mode hands to the pool, and when their late readers fetch them. Pure Python: no TensorFlow.

Passive mode (paper.md §1.4) can only evict a tensor whose buffer nothing but capuchin_tf holds. The measured step
therefore hands every tensor that lives across other work to the pool right after it is produced (a Hold), and its
far readers read it through their own Get, gated so that the Get runs when the reader is about to run, not when the
tensor is produced: between its near readers and its far ones, the pool holds the only reference.

The first iteration has no measurement yet, so "far" is judged on the graph and a schedule estimate (a topological
order taking ready ops first-in first-out in graph order). The estimate only decides what is held; a wrong guess
costs memory or time, never correctness: a Get's gates are inputs of its reader, so they cannot make a cycle.
"""

from __future__ import annotations

import dataclasses

from capuchin_tf.core.graph_model import VIEW_OPS, GraphModel
from capuchin_tf.core.schedule import produced_bytes, schedule_order

# dtypes the host store copies (names as in the graph model)
SWAPPABLE_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "uint16",
                              "int32", "uint32", "int64", "uint64", "bool", "complex64", "complex128"})
# Readers that must see the original tensor: the function's results.
DIRECT_READERS = frozenset({"_Retval"})
# Tensors a guided step hands to capuchin_tf's tensor pool (Hold/Get) are at least this large. Not to be confused
# with the device allocator's CapuchinAllocator::kSmallPoolMaxAllocationBytes (cc/kernels/device_allocator.h), also
# 64 KiB, which sends small allocations to a region of their own.
GUIDED_MIN_POOLED_BYTES = 64 * 1024
# The measured step pools smaller tensors too. It has no plan and no retry: the pool is all it has, and what the pool
# cannot evict stays where BFC put it: small tensors kept for the backward pass (a LayerNorm's statistics) sit between
# freed activations and split the free memory into pieces smaller than the next large request. Pooled, they are
# evicted too and the free space coalesces (docs/decisions.md, "What is held and when its Gets run"). Guided steps keep
# GUIDED_MIN_POOLED_BYTES: they have their plan, a retry and passive mode's rescue, and every Hold/Get pair costs time
# at every step.
MEASURED_MIN_POOLED_BYTES = 4 * 1024


@dataclasses.dataclass(frozen=True)
class PooledRead:
    """`reader` reads the pooled tensor through a Get that runs only after the ops `gates`."""

    reader: str
    gates: tuple[str, ...]


def hold_plan(graph: GraphModel, min_bytes: int = GUIDED_MIN_POOLED_BYTES,
              order: list[str] | None = None) -> dict[str, list[PooledRead]]:
    """Tensor id -> its far readers, each with the gate of its Get.

    Held: transient tensors of a swappable dtype and at least `min_bytes` that capuchin_tf may manage (made and read
    by ops that always run, GraphModel.manageable), with a far reader. A reader is far when, in the schedule estimate,
    at least `min_bytes` of other tensors are produced between the tensor and it: memory is allocated while the tensor
    waits. Its Get is gated on the op just before the reader in the estimate, so that it runs when the reader is about
    to. (Gating on the reader's other inputs is not enough: the executor's ready queue is first-in first-out, and a
    reader ready early, a gradient's BiasAddGrad for instance, still runs late.) It also waits for the producers of the
    reader's other inputs: the op before the reader in the estimate can run far earlier than the estimate says (a
    gradient op that reads only forward tensors runs in the forward pass; a ReadVariableOp, at the start), and a Get
    gated on it alone brings its tensor back there and keeps it on the device from then on, splitting the free memory
    of everything in between (docs/decisions.md, "What is held and when its Gets run").
    `order`: the schedule estimate (`schedule_order(graph)`), if already computed.
    """
    if order is None:
        order = schedule_order(graph)
    pos = {name: i for i, name in enumerate(order)}
    produced = produced_bytes(graph, order)
    # The op before each op in the estimate among the ops that always run (only they may gate: control_flow.py).
    before: dict[str, str | None] = {}
    last = None
    for name in order:
        before[name] = last
        if graph.ops[name].always_runs:
            last = name
    plan: dict[str, list[PooledRead]] = {}
    for t in graph.tensors.values():
        if t.nbytes < min_bytes or t.dtype not in SWAPPABLE_DTYPES or not t.consumers or not graph.manageable(t.id):
            continue
        if graph.ops[t.op].type in ("Capuchin>Hold", "Capuchin>Get"):
            continue
        p = pos[t.op]
        # A view op reads no data: the readers of its output read the tensor (the graph folds them into readers of
        # it, graph_model.fold_views), and their Gets feed clones of the views (rewrite.insert_hold_get).
        readers = sorted((c for c in dict.fromkeys(t.consumers) if graph.ops[c].type not in VIEW_OPS),
                         key=pos.__getitem__)
        if any(graph.ops[r].type in DIRECT_READERS for r in readers):
            continue
        reads = [PooledRead(r, _gates(graph, r, t.id, before[r])) for r in readers
                 if produced[pos[r]] - produced[p + 1] >= min_bytes]
        if reads:
            plan[t.id] = reads
    return plan


def _gates(graph: GraphModel, reader: str, tid: str, before: str | None) -> tuple[str, ...]:
    """What the Get of `tid` for `reader` waits for: the op before the reader in the estimate, and the producers of
    the reader's other inputs (all of which the reader waits for anyway), those that always run."""
    producers = [graph.tensors[i].op for i in graph.ops[reader].inputs
                 if i != tid and graph.ops[graph.tensors[i].op].type != "_Arg"]
    return tuple(g for g in dict.fromkeys([before, *producers]) if g is not None and graph.ops[g].always_runs)
