"""Function surgery: a captured step's optimized GraphDef, edited or not, back into a function on the same variables,
and run without a second Grappler pass. The one module that builds FuncGraphs and ConcreteFunctions (private
TensorFlow API).

`rebuild(concrete, graph_def)` imports the graph into a new FuncGraph that captures the same variable handles and
returns a ConcreteFunction with the original calling convention and outputs (docs/design/tf-notes.md, "Running a
rewritten graph on the same variables"); `call_without_grappler` runs it without a second Grappler pass, so that the
inserted nodes cannot change what Grappler does and the kernels are those plain TensorFlow runs (bit-for-bit results).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.client import pywrap_tf_session as c_api
from tensorflow.python.eager import context, record
from tensorflow.python.eager.polymorphic_function import atomic_function
from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.framework import importer, ops
from tensorflow.python.ops import gradients_util
from tensorflow.python.util import nest

from capuchin_tf.tf import capture


class RewriteError(RuntimeError):
    """The rewritten graph could not be built."""


def _function_body(concrete, graph_def: graph_pb2.GraphDef, device_args: bool
                   ) -> tuple[graph_pb2.GraphDef, dict[int, str], dict[int, str], list[str]]:
    """`graph_def` as the body of a function: its `_Arg` nodes made placeholders (on their devices with
    `device_args`), its `_Retval` nodes dropped, control edges from arguments dropped. Returns (the body, argument
    index -> placeholder name, result index -> tensor "node:slot", the names of the function's control outputs that
    are in it)."""
    orig = concrete.graph
    body = graph_pb2.GraphDef()
    body.versions.CopyFrom(graph_def.versions)
    body.library.CopyFrom(graph_def.library)
    args: dict[int, str] = {}
    rets: dict[int, str] = {}
    for node in graph_def.node:
        if node.op == "_Arg":
            ph = body.node.add(name=node.name, op="Placeholder", device=node.device if device_args else "")
            ph.attr["dtype"].CopyFrom(node.attr["T"])
            args[node.attr["index"].i] = node.name
        elif node.op == "_Retval":
            rets[node.attr["index"].i] = node.input[0] if ":" in node.input[0] else f"{node.input[0]}:0"
        else:
            body.node.add().CopyFrom(node)
    if sorted(args) != list(range(len(orig.inputs))) or sorted(rets) != list(range(len(orig.outputs))):
        raise RewriteError(f"the graph has arguments {sorted(args)} and results {sorted(rets)}; the function takes "
                           f"{len(orig.inputs)} inputs and returns {len(orig.outputs)} outputs")
    # Control edges from arguments mean nothing in a function (arguments are ready at the start); the placeholders
    # standing in for them are mapped away, so such edges would name a node nobody feeds.
    arg_names = set(args.values())
    for node in body.node:
        kept = [i for i in node.input if not (i.startswith("^") and i[1:] in arg_names)]
        if len(kept) != len(node.input):
            del node.input[:]
            node.input.extend(kept)
    present = {n.name for n in body.node}
    control_names = [op.name for op in orig.control_outputs if op.name in present]
    return body, args, rets, control_names


_RUNNABLE_NAMES = itertools.count()


class RunnableStep:
    """A captured step's optimized GraphDef, edited or not, as a function of the runtime, called as the step is.

    Made without a Python graph (`runnable`): the GraphDef is imported into a graph of the C API and made a function
    there, which is what `rebuild` costs in Python for every node (ResNet50's passive step: 0.52-0.71 s by `rebuild`,
    0.14-0.15 s this way). Calls take the step's own arguments and return its structured outputs; run it with
    `call_without_grappler`. It records no gradient: a call under a GradientTape that watches its inputs raises
    RewriteError (nothing has run)."""

    def __init__(self, concrete, atomic, graph_def: graph_pb2.GraphDef):
        self._concrete = concrete
        self.atomic = atomic
        n_user = len(concrete.graph.inputs) - len(concrete.graph.captures)
        self.input_dtypes = [t.dtype for t in concrete.graph.inputs[:n_user]]
        self.input_ranks = [t.shape.rank for t in concrete.graph.inputs[:n_user]]
        self.captured_inputs = list(concrete.captured_inputs)
        self.node_names = frozenset(n.name for n in graph_def.node)

    def flat_inputs(self, args, kwargs) -> list:
        """The flat tensors a call with `args` and `kwargs` passes (the step's inputs, then its captures)."""
        return capture.flat_call_inputs(self._concrete, args, kwargs)

    def __call__(self, *args, **kwargs):
        flat = self.flat_inputs(args, kwargs)
        if (record.could_possibly_record()
                and gradients_util.PossibleTapeGradientTypes(flat) != gradients_util.POSSIBLE_GRADIENT_TYPES_NONE):
            raise RewriteError("a gradient tape watches the step's inputs: capuchin_tf's rewritten step records no "
                               "gradients")
        return self.atomic.call_preflattened(flat)


def runnable(concrete, graph_def: graph_pb2.GraphDef, name: str = "capuchin_step") -> RunnableStep:
    """`graph_def` (the post-optimization graph of `concrete`, as is or edited; see `rebuild`) as a RunnableStep on
    `concrete`'s captured variables: its `_Arg` nodes (by index: the user's inputs, then the captures) are the
    function's inputs, its `_Retval` nodes its outputs, every node keeps the device its NodeDef names. Raises
    RewriteError when the graph does not import or does not make a function."""
    body, args, rets, control_names = _function_body(concrete, graph_def, device_args=True)
    graph = ops.Graph()
    options = c_api.TF_NewImportGraphDefOptions()
    try:
        for i in range(len(args)):
            c_api.TF_ImportGraphDefOptionsAddReturnOutput(options, args[i], 0)
        for i in range(len(rets)):
            node, _, slot = rets[i].rpartition(":")
            c_api.TF_ImportGraphDefOptionsAddReturnOutput(options, node, int(slot))
        for control in control_names:
            c_api.TF_ImportGraphDefOptionsAddReturnOperation(options, control)
        results = c_api.TF_GraphImportGraphDefWithResultsNoSerialization(graph._c_graph, body, options)
        try:
            outputs = c_api.TF_ImportGraphDefResultsReturnOutputs(results)
            controls = c_api.TF_ImportGraphDefResultsReturnOperations(results)
        finally:
            c_api.TF_DeleteImportGraphDefResults(results)
        fn_name = f"{name}_{next(_RUNNABLE_NAMES)}"
        c_fn = c_api.TF_GraphToFunction_wrapper(graph._c_graph, fn_name, False, None, outputs[:len(args)],
                                                outputs[len(args):], [], controls, [], None, "")
    except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError, ValueError) as e:
        raise RewriteError(f"the rewritten graph does not import: {e}") from e
    finally:
        c_api.TF_DeleteImportGraphDefOptions(options)
    ctx = context.context()
    for f in body.library.function:  # the conds and loops it calls
        if not ctx.has_function(f.signature.name):
            ctx.add_function_def(f)
    try:
        ctx.add_c_function(c_fn)
    finally:
        c_api.TF_DeleteFunction(c_fn)
    # The runtime's function, released when this object is (AtomicFunction counts its references).
    atomic = atomic_function.AtomicFunction(fn_name, ctx, concrete.function_type,
                                            call_options=atomic_function.CallOptions(is_stateful=True))
    return RunnableStep(concrete, atomic, graph_def)


