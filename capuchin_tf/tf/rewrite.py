"""Rewriting: a captured step's optimized GraphDef, edited, back into a function on the same variables.

The one module that does FuncGraph surgery (private TensorFlow APIs). Edits are made on the post-optimization graph
(capture.optimized_graph: what TensorFlow's executor would run, Grappler's fusions done, names the trace's tensor
ids use). `rebuild(concrete, graph_def)` imports it into a new FuncGraph that captures the same variable handles
and returns a ConcreteFunction with the original calling convention and outputs (tf-notes.md, "Running a rewritten
graph on the same variables"); `call_without_grappler` runs it without a second Grappler pass, so that the inserted
nodes cannot change what Grappler does and the kernels are those plain TensorFlow runs (bit-for-bit results).
Graph edits are functions GraphDef -> GraphDef, each documented with a before/after sketch; inserted nodes are
named `capuchin/<kind>/<tensor>...`.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Mapping, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2
from tensorflow.python.framework import op_def_registry

from capuchin_tf.core import control_flow
from capuchin_tf.core.graph_model import VIEW_OPS, fold_views, shape_of, split_tensor_id, tf_dims, view_input
from capuchin_tf.core.pool_plan import GUIDED_MIN_POOLED_BYTES, MEASURED_MIN_POOLED_BYTES, SWAPPABLE_DTYPES, hold_plan
from capuchin_tf.core.schedule import deferral_gates, guided_order, schedule_order
from capuchin_tf.tf import capture, function_surgery
from capuchin_tf.tf.function_surgery import RewriteError

RECOMPUTE_PREFIX = "capuchin/recompute/"  # the name prefix of a replay's clones


def safe_name(tid: str) -> str:
    """A node-name-safe form of a tensor id: 'a/b:1' -> 'a/b_1'."""
    op, slot = split_tensor_id(tid)
    return re.sub(r"[^A-Za-z0-9_./-]", "_", f"{op}_{slot}")


def _attr_type(dtype) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=tf.as_dtype(dtype).as_datatype_enum)


def _attr_shape(shape) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(shape=tf.TensorShape(shape).as_proto())


class GraphEditor:
    """A copy of an optimized GraphDef that capuchin_tf's edits go through, so that no edit breaks the graph.

    Every control edge goes through `add_control`, which refuses (returns False, adds nothing) an edge that
    - touches an op that may not run (a cond branch, a loop body, an Exit: control_flow.py): from such an op it would
      kill its destination whenever the branch is not taken, into or out of a loop frame TensorFlow refuses it;
    - or would close a cycle (control_flow.IncrementalOrder).
    Control edges are orderings that capuchin_tf chose (the pinned order, gates of pool reads, swap and recompute
    triggers): leaving one out costs memory or time, never correctness. Inserted nodes (`add_node`) run whenever
    their inputs do. `refused` counts the edges left out, by reason.

    `order`: a topological order to start from (the pinned order, so that its edges cost nothing); else graph order.
    """

    def __init__(self, graph_def: graph_pb2.GraphDef, order: Sequence[str] | None = None,
                 flow: control_flow.ControlFlow | None = None):
        self.graph = copy.deepcopy(graph_def)
        self.nodes: dict[str, node_def_pb2.NodeDef] = {n.name: n for n in self.graph.node}
        flow = flow if flow is not None else control_flow.of_graph_def(self.graph)  # `flow`: if already analyzed
        self._always = {name: flow.always_runs(name) for name in self.nodes}
        # Reachability is kept between units: a node of the root frame is its own unit, a loop (with its nested
        # loops, Enters and Exits) is one unit. Within a loop every op can depend on every other through the next
        # iteration (NextIteration -> Merge), so a loop is one strongly connected piece: an edge from an op after
        # the loop to one feeding it closes a cycle, though the graph without its back edges shows none.
        self._unit = {name: name if flow.frame[name] == control_flow.ROOT else f"\0loop:{flow.frame[name][0]}"
                      for name in self.nodes}
        edges = set()
        for n in self.graph.node:
            for i in n.input:
                src = _split_ref(i[1:] if i.startswith("^") else i)[0]
                if src in self.nodes and self._unit[src] != self._unit[n.name]:
                    edges.add((self._unit[src], self._unit[n.name]))
        priority = {}
        for i, name in enumerate(order or ()):
            priority.setdefault(self._unit.get(name, name), float(i))
        self.order = control_flow.IncrementalOrder(dict.fromkeys(self._unit.values()), edges, priority)
        self.refused: dict[str, int] = {"may not run": 0, "cycle": 0}
        self.added_controls: dict[str, list[str]] = {}  # node -> the gates add_control gave it, in order

    def reaches(self, a: str, b: str) -> bool:
        """Whether node `b` depends on node `a` (through any path, loops included)."""
        return self.order.reaches(self._unit[a], self._unit[b])

    def always_runs(self, name: str) -> bool:
        """Whether the node always runs (control_flow.py): edits keep what the analysis of the given graph said, as
        control edges join only ops that always run, and an inserted node runs when its inputs do."""
        return self._always.get(name, False)

    def add_node(self, name: str, op: str, inputs: Sequence[str], device: str,
                 mirrors: Sequence[str] = (), reader: str | None = None) -> node_def_pb2.NodeDef:
        """A new node reading `inputs` (data inputs as refs); it runs whenever they are all computed. `mirrors`: per
        output, the tensor whose value it has (capture.MIRRORS_ATTR). `reader`: the node it will feed, if known (the
        edges gating it then cost least to check: IncrementalOrder.add_node)."""
        if name in self.nodes:
            raise RewriteError(f"the rewrite would insert {name!r} twice")
        node = self.graph.node.add(name=name, op=op, input=list(inputs), device=device)
        if mirrors:
            node.attr[capture.MIRRORS_ATTR].list.s.extend(m.encode() for m in mirrors)
        return self._register(node, reader)

    def add_copy(self, original: node_def_pb2.NodeDef, name: str, inputs: Sequence[str],
                 reader: str | None = None) -> node_def_pb2.NodeDef:
        """A clone of `original` (attributes and device) named `name`, reading `inputs` (data inputs only); its
        outputs mirror the original's (capture.MIRRORS_ATTR). `reader`: as for `add_node`."""
        if name in self.nodes:
            raise RewriteError(f"the rewrite would insert {name!r} twice")
        node = self.graph.node.add()
        node.CopyFrom(original)
        node.name = name
        del node.input[:]
        node.input.extend(inputs)
        if capture.MIRRORS_ATTR not in original.attr:
            n_out = max(_num_outputs(original), 1)
            node.attr[capture.MIRRORS_ATTR].list.s[:] = [f"{original.name}:{k}".encode() for k in range(n_out)]
        return self._register(node, reader)

    def _register(self, node: node_def_pb2.NodeDef, reader: str | None = None) -> node_def_pb2.NodeDef:
        sources = [_split_ref(i)[0] for i in node.input if not i.startswith("^")]
        self.nodes[node.name] = node
        self._always[node.name] = all(self._always.get(src, False) for src in sources)
        self._unit[node.name] = node.name
        self.order.add_node(node.name, after=dict.fromkeys(self._unit[src] for src in sources),
                            before=self._unit.get(reader) if reader is not None else None)
        return node

    def set_input(self, node: node_def_pb2.NodeDef, i: int, ref: str) -> None:
        """Makes data input `i` of `node` read `ref` (a data edge capuchin_tf needs: a cycle is a bug)."""
        src = _split_ref(ref)[0]
        if self._unit[src] != self._unit[node.name] and not self.order.add_edge(self._unit[src],
                                                                                self._unit[node.name]):
            raise RewriteError(f"reading {ref!r} in {node.name!r} would close a cycle")
        node.input[i] = ref

    def add_control(self, node: str, gate: str) -> bool:
        """`node` waits for `gate` (a control edge), unless the edge is refused (see the class docstring)."""
        if gate == node:
            return False
        if not (self.always_runs(gate) and self.always_runs(node)):
            self.refused["may not run"] += 1
            return False
        target = self.nodes[node]
        if f"^{gate}" in target.input:
            return True
        if not self.order.add_edge(self._unit[gate], self._unit[node]):
            self.refused["cycle"] += 1
            return False
        target.input.append(f"^{gate}")
        self.added_controls.setdefault(node, []).append(gate)
        return True


