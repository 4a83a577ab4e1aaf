"""Synthetic training steps as GraphModel + AccessTrace, for tests and planning benchmarks. Pure Python.

Two levels:

- ``TraceBuilder``: ops listed in executed order with explicit inputs, output sizes and durations. Ops run one after
  the other (with a small gap); each output is allocated when its producer starts, produced (access 0) when it ends,
  read at each consumer's start and freed when its last consumer ends. Used for hand-made cases such as the paper's
  T1..T4 chains.
- ``ModelBuilder``: forward layers only; ``build()`` derives the backward pass as TensorFlow's autodiff would (a
  gradient op per forward op that needs one, reading the forward tensors its gradient needs, AddN where a tensor fans
  out, optional TensorFlow-style shape bookkeeping for broadcasting binary ops) and the optimizer updates. Durations
  come from a roofline-like cost: FLOPs / rate + bytes touched / memory bandwidth.

Generators: ``linear_chain``, ``resnet``, ``transformer`` (and ``bert_base``, about 10,000 tensors), ``random_model``.
Every trace's ``meta`` holds the step's FLOP count (``meta["flops"]``), so the ``p100`` link regime applies.
"""

from __future__ import annotations

import dataclasses
import random

from capuchin_tf.core.access_trace import Access, AccessTrace, OpRecord, TensorRecord, build_trace
from capuchin_tf.core.graph_model import GraphModel, OpInfo, Role, TensorInfo

F32 = 4


@dataclasses.dataclass
class _Op:
    name: str
    type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    role: Role
    duration: float
    stateful: bool
    replayable: bool


class TraceBuilder:
    """Builds a trace from ops in executed order. Tensor ids are ``"<op>:<slot>"``."""

    def __init__(self, *, gap_s: float = 2e-6, meta: dict | None = None):
        self.gap_s = gap_s
        self.meta = dict(meta or {})
        self._ops: list[_Op] = []
        self._graph_only: list[OpInfo] = []
        self._nbytes: dict[str, int] = {}
        self._persistent: set[str] = set()
        self._producer: dict[str, str] = {}
        self.flops = 0.0

    def persistent(self, name: str, nbytes: int, type: str = "VarHandleOp") -> str:
        """A tensor that lives across steps (a weight, an optimizer slot, the step's input batch)."""
        tid = f"{name}:0"
        self._graph_only.append(OpInfo(name, type, (), (), (tid,), Role.OTHER, stateful=True, replayable=False))
        self._nbytes[tid] = int(nbytes)
        self._persistent.add(tid)
        self._producer[tid] = name
        return tid

    def op(
        self,
        name: str,
        type: str,
        inputs=(),
        out_bytes=(),
        *,
        role: Role = Role.FORWARD,
        duration: float = 1e-4,
        stateful: bool = False,
        replayable: bool | None = None,
        flops: float = 0.0,
    ) -> tuple[str, ...]:
        """Appends an op; returns its output tensor ids (one per entry of `out_bytes`)."""
        for t in inputs:
            if t not in self._nbytes:
                raise KeyError(f"op {name!r}: unknown input {t!r}")
        outs = tuple(f"{name}:{i}" for i in range(len(out_bytes)))
        for t, b in zip(outs, out_bytes):
            self._nbytes[t] = int(b)
            self._producer[t] = name
        if replayable is None:
            replayable = not stateful
        self._ops.append(_Op(name, type, tuple(inputs), outs, role, float(duration), stateful, replayable))
        self.flops += flops
        return outs

    def build(self, *, keep_alive=(), budget_bytes: int | None = None, evicted_bytes: int = 0) -> AccessTrace:
        """The trace. Tensors in `keep_alive` are never freed (step outputs)."""
        t = 0.0
        records: list[OpRecord] = []
        start: dict[str, float] = {}
        end: dict[str, float] = {}
        accesses: dict[str, list[Access]] = {}
        consumers: dict[str, list[str]] = {}
        for o in self._ops:
            start[o.name], end[o.name] = t, t + o.duration
            records.append(OpRecord(o.name, o.type, t, o.duration, o.role))
            for tid in dict.fromkeys(o.inputs):
                consumers.setdefault(tid, []).append(o.name)
                if tid not in self._persistent:
                    accesses[tid].append(Access(tid, len(accesses[tid]), t, o.name))
            for tid in o.outputs:
                accesses[tid] = [Access(tid, 0, t + o.duration, o.name)]
            t += o.duration + self.gap_s
        step_time = t - self.gap_s if self._ops else 0.0
        keep = set(keep_alive)
        tensors = []
        for tid, acc in accesses.items():
            prod = self._producer[tid]
            free = None if tid in keep else end[acc[-1].op]
            tensors.append(TensorRecord(tid, self._nbytes[tid], start[prod], free, tuple(acc)))
        ops_info = list(self._graph_only) + [
            OpInfo(o.name, o.type, o.inputs, (), o.outputs, o.role, o.stateful, o.replayable) for o in self._ops
        ]
        tinfo = [
            TensorInfo(
                tid,
                self._producer[tid],
                nbytes=n,
                consumers=tuple(consumers.get(tid, ())),
                persistent=tid in self._persistent,
            )
            for tid, n in self._nbytes.items()
        ]
        graph = GraphModel.build(ops_info, tinfo)
        persistent_bytes = sum(self._nbytes[t] for t in self._persistent)
        meta = dict(self.meta)
        meta.setdefault("flops", self.flops)
        meta.setdefault("synthetic", True)
        trace = build_trace(
            graph,
            records,
            tensors,
            memory_curve=(),
            step_time=step_time,
            peak_bytes=0,
            persistent_bytes=persistent_bytes,
            evicted_bytes=evicted_bytes,
            budget_bytes=budget_bytes,
            meta=meta,
        )
        curve = tuple(trace.replayed_curve())
        return dataclasses.replace(trace, memory_curve=curve, peak_bytes=max(b for _, b in curve))


