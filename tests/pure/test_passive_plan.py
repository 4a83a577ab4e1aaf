"""What passive mode hands to the pool and when the Gets run (capuchin_tf.core.pool_plan), and the order the measured
step
is made to follow (capuchin_tf.core.schedule): no TensorFlow."""

import dataclasses

import pytest

from capuchin_tf.core.graph_model import GraphModel, OpInfo, Role, TensorInfo
from capuchin_tf.core.pool_plan import GUIDED_MIN_POOLED_BYTES, PooledRead, hold_plan
from capuchin_tf.core.schedule import deferral_gates, schedule_order, small_tensor_peak

MB = 1 << 20


def graph(spec, persistent=(), dtypes=None, sizes=None, controls=None):
    """spec: op name -> (type, input tensor ids); every op has one output `<op>:0` of 1 MiB float32."""
    consumers = {}
    for name, (_, inputs) in spec.items():
        for t in inputs:
            consumers.setdefault(t, []).append(name)
    ops, tensors = [], []
    for name, (op_type, inputs) in spec.items():
        role = Role.BACKWARD if name.startswith("grad") else Role.FORWARD
        ops.append(OpInfo(name, op_type, tuple(inputs), tuple((controls or {}).get(name, ())), (f"{name}:0",), role))
        tensors.append(TensorInfo(f"{name}:0", name, dtype=(dtypes or {}).get(name, "float32"),
                                  nbytes=(sizes or {}).get(name, MB), consumers=tuple(consumers.get(f"{name}:0", ())),
                                  persistent=name in persistent))
    return GraphModel.build(ops, tensors)


def chain_with_backward():
    """x -> f1 -> f2 -> f3 -> loss; g3 reads loss and f2, g2 reads g3 and f1, g1 reads g2 and x."""
    return graph({
        "x": ("_Arg", ()),
        "f1": ("MatMul", ("x:0",)),
        "f2": ("Relu", ("f1:0",)),
        "f3": ("MatMul", ("f2:0",)),
        "loss": ("Sum", ("f3:0",)),
        "grad3": ("ReluGrad", ("loss:0", "f2:0")),
        "grad2": ("MatMul", ("grad3:0", "f1:0")),
        "grad1": ("MatMul", ("grad2:0", "x:0")),
    }, persistent={"x"})


def test_schedule_is_first_in_first_out_over_ready_ops():
    g = graph({
        "a": ("Const", ()), "b": ("Const", ()),
        "a1": ("Neg", ("a:0",)), "b1": ("Neg", ("b:0",)),
        "a2": ("Neg", ("a1:0",)), "join": ("AddV2", ("a2:0", "b1:0")),
    })
    # breadth first: both sources, then both of their readers, then a2, then the join
    assert schedule_order(g) == ["a", "b", "a1", "b1", "a2", "join"]


def test_schedule_follows_control_edges_and_ignores_loop_back_edges():
    g = graph({
        "a": ("Const", ()), "b": ("Const", ()),
        "merge": ("Merge", ("a:0", "next:0")),
        "body": ("Neg", ("merge:0",)),
        "next": ("NextIteration", ("body:0",)),
    }, controls={"a": ("b",)})
    order = schedule_order(g)
    assert order.index("b") < order.index("a") < order.index("merge") < order.index("body") < order.index("next")


def test_the_small_tensor_peak_counts_small_transients_live_at_once_in_the_schedule():
    KB = 1 << 10
    g = graph({
        "w": ("ReadVariableOp", ()),
        "x": ("_Arg", ()),
        "a": ("Mean", ("x:0",)),  # 1000 bytes, rounded up to 1024; read last by d
        "b": ("Relu", ("x:0",)),  # 1 MiB: not small
        "v": ("Reshape", ("a:0",)),  # a view of a: reading it reads a
        "c": ("Mean", ("b:0",)),  # 10 KiB, read by d
        "d": ("AddV2", ("v:0", "c:0")),  # 64 KiB: the largest small tensor, freed at once (no reader)
        "e": ("Sum", ("w:0",)),  # 100 bytes, after d frees everything: 256
        "p": ("Mean", ("w:0",)),  # persistent: nothing
    }, persistent={"p"}, sizes={"a": 1000, "c": 10 * KB, "d": 64 * KB, "e": 100, "w": 512, "p": 4 * KB, "v": 1000})
    assert schedule_order(g) == ["w", "x", "e", "p", "a", "b", "v", "c", "d"]
    # at d: a (1024, through the view), c (10 KiB), d itself (64 KiB) and e (made early, never read: freed at once)
    assert small_tensor_peak(g) == 1024 + 10 * KB + 64 * KB
    # a larger largest small tensor: b counts too, and it is live from its producer to c
    assert small_tensor_peak(g, max_bytes=MB) == 1024 + MB + 10 * KB