def insert_hold_get(ed: GraphEditor, plan: Mapping[str, Sequence], dtypes: Mapping[str, str],
                    shapes: Mapping[str, tuple | None]) -> None:
    r"""Hands each tensor of `plan` (pool_plan.hold_plan) to the pool right after it is produced; each of its far
    readers reads it through its own Get, which runs only after that read's gates.

    Before:                          After:
        P --t--> F (near reader)         P --t--> F
          \----> B (far reader)           \--> capuchin/hold/t --h--> capuchin/get/t/0 --t'--> B
                  ^ u                                                 ^ (ctrl: gates, e.g. u's producer)
    Once F has run, the pool holds t's only reference: passive mode can evict it, and the Get brings it back.
    `dtypes`/`shapes`: the tensor's dtype name and static shape (None or -1 entries where unknown). Gates that may
    not run or would close a cycle are left out (GraphEditor.add_control). The edits go into `ed`.
    Inserted nodes: `capuchin/hold/<tensor>`, `capuchin/get/<tensor>/<k>`, on the producer's device.
    """
    for tid, reads in plan.items():
        op, slot = split_tensor_id(tid)
        base = f"capuchin/hold/{safe_name(tid)}"
        device = ed.nodes[op].device
        hold = ed.add_node(base, "Capuchin>Hold", [_ref(tid)], device)
        hold.attr["T"].CopyFrom(_attr_type(dtypes[tid]))
        hold.attr["tensor_name"].CopyFrom(attr_value_pb2.AttrValue(s=tid.encode()))
        shape = shapes.get(tid)
        for k, read in enumerate(reads):
            get = ed.add_node(f"capuchin/get/{safe_name(tid)}/{k}", "Capuchin>Get", [base], device,
                              mirrors=[_mirror(ed, tid)], reader=read.reader)
            get.attr["dtype"].CopyFrom(_attr_type(dtypes[tid]))
            get.attr["shape"].CopyFrom(_attr_shape(tf_dims(shape)))
            _rewire(ed, ed.nodes[read.reader], tid, get.name, get.name)
            for g in read.gates:
                ed.add_control(get.name, g)


