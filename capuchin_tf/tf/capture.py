"""Capture: a user's training step as a graph, and its graph model. The one place that reads TensorFlow graphs.

`concrete_step(fn, args)` gets the ConcreteFunction of a `tf.function` training step (forward, GradientTape
gradients and optimizer updates are inline in one flat graph, tf-notes.md); `graph_model(graph_def, func_graph)`
turns the post-optimization GraphDef (what the executor really runs) into the pure GraphModel, with sizes taken
from the captured graph's static shapes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, op_def_pb2, types_pb2
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import cancellation, context, execute
from tensorflow.python.eager.polymorphic_function import function_type_utils
from tensorflow.python.framework import op_def_registry
from tensorflow.python.ops import resource_variable_ops

from capuchin_tf.core import control_flow
from capuchin_tf.core.graph_model import (
    GraphModel,
    OpInfo,
    Role,
    TensorInfo,
    propagate_backward_roles,
    shape_of,
)
from capuchin_tf.core.schedule import is_variable_writer

# Ops whose bodies run in nested functions: opaque to capuchin_tf, their inner tensors are not managed.
FUNCTIONAL_OPS = frozenset({
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "RemoteCall", "For",
})
# Ops whose outputs alias memory that outlives the step (arguments, variables, constants).
PERSISTENT_PRODUCERS = frozenset({"_Arg", "Placeholder", "Const", "HostConst", "ReadVariableOp", "VarHandleOp",
                                  "VariableV2", "ResourceGather"})
BOOKKEEPING_OPS = frozenset({"_Arg", "_Retval", "NoOp", "Const", "HostConst", "ReadVariableOp", "VarHandleOp",
                             "Identity", "IdentityN", "Placeholder", "Shape", "ShapeN", "Size", "Rank"})


class CaptureError(ValueError):
    """The step cannot be captured (not a tf.function, XLA-compiled, ...)."""


class MergedGraphError(CaptureError):
    """The graph read back from run metadata has another function's graph merged into it: TensorFlow's graph
    collector is the eager context's and merges (GraphDef.MergeFrom) every function instantiated while run metadata is
    on, in any thread. Reading again usually gives the step's own graph."""


def concrete_step(fn, args):
    """The ConcreteFunction of `fn` for `args` (tensors or TensorSpecs)."""
    if not hasattr(fn, "get_concrete_function"):
        raise CaptureError(
            f"{fn!r} is not a tf.function: wrap the training step with @tf.function (or @capuchin_tf.function)"
        )
    refuse_xla(fn)
    return fn.get_concrete_function(*args)


def refuse_xla(fn) -> None:
    """Raises CaptureError when the tf.function `fn` is XLA-compiled (its private `_jit_compile`)."""
    if getattr(fn, "_jit_compile", False):
        raise CaptureError(
            "the training step is compiled with XLA (jit_compile=True): capuchin_tf's custom ops cannot run under "
            "XLA. Use jit_compile=False for the step capuchin_tf manages."
        )


# Reads of a step's optimized graph before a graph merged with another function's is an error (MergedGraphError).
GRAPH_READ_ATTEMPTS = 5
GRAPH_READ_BACKOFF_S = 0.02
_NONCES = itertools.count(1 << 30)  # timeline_step values no other call uses (see optimized_graph)
# Held while run metadata collects a function's optimized graph, and by any other thread's instantiation
# (function_surgery.preinstantiate, a plan change built in the background): run metadata is the eager context's, so
# an instantiation in another thread during the window lands in the same metadata, its graph merged into the one
# read (seen: ResNet50's step read back with 10,416 nodes, 4,345 names twice, while another managed step's plan
# change was built; docs/decisions.md, "One instantiation at a time while a graph is read").
INSTANTIATION_LOCK = threading.RLock()


def optimized_graph(concrete, args) -> graph_pb2.GraphDef:
    """The post-optimization GraphDef TensorFlow runs for `concrete(*args)`, obtained without running the step.

    The function is called with a cancellation manager that is already cancelled: TensorFlow instantiates it (the
    placer and Grappler run, run metadata collects the optimized graph) and then refuses to start it, so no op runs
    and no variable is written. Used when the step may not fit the device (the measured step under a budget).
    """
    flat = flat_call_inputs(concrete, args)
    names = {op.name for op in concrete.graph.get_operations()}
    for attempt in itertools.count(1):
        # A config no other call uses: the function is instantiated (optimized) anew even if it ran before, and the
        # instantiation is what hands over the graph. The field set is one only DirectSession reads.
        nonce = next(_NONCES)
        with call_config(lambda config: setattr(config.graph_options, "timeline_step", nonce)):
            metadata = _instantiate(concrete, flat)
        try:
            return _pick_graph(metadata, names)
        except MergedGraphError:
            if attempt == GRAPH_READ_ATTEMPTS:
                raise
            time.sleep(GRAPH_READ_BACKOFF_S * attempt)  # let the other thread's instantiation pass