def rebuild(concrete, graph_def: graph_pb2.GraphDef, name: str = "capuchin_step",
            input_shapes: Sequence | None = None) -> ConcreteFunction:
    """A ConcreteFunction running `graph_def` on `concrete`'s captured variables, with `concrete`'s inputs, outputs
    and structured outputs. `graph_def` is the post-optimization graph of `concrete` (capture.optimized_graph), as
    is or edited: its `_Arg` nodes (by index: the user's inputs, then the captures) become the new function's
    inputs, its `_Retval` nodes its outputs. Call the result with `call_without_grappler`: the graph is already
    optimized, and Grappler must not rewrite the nodes capuchin_tf inserted. `input_shapes`: static shapes for the
    user's inputs instead of the function's own (the step's real shapes, for a graph read only for its static
    shapes, when the function's input signature leaves dimensions open)."""
    orig = concrete.graph
    n_user = len(orig.inputs) - len(orig.captures)
    body, args, rets, control_names = _function_body(concrete, graph_def, device_args=False)
    fg = func_graph_module.FuncGraph(name)
    with fg.as_default():
        input_map = {}
        new_inputs = []
        for i in range(n_user):
            t = orig.inputs[i]
            shape = t.shape if input_shapes is None else input_shapes[i]
            ph = tf.compat.v1.placeholder(t.dtype, shape, name=f"capuchin_input_{i}")
            new_inputs.append(ph)
            input_map[f"{args[i]}:0"] = ph
        for j, (external, _) in enumerate(orig.captures):
            input_map[f"{args[n_user + j]}:0"] = fg.capture(external, name=f"capuchin_capture_{j}")
        output_names = [rets[i] for i in range(len(rets))]
        # The importer applies each node's device through a device scope of its own, which costs a Python context
        # manager and a signature inspection per node (0.99 s of a 4.4 s install on bert-4l, profiled).
        # With no device scope around, that scope sets exactly the device string: the nodes are imported without
        # their devices, then each gets its own back (docs/decisions.md, "What a plan change costs").
        devices = _strip_devices(body) if not fg._device_functions_outer_to_inner else None
        try:
            imported = importer.import_graph_def(body, input_map=input_map,
                                                 return_elements=output_names + control_names, name="")
        except (ValueError, tf.errors.InvalidArgumentError) as e:
            raise RewriteError(f"the rewritten graph does not import: {e}") from e
        if devices:
            _restore_devices(fg, devices)
        outputs = imported[: len(output_names)]
        controls = imported[len(output_names):]
    # Inputs: the user's placeholders first, then the captures (the calling convention of a ConcreteFunction).
    fg.inputs = new_inputs + [fg.captures[i][1] for i in range(len(fg.captures))]
    fg.outputs = list(outputs)
    fg.structured_outputs = nest.pack_sequence_as(orig.structured_outputs, outputs, expand_composites=True)
    fg.control_outputs = list(controls)
    fg.variables = orig.variables
    fg.structured_input_signature = orig.structured_input_signature
    return ConcreteFunction.from_func_graph(fg, concrete.function_type, attrs={})