def _mirror(ed: GraphEditor, tid: str) -> str:
    """The original tensor whose value `tid` has (itself, unless made by a node capuchin_tf inserted)."""
    op, slot = split_tensor_id(tid)
    node = ed.nodes.get(op)
    if node is not None and capture.MIRRORS_ATTR in node.attr and slot < len(node.attr[capture.MIRRORS_ATTR].list.s):
        return node.attr[capture.MIRRORS_ATTR].list.s[slot].decode()
    return tid


def _num_outputs(node: node_def_pb2.NodeDef) -> int:
    op_def = op_def_registry.get(node.op)
    return capture.num_outputs(node, op_def) if op_def is not None else 1


def add_gates(ed: GraphEditor, gates: Mapping[str, Sequence[str]]) -> None:
    """Each op of `gates` in the graph `ed` edits waits for its gates (control edges; schedule.deferral_gates),
    where GraphEditor.add_control allows:

        G ...          G ...
        X --> R        X --> R
                       ^ (ctrl: G)
    """
    for name, gs in gates.items():
        for gate in gs:
            ed.add_control(name, gate)


# dtypes whose values Capuchin>AssignInPlace copies byte for byte (those the host store copies), as DataType enums.
_MEMCPY_DTYPES = frozenset(tf.as_dtype(d).as_datatype_enum for d in SWAPPABLE_DTYPES)