def flat_call_inputs(concrete, args, kwargs=None) -> list:
    """The flat tensors a call of `concrete` with `args` and `kwargs` passes to its runtime function (the step's
    inputs, then its captures), as ConcreteFunction's own call flattens them."""
    function_type = concrete.function_type
    bound = function_type_utils.canonicalize_function_inputs(args, kwargs or {}, function_type)
    return list(function_type.unpack_inputs(bound)) + list(concrete.captured_inputs)


def instantiate_without_running(name: str, num_outputs: int, inputs: list) -> bool:
    """Calls the runtime function `name` with `inputs` under a cancellation manager cancelled beforehand, with this
    thread's function call options: TensorFlow instantiates it (placement, the graph passes, partitioning) and keeps
    the instantiation, then refuses to start the call ("Function was cancelled before it was started"), so no node
    runs. True when the call was refused as it should be, False when it ran. Raises the instantiation's OpError.

    The manager is passed to this call alone: TensorFlow's `CancellationManager.get_cancelable_function` sets a
    process-wide manager, which cancelled any function another thread called meanwhile."""
    ctx = context.context()
    attrs = tuple(itertools.chain(*ctx.function_call_options.as_attrs().items()))
    manager = cancellation.CancellationManager()
    manager.start_cancel()
    try:
        execute.execute_with_cancellation(name, num_outputs=num_outputs, inputs=inputs, attrs=attrs, ctx=ctx,
                                          cancellation_manager=manager)
    except tf.errors.CancelledError:
        return True
    return False