# ---- a small autodiff over forward layers ----------------------------------------------------------------------------
# How each forward op's gradient is formed (which forward tensors it reads):
#   "matmul": y = f(a, b) bilinear (MatMul, Conv2D, BatchMatMul): da = g1(dy, b), db = g2(a, dy)
#   "out":    dx = T(dy, y)  (Relu, Tanh, Softmax, Rsqrt, Sigmoid)
#   "in":     dx = T(dy, x)  (Square, Pow, ...)
#   "linear": dx = T(dy)     (Reshape, Transpose, scaling by a constant)
#   "add":    y = a + b (or a - b): dy flows to both (with shape bookkeeping when tf_like)
#   "mul":    y = a * b: da = Mul(dy, b), db = Mul(a, dy)
#   "bias":   y = x + w (w a weight): dx = dy, dw = BiasAddGrad(dy)
#   "reduce": y = mean(x): dx = broadcast(dy) over x's shape
#   "none":   no gradient (random ops, masks, casts of masks)
GRAD_KINDS = ("matmul", "out", "in", "linear", "add", "mul", "bias", "reduce", "none")

_MATMUL_GRAD_TYPES = {
    "Conv2D": ("Conv2DBackpropInput", "Conv2DBackpropFilter"),
    "MatMul": ("MatMul", "MatMul"),
    "BatchMatMulV2": ("BatchMatMulV2", "BatchMatMulV2"),
    "Einsum": ("Einsum", "Einsum"),
}


@dataclasses.dataclass
class _Layer:
    name: str
    type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    grad: str
    flops: float