def test_the_small_tensor_peak_of_a_loop_is_not_known():
    g = graph({
        "a": ("Const", ()), "merge": ("Merge", ("a:0", "next:0")), "body": ("Neg", ("merge:0",)),
        "next": ("NextIteration", ("body:0",)),
    }, sizes={"body": 1024})
    assert small_tensor_peak(g) is None


def test_schedule_rejects_a_real_cycle():
    g = graph({"a": ("Neg", ("b:0",)), "b": ("Neg", ("a:0",))})
    with pytest.raises(ValueError, match="cycle"):
        schedule_order(g)


def test_forward_tensors_read_by_the_backward_pass_are_held_and_their_gets_run_just_before_the_reader():
    g = chain_with_backward()
    plan = hold_plan(g, min_bytes=MB)
    order = schedule_order(g)
    # f1 is read next by f2 (near: direct) and later by grad2 (far); f2 by f3 (direct) and grad3 (far)
    assert set(plan) == {"f1:0", "f2:0"}
    assert plan["f1:0"] == [PooledRead("grad2", (order[order.index("grad2") - 1],))]
    assert plan["f2:0"] == [PooledRead("grad3", (order[order.index("grad3") - 1],))]
    # a gate always precedes its reader in a topological order: no cycle can follow
    for reads in plan.values():
        for r in reads:
            assert all(order.index(gate) < order.index(r.reader) for gate in r.gates)


def test_what_is_not_held():
    g = graph({
        "x": ("_Arg", ()),
        "small": ("MatMul", ("x:0",)),
        "ints": ("Cast", ("x:0",)),
        "res": ("Neg", ("x:0",)),
        "f": ("MatMul", ("x:0",)),
        "mid1": ("Neg", ("f:0",)), "mid2": ("Neg", ("mid1:0",)), "mid3": ("Neg", ("mid2:0",)),
        "late": ("AddN", ("small:0", "ints:0", "res:0", "mid3:0")),
        "out": ("_Retval", ("res:0",)),
    }, persistent={"x"}, dtypes={"ints": "string"}, sizes={"small": 1024, "out": 0})
    plan = hold_plan(g, min_bytes=MB)
    # persistent x, a tensor under min_bytes, a dtype the host store cannot copy, a function result: not held
    assert set(plan) == set()
    assert GUIDED_MIN_POOLED_BYTES >= 1024