@contextlib.contextmanager
def call_config(edit: Callable[[config_pb2.ConfigProto], None]) -> Iterator[None]:
    """Functions called inside run with the thread's function call options' config as `edit` changes it (the call
    options are per call and per thread; a function is instantiated once per distinct options)."""
    ctx = context.context()
    old = ctx.function_call_options
    config = config_pb2.ConfigProto()
    config.ParseFromString(old.config_proto_serialized or b"")
    edit(config)
    ctx.function_call_options = context.FunctionCallOptions(executor_type=old.executor_type, config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = old


def _instantiate(concrete, flat):
    """Instantiates `concrete` for the flat inputs `flat` without running it, with run metadata on: its optimized
    graphs."""
    atomic = concrete._inference_function  # what a call outside a gradient tape runs
    with _run_metadata() as (ctx, flush):
        if not instantiate_without_running(atomic.name.decode(), len(atomic.function_type.flat_outputs), flat):
            raise CaptureError("the step ran although it was cancelled before its start")
        flush()  # an executed eager op hands the graphs collected at instantiation to the run metadata
        return ctx.export_run_metadata()


@contextlib.contextmanager
def _run_metadata() -> Iterator[tuple]:
    """Run metadata on, with nothing collected before in it, and no other thread's instantiation while it is on
    (INSTANTIATION_LOCK); yields (the eager context, `flush`: runs an eager op, which hands what the graph collector
    holds to the run metadata). TensorFlow's graph collector can hold another function's graph from before the
    window (seen: a plan change's function, whose instantiation in another thread held the lock, in the collector at
    the next read): it is handed over and dropped first."""
    ctx = context.context()
    one = tf.constant(0)
    tf.identity(one)  # instantiated now, so that running it in the window adds no graph of its own

    def flush() -> None:
        tf.identity(one)

    with INSTANTIATION_LOCK:
        ctx.enable_run_metadata()
        try:
            flush()
            ctx.export_run_metadata()
            yield ctx, flush
        finally:
            ctx.disable_run_metadata()


def run_with_post_optimization_graph(call, names: Collection[str]):
    """Runs `call()` once with run metadata on; returns (its result, the post-optimization GraphDef it executed).

    `names`: the node names of the graph of the function `call` runs: run metadata can also carry graphs of other
    functions (a function run earlier in the process, for one), so the one sharing most node names with it is taken.
    """
    with _run_metadata() as (ctx, _):
        result = call()
        metadata = ctx.export_run_metadata()
    return result, _pick_graph(metadata, names)


def _pick_graph(metadata, names: Collection[str]) -> graph_pb2.GraphDef:
    graphs = [fg.post_optimization_graph for fg in metadata.function_graphs]
    if not graphs:
        raise CaptureError("TensorFlow returned no function graph for the step (was it a tf.function call?)")
    graph = max(graphs, key=lambda g: sum(n.name in names for n in g.node))
    merged = merged_graph(graph)
    if merged:
        raise MergedGraphError(f"the optimized graph TensorFlow returned has another function's graph merged in "
                               f"({merged}): a function was instantiated in another thread while it was read")
    return graph


def merged_graph(graph: graph_pb2.GraphDef) -> str | None:
    """Why `graph` (a function's graph from run metadata) holds more than one function's graph, or None: a node name
    twice, or an `_Arg` or `_Retval` index twice (every function's inputs and outputs are numbered from 0, so a
    second function's graph repeats them even where its node names differ)."""
    names = collections.Counter(n.name for n in graph.node)
    twice = [name for name, count in names.items() if count > 1]
    if twice:
        return f"{len(twice)} node names twice, as {twice[0]!r}"
    indices = collections.Counter((n.op, n.attr["index"].i) for n in graph.node
                                  if n.op in ("_Arg", "_Retval") and "index" in n.attr)
    twice = [key for key, count in indices.items() if count > 1]
    if twice:
        return f"{len(twice)} argument or result indices twice, as {twice[0][0]} {twice[0][1]}"
    return None


def arg_types(node, args) -> list[int]:
    """The DataType enum of each tensor an op's argument list (an OpDef's `input_arg` or `output_arg`) stands for in
    `node`, expanded over list and repeated arguments; 0 (DT_INVALID) where the node does not set its type."""
    out = []
    for arg in args:
        if arg.type_list_attr:
            out += list(node.attr[arg.type_list_attr].list.type)
            continue
        if arg.type_attr:
            dtype = node.attr[arg.type_attr].type if arg.type_attr in node.attr else 0
        else:
            dtype = arg.type
        out += [dtype] * (node.attr[arg.number_attr].i if arg.number_attr else 1)
    return out


def num_outputs(node, op_def) -> int:
    return len(arg_types(node, op_def.output_arg))


def resource_inputs(node) -> list[int]:
    """Indices of `node`'s data inputs of type resource (from its OpDef; none for an op TensorFlow does not know)."""
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        return []
    return [i for i, t in enumerate(arg_types(node, op_def.input_arg)) if t == types_pb2.DT_RESOURCE]


def variable_shapes_and_dtypes(handle) -> list[tuple[tf.DType, tf.TensorShape]] | None:
    """What a captured resource handle says of the variable it refers to (dtype and shape; several for a handle that
    carries more), or None when it is not a handle or carries no such data (a lookup table, an iterator)."""
    if getattr(handle, "dtype", None) != tf.resource:
        return None
    data = resource_variable_ops.get_eager_safe_handle_data(handle)
    if data is None or not data.is_set or not data.shape_and_type:
        return None
    return [(tf.as_dtype(d.dtype), tf.TensorShape(d.shape)) for d in data.shape_and_type]


def is_backward_name(node_name: str) -> bool:
    """Whether a node's name puts it in the backward pass (GradientTape's and tf.gradients' name scopes)."""
    return (node_name.startswith("gradient_tape/") or "/gradient_tape/" in node_name
            or node_name.startswith("gradients/"))


def _role(node_name: str, op_type: str, optimizer_scopes: tuple[str, ...]) -> Role:
    if is_backward_name(node_name):
        return Role.BACKWARD
    if is_variable_writer(op_type) or any(node_name.lower().startswith(s) for s in optimizer_scopes):
        return Role.OPTIMIZER
    if op_type in BOOKKEEPING_OPS:
        return Role.OTHER
    return Role.FORWARD


# A node capuchin_tf inserts carries, per output, the tensor of the original graph whose value (hence dtype and static
# shape) that output has: a recomputation's clones and views their originals, a Get or a SwapIn the tensor it holds.
MIRRORS_ATTR = "_capuchin_mirrors"


@dataclasses.dataclass(frozen=True)
class StaticTensor:
    dtype: tf.DType
    shape: tf.TensorShape


_STATIC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _static_of(func_graph) -> dict[str, StaticTensor]:
    """Every tensor of `func_graph` by name, read once per graph (reading them one by one through the graph's API
    costs more than the rest of a pass over a large graph)."""
    table = _STATIC.get(func_graph)
    if table is None:
        table = {t.name: StaticTensor(t.dtype, t.shape) for op in func_graph.get_operations() for t in op.outputs}
        _STATIC[func_graph] = table
    return table


def refine_static(func_graph, original) -> None:
    """Sharpens the static shapes read from `func_graph` (the optimized graph imported) with those of the captured
    graph `original`, tensor by tensor where the names match: shape inference on the lowered graph loses what goes
    through a loop (a Merge's input from the next iteration is not known when the Merge is inferred, so the loop's
    outputs, and everything computed from them, get unknown dimensions), while the captured graph's functional While
    op kept them. Without them, every activation computed from a loop's output has an unknown size and is never
    pooled (docs/decisions.md, "Static shapes of inserted nodes come through their mirrors")."""
    table = _static_of(func_graph)
    for op in original.get_operations():
        for t in op.outputs:
            known = table.get(t.name)
            if known is None or known.shape.is_fully_defined() or known.dtype != t.dtype:
                continue
            if known.shape.is_compatible_with(t.shape):
                table[t.name] = StaticTensor(known.dtype, known.shape.merge_with(t.shape))


def static_tensor(func_graph, node, slot: int) -> StaticTensor | None:
    """The dtype and static shape of output `slot` of `node` (a NodeDef of the graph `func_graph` was imported from,
    or of an edited copy of it), None if unknown. Nodes capuchin_tf inserted are found through their MIRRORS_ATTR,
    so an edited graph needs no import of its own."""
    table = _static_of(func_graph)
    found = table.get(f"{node.name}:{slot}")
    if found is not None:
        return found
    mirrors = node.attr[MIRRORS_ATTR].list.s if MIRRORS_ATTR in node.attr else []
    return table.get(mirrors[slot].decode()) if slot < len(mirrors) else None


def graph_model(graph_def: graph_pb2.GraphDef, func_graph=None,
                optimizer_scopes: tuple[str, ...] = ("sgd/", "adam/", "adamw/", "rmsprop/", "optimizer/"),
                always_runs: Callable[[str], bool] | None = None) -> GraphModel:
    """The GraphModel of a post-optimization GraphDef, edited or not. `func_graph` (the optimized graph imported,
    `function_surgery.rebuild(...).graph`) supplies static shapes (`static_tensor`). `always_runs`: which nodes
    always run, if already known (control_flow.of_graph_def(graph_def).always_runs, or the GraphEditor's that made
    the graph)."""
    # One read of each NodeDef (reading protobuf fields is most of the cost of a pass over a large graph).
    names, types, data, controls, nodes = [], [], [], [], []
    consumers: dict[str, list[str]] = {}
    for node in graph_def.node:
        name, refs = node.name, list(node.input)
        ins = [r if ":" in r else f"{r}:0" for r in refs if not r.startswith("^")]
        for t in ins:
            consumers.setdefault(t, []).append(name)
        names.append(name)
        types.append(node.op)
        data.append(ins)
        controls.append(tuple(r[1:] for r in refs if r.startswith("^")))
        nodes.append(node)
    # Lowered conds and loops: which ops always run (control_flow.py).
    if always_runs is None:
        always_runs = control_flow.analyze(
            control_flow.FlowNode(name=name, op=op, inputs=tuple(ins), control_inputs=ctrl,
                                  frame_name=node.attr["frame_name"].s.decode()
                                  if op in control_flow.ENTER_OPS else None)
            for name, op, ins, ctrl, node in zip(names, types, data, controls, nodes)).always_runs
    dtype_names: dict[int, str] = {}

    def _dtype_name(enum: int) -> str:
        found = dtype_names.get(enum)
        if found is None:
            found = dtype_names[enum] = tf.as_dtype(enum).name if enum else "unknown"
        return found

    op_defs, out_dtypes = [], {}  # out_dtypes: of the nodes whose op this process knows
    for name, op, node in zip(names, types, nodes):
        op_def = op_def_registry.get(op)
        op_defs.append(op_def)
        if op_def is not None:
            out_dtypes[name] = [_dtype_name(t) for t in arg_types(node, op_def.output_arg)]

    def _input_dtype(ref: str) -> str:
        """The dtype name of a data input ("node:slot"), "unknown" when it cannot be told."""
        name, _, slot = ref.rpartition(":")
        dtypes = out_dtypes.get(name)
        k = int(slot)
        return dtypes[k] if dtypes is not None and k < len(dtypes) else "unknown"

    table = _static_of(func_graph) if func_graph is not None else None
    sized: dict[int, tuple] = {}  # id(StaticTensor) -> (shape, nbytes)
    ops, tensors = [], []
    for name, op, ins, ctrl, node, op_def in zip(names, types, data, controls, nodes, op_defs):
        stateful = bool(op_def.is_stateful) if op_def is not None else True
        dtypes = out_dtypes.get(name)
        if dtypes is None:  # an op this process does not know: keep what its consumers tell
            slots = [int(t.rsplit(":", 1)[1]) for t in consumers if t.rsplit(":", 1)[0] == name]
            dtypes = ["unknown"] * (max(slots) + 1 if slots else 0)
        persistent = op in PERSISTENT_PRODUCERS
        outputs = []
        mirrors = None
        for slot in range(len(dtypes)):
            tid = f"{name}:{slot}"
            shape, nbytes = None, -1
            static = None
            if table is not None:
                static = table.get(tid)
                if static is None:
                    if mirrors is None:
                        mirrors = node.attr[MIRRORS_ATTR].list.s if MIRRORS_ATTR in node.attr else []
                    static = table.get(mirrors[slot].decode()) if slot < len(mirrors) else None
            if static is not None:
                found = sized.get(id(static))
                if found is None:
                    if static.shape.rank is not None:
                        shape = shape_of(static.shape.as_list())
                        dtype = static.dtype
                        if static.shape.is_fully_defined() and dtype.is_numpy_compatible and dtype != tf.string:
                            nbytes = int(static.shape.num_elements()) * dtype.size
                    found = sized[id(static)] = (shape, nbytes)
                shape, nbytes = found
            tensors.append(TensorInfo(id=tid, op=name, dtype=dtypes[slot], shape=shape, nbytes=nbytes,
                                      consumers=tuple(consumers.get(tid, ())), persistent=persistent))
            outputs.append(tid)
        runs = always_runs(name)
        # Replayable: running it again on the same inputs gives the same bits. Not a stateful op (variables, random
        # ops with a hidden state), nor lowered or functional control flow, nor an op that may not run, nor one that
        # reads a resource or a variant (what a handle or a list refers to can change between the run and the replay).
        replayable = (not stateful and op not in FUNCTIONAL_OPS and op not in control_flow.CONTROL_FLOW_OPS
                      and runs and op not in ("_Arg", "_Retval")
                      and not any(_input_dtype(i) in ("resource", "variant") for i in ins))
        ops.append(OpInfo(
            name=name, type=op, inputs=tuple(ins), control_inputs=ctrl, outputs=tuple(outputs),
            role=_role(name, op, optimizer_scopes), stateful=stateful, replayable=replayable, always_runs=runs,
        ))
    # Inputs naming tensors of nodes that are not in this graph (should not happen in a post-optimization graph)
    # would make the model inconsistent: drop them with the check.
    known = {t.id for t in tensors}
    ops = [o if all(i in known for i in o.inputs) else
           dataclasses.replace(o, inputs=tuple(i for i in o.inputs if i in known)) for o in ops]
    return propagate_backward_roles(GraphModel.build(ops, tensors))


def graph_fingerprint(graph_def: graph_pb2.GraphDef) -> str:
    """A digest of a step's graph that is the same in every process that traces the same step: every node's name, op,
    inputs, device and attributes (so a model with other shapes, dtypes or hyperparameters differs), with the functions
    it calls (conds, loops) digested by content, since their names carry a per-process counter."""
    library = {f.signature.name: f for f in graph_def.library.function}
    memo: dict[str, str] = {}

    def attr_digest(value: attr_value_pb2.AttrValue) -> bytes:
        value = attr_value_pb2.AttrValue.FromString(value.SerializeToString())
        funcs = [value.func] if value.HasField("func") else list(value.list.func)
        for f in funcs:
            f.name = function_digest(f.name)
            for a in f.attr.values():
                a.CopyFrom(attr_value_pb2.AttrValue(s=attr_digest(a)))
        return value.SerializeToString(deterministic=True)

    def nodes_digest(h, nodes) -> None:
        for node in sorted(nodes, key=lambda n: n.name):
            h.update(f"{node.name}|{node.op}|{','.join(node.input)}|{node.device}".encode())
            for key in sorted(node.attr):
                h.update(key.encode() + b"=" + attr_digest(node.attr[key]) + b";")

    def function_digest(name: str) -> str:
        if name in memo:
            return memo[name]
        memo[name] = "<recursive>"
        f = library.get(name)
        h = hashlib.sha256()
        if f is None:
            h.update(name.encode())  # not in the library: a registered op or an outside function, by name
        else:
            sig = op_def_pb2.OpDef.FromString(f.signature.SerializeToString())
            sig.name = ""
            h.update(sig.SerializeToString(deterministic=True))
            nodes_digest(h, f.node_def)
            for k in sorted(f.ret):
                h.update(f"{k}->{f.ret[k]};".encode())
        memo[name] = h.hexdigest()
        return memo[name]

    h = hashlib.sha256()
    nodes_digest(h, graph_def.node)
    return h.hexdigest()