def assignments_in_place(graph_def: graph_pb2.GraphDef) -> tuple[graph_pb2.GraphDef, int]:
    """`graph_def` with every AssignVariableOp of a dense, memcpy-able dtype made a `Capuchin>AssignInPlace` (same
    name, inputs and dtype), and the number of nodes changed.

    AssignVariableOp takes over its value's buffer when nothing else holds it: the variable moves to wherever the value
    was computed, and its old buffer is freed. Keras' SGD with momentum assigns every momentum slot that way, and
    BatchNormalization its moving statistics, so in every step such buffers move out of the run the variables were laid
    out in (recovery.compact_variables) and scatter over the free memory (the trace's `released`; docs/decisions.md,
    "Managed steps assign variables in place"). Capuchin>AssignInPlace copies the value into the variable's own buffer
    when nothing shares it (the same bytes; a copy of the value per assignment), and otherwise into a new buffer of its
    own, as AssignVariableOp does when it copies."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    changed = 0
    for node in out.node:
        if node.op != "AssignVariableOp" or node.attr["dtype"].type not in _MEMCPY_DTYPES:
            continue
        dtype = node.attr["dtype"].type
        node.op = "Capuchin>AssignInPlace"
        node.ClearField("attr")
        node.attr["dtype"].type = dtype
        changed += 1
    return out, changed


def _ref(tid: str) -> str:
    op, slot = split_tensor_id(tid)
    return op if slot == 0 else f"{op}:{slot}"


def _split_ref(ref: str) -> tuple[str, int]:
    name, _, slot = ref.partition(":")
    return name, int(slot) if slot else 0


def _view_chain(nodes: Mapping[str, node_def_pb2.NodeDef], ref: str) -> tuple[str, list[str]]:
    """(the ref whose buffer `ref` is, the view refs between it and `ref`, innermost first): `ref` itself and no
    views unless `ref` is made by view ops (graph_model.VIEW_OPS)."""
    views = []
    for _ in range(len(nodes) + 1):
        name, slot = _split_ref(ref)
        view = nodes.get(name)
        k = None if view is None else view_input(view.op, slot)
        if k is None or k >= len(view.input) or view.input[k].startswith("^"):
            break
        views.append(ref)
        ref = view.input[k]
    return ref, views[::-1]


def _view_reads(nodes: Mapping[str, node_def_pb2.NodeDef], node: node_def_pb2.NodeDef,
                tid: str) -> list[tuple[int, list[str]]]:
    """The inputs of `node` that read `tid`'s buffer: (input index, the view refs between `tid` and that input,
    innermost first). A direct read has no views; a read through Reshapes and the like has them (the graph model
    folds such reads into reads of `tid`, graph_model.fold_views)."""
    target = split_tensor_id(tid)
    found = []
    for i, inp in enumerate(node.input):
        if inp.startswith("^"):
            continue
        base, views = _view_chain(nodes, inp)
        if _split_ref(base) == target:
            found.append((i, views))
        else:  # `tid` may itself be a view (one whose op the profiler saw): the views made on it
            for j, v in enumerate(views):
                if _split_ref(v) == target:
                    found.append((i, views[j + 1:]))
                    break
    return found


def _reads(nodes: Mapping[str, node_def_pb2.NodeDef], node: node_def_pb2.NodeDef, tid: str) -> bool:
    return bool(_view_reads(nodes, node, tid))


def _rewire(ed: GraphEditor, node: node_def_pb2.NodeDef, tid: str, new_ref: str, prefix: str) -> None:
    """Makes `node` read `new_ref` wherever it read `tid`. A read through views reads clones of those views made on
    `new_ref`, named `<prefix>/view/<view node>`:

        t --> Reshape_5 --> sub_1        t' --> <prefix>/view/Reshape_5 --> sub_1
    """
    nodes = ed.nodes
    for i, views in _view_reads(nodes, node, tid):
        ref = new_ref
        for v in views:
            name, slot = _split_ref(v)
            original = nodes[name]
            k = view_input(original.op, slot)
            clone_name = f"{prefix}/view/{name}"
            existing = nodes.get(clone_name)
            if existing is not None and existing.input[k] != ref:
                clone_name = f"{clone_name}_{slot}"
                existing = nodes.get(clone_name)
            if existing is None:
                inputs = [x for x in original.input if not x.startswith("^")]
                inputs[k] = ref
                ed.add_copy(original, clone_name, inputs)
            ref = clone_name if slot == 0 else f"{clone_name}:{slot}"
        ed.set_input(node, i, ref)


def apply_plan(graph_def: graph_pb2.GraphDef, plan, trace, dtypes: Mapping[str, str],
               shapes: Mapping[str, tuple | None]) -> graph_pb2.GraphDef:
    r"""The optimized graph of the measured step with `plan`'s swaps and recomputations inserted (`plan_editor`'s
    graph)."""
    return plan_editor(graph_def, plan, trace, dtypes, shapes).graph


def guided_graph(graph_def: graph_pb2.GraphDef, plan, trace, dtypes: Mapping[str, str],
                 shapes: Mapping[str, tuple | None], shaped=None) -> graph_pb2.GraphDef:
    """`apply_plan`, and with `shaped` (rewrite.shapes_graph) then `pooled` on the same editor: every tensor that
    still waits across other work handed to the pool."""
    ed = plan_editor(graph_def, plan, trace, dtypes, shapes)
    return ed.graph if shaped is None else pooled(ed.graph, shaped, editor=ed)


def plan_editor(graph_def: graph_pb2.GraphDef, plan, trace, dtypes: Mapping[str, str],
                shapes: Mapping[str, tuple | None]) -> GraphEditor:
    r"""The GraphEditor of the optimized graph of the measured step with `plan`'s swaps and recomputations inserted.

    `trace` is the AccessTrace the plan was made from (its op names are the graph's node names): it tells which
    readers come after a decision's evicted-access, and which op ran just before a back-access. `dtypes`/`shapes`:
    the planned tensors' dtype names and static shapes.

    A swap of t (evicted-access E, in-trigger T, back-access B):

        Before:
            P --t--> E ...
              \----> B
        After:
            P --t--> E ...
              \--> capuchin/swap_out/t --h--> capuchin/prefetch/t --h--> capuchin/swap_in/t --t'--> B
                   ^ (ctrl: E)                ^ (ctrl: T)                ^ (ctrl: op before B)
    The swap-out runs once E is done and frees the device buffer when its copy ends; the prefetch starts the copy
    back when T is done; the swap-in, gated on the op just before B, hands the tensor to B and every later reader
    (it waits only if the prefetch is late, and counts it). Without an in-trigger (on demand) there is no prefetch
    and the swap-in is gated on the op that ran just before B in the measured step.

    A recomputation of t from sources S by replaying ops r1..rk:

        Before:
            S --> r1 --> ... --> rk --t--> E ...
                                     \---> B
        After:
            S --> r1 --> ... --> rk --t--> E ...
              \--> capuchin/recompute/t/r1 --> ... --> capuchin/recompute/t/rk --t'--> B
                   ^ (ctrl: the trigger, or the op before B when on demand)
    The clones read the sources (resident when they run) and each other; t' feeds B and every later reader, so the
    original t is freed after E. Targets the replay keeps (collective recomputation) are served from the same
    clones.
    """
    names = {n.name for n in graph_def.node}
    # The measured order, made an order of the graph (ops that overlapped in time are ordered by their starts), with
    # the forward pass's state writes moved after its large allocations (schedule.guided_order).
    executed = [name for name in guided_order(trace.graph, {o.name: o.start for o in trace.ops}) if name in names]
    ed = GraphEditor(graph_def, order=executed)
    nodes = ed.nodes
    # The plan was made for the measured order: make it the executed one. A control edge only means "not before",
    # so each op waits for the one before it in that order. Only ops that always run are ordered (an op of a cond
    # branch, a loop body or lowered control flow runs when its inputs say).
    pinned = [n for n in executed if ed.always_runs(n) and nodes[n].op not in ("_Arg", "_Retval")]
    before = {name: pinned[i - 1] for i, name in enumerate(pinned) if i > 0}
    for name in pinned[1:]:
        ed.add_control(name, before[name])
    skipped: list[str] = []

    def later_readers(tid: str, evicted_index: int) -> list[str]:
        names = [a.op for a in trace.tensors[tid].accesses if a.index > evicted_index]
        return [n for n in dict.fromkeys(names)
                if n in nodes and nodes[n].op not in VIEW_OPS and _reads(nodes, nodes[n], tid)]

    pos = {name: i for i, name in enumerate(pinned)}

    def first(names: list[str]) -> str:
        return min(names, key=lambda n: pos.get(n, len(pos)))

    for d in plan.swaps:
        tid = d.tensor
        producer = nodes[split_tensor_id(tid)[0]]
        key = safe_name(tid)
        readers = later_readers(tid, d.evicted_access.index)
        if not readers:
            continue
        back = first(readers)
        if pos.get(d.evicted_access.op, -1) >= pos.get(back, len(pos)):
            skipped.append(tid)  # the enforced order puts the evicted-access after a later reader: not realizable
            continue
        swap_out = ed.add_node(f"capuchin/swap_out/{key}", "Capuchin>SwapOut", [_ref(tid)], producer.device,
                               reader=back)
        swap_out.attr["T"].CopyFrom(_attr_type(dtypes[tid]))
        swap_out.attr["tensor_name"].CopyFrom(attr_value_pb2.AttrValue(s=tid.encode()))
        if d.evicted_access.op != producer.name:
            ed.add_control(swap_out.name, d.evicted_access.op)
        handle = swap_out.name
        trigger = d.in_trigger.op if d.in_trigger is not None else None
        if trigger is not None and pos.get(trigger, len(pos)) >= pos[back]:
            trigger = before.get(back)  # the trigger falls after the back-access in the enforced order
        if trigger is not None:
            prefetch = ed.add_node(f"capuchin/prefetch/{key}", "Capuchin>Prefetch", [handle], producer.device,
                                   reader=back)
            ed.add_control(prefetch.name, trigger)
            handle = prefetch.name
        swap_in = ed.add_node(f"capuchin/swap_in/{key}", "Capuchin>SwapIn", [handle], producer.device,
                              mirrors=[_mirror(ed, tid)], reader=back)
        swap_in.attr["dtype"].CopyFrom(_attr_type(dtypes[tid]))
        shape = shapes.get(tid)
        swap_in.attr["shape"].CopyFrom(_attr_shape(tf_dims(shape)))
        for r in readers:
            _rewire(ed, nodes[r], tid, swap_in.name, swap_in.name)
        # Gated like an on-demand swap-in even after a prefetch: it runs when the back-access is about to, so a
        # swap-in that waits is a prefetch that really came late (without the gate it runs right after the prefetch
        # and always waits: every prefetch counts as late; docs/decisions.md, "A swap-in is gated on the op before
        # its back-access").
        if before.get(back) is not None:
            ed.add_control(swap_in.name, before[back])

    by_target = {d.tensor: d for d in plan.recomputes}
    for d in plan.recomputes:
        if not d.replay_ops:
            continue  # rebuilt and kept by another target's replay (d.regenerated_by), served below
        key = safe_name(d.tensor)
        replayed = set(d.replay_ops)
        clone_of: dict[str, str] = {}
        readers = later_readers(d.tensor, d.evicted_access.index)
        if not readers:
            continue
        back = first(readers)
        early = d.trigger_mode == "early" and pos.get(d.trigger.op, len(pos)) < pos[back]
        gate = d.trigger.op if early else before.get(back)
        for name in d.replay_ops:
            original = nodes[name]
            # ordering edges of the original are dropped: the clone is ordered by its gate and its inputs
            clone = ed.add_copy(original, f"{RECOMPUTE_PREFIX}{key}/{name}",
                                [i for i in original.input if not i.startswith("^")], reader=back)
            rebuilt = {b for b in (_split_ref(_view_chain(nodes, i)[0]) for i in clone.input) if b[0] in replayed}
            if not rebuilt and gate is not None:
                ed.add_control(clone.name, gate)
            for src, slot in rebuilt:  # read the replayed inputs from their clones (through clones of views, if any)
                _rewire(ed, clone, f"{src}:{slot}", clone_of[src] if slot == 0 else f"{clone_of[src]}:{slot}",
                        f"{RECOMPUTE_PREFIX}{key}")
            clone_of[name] = clone.name
        for target in (d.tensor, *d.keeps):
            td = by_target.get(target, d)
            op, slot = split_tensor_id(target)
            if op not in clone_of:
                raise RewriteError(f"the replay for {d.tensor} does not rebuild {target}")
            new_ref = clone_of[op] if slot == 0 else f"{clone_of[op]}:{slot}"
            for r in later_readers(target, td.evicted_access.index):
                _rewire(ed, nodes[r], target, new_ref, f"{RECOMPUTE_PREFIX}{key}/{safe_name(target)}")
    if skipped:
        warnings.warn(f"capuchin_tf: {len(skipped)} planned swap(s) cannot follow the enforced order and were left "
                      f"out: {skipped[:3]}", RuntimeWarning, stacklevel=3)
    return ed


# ---- passive mode's tensor pool ----------------------------------------------------------------------------------
def input_shapes(args) -> list:
    """The static shapes of a call's tensor arguments, in the order of the function's inputs."""
    return [t.shape for t in tf.nest.flatten(args, expand_composites=True) if isinstance(t, (tf.Tensor, tf.Variable))]


def shapes_graph(concrete, optimized, args):
    """The optimized graph imported with the call's input shapes: the static shape of every tensor of it, and of
    every node capuchin_tf inserts into it later (capture.static_tensor)."""
    shaped = function_surgery.rebuild(concrete, optimized, name="capuchin_shapes",
                                      input_shapes=input_shapes(args)).graph
    capture.refine_static(shaped, concrete.graph)
    return shaped


def passive_graph(concrete, args, optimized=None, shaped=None, model=None):
    """The GraphDef of the step with passive mode's tensor pool: its optimized graph (obtained without running it,
    unless given) with every tensor that waits while memory is allocated handed to the pool (see `pooled`).
    `shaped`: `shapes_graph` of the optimized graph, if already made; `model`: its capture.graph_model, if made."""
    if optimized is None:
        optimized = capture.optimized_graph(concrete, args)  # without running the step: it may not fit
        model = None
    if shaped is None:
        shaped = shapes_graph(concrete, optimized, args)
    return pooled(optimized, shaped, min_bytes=MEASURED_MIN_POOLED_BYTES, defer=True, model=model)


def passive_step(concrete, args, graph_def=None):
    """The step with passive mode's tensor pool (`passive_graph`, or `graph_def` if given). Run it with
    `function_surgery.call_without_grappler` and passive mode on: it completes under a limit the plain step does not
    fit, as long as what is not pooled fits, with the plain step's results bit for bit."""
    if graph_def is None:
        graph_def = passive_graph(concrete, args)
    return function_surgery.runnable(concrete, graph_def, name="capuchin_passive_step")