def test_a_reader_is_far_only_when_memory_is_allocated_while_the_tensor_waits():
    spec = {
        "x": ("_Arg", ()),
        "t": ("MatMul", ("x:0",)),
        "other": ("MatMul", ("x:0",)),  # produced between t and its reader in the estimate
        "reader": ("AddV2", ("t:0", "other:0")),
    }
    assert hold_plan(graph(spec, persistent={"x"}), min_bytes=MB)  # 1 MiB produced meanwhile: far
    assert not hold_plan(graph(spec, persistent={"x"}, sizes={"other": MB // 2}), min_bytes=MB)  # near


def head_graph(**extra_sizes):
    """A masked-LM head in miniature: the gradient of the label gather (grad_seg, 20 MiB) reads only the labels, so
    the executor can run it first; the log-softmax gradient needs it only at the end."""
    sizes = {"grad_seg": 20 * MB, "logits": 20 * MB, "logsm": 20 * MB, "grad_exp": 20 * MB, "grad_mul": 20 * MB,
             "grad_sub": 20 * MB, "f1": 4 * MB, "f2": 4 * MB, "grad_sum": 1024, "gather": 1024, "loss": 4,
             **extra_sizes}
    return graph({
        "x": ("_Arg", ()), "labels": ("_Arg", ()),
        "grad_seg": ("UnsortedSegmentSum", ("labels:0",)),
        "grad_sum": ("Sum", ("grad_seg:0",)),
        "f1": ("MatMul", ("x:0",)), "f2": ("Relu", ("f1:0",)),
        "logits": ("MatMul", ("f2:0",)), "logsm": ("LogSoftmax", ("logits:0",)),
        "gather": ("GatherV2", ("logsm:0", "labels:0")), "loss": ("Neg", ("gather:0",)),
        "grad_exp": ("Exp", ("logsm:0",)), "grad_mul": ("Mul", ("grad_exp:0", "grad_sum:0")),
        "grad_sub": ("Sub", ("grad_seg:0", "grad_mul:0")),
        "grad_w": ("MatMul", ("grad_sub:0", "f2:0")),
    }, persistent={"x", "labels"}, sizes=sizes)


def with_gates(g, gates):
    ops = [dataclasses.replace(op, control_inputs=op.control_inputs + tuple(gates.get(op.name, ())))
           for op in g.ops.values()]
    return GraphModel.build(ops, list(g.tensors.values()))


def test_gradient_ops_ready_early_are_deferred_to_just_before_their_first_reader():
    g = head_graph()
    before = schedule_order(g)
    assert before.index("grad_seg") < before.index("f2")  # ready at once: it reads only the labels
    gates = deferral_gates(g, min_bytes=MB)
    # grad_sum moves with it (it reads grad_seg), and both wait for the op before grad_mul, their first reader;
    # grad_exp, ready as soon as the log-softmax is, waits for the gather, the log-softmax's forward reader
    assert set(gates) == {"grad_seg", "grad_sum", "grad_exp"} and gates["grad_exp"] == ("gather",)
    after = schedule_order(with_gates(g, gates))  # still an order: no cycle
    assert after.index("gather") < after.index("grad_seg") < after.index("grad_sum") < after.index("grad_mul")
    # the head now holds two 20 MiB tensors where it held three: grad_seg is no longer alive at the log-softmax,
    # and grad_exp reads the log-probabilities last (it can compute in place)
    assert after.index("logsm") < after.index("grad_seg")
    assert after.index("gather") < after.index("grad_exp")


def test_an_early_gradient_op_is_not_deferred_when_that_keeps_a_larger_input_alive():
    g = graph({
        "x": ("_Arg", ()),
        "big": ("MatMul", ("x:0",)),
        "grad_small": ("Sum", ("big:0",)),  # backward, ready early; its input dies as soon as it has run
        "f1": ("MatMul", ("x:0",)), "f2": ("Relu", ("f1:0",)), "f3": ("Relu", ("f2:0",)),
        "loss": ("Sum", ("f3:0",)),
        "grad_late": ("AddV2", ("loss:0", "grad_small:0")),
    }, persistent={"x"}, sizes={"big": 20 * MB, "grad_small": MB, "f1": 4 * MB, "f2": 4 * MB, "f3": 4 * MB})
    assert deferral_gates(g, min_bytes=MB) == {}
    # with the input smaller than the output it is deferred
    g2 = graph({name: (op.type, op.inputs) for name, op in g.ops.items()}, persistent={"x"},
               sizes={"big": MB, "grad_small": 2 * MB, "f1": 4 * MB, "f2": 4 * MB, "f3": 4 * MB})
    assert set(deferral_gates(g2, min_bytes=MB)) == {"grad_small"}


def test_a_get_also_waits_for_the_producers_of_its_readers_other_inputs():
    # grad2 reads f1 (pooled) and grad3; in the estimate the op just before grad2 is `early`, which the executor may
    # run long before grad2 (it reads only x): the Get must not run then, so it waits for grad3 too.
    g = graph({
        "x": ("_Arg", ()),
        "f1": ("MatMul", ("x:0",)), "f2": ("Relu", ("f1:0",)), "f3": ("MatMul", ("f2:0",)),
        "loss": ("Sum", ("f3:0",)),
        "grad3": ("ReluGrad", ("loss:0", "f2:0")),
        "early": ("Neg", ("x:0",)),
        "grad2": ("MatMul", ("grad3:0", "f1:0", "early:0")),
    }, persistent={"x"}, controls={"early": ("grad3",)})
    order = schedule_order(g)
    plan = hold_plan(g, min_bytes=MB)
    (read,) = plan["f1:0"]
    assert read.reader == "grad2" and read.gates[0] == order[order.index("grad2") - 1]
    assert set(read.gates) == {order[order.index("grad2") - 1], "grad3", "early"}
    assert "x" not in read.gates  # an argument is always ready: no gate
