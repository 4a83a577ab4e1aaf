"""Rewriting: a captured step's GraphDef, edited, back into a function on the same variables.

The one module that does FuncGraph surgery (private TensorFlow APIs). `rebuild(concrete, graph_def)` imports an edited
copy of the step's own (pre-optimization) GraphDef into a new FuncGraph that captures the same variable handles, and
returns a ConcreteFunction with the original calling convention and outputs (tf-notes.md, "Running a rewritten graph
on the same variables"). Graph edits are functions GraphDef -> GraphDef, each documented with a before/after sketch;
inserted nodes are named `capuchin/<kind>/<tensor>...`.
"""

from __future__ import annotations

import copy
import re
from typing import Callable

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2
from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.framework import importer
from tensorflow.python.util import nest

from capuchin_tf.graph_model import split_tensor_id

SWAPPABLE = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int16, tf.uint16,
                       tf.int32, tf.uint32, tf.int64, tf.uint64, tf.bool, tf.complex64, tf.complex128})


class RewriteError(RuntimeError):
    """The rewritten graph could not be built."""


def safe_name(tid: str) -> str:
    """A node-name-safe form of a tensor id: 'a/b:1' -> 'a/b_1'."""
    op, slot = split_tensor_id(tid)
    return re.sub(r"[^A-Za-z0-9_./-]", "_", f"{op}_{slot}")


def rebuild(concrete, graph_def: graph_pb2.GraphDef, name: str = "capuchin_step") -> ConcreteFunction:
    """A ConcreteFunction running `graph_def` (an edited copy of `concrete.graph.as_graph_def()`) on the same
    captured variables, with `concrete`'s inputs, outputs and structured outputs."""
    orig = concrete.graph
    captured_internal = {internal.name for _, internal in orig.captures}
    user_inputs = [t for t in orig.inputs if t.name not in captured_internal]
    mapped_nodes = {t.op.name for t in orig.inputs}
    body = graph_pb2.GraphDef()
    body.versions.CopyFrom(graph_def.versions)
    body.library.CopyFrom(graph_def.library)
    body.node.extend(n for n in graph_def.node if n.name not in mapped_nodes)

    fg = func_graph_module.FuncGraph(name)
    with fg.as_default():
        input_map = {}
        new_inputs = []
        for i, t in enumerate(user_inputs):
            ph = tf.compat.v1.placeholder(t.dtype, t.shape, name=f"capuchin_input_{i}")
            new_inputs.append(ph)
            input_map[t.name] = ph
        for external, internal in orig.captures:
            input_map[internal.name] = fg.capture(external, name=f"capuchin_capture_{len(input_map)}")
        output_names = [t.name for t in orig.outputs]
        control_names = [op.name for op in orig.control_outputs]
        try:
            imported = importer.import_graph_def(body, input_map=input_map,
                                                 return_elements=output_names + control_names, name="")
        except (ValueError, tf.errors.InvalidArgumentError) as e:
            raise RewriteError(f"the rewritten graph does not import: {e}") from e
        outputs = imported[: len(output_names)]
        controls = imported[len(output_names):]
    # Inputs: the user's placeholders first, then the captures (the calling convention of a ConcreteFunction).
    capture_phs = [fg.captures[i][1] for i in range(len(fg.captures))]
    fg.inputs = new_inputs + capture_phs
    fg.outputs = list(outputs)
    fg.structured_outputs = nest.pack_sequence_as(orig.structured_outputs, outputs, expand_composites=True)
    fg.control_outputs = list(controls)
    fg.variables = orig.variables
    fg.structured_input_signature = orig.structured_input_signature
    return ConcreteFunction.from_func_graph(fg, concrete.function_type, attrs={})


def _attr_type(dtype) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=tf.as_dtype(dtype).as_datatype_enum)


def _attr_shape(shape) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(shape=tf.TensorShape(shape).as_proto())


def _mark(node: node_def_pb2.NodeDef) -> None:
    node.attr["_grappler_do_not_remove"].CopyFrom(attr_value_pb2.AttrValue(b=True))


def insert_hold_get(graph_def: graph_pb2.GraphDef, readers: dict[str, list[str]], dtypes: dict, shapes: dict,
                    is_late: Callable[[str], bool]) -> graph_pb2.GraphDef:
    """Hands each tensor in `readers` to the pool right after it is produced and makes each listed reader read it
    through its own get, gated to run only when the reader's other inputs are ready.

    Before:                          After:
        P --t--> F (forward)             P --t--> F
          \\----> B (backward)             \\--> capuchin/hold/t --h--> capuchin/get/t/0 --t'--> B
                  ^ u                                                 ^ (ctrl: producer of u)   ^ u
    Once F has run, the pool holds t's only reference: passive mode can evict it, and the get brings it back.
    `readers`: tensor id -> names of the nodes to serve through gets; `is_late(node name)` tells the inputs that
    become ready late (backward ops). Inserted nodes: `capuchin/hold/<tensor>`, `capuchin/get/<tensor>/<k>`.
    """
    out = copy.deepcopy(graph_def)
    nodes = {n.name: n for n in out.node}
    for tid, consumer_names in readers.items():
        op, slot = split_tensor_id(tid)
        ref = op if slot == 0 else f"{op}:{slot}"
        base = f"capuchin/hold/{safe_name(tid)}"
        hold = out.node.add(name=base, op="Capuchin>Hold", input=[ref])
        hold.attr["T"].CopyFrom(_attr_type(dtypes[tid]))
        hold.attr["tensor_name"].CopyFrom(attr_value_pb2.AttrValue(s=tid.encode()))
        if nodes[op].device:
            hold.device = nodes[op].device
        _mark(hold)
        nodes[hold.name] = hold
        for k, cname in enumerate(consumer_names):
            consumer = nodes[cname]
            get = out.node.add(name=f"capuchin/get/{safe_name(tid)}/{k}", op="Capuchin>Get", input=[base])
            get.attr["dtype"].CopyFrom(_attr_type(dtypes[tid]))
            get.attr["shape"].CopyFrom(_attr_shape(shapes[tid]))
            _mark(get)
            nodes[get.name] = get
            # Gate on the reader's inputs that become ready late (backward ones): a gate on a forward producer
            # (FusedBatchNormGrad's reserve spaces, a variable read) is satisfied at once and would let the get run
            # early, holding a second reference that keeps the tensor from being evicted. A reader with no late input
            # (a gradient op recomputing from forward tensors) keeps gates on all its producers: gating it on ops
            # further downstream was tried and changed the numbers (a control consumer on a producer can stop
            # Grappler from fusing it; docs/decisions.md).
            producers = [inp.split(":")[0] for inp in consumer.input if not inp.startswith("^")]
            producers = [p for p in producers
                         if p != op and nodes[p].op not in ("Placeholder", "_Arg", "Const")]
            late = [p for p in producers if is_late(p) or nodes[p].op == "Capuchin>Get"]
            gates = list(dict.fromkeys(late or producers))
            get.input.extend(f"^{p}" for p in gates)
            for i, inp in enumerate(consumer.input):
                if inp == ref or (slot == 0 and inp == f"{op}:0"):
                    consumer.input[i] = get.name
    return out