class ModelBuilder:
    """Forward layers in order; ``build()`` adds the backward pass and the optimizer (see the module docstring)."""

    def __init__(
        self,
        *,
        flop_rate: float = 5e10,
        mem_bw: float = 1e10,
        min_op_s: float = 4e-6,
        gap_s: float = 2e-6,
        tf_like: bool = False,
        optimizer: str = "sgd",
        jitter: random.Random | None = None,
        meta: dict | None = None,
    ):
        self.tb = TraceBuilder(gap_s=gap_s, meta=meta)
        self.flop_rate, self.mem_bw, self.min_op_s = flop_rate, mem_bw, min_op_s
        self.tf_like = tf_like
        if optimizer not in ("sgd", "adamw_ops"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw_ops', got {optimizer!r}")
        self.optimizer = optimizer
        self.jitter = jitter
        self.layers: list[_Layer] = []
        self.nbytes: dict[str, int] = {}
        self.weights: list[str] = []
        self.requires_grad: set[str] = set()
        self.alias: dict[str, str] = {}  # ReadVariableOp output -> the variable
        self.shapes: dict[str, str] = {}  # tensor -> its Shape tensor (tf_like)
        self._names: set[str] = set()

    # ---- naming and costs ----
    def _unique(self, name: str) -> str:
        base, i = name, 1
        while name in self._names:
            name = f"{base}_{i}"
            i += 1
        self._names.add(name)
        return name

    def _duration(self, flops: float, inputs, out_bytes) -> float:
        moved = sum(self.nbytes.get(t, 0) for t in inputs) + sum(out_bytes)
        d = max(self.min_op_s, flops / self.flop_rate + moved / self.mem_bw)
        if self.jitter is not None:
            d *= self.jitter.uniform(0.6, 1.6)
        return d

    def _emit(self, name, type, inputs, out_bytes, role, flops=0.0, stateful=False, replayable=None, shape_of=None):
        if shape_of is not None and shape_of in self.shapes:
            # TensorFlow's gradient functions take the forward input's shape (a tiny int32 tensor) as an input.
            inputs = tuple(inputs) + (self.shapes[shape_of],)
        name = self._unique(name)
        outs = self.tb.op(
            name,
            type,
            inputs,
            out_bytes,
            role=role,
            duration=self._duration(flops, inputs, out_bytes),
            stateful=stateful,
            replayable=replayable,
            flops=flops,
        )
        for t, b in zip(outs, out_bytes):
            self.nbytes[t] = int(b)
        return outs

    # ---- the forward pass ----
    def input(self, name: str, nbytes: int) -> str:
        tid = self.tb.persistent(self._unique(name), nbytes, "_Arg")
        self.nbytes[tid] = int(nbytes)
        return tid

    def weight(self, name: str, nbytes: int) -> str:
        tid = self.tb.persistent(self._unique(name), nbytes)
        self.nbytes[tid] = int(nbytes)
        self.weights.append(tid)
        self.requires_grad.add(tid)
        return tid

    def layer(
        self,
        name: str,
        type: str,
        inputs,
        out_bytes,
        *,
        grad: str,
        flops: float = 0.0,
        stateful: bool = False,
        replayable: bool | None = None,
    ) -> str:
        """A forward op with one output (or several: `out_bytes` a tuple); returns its first output."""
        if grad not in GRAD_KINDS:
            raise ValueError(f"unknown gradient kind {grad!r}")
        inputs = tuple(inputs)
        if self.tf_like:
            # Each use of a variable reads it through a ReadVariableOp (a view: no new buffer), and the forward pass
            # records the shapes of the inputs the gradient will need (tiny int32 tensors, alive until backward).
            inputs = tuple(self._read_variable(t) if t in self.weights else t for t in inputs)
            if grad not in ("none", "bias"):
                # One Shape per gradient use, as the gradient functions ask for them (no CSE across ops).
                for t in inputs:
                    if t not in self.tb._persistent:
                        self.shapes[t] = self._emit(f"{name}/Shape", "Shape", (t,), (16,), Role.FORWARD)[0]
        ob = tuple(out_bytes) if isinstance(out_bytes, (tuple, list)) else (out_bytes,)
        outs = self._emit(name, type, inputs, ob, Role.FORWARD, flops, stateful, replayable)
        if grad != "none" and any(t in self.requires_grad for t in inputs):
            self.requires_grad.update(outs)
        self.layers.append(_Layer(outs[0].rpartition(":")[0], type, inputs, outs, grad, flops))
        return outs[0]

    def _read_variable(self, w: str) -> str:
        (r,) = self._emit(f"{w.rpartition(':')[0]}/ReadVariableOp", "ReadVariableOp", (w,), (0,), Role.FORWARD)
        self.alias[r] = w
        self.requires_grad.add(r)
        return r

    def _adamw_ops(self, p: str, w: str, g: str) -> None:
        """AdamW written with plain ops, as in Google's BERT code (AdamWeightDecayOptimizer): each intermediate is a
        transient tensor of the weight's size."""
        n = self.nbytes[w]
        opt = Role.OPTIMIZER
        m = self.tb.persistent(self._unique(f"{p}/m"), n)
        v = self.tb.persistent(self._unique(f"{p}/v"), n)

        def e(name, type, ins):
            return self._emit(f"{p}/{name}", type, ins, (n,), opt)[0]

        variables = (w, m, v)
        if self.tf_like:  # the update reads the variable and its slots through ReadVariableOps
            w, m, v = (self._emit(f"{p}/ReadVariableOp", "ReadVariableOp", (x,), (0,), opt)[0] for x in variables)

        m1 = e("Mul", "Mul", (m,))
        g1 = e("Mul_1", "Mul", (g,))
        nm = e("add", "AddV2", (m1, g1))
        v1 = e("Mul_2", "Mul", (v,))
        g2 = e("Square", "Square", (g,))
        g2 = e("Mul_3", "Mul", (g2,))
        nv = e("add_1", "AddV2", (v1, g2))
        d = e("Sqrt", "Sqrt", (nv,))
        d = e("add_2", "AddV2", (d,))
        u = e("truediv", "RealDiv", (nm, d))
        wd = e("mul_4", "Mul", (w,))
        u = e("add_3", "AddV2", (u, wd))
        u = e("mul_5", "Mul", (u,))
        nw = e("sub", "Sub", (w, u))
        for target, value in zip(variables, (nw, nm, nv)):
            self._emit(f"{p}/Assign", "AssignVariableOp", (target, value), (), opt, stateful=True)

    # ---- the backward pass ----
    def build(self, **kwargs) -> AccessTrace:
        grads: dict[str, list[str]] = {}
        loss = self.layers[-1].outputs[0]
        (seed,) = self._emit("gradient_tape/ones", "OnesLike", (loss,), (self.nbytes[loss],), Role.BACKWARD)
        grads[loss] = [seed]

        def total(t: str, prefix: str) -> str | None:
            parts = grads.get(t)
            if not parts:
                return None
            if len(parts) == 1:
                return parts[0]
            (s,) = self._emit(f"gradient_tape/{prefix}/AddN", "AddN", tuple(parts), (self.nbytes[t],), Role.BACKWARD)
            return s

        def give(t: str, g: str) -> None:
            t = self.alias.get(t, t)
            if t in self.requires_grad:
                grads.setdefault(t, []).append(g)

        bw = Role.BACKWARD
        nb = lambda t: self.nbytes[self.alias.get(t, t)]  # noqa: E731
        for layer in reversed(self.layers):
            y = layer.outputs[0]
            p = f"gradient_tape/{layer.name}"
            dy = total(y, layer.name)
            if dy is None or layer.grad == "none":
                continue
            ins = layer.inputs
            need = [t in self.requires_grad for t in ins]
            k = layer.grad
            if k == "matmul":
                a, b = ins
                ta, tb = _MATMUL_GRAD_TYPES.get(layer.type, (layer.type, layer.type))
                if need[0]:
                    (g,) = self._emit(f"{p}/{ta}", ta, (dy, b), (nb(a),), bw, layer.flops, shape_of=a)
                    give(a, g)
                if need[1]:
                    (g,) = self._emit(f"{p}/{tb}_1", tb, (a, dy), (nb(b),), bw, layer.flops, shape_of=b)
                    give(b, g)
            elif k == "out" and self.tf_like and layer.type == "Softmax":
                # TensorFlow's _SoftmaxGrad: (dy - sum(dy * y, -1)) * y
                n = nb(ins[0])
                t1 = self._emit(f"{p}/mul", "Mul", (dy, y), (n,), bw)[0]
                t2 = self._emit(f"{p}/Sum", "Sum", (t1,), (n // 64 or 1,), bw)[0]
                t3 = self._emit(f"{p}/sub", "Sub", (dy, t2), (n,), bw)[0]
                (g,) = self._emit(f"{p}/mul_1", "Mul", (t3, y), (n,), bw)
                give(ins[0], g)
            elif k == "out":
                (g,) = self._emit(f"{p}/{layer.type}Grad", f"{layer.type}Grad", (dy, y), (nb(ins[0]),), bw,
                                  shape_of=ins[0])
                give(ins[0], g)
            elif k == "in":
                (g,) = self._emit(f"{p}/{layer.type}Grad", "Mul", (dy, ins[0]), (nb(ins[0]),), bw, shape_of=ins[0])
                give(ins[0], g)
            elif k == "linear" and self.tf_like and layer.type in ("Mul", "RealDiv", "AddV2"):
                # A binary op with a constant: TensorFlow's broadcasting gradient all the same
                n = nb(ins[0])
                s0 = self.shapes.get(ins[0])
                r = self._emit(f"{p}/BroadcastGradientArgs", "BroadcastGradientArgs", (s0,) if s0 else (), (16, 16), bw)
                g = dy
                if layer.type != "AddV2":
                    (g,) = self._emit(f"{p}/{layer.type}", layer.type, (dy,), (n,), bw)
                (g,) = self._emit(f"{p}/Sum", "Sum", (g, r[0]), (n,), bw)
                (g,) = self._emit(f"{p}/Reshape", "Reshape", (g,) + ((s0,) if s0 else ()), (n,), bw)
                give(ins[0], g)
            elif k == "linear":
                (g,) = self._emit(f"{p}/{layer.type}", layer.type, (dy,), (nb(ins[0]),), bw, shape_of=ins[0])
                give(ins[0], g)
            elif k == "reduce" and self.tf_like:
                # TensorFlow's _MeanGrad: reshape, tile to the input's shape, divide by the count
                n = nb(ins[0])
                t1 = self._emit(f"{p}/Reshape", "Reshape", (dy,), (nb(y),), bw, shape_of=ins[0])[0]
                t2 = self._emit(f"{p}/Tile", "Tile", (t1,), (n,), bw)[0]
                (g,) = self._emit(f"{p}/truediv", "RealDiv", (t2,), (n,), bw)
                give(ins[0], g)
            elif k == "reduce":
                (g,) = self._emit(f"{p}/BroadcastTo", "BroadcastTo", (dy,), (nb(ins[0]),), bw, shape_of=ins[0])
                give(ins[0], g)
            elif k == "bias":
                x, w = ins
                give(x, dy)
                if need[1]:
                    (g,) = self._emit(f"{p}/BiasAddGrad", "BiasAddGrad", (dy,), (nb(w),), bw)
                    give(w, g)
            elif k in ("add", "mul"):
                shapes = None
                if self.tf_like and ins[0] in self.shapes and ins[1] in self.shapes:
                    # TensorFlow's broadcasting-gradient bookkeeping (tiny int32 tensors)
                    s0, s1 = shapes = (self.shapes[ins[0]], self.shapes[ins[1]])
                    r = self._emit(f"{p}/BroadcastGradientArgs", "BroadcastGradientArgs", (s0, s1), (16, 16), bw)
                for j, t in enumerate(ins):
                    if not need[j]:
                        continue
                    g = dy
                    if k == "mul":
                        other = ins[1 - j]
                        (g,) = self._emit(f"{p}/Mul_{j}", "Mul", (dy, other), (nb(y),), bw)
                    if shapes is not None:
                        (g,) = self._emit(f"{p}/Sum_{j}", "Sum", (g, r[j]), (nb(t),), bw)
                        (g,) = self._emit(f"{p}/Reshape_{j}", "Reshape", (g, shapes[j]), (nb(t),), bw)
                    give(t, g)
            else:  # pragma: no cover (validated in layer())
                raise ValueError(k)
        # Optimizer: one update per weight, after the backward pass (as Keras applies gradients).
        final = {w: total(w, w.rpartition(":")[0]) for w in self.weights}
        final = {w: g for w, g in final.items() if g is not None}
        if self.optimizer == "adamw_ops" and final:
            # clip_by_global_norm(1.0), as BERT's optimizer does
            opt = Role.OPTIMIZER
            norms = [self._emit(f"clip/{w.rpartition(':')[0]}/L2Loss", "L2Loss", (g,), (F32,), opt)[0]
                     for w, g in final.items()]
            (tot,) = self._emit("clip/global_norm/AddN", "AddN", tuple(norms), (F32,), opt)
            (nrm,) = self._emit("clip/global_norm/Sqrt", "Sqrt", (tot,), (F32,), opt)
            (scale,) = self._emit("clip/Maximum", "Maximum", (nrm,), (F32,), opt)
            (scale,) = self._emit("clip/truediv", "RealDiv", (scale,), (F32,), opt)
            final = {w: self._emit(f"clip/{w.rpartition(':')[0]}/mul", "Mul", (g, scale), (self.nbytes[w],), opt)[0]
                     for w, g in final.items()}
        for w, g in final.items():
            name = f"optimizer/update_{w.rpartition(':')[0]}"
            if self.optimizer == "sgd":
                self._emit(name, "ResourceApplyGradientDescent", (w, g), (), Role.OPTIMIZER, stateful=True)
            else:
                self._adamw_ops(name, w, g)
        self.tb.meta.setdefault("model", "synthetic")
        return self.tb.build(**kwargs)


# ---- generators ------------------------------------------------------------------------------------------------------
def _dense(m: ModelBuilder, name: str, x: str, rows: int, k: int, n: int, act: str | None = "Relu") -> str:
    w = m.weight(f"{name}/kernel", k * n * F32)
    b = m.weight(f"{name}/bias", n * F32)
    if m.tf_like:
        # Keras' Dense on a 3-D input goes through Tensordot: shape arithmetic, a reshape to 2-D, MatMul, reshape back
        shp = m.layer(f"{name}/Tensordot/Shape", "Shape", (x,), 16, grad="none")
        g = m.layer(f"{name}/Tensordot/GatherV2", "GatherV2", (shp,), 8, grad="none")
        pr = m.layer(f"{name}/Tensordot/Prod", "Prod", (g,), 4, grad="none")
        st = m.layer(f"{name}/Tensordot/stack", "Pack", (pr,), 8, grad="none")
        out_shape = m.layer(f"{name}/Tensordot/concat", "ConcatV2", (g,), 12, grad="none")
        x = m.layer(f"{name}/Tensordot/Reshape", "Reshape", (x, st), rows * k * F32, grad="linear")
        y = m.layer(f"{name}/Tensordot/MatMul", "MatMul", (x, w), rows * n * F32, grad="matmul",
                    flops=2.0 * rows * k * n)
        y = m.layer(f"{name}/Tensordot", "Reshape", (y, out_shape), rows * n * F32, grad="linear")
    else:
        y = m.layer(f"{name}/MatMul", "MatMul", (x, w), rows * n * F32, grad="matmul", flops=2.0 * rows * k * n)
    y = m.layer(f"{name}/BiasAdd", "BiasAdd", (y, b), rows * n * F32, grad="bias")
    if act:
        y = m.layer(f"{name}/{act}", act, (y,), rows * n * F32, grad="out")
    return y


def _loss(m: ModelBuilder, x: str) -> str:
    return m.layer("loss/Mean", "Mean", (x,), F32, grad="reduce")


def linear_chain(n_layers: int = 8, batch: int = 64, width: int = 1024, **builder) -> AccessTrace:
    """An MLP: n_layers x (MatMul, BiasAdd, Relu), then a mean loss."""
    m = ModelBuilder(meta={"model": f"linear_chain({n_layers})"}, **builder)
    x = m.input("input", batch * width * F32)
    for i in range(n_layers):
        x = _dense(m, f"dense_{i}", x, batch, width, width)
    _loss(m, x)
    return m.build()


def _conv(m: ModelBuilder, name: str, x: str, batch: int, hw: int, cin: int, cout: int, k: int = 3) -> str:
    w = m.weight(f"{name}/kernel", k * k * cin * cout * F32)
    out = batch * hw * hw * cout * F32
    return m.layer(f"{name}/Conv2D", "Conv2D", (x, w), out, grad="matmul",
                   flops=2.0 * batch * hw * hw * cin * cout * k * k)


def resnet(n_blocks: int = 4, batch: int = 16, hw: int = 32, channels: int = 64, **builder) -> AccessTrace:
    """A ResNet-style CNN: a stem conv, n_blocks residual blocks (conv-bias-relu-conv-bias + skip, relu), a loss."""
    m = ModelBuilder(meta={"model": f"resnet({n_blocks})"}, **builder)
    act = batch * hw * hw * channels * F32
    x = m.input("input", batch * hw * hw * 3 * F32)
    x = _conv(m, "stem", x, batch, hw, 3, channels)
    x = m.layer("stem/Relu", "Relu", (x,), act, grad="out")
    for i in range(n_blocks):
        p = f"block_{i}"
        h = _conv(m, f"{p}/conv1", x, batch, hw, channels, channels)
        h = m.layer(f"{p}/bias1", "BiasAdd", (h, m.weight(f"{p}/b1", channels * F32)), act, grad="bias")
        h = m.layer(f"{p}/relu1", "Relu", (h,), act, grad="out")
        h = _conv(m, f"{p}/conv2", h, batch, hw, channels, channels)
        h = m.layer(f"{p}/bias2", "BiasAdd", (h, m.weight(f"{p}/b2", channels * F32)), act, grad="bias")
        h = m.layer(f"{p}/add", "AddV2", (h, x), act, grad="add")
        x = m.layer(f"{p}/relu2", "Relu", (h,), act, grad="out")
    _loss(m, x)
    return m.build()


def _layer_norm(m: ModelBuilder, p: str, x: str, rows: int, hidden: int) -> str:
    full, col = rows * hidden * F32, rows * F32
    mean = m.layer(f"{p}/Mean", "Mean", (x,), col, grad="reduce")
    c = m.layer(f"{p}/Sub", "Sub", (x, mean), full, grad="add")
    sq = m.layer(f"{p}/Square", "Square", (c,), full, grad="in")
    var = m.layer(f"{p}/Mean_1", "Mean", (sq,), col, grad="reduce")
    r = m.layer(f"{p}/Rsqrt", "Rsqrt", (var,), col, grad="out")
    n = m.layer(f"{p}/Mul", "Mul", (c, r), full, grad="mul")
    n = m.layer(f"{p}/Mul_1", "Mul", (n, m.weight(f"{p}/gamma", hidden * F32)), full, grad="mul")
    return m.layer(f"{p}/Add", "BiasAdd", (n, m.weight(f"{p}/beta", hidden * F32)), full, grad="bias")


def _dropout(m: ModelBuilder, p: str, x: str, nbytes: int, stateful: bool) -> str:
    if stateful:
        u = m.layer(f"{p}/RandomUniform", "RandomUniform", (), nbytes, grad="none", stateful=True)
    else:
        seed = ()
        if m.tf_like:  # Keras' stateless dropout derives a key and counter from the seed first
            m.layer(f"{p}/StatelessRandomGetKeyCounter", "StatelessRandomGetKeyCounter", (), (16, 16), grad="none")
            seed = (f"{m.layers[-1].name}:0", f"{m.layers[-1].name}:1")
        u = m.layer(f"{p}/StatelessRandomUniformV2", "StatelessRandomUniformV2", seed, nbytes, grad="none")
    if m.tf_like:  # x / keep_prob
        x = m.layer(f"{p}/truediv", "RealDiv", (x,), nbytes, grad="linear")
    keep = m.layer(f"{p}/GreaterEqual", "GreaterEqual", (u,), nbytes // 4, grad="none")
    mask = m.layer(f"{p}/Cast", "Cast", (keep,), nbytes, grad="none")
    return m.layer(f"{p}/Mul", "Mul", (x, mask), nbytes, grad="mul")


def _gelu(m: ModelBuilder, p: str, x: str, nbytes: int) -> str:
    c = m.layer(f"{p}/Pow", "Pow", (x,), nbytes, grad="in")
    c = m.layer(f"{p}/mul", "Mul", (c,), nbytes, grad="linear")
    c = m.layer(f"{p}/add", "AddV2", (x, c), nbytes, grad="add")
    c = m.layer(f"{p}/mul_1", "Mul", (c,), nbytes, grad="linear")
    c = m.layer(f"{p}/Tanh", "Tanh", (c,), nbytes, grad="out")
    c = m.layer(f"{p}/add_1", "AddV2", (c,), nbytes, grad="linear")
    c = m.layer(f"{p}/mul_2", "Mul", (x, c), nbytes, grad="mul")
    return m.layer(f"{p}/mul_3", "Mul", (c,), nbytes, grad="linear")


def transformer(
    n_blocks: int = 2,
    batch: int = 8,
    seq: int = 64,
    hidden: int = 128,
    heads: int = 4,
    ffn: int | None = None,
    *,
    dropout: bool = True,
    stateful_dropout: bool = False,
    **builder,
) -> AccessTrace:
    """A BERT-style encoder: embeddings, n_blocks x (self-attention, dropout, residual, LayerNorm, GELU FFN), a loss.

    With ``stateful_dropout`` the dropout masks come from a stateful random op (not replayable)."""
    ffn = ffn or 4 * hidden
    builder.setdefault("meta", {"model": f"transformer({n_blocks}, hidden={hidden})"})
    m = ModelBuilder(**builder)
    rows = batch * seq
    full = rows * hidden * F32
    ids = m.input("input_ids", rows * F32)
    mask_ids = m.input("padding_mask", rows * F32)
    table = m.weight("embeddings/table", 30522 * hidden * F32)
    x = m.layer("embeddings/Gather", "ResourceGather", (table, ids), full, grad="none")
    x = _layer_norm(m, "embeddings/LayerNorm", x, rows, hidden)
    for i in range(n_blocks):
        p = f"encoder/layer_{i}"
        qkv = []
        for which in ("query", "key", "value"):
            h = _dense(m, f"{p}/attention/{which}", x, rows, hidden, hidden, act=None)
            h = m.layer(f"{p}/attention/{which}/Reshape", "Reshape", (h,), full, grad="linear")
            h = m.layer(f"{p}/attention/{which}/Transpose", "Transpose", (h,), full, grad="linear")
            qkv.append(h)
        q, k, v = qkv
        scores_b = batch * heads * seq * seq * F32
        dh = hidden // heads
        s = m.layer(f"{p}/attention/scores", "BatchMatMulV2", (q, k), scores_b, grad="matmul",
                    flops=2.0 * batch * heads * seq * seq * dh)
        s = m.layer(f"{p}/attention/scale", "Mul", (s,), scores_b, grad="linear")
        if m.tf_like:  # the padding mask, expanded and added per block (keras-hub's attention)
            mk = m.layer(f"{p}/attention/mask/Cast", "Cast", (mask_ids,), rows * F32, grad="none")
            mk = m.layer(f"{p}/attention/mask/ExpandDims", "ExpandDims", (mk,), rows * F32, grad="none")
            mk = m.layer(f"{p}/attention/mask/sub", "Sub", (mk,), rows * F32, grad="none")
            mk = m.layer(f"{p}/attention/mask/mul", "Mul", (mk,), rows * F32, grad="none")
            s = m.layer(f"{p}/attention/mask/add", "AddV2", (s, mk), scores_b, grad="add")
        s = m.layer(f"{p}/attention/Softmax", "Softmax", (s,), scores_b, grad="out")
        if dropout:
            s = _dropout(m, f"{p}/attention/dropout", s, scores_b, stateful_dropout)
        c = m.layer(f"{p}/attention/context", "BatchMatMulV2", (s, v), full, grad="matmul",
                    flops=2.0 * batch * heads * seq * seq * dh)
        c = m.layer(f"{p}/attention/context/Transpose", "Transpose", (c,), full, grad="linear")
        c = m.layer(f"{p}/attention/context/Reshape", "Reshape", (c,), full, grad="linear")
        c = _dense(m, f"{p}/attention/output", c, rows, hidden, hidden, act=None)
        if dropout:
            c = _dropout(m, f"{p}/attention/output/dropout", c, full, stateful_dropout)
        c = m.layer(f"{p}/attention/output/add", "AddV2", (c, x), full, grad="add")
        x = _layer_norm(m, f"{p}/attention/output/LayerNorm", c, rows, hidden)
        h = _dense(m, f"{p}/intermediate", x, rows, hidden, ffn, act=None)
        h = _gelu(m, f"{p}/intermediate/gelu", h, rows * ffn * F32)
        h = _dense(m, f"{p}/output", h, rows, ffn, hidden, act=None)
        if dropout:
            h = _dropout(m, f"{p}/output/dropout", h, full, stateful_dropout)
        h = m.layer(f"{p}/output/add", "AddV2", (h, x), full, grad="add")
        x = _layer_norm(m, f"{p}/output/LayerNorm", h, rows, hidden)
    if not m.tf_like:
        x = _dense(m, "head/transform", x, rows, hidden, hidden, act="Tanh")
        _loss(m, x)
        return m.build()
    # BERT pre-training heads (benchmarks.md): masked LM over 20 positions per sequence, and a 2-class head.
    masked = batch * 20
    pos = m.input("masked_positions", masked * F32)
    h = m.layer("mlm/GatherV2", "GatherV2", (x, pos), masked * hidden * F32, grad="linear")
    h = _dense(m, "mlm/transform", h, masked, hidden, hidden, act=None)
    h = _gelu(m, "mlm/transform/gelu", h, masked * hidden * F32)
    h = _layer_norm(m, "mlm/LayerNorm", h, masked, hidden)
    logits = m.layer("mlm/MatMul", "MatMul", (h, table), masked * 30522 * F32, grad="matmul",
                     flops=2.0 * masked * hidden * 30522)
    logits = m.layer("mlm/BiasAdd", "BiasAdd", (logits, m.weight("mlm/bias", 30522 * F32)), masked * 30522 * F32,
                     grad="bias")
    lp = m.layer("mlm/LogSoftmax", "LogSoftmax", (logits,), masked * 30522 * F32, grad="out")
    labels = m.input("masked_ids_one_hot", masked * 30522 * F32)
    nll = m.layer("mlm/mul", "Mul", (lp, labels), masked * 30522 * F32, grad="mul")
    mlm = m.layer("mlm/Sum", "Sum", (nll,), masked * F32, grad="reduce")
    mlm = m.layer("mlm/Mean", "Mean", (mlm,), F32, grad="reduce")
    first = m.layer("nsp/strided_slice", "StridedSlice", (x,), batch * hidden * F32, grad="linear")
    pooled = _dense(m, "nsp/pooler", first, batch, hidden, hidden, act="Tanh")
    nsp = _dense(m, "nsp/classifier", pooled, batch, hidden, 2, act=None)
    nsp = m.layer("nsp/LogSoftmax", "LogSoftmax", (nsp,), batch * 2 * F32, grad="out")
    nsp = m.layer("nsp/Mean", "Mean", (nsp,), F32, grad="reduce")
    m.layer("loss/add", "AddV2", (mlm, nsp), F32, grad="add")
    return m.build()


def bert_base(batch: int = 8, seq: int = 128, **kwargs) -> AccessTrace:
    """BERT-base-sized: 12 blocks, hidden 768, 12 heads, FFN 3072, with TensorFlow-style gradient bookkeeping
    (about 10,000 tensors)."""
    kwargs.setdefault("tf_like", True)
    kwargs.setdefault("optimizer", "adamw_ops")
    kwargs.setdefault("meta", {"model": "bert_base (synthetic)"})
    return transformer(12, batch, seq, 768, 12, 3072, **kwargs)


def random_model(seed: int, n_layers: int = 6, max_width: int = 512, batch: int = 32) -> AccessTrace:
    """A random MLP/ResNet mix for property tests: random widths, residual skips, dropout, jittered durations."""
    rng = random.Random(seed)
    width = rng.choice([64, 128, 256, max_width])
    m = ModelBuilder(jitter=random.Random(seed + 1), meta={"model": f"random({seed})"})
    x = m.input("input", batch * width * F32)
    for i in range(n_layers):
        kind = rng.random()
        if kind < 0.4:
            x = _dense(m, f"dense_{i}", x, batch, width, width, act=rng.choice(["Relu", "Tanh"]))
        elif kind < 0.8:
            h = _dense(m, f"res_{i}/a", x, batch, width, width)
            h = _dense(m, f"res_{i}/b", h, batch, width, width, act=None)
            h = m.layer(f"res_{i}/add", "AddV2", (h, x), batch * width * F32, grad="add")
            x = m.layer(f"res_{i}/relu", "Relu", (h,), batch * width * F32, grad="out")
        else:
            x = _dense(m, f"drop_{i}", x, batch, width, width)
            x = _dropout(m, f"drop_{i}/dropout", x, batch * width * F32, stateful=rng.random() < 0.5)
    _loss(m, x)
    return m.build()


def budget_fraction(trace: AccessTrace, fraction: float) -> int:
    """A budget of persistent + `fraction` of the transient peak (benchmarks.md's "half the transient peak")."""
    peak = trace.replayed_peak_bytes()
    return int(trace.persistent_bytes + fraction * (peak - trace.persistent_bytes))


__all__ = [
    "TraceBuilder",
    "ModelBuilder",
    "linear_chain",
    "resnet",
    "transformer",
    "bert_base",
    "random_model",
    "budget_fraction",
]
