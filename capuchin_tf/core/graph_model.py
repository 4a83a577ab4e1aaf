"""The graph model: a training step's ops and tensors as plain data. Pure Python: imports no TensorFlow.

A tensor's id is the post-optimization node name and output slot, ``"node:slot"`` (Grappler renames nothing it
keeps, and a fused node keeps the name of its last op), so that the same logical tensor is found again in later
iterations. Each op carries its role in the step (forward, backward, optimizer) and whether replaying it reproduces
its outputs exactly (needed before it may be recomputed).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping

from capuchin_tf.core.control_flow import CONTROL_FLOW_OPS

SCHEMA_VERSION = 1


class Role(str, enum.Enum):
    """Where an op sits in a training step."""

    FORWARD = "forward"
    BACKWARD = "backward"  # gradient_tape/... and the like
    OPTIMIZER = "optimizer"  # variable updates
    OTHER = "other"  # inputs, constants, variable reads, bookkeeping


def tensor_id(op_name: str, slot: int = 0) -> str:
    """The id of output `slot` of op `op_name`."""
    return f"{op_name}:{slot}"


def split_tensor_id(tid: str) -> tuple[str, int]:
    """("op", slot) from "op:slot"."""
    op, _, slot = tid.rpartition(":")
    if not op or not slot.isdigit():
        raise ValueError(f"not a tensor id (expected 'op:slot'): {tid!r}")
    return op, int(slot)


UNKNOWN_DIM = -1  # a dimension a shape leaves open, as the graph model and the trace write it


def shape_of(dims) -> tuple[int, ...] | None:
    """A shape as the graph model keeps it, from TensorFlow's dims (None: unknown rank; None dims become -1)."""
    return None if dims is None else tuple(UNKNOWN_DIM if d is None else int(d) for d in dims)


def tf_dims(shape: tuple[int, ...] | None) -> list[int | None] | None:
    """The inverse of `shape_of`: dims with None for the open ones, for a TensorShape or a shape attribute."""
    return None if shape is None else [None if d == UNKNOWN_DIM else d for d in shape]


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One op of the step. `inputs` are tensor ids in input order; `control_inputs` are op names."""

    name: str
    type: str
    inputs: tuple[str, ...] = ()
    control_inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    role: Role = Role.OTHER
    stateful: bool = False
    # True when running the op again on the same inputs gives the same bits: not stateful, not an unseeded random
    # op, not an opaque control-flow op. Only replayable ops may be recomputed.
    replayable: bool = True
    # True when the op runs, exactly once, whenever the step runs: in the step's root frame and not in a cond branch
    # (control_flow.py). Only such ops may be ordered, gate inserted nodes, or produce or read managed tensors.
    always_runs: bool = True

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["role"] = self.role.value
        for k in ("inputs", "control_inputs", "outputs"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> OpInfo:
        return cls(
            name=d["name"],
            type=d["type"],
            inputs=tuple(d.get("inputs", ())),
            control_inputs=tuple(d.get("control_inputs", ())),
            outputs=tuple(d.get("outputs", ())),
            role=Role(d.get("role", "other")),
            stateful=bool(d.get("stateful", False)),
            replayable=bool(d.get("replayable", True)),
            always_runs=bool(d.get("always_runs", True)),
        )


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of the step. `nbytes` is what the tensor occupies (-1 when unknown)."""

    id: str
    op: str
    dtype: str = "float32"
    shape: tuple[int, ...] | None = None  # None: unknown rank; -1 entries: unknown dims
    nbytes: int = -1
    consumers: tuple[str, ...] = ()  # op names, in graph order
    # Variables, optimizer slots and anything else that lives across steps; never a candidate.
    persistent: bool = False

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = None if self.shape is None else list(self.shape)
        d["consumers"] = list(self.consumers)
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> TensorInfo:
        shape = d.get("shape")
        return cls(
            id=d["id"],
            op=d["op"],
            dtype=d.get("dtype", "float32"),
            shape=None if shape is None else tuple(shape),
            nbytes=int(d.get("nbytes", -1)),
            consumers=tuple(d.get("consumers", ())),
            persistent=bool(d.get("persistent", False)),
        )