def device_scope_around() -> bool:
    """Whether a function built in this thread now gets a device scope from around it (`tf.device` in effect): a
    function built in another thread would not."""
    return bool(func_graph_module.FuncGraph("capuchin_probe")._device_functions_outer_to_inner)


def _strip_devices(body: graph_pb2.GraphDef) -> dict[str, str]:
    """Clears the device of every node of `body`; returns node name -> the device it had."""
    devices = {}
    for node in body.node:
        if node.device:
            devices[node.name] = node.device
            node.device = ""
    return devices


def _canonical_device(device: str, cache: dict[str, str]) -> str:
    """The device string the importer's own device scope would give a node with `device` (no scope around)."""
    if device not in cache:
        with tf.Graph().as_default(), tf.device(device):
            cache[device] = tf.raw_ops.NoOp().device
    return cache[device]


def _restore_devices(fg, devices: dict[str, str]) -> None:
    """Gives each imported op of `fg` its node's device (`devices`: node name -> device) as the importer's device
    scope would have; an op colocated with others takes the device of the first of them that has one, as in
    importer._ProcessNewOps."""
    cache: dict[str, str] = {}
    colocated = {}
    for op in fg.get_operations():
        names = _colocation_names(op)
        if names:
            colocated[op] = names
        elif devices.get(op.name):
            op._set_device_from_string(_canonical_device(devices[op.name], cache))
    for op, names in colocated.items():
        for name in names:
            try:
                device = fg.get_operation_by_name(name).device
            except KeyError:
                continue
            if device:
                op._set_device_from_string(tf.DeviceSpec.from_string(device).to_string())
                break