def pooled(graph_def, shaped, min_bytes: int = GUIDED_MIN_POOLED_BYTES, defer: bool = False, model=None,
           editor: GraphEditor | None = None):
    """`graph_def` (the step's optimized graph, rewritten or not) with every tensor that waits while memory is
    allocated handed to the pool (pool_plan.hold_plan, rewrite.insert_hold_get): under passive mode the allocator can
    evict any of them on demand. With `defer`, gradient ops ready long before they are needed first wait for the op
    before their first reader (schedule.deferral_gates): the measured step's order, which guided steps follow.
    `shaped`: `shapes_graph` of the optimized graph (static shapes, those of inserted nodes through their mirrors).
    `model`: capture.graph_model of `graph_def`, if already made; `editor`: the GraphEditor that made `graph_def`
    (`graph_def` is then its graph), whose edits and control flow go on here (one copy of the graph, one analysis)."""
    if editor is not None:
        ed = editor
        if model is None:
            model = capture.graph_model(ed.graph, shaped, always_runs=ed.always_runs)
    else:
        flow = control_flow.of_graph_def(graph_def)
        if model is None:
            model = capture.graph_model(graph_def, shaped, always_runs=flow.always_runs)
        ed = GraphEditor(graph_def, order=schedule_order(model), flow=flow)
    if defer:
        before = {node: list(gates) for node, gates in ed.added_controls.items()}
        add_gates(ed, deferral_gates(model))
        # Gates are control edges only: the gated graph's model is this one with them (GraphEditor.add_control).
        model = model.with_control_inputs({node: gates[len(before.get(node, ())):]
                                           for node, gates in ed.added_controls.items()})
    graph = fold_views(model)  # a far read through a Reshape is a far read
    order = schedule_order(graph)
    # Tensors a plan swaps are the plan's: their swap-out must read them directly (through a Get it would run when
    # the Get's gate says, and the pool would keep the tensor on the device until then).
    # Nor are the tensors of a plan's replays held: their Gets' gates hold the replay back, and what it reads with
    # it (the checkpoint plan on the quick tier's transformer: peak 78 MiB with them held, 63 MiB without, on a
    # device larger than the budget; docs/decisions.md, "The guided pool leaves a plan's replays alone").
    plan = {tid: reads for tid, reads in hold_plan(graph, min_bytes=min_bytes, order=order).items()
            if not any(graph.ops[c].type == "Capuchin>SwapOut" for c in graph.tensors[tid].consumers)
            and not tid.startswith(RECOMPUTE_PREFIX)}
    dtypes, shapes = {}, {}
    for tid in plan:
        op, slot = split_tensor_id(tid)
        t = capture.static_tensor(shaped, ed.nodes[op], slot)
        dtypes[tid] = t.dtype.name
        shapes[tid] = shape_of(None if t.shape.rank is None else t.shape.as_list())
    insert_hold_get(ed, plan, dtypes, shapes)
    return ed.graph