class GraphModelError(ValueError):
    """The graph model is inconsistent (dangling tensor or op references)."""


@dataclasses.dataclass(frozen=True)
class GraphModel:
    """Ops (in graph order) and tensors of one training step."""

    ops: Mapping[str, OpInfo]
    tensors: Mapping[str, TensorInfo]

    @classmethod
    def build(cls, ops: Iterable[OpInfo], tensors: Iterable[TensorInfo], check: bool = True) -> GraphModel:
        model = cls(ops={o.name: o for o in ops}, tensors={t.id: t for t in tensors})
        if check:
            model.check()
        return model

    def check(self) -> None:
        """Raises GraphModelError if an op names an unknown tensor or a tensor an unknown op."""
        for op in self.ops.values():
            for t in op.inputs + op.outputs:
                if t not in self.tensors:
                    raise GraphModelError(f"op {op.name!r} names unknown tensor {t!r}")
            for c in op.control_inputs:
                if c not in self.ops:
                    raise GraphModelError(f"op {op.name!r} has unknown control input {c!r}")
        for t in self.tensors.values():
            if t.op not in self.ops:
                raise GraphModelError(f"tensor {t.id!r} is produced by unknown op {t.op!r}")
            for c in t.consumers:
                if c not in self.ops:
                    raise GraphModelError(f"tensor {t.id!r} is consumed by unknown op {c!r}")

    def with_control_inputs(self, added: Mapping[str, Iterable[str]]) -> GraphModel:
        """The model with control inputs appended: `added` maps an op to the ops it now also waits for, in the
        order of its graph's new `^` inputs (a graph edit that adds control edges only)."""
        ops = dict(self.ops)
        for name, gates in added.items():
            gates = tuple(gates)
            if gates:
                ops[name] = dataclasses.replace(ops[name], control_inputs=ops[name].control_inputs + gates)
        model = GraphModel(ops=ops, tensors=self.tensors)
        for name in added:
            for c in ops[name].control_inputs:
                if c not in ops:
                    raise GraphModelError(f"op {name!r} has unknown control input {c!r}")
        return model

    def producer(self, tid: str) -> OpInfo:
        return self.ops[self.tensors[tid].op]

    def consumers(self, tid: str) -> list[OpInfo]:
        return [self.ops[c] for c in self.tensors[tid].consumers]

    def manageable(self, tid: str) -> bool:
        """Whether capuchin_tf may hold, swap or recompute the tensor: transient, produced by an op that always runs
        and is not lowered control flow (a Switch's outputs may be dead, an Exit's come out of a loop), and read only
        by ops that always run (control_flow.py)."""
        t = self.tensors[tid]
        producer = self.ops[t.op]
        return (not t.persistent and producer.always_runs and producer.type not in CONTROL_FLOW_OPS
                and all(self.ops[c].always_runs for c in t.consumers))

    def to_json(self) -> dict:
        return {
            "ops": [o.to_json() for o in self.ops.values()],
            "tensors": [t.to_json() for t in self.tensors.values()],
        }

    @classmethod
    def from_json(cls, d: Mapping) -> GraphModel:
        return cls.build(
            (OpInfo.from_json(o) for o in d["ops"]),
            (TensorInfo.from_json(t) for t in d["tensors"]),
        )


# Ops that read state or stand for it: they keep their role (a ReadVariableOp of a slot is state, not an update).
_NOT_OPTIMIZER_TYPES = frozenset({"_Arg", "_Retval", "ReadVariableOp", "VarHandleOp", "Const", "HostConst",
                                  "Placeholder", "NoOp"})