def _colocation_names(op) -> list[str]:
    """The ops `op` is colocated with (its `_class` attribute), as importer._GetColocationNames reads them."""
    try:
        groups = op.get_attr("_class")
    except ValueError:
        return []
    return [g.decode()[len("loc:@"):] for g in groups if g.startswith(b"loc:@") and g.decode()[5:] != op.name]


@contextlib.contextmanager
def grappler_off():
    """Functions first called inside run without Grappler (the call options are per call and per thread; a
    function is instantiated once per distinct options, so later calls inside find the same instantiation)."""
    with capture.call_config(lambda config: setattr(config.graph_options.rewrite_options, "disable_meta_optimizer",
                                                      True)):
        yield


def call_without_grappler(fn, *args):
    """`fn(*args)` for a function made by `runnable` or `rebuild`: its graph is already optimized."""
    with grappler_off():
        return fn(*args)


def arg_specs(args) -> tuple | None:
    """(dtype, device) of each flat tensor argument of a call with `args`, the part of a call that decides which
    instantiation of a function it runs (its shapes do not); None when an argument is not a tensor."""
    flat = nest.flatten(args, expand_composites=True)
    if not all(isinstance(t, tf.Tensor) for t in flat):
        return None
    return tuple((t.dtype, t.device) for t in flat)


def preinstantiate(fn: RunnableStep, specs: tuple | None) -> bool:
    """Instantiates `fn` (made by `runnable`) for calls whose arguments are like `specs` (arg_specs) without running
    it, so that its first call runs almost at once: TensorFlow instantiates a function (placement, the graph passes,
    partitioning) at its first call and keeps the instantiation for later calls with the same options and
    arguments' devices and dtypes; the executor and its kernels are still made at the first real call. The call is
    made with empty tensors of the arguments' dtypes and devices and a
    cancellation manager cancelled beforehand: the eager runtime instantiates the function and caches the kernel,
    then the function runtime refuses to start a cancelled call ("Function was cancelled before it was started",
    FunctionLibraryRuntimeImpl::Run) and no node runs. False, with nothing done, when the arguments are not all
    tensors of the function's inputs' dtypes, or one is a resource or a variant (their handles' shapes are part of
    the instantiation). Raises RewriteError if the instantiation fails (the function could not run either) or if
    the call was not refused."""
    if specs is None:
        return False
    if len(specs) != len(fn.input_dtypes) or any(dtype != d or dtype in (tf.resource, tf.variant)
                                                 for (dtype, _), d in zip(specs, fn.input_dtypes)):
        return False
    atomic = fn.atomic
    with grappler_off():  # the call options the step's own calls have (call_without_grappler)
        # Not while another thread reads a graph from the context's run metadata (capture.INSTANTIATION_LOCK), and
        # the empty arguments made under the lock too: an eager op's first run instantiates a function of its own.
        with capture.INSTANTIATION_LOCK:
            empty = []
            for (dtype, device), rank in zip(specs, fn.input_ranks):
                shape = [0] * (rank or 0)
                with tf.device(device):
                    empty.append(tf.fill(shape, "") if dtype == tf.string else tf.zeros(shape, dtype))
            try:
                refused = capture.instantiate_without_running(
                    atomic.name.decode(), len(atomic.function_type.flat_outputs), empty + list(fn.captured_inputs))
            except tf.errors.OpError as e:
                raise RewriteError(f"the rebuilt step does not instantiate: {e.message}") from e
    if refused:
        return True
    raise RewriteError("a cancelled call of the rebuilt step was not refused")