def propagate_backward_roles(model: GraphModel) -> GraphModel:
    """Names decide roles at first (`gradient_tape/...` is backward); this fixes what names miss: a forward-named op
    that reads a backward tensor is backward too (gradient sums such as `AddN_3` sit outside the tape's name scope),
    and one read only by optimizer ops is the optimizer's. Propagated to a fixpoint along data edges; optimizer ops
    keep their role."""
    roles = {name: op.role for name, op in model.ops.items()}
    consumers: dict[str, list[str]] = {}
    for op in model.ops.values():
        for t in op.inputs:
            consumers.setdefault(model.tensors[t].op, []).append(op.name)
    # Seeds: backward ops that compute something. Sources (constants, even ones Grappler folded under the tape's
    # name scope and shares with forward ops) say nothing about when their readers run.
    stack = [n for n, r in roles.items() if r == Role.BACKWARD and model.ops[n].inputs]
    while stack:
        for c in consumers.get(stack.pop(), ()):
            if roles[c] in (Role.FORWARD, Role.OTHER) and model.ops[c].type not in ("_Retval",):
                roles[c] = Role.BACKWARD
                stack.append(c)
    # Optimizer ops the name scopes miss (Keras names RMSprop's scope "rm_sprop"): an op that is neither forward by
    # name nor backward and whose every reader is an optimizer op. A slot's decay (rho x v) reads only the slot and
    # feeds only its assignment: it is the optimizer's, wherever the executor happens to run it.
    # A worklist to the same fixpoint as sweeping every op until none changes (an op only ever becomes the
    # optimizer's, and only when its readers have): when one does, the ops it reads are looked at again.
    work = list(model.ops)
    while work:
        name = work.pop()
        op = model.ops[name]
        if roles[name] not in (Role.FORWARD, Role.OTHER) or op.type in _NOT_OPTIMIZER_TYPES:
            continue
        rs = consumers.get(name)
        if rs and all(roles[r] == Role.OPTIMIZER for r in rs):
            roles[name] = Role.OPTIMIZER
            work.extend(model.tensors[t].op for t in op.inputs)
    if all(roles[n] == op.role for n, op in model.ops.items()):
        return model
    ops = {name: op if roles[name] == op.role else dataclasses.replace(op, role=roles[name])
           for name, op in model.ops.items()}
    return GraphModel(ops=ops, tensors=model.tensors)


# Ops whose output is always a view of one input's buffer: they never allocate (TensorFlow runs them inline, and the
# profiler shows no kernel of them). Snapshot is not one: it copies when it cannot forward.
VIEW_OPS = frozenset({"Reshape", "Identity", "Squeeze", "ExpandDims", "Bitcast", "StopGradient", "EnsureShape",
                      "PreventGradient", "IdentityN"})


# Ops whose kernels write their output into an input's buffer when that input is dead after them and of the output's
# size (TensorFlow's forward_input_or_allocate_output): element-wise ops, BiasAdd, Softmax and LogSoftmax.
FORWARDING_OPS = frozenset({
    "Abs", "Add", "AddV2", "BiasAdd", "Ceil", "Cos", "Div", "DivNoNan", "Elu", "Erf", "Erfc", "Exp", "Expm1", "Floor",
    "Gelu", "Inv", "LeakyRelu", "Log", "Log1p", "LogSoftmax", "Maximum", "Minimum", "Mul", "MulNoNan", "Neg", "Pow",
    "RealDiv", "Reciprocal", "Relu", "Relu6", "Round", "Rsqrt", "Select", "SelectV2", "Selu", "Sigmoid", "Sign",
    "Sin", "Softmax", "Softplus", "Softsign", "Sqrt", "Square", "SquaredDifference", "Sub", "Tanh",
})


def view_input(op_type: str, slot: int) -> int | None:
    """For an op of `op_type`, the input whose buffer output `slot` views; None when the op is not a view op."""
    if op_type not in VIEW_OPS:
        return None
    return slot if op_type == "IdentityN" else 0


def view_chain(model: GraphModel, tid: str) -> tuple[str, tuple[str, ...]]:
    """(the tensor whose buffer `tid` is, the view ops between it and `tid`): `tid` itself and no ops, or, through
    any chain of view ops, the tensor they view and those ops."""
    ops: list[str] = []
    seen = set()
    while tid not in seen:
        seen.add(tid)
        op, slot = split_tensor_id(tid)
        info = model.ops.get(op)
        k = None if info is None else view_input(info.type, slot)
        if k is None or k >= len(info.inputs):
            break
        ops.append(op)
        tid = info.inputs[k]
    return tid, tuple(ops)


def view_base(model: GraphModel, tid: str) -> str:
    """The tensor whose buffer `tid` is (see `view_chain`)."""
    return view_chain(model, tid)[0]


def fold_views(model: GraphModel) -> GraphModel:
    """The graph with every read through a view op made a read of the tensor it views.

    A view shares its input's buffer, so reading the view reads that buffer: a tensor reshaped as soon as it is made
    and read only through the Reshape much later has, unfolded, no read after the Reshape, while its buffer stays in
    use until the late read. Folded, that read is an access of the viewed tensor, so the planner sees the idle gap
    (docs/decisions.md, "Reads through view ops are reads of the buffer they view"). The view ops stay (they still
    read their input) and each folded reader gets a control input on its view ops, so that orders of the folded graph
    stay orders of the real one. The rewriter recreates the views on whatever replaces the tensor (rewrite.py).
    """
    changed = False
    ops = []
    for op in model.ops.values():
        inputs, ctrl = [], list(op.control_inputs)
        for t in op.inputs:
            base, views = view_chain(model, t)
            changed |= base != t
            # the view ops between base and this reader become ordering edges
            ctrl.extend(v for v in views if v not in ctrl and v != op.name)
            inputs.append(base)
        ops.append(dataclasses.replace(op, inputs=tuple(inputs), control_inputs=tuple(ctrl)))
    if not changed:
        return model
    consumers: dict[str, list[str]] = {}
    for o in ops:
        for t in o.inputs:
            consumers.setdefault(t, []).append(o.name)
    tensors = [dataclasses.replace(t, consumers=tuple(dict.fromkeys(consumers.get(t.id, ()))))
               for t in model.tensors.values()]
    return GraphModel.build(ops, tensors)


@dataclasses.dataclass(frozen=True)
class Floor:
    """The most transient memory one op needs at once: its inputs and outputs (`bytes`), at op `op`."""

    bytes: int
    op: str
    op_type: str


# Ops that allocate nothing of their own for their outputs (views of inputs, persistent state, control flow).
ALLOCATES_NOTHING = frozenset({"_Arg", "_Retval", "NoOp", "Const", "HostConst", "ReadVariableOp", "VarHandleOp",
                             "Placeholder"}) | VIEW_OPS


def working_set_floor(graph: GraphModel) -> Floor:
    """A lower bound of the transient memory the step needs: over every op, its transient inputs and the outputs it
    cannot have computed in place, all on the device at once while it runs. Inputs are counted by the buffer they
    view (`view_base`), once each; an output as large as an input may take that input's buffer (TensorFlow forwards a
    dead input's buffer), so it is not counted; persistent tensors and sizes unknown statically count nothing. Its
    temporaries (a convolution's workspace) are not known before it runs: the true floor can only be higher."""
    best = Floor(0, "", "")
    for op in graph.ops.values():
        if op.type in ALLOCATES_NOTHING or op.type in CONTROL_FLOW_OPS:
            continue
        inputs = []
        for t in dict.fromkeys(view_base(graph, i) for i in op.inputs):
            info = graph.tensors.get(t)
            if info is not None and not info.persistent and info.nbytes > 0:
                inputs.append(info.nbytes)
        total = sum(inputs)
        free = sorted(inputs)
        for t in op.outputs:
            info = graph.tensors[t]
            if info.persistent or info.nbytes <= 0:
                continue
            if info.nbytes in free:
                free.remove(info.nbytes)  # may reuse that input's buffer
            else:
                total += info.nbytes
        if total > best.bytes:
            best = Floor(total, op.name, op.type)
    return best
