"""The plan rewriter (rewrite.apply_plan): a measured step's plan turned into a step that swaps and recomputes for
real, on the same variables, with plain TensorFlow's numbers bit for bit.

The step runs on the test device (enough memory): what is checked here is the graph surgery and the numbers; the
budget is the planner's, and the guided step's BFC peak is compared with it.
"""

import hashlib

import numpy as np
import pytest
import tensorflow as tf

import capuchin_tf  # noqa: F401  (loads the op library)
from capuchin_tf.cli import models
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.policy import make_plan
from capuchin_tf.tf import capture, function_surgery, measure, ops, rewrite

MODEL, BATCH, STEPS = "cnn", 32, 3
MiB = 1 << 20


def digest(setup):
    h = hashlib.sha256()
    for v in setup.variables:
        h.update(np.asarray(v.numpy()).tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def plain():
    setup = models.build(MODEL, BATCH)
    losses = [float.hex(float(setup.train_step(*setup.inputs))) for _ in range(STEPS)]
    return losses, digest(setup)


@pytest.mark.parametrize("policy", ["swap-only", "recompute-only", "capuchin"])
def test_guided_steps_follow_the_plan_and_give_plain_tensorflows_bits(plain, policy):
    setup = models.build(MODEL, BATCH)
    loss, trace = measure.measure_step(setup.train_step, setup.inputs)
    budget = int(trace.persistent_bytes + 0.75 * (trace.peak_bytes - trace.persistent_bytes))
    plan = make_plan(trace, budget, policy, DeviceModel.from_link("native", trace))
    assert plan.decisions, plan.summary()

    concrete = setup.train_step.get_concrete_function()
    optimized = capture.optimized_graph(concrete, setup.inputs)
    shaped = function_surgery.rebuild(concrete, optimized).graph
    tensors = {d.tensor: shaped.get_tensor_by_name(d.tensor) for d in plan.decisions}
    dtypes = {t: v.dtype.name for t, v in tensors.items()}
    shapes = {t: tuple(-1 if x is None else x for x in v.shape.as_list()) for t, v in tensors.items()}
    rewritten = rewrite.apply_plan(optimized, plan, trace, dtypes, shapes)
    # Views read through are cloned under the inserted node's name (`<name>/view/<view op>`): not counted here.
    names = {n.name for n in rewritten.node if "/view/" not in n.name}
    assert sum(n.startswith("capuchin/swap_out/") for n in names) == len(plan.swaps)
    assert sum(n.startswith("capuchin/swap_in/") for n in names) == len(plan.swaps)
    assert (sum(n.startswith("capuchin/recompute/") for n in names)
            == sum(len(d.replay_ops) for d in plan.recomputes))
    # The plan's editor going on into the pool (what a guided step is made of) makes the graph a fresh editor makes.
    assert rewrite.guided_graph(optimized, plan, trace, dtypes, shapes, shaped) == rewrite.pooled(rewritten, shaped)
    guided = function_surgery.runnable(concrete, rewritten)

    losses = [float.hex(float(loss))]
    before = ops.host_store_stats()
    peaks = []
    for _ in range(STEPS - 1):
        tf.config.experimental.reset_memory_stats("CPU:0")
        losses.append(float.hex(float(function_surgery.call_without_grappler(guided, *setup.inputs))))
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    after = ops.host_store_stats()

    assert (losses, digest(setup)) == plain
    assert after["swap_outs"] - before["swap_outs"] == (STEPS - 1) * len(plan.swaps)
    assert after["live_handles"] == 0  # every swapped tensor came back and its handle was consumed
    # the executed order is the measured one, so the guided peak is the planned one, not plain TensorFlow's
    assert max(peaks) < trace.peak_bytes
    assert max(peaks) <= 1.10 * max(budget, plan.predicted_peak_bytes)


def test_a_graph_model_with_the_control_inputs_an_editor_added_is_the_model_of_the_edited_graph():
    """The passive graph's deferral gates are control edges only: GraphModel.with_control_inputs of what the editor
    added is what capture.graph_model reads from the gated graph (rewrite.pooled relies on it instead of a second
    pass over the graph)."""
    from capuchin_tf.core.schedule import deferral_gates

    setup = models.build("transformer", 8)
    concrete = setup.train_step.get_concrete_function()
    optimized = capture.optimized_graph(concrete, setup.inputs)
    shaped = rewrite.shapes_graph(concrete, optimized, setup.inputs)
    model = capture.graph_model(optimized, shaped)
    gates = deferral_gates(model)
    ed = rewrite.GraphEditor(optimized)
    rewrite.add_gates(ed, gates)
    assert sum(map(len, ed.added_controls.values())) > 0, gates  # something to compare
    assert model.with_control_inputs(ed.added_controls) == capture.graph_model(ed.graph, shaped)
    assert model.with_control_inputs(ed.added_controls) != model


def test_a_read_through_views_reads_clones_of_the_views_on_the_new_tensor():
    """t -> Reshape r -> ExpandDims e -> sub: rewired to t', sub reads clones of r and e made on t' (the originals
    stay for their other readers), and a direct reader of t reads t' itself."""
    from tensorflow.core.framework import graph_pb2

    g = graph_pb2.GraphDef()
    for name, op, inputs in [("t", "Const", []), ("shape", "Const", []), ("axis", "Const", []), ("x", "Const", []),
                             ("r", "Reshape", ["t", "shape"]), ("e", "ExpandDims", ["r", "axis"]),
                             ("sub", "Sub", ["e", "x", "^x"]), ("neg", "Neg", ["t:0"]), ("t2", "Const", []),
                             ("new", "Identity", ["t2"])]:
        g.node.add(name=name, op=op, input=inputs)
    ed = rewrite.GraphEditor(g)
    nodes = ed.nodes
    assert rewrite._reads(nodes, nodes["sub"], "t:0") and not rewrite._reads(nodes, nodes["neg"], "x:0")
    rewrite._rewire(ed, nodes["sub"], "t:0", "new", "capuchin/swap_in/t_0")
    rewrite._rewire(ed, nodes["neg"], "t:0", "new", "capuchin/swap_in/t_0")
    assert list(nodes["sub"].input) == ["capuchin/swap_in/t_0/view/e", "x", "^x"]
    assert list(nodes["capuchin/swap_in/t_0/view/e"].input) == ["capuchin/swap_in/t_0/view/r", "axis"]
    assert list(nodes["capuchin/swap_in/t_0/view/r"].input) == ["new", "shape"]
    assert list(nodes["neg"].input) == ["new"]
    assert list(nodes["r"].input) == ["t", "shape"]  # the original views are untouched



def test_assignments_in_place_keep_what_the_planner_knows_of_them():
    """rewrite.assignments_in_place: AssignVariableOp of a copyable dtype becomes Capuchin>AssignInPlace (same name,
    inputs, dtype), a string variable's stays; the new op is still a variable write to the graph model (optimizer
    role) and to the schedule (BatchNormalization's statistics are deferred as writes); same numbers."""
    from capuchin_tf.core import schedule

    w = tf.Variable(tf.ones([3]))
    s = tf.Variable("a")

    @tf.function
    def step(x):
        w.assign(w * x)
        s.assign("b")
        return tf.reduce_sum(w)

    x = tf.constant(2.0)
    concrete = step.get_concrete_function(x)
    graph_def = capture.optimized_graph(concrete, (x,))
    edited, changed = rewrite.assignments_in_place(graph_def)
    before = {n.name: n for n in graph_def.node}
    after = {n.name: n for n in edited.node}
    assert changed == 1
    (name,) = [n for n, node in after.items() if node.op == "Capuchin>AssignInPlace"]
    assert before[name].op == "AssignVariableOp" and list(after[name].input) == list(before[name].input)
    assert after[name].attr["dtype"].type == tf.float32.as_datatype_enum
    assert [n.op for n in edited.node if n.op == "AssignVariableOp"] == ["AssignVariableOp"]  # the string's
    assert schedule.is_variable_writer("Capuchin>AssignInPlace")
    model = capture.graph_model(edited)
    assert model.ops[name].role.name == "OPTIMIZER"
    fn = function_surgery.runnable(concrete, edited)
    assert float(function_surgery.call_without_grappler(fn, x)) == 6.0 and w.numpy().tolist() == [2.0, 2.0, 2.0]
    assert s.numpy() == b"b"


def test_a_rebuilt_step_places_every_op_as_the_importers_own_device_scopes_do(monkeypatch):
    """rebuild imports the nodes without their devices and gives each its own back (a device scope per node costs
    about 1 s of a plan change on bert-4l): every op of the rebuilt function, inserted pool ops included, has the
    device and colocation the importer's own path gives it."""
    setup = models.build(MODEL, BATCH)
    concrete = setup.train_step.get_concrete_function()
    optimized = capture.optimized_graph(concrete, setup.inputs)
    pooled = rewrite.pooled(optimized, function_surgery.rebuild(concrete, optimized).graph)
    fast = function_surgery.rebuild(concrete, pooled)
    monkeypatch.setattr(function_surgery, "_strip_devices", lambda body: None)
    slow = function_surgery.rebuild(concrete, pooled)

    def placed(fn):
        return {op.name: (op.device, tuple(op.colocation_groups())) for op in fn.graph.get_operations()}

    fast_ops, slow_ops = placed(fast), placed(slow)
    assert fast_ops == slow_ops
    assert sum(bool(device) for device, _ in fast_ops.values()) > len(fast_ops) // 2  # devices are there to compare


def test_a_runnable_step_runs_its_graph_def_as_given_on_the_same_variables():
    """function_surgery.runnable: the executor runs the GraphDef's own nodes (names, inputs, devices; its arguments
    keep their names), the step's structured outputs come back, and a call under a tape that watches its inputs is
    refused before anything runs."""
    w = tf.Variable(tf.ones([3]))

    @tf.function
    def step(x):
        w.assign_add(x)
        return {"sum": tf.reduce_sum(w * x), "x": x}

    x = tf.constant([1.0, 2.0, 3.0])
    concrete = step.get_concrete_function(x)
    optimized = capture.optimized_graph(concrete, (x,))
    fn = function_surgery.runnable(concrete, optimized)
    out, executed = capture.run_with_post_optimization_graph(
        lambda: function_surgery.call_without_grappler(fn, x), fn.node_names)
    assert set(out) == {"sum", "x"} and float(out["sum"]) == 2 * 1 + 3 * 2 + 4 * 3
    assert w.numpy().tolist() == [2.0, 3.0, 4.0]
    given = {n.name: (n.op, tuple(n.input), n.device) for n in optimized.node}
    ran = {n.name: (n.op, tuple(n.input), n.device) for n in executed.node}
    assert {name: given[name] for name in ran if name in given} == {name: ran[name] for name in ran if name in given}
    assert {n.name for n in optimized.node if n.op == "_Arg"} <= set(ran)
    with tf.GradientTape() as tape:
        tape.watch(x)
        with pytest.raises(function_surgery.RewriteError, match="gradient tape"):
            fn(x)
    assert w.numpy().tolist() == [2.0, 3.0, 4.0]


PREINSTANTIATE = """
import json
import numpy as np
import tensorflow as tf
import capuchin_tf
from capuchin_tf.tf import capture, function_surgery

n = 1 << 18
big = np.arange(n, dtype=np.float32) % 7


def make():
    v, runs = tf.Variable(tf.zeros([n])), tf.Variable(0)

    @tf.function
    def step(x):
        runs.assign_add(1)
        v.assign_add(x * tf.reduce_sum(tf.constant(big) * x[0]))
        return tf.reduce_sum(v)
    return v, runs, step


x = tf.ones([n])
v, runs, step = make()
concrete = step.get_concrete_function(x)
fn = function_surgery.runnable(concrete, capture.optimized_graph(concrete, (x,)))
done = function_surgery.preinstantiate(fn, function_surgery.arg_specs((x,)))
untouched = bool(np.all(v.numpy() == 0)) and int(runs.numpy()) == 0
rebuilt = [float.hex(float(function_surgery.call_without_grappler(fn, x))) for _ in range(2)]
_, _, plain_step = make()
plain = [float.hex(float(plain_step(x))) for _ in range(2)]
skipped = function_surgery.preinstantiate(fn, function_surgery.arg_specs((np.ones(3, np.float32),)))
print(json.dumps({"done": done, "untouched": untouched, "rebuilt": rebuilt, "plain": plain, "skipped": skipped}))
"""


def test_a_rebuilt_step_is_instantiated_before_its_first_call_without_running_anything(simulated_device):
    # A cancelled call instantiates the function and runs no node: neither variable the step updates has changed;
    # the calls after give plain TensorFlow's bits.
    r = simulated_device(PREINSTANTIATE, limit_mb=256)
    assert r["done"] and r["untouched"], r
    assert r["rebuilt"] == r["plain"], r
    assert r["skipped"] is False  # arguments that are not tensors: nothing done


GRAPH_READ_BESIDE_INSTANTIATIONS = """
import collections
import contextlib
import json
import os
import threading
import time
import tensorflow as tf
from capuchin_tf.tf import capture, function_surgery

mode = os.environ["GRAPH_READ_MODE"]
if mode == "unlocked":  # what the lock prevents, for the test to see it happen
    capture.INSTANTIATION_LOCK = contextlib.nullcontext()
counts = collections.Counter()
merged_graph = capture.merged_graph


def counted(graph):  # every read graph checked, and how many were merged before a read again
    why = merged_graph(graph)
    counts["detected"] += why is not None
    return why


capture.merged_graph = counted
v = tf.Variable(tf.ones([64, 64]))


@tf.function
def step(x):
    y = x
    for _ in range(20):
        y = tf.nn.relu(tf.matmul(y, v))
    v.assign_sub(0.01 * tf.reduce_mean(y) * tf.ones_like(v))
    return tf.reduce_sum(y)


args = (tf.ones([8, 64]),)
concrete = capture.concrete_step(step, args)
graph = capture.optimized_graph(concrete, args)
own = sorted(n.name for n in graph.node)
specs = function_surgery.arg_specs(args)
stop = threading.Event()


def build_plans():  # a plan change built in the background instantiates a new function, again and again
    while not stop.is_set():
        function_surgery.preinstantiate(function_surgery.runnable(concrete, graph), specs)


def users_functions():  # the user's own thread calls functions it has just made (each one instantiated anew)
    i = 0
    while not stop.is_set():
        i += 1
        k = float(i)
        try:
            tf.function(lambda a: a * k + 1.0)(tf.constant([1.0, 2.0]))
        except tf.errors.CancelledError:  # TensorFlow's get_cancelable_function cancels every thread's calls
            counts["user_cancelled"] += 1
        counts["user_calls"] += 1
        time.sleep(0.002)


thread = threading.Thread(target=users_functions if mode == "user-thread" else build_plans)
thread.start()
try:
    while counts["read"] < 30 or (mode == "unlocked" and not counts["detected"] and counts["read"] < 200):
        counts["read"] += 1
        try:
            read = capture.optimized_graph(concrete, args)
        except capture.MergedGraphError:  # merged in every attempt: a clear error
            counts["refused"] += 1
        else:
            counts["own" if sorted(n.name for n in read.node) == own else "wrong"] += 1
finally:
    stop.set()
    thread.join()
print(json.dumps(counts))
"""


@pytest.mark.parametrize("mode", ["locked", "unlocked", "user-thread"])
def test_a_graph_read_while_another_thread_instantiates_is_the_steps_own(simulated_device, mode):
    # A plan change built in the background (function_surgery.preinstantiate) while another signature or managed step
    # reads its optimized graph from the context's run metadata (capture.optimized_graph): without the lock the read
    # graph had the other function's nodes merged in (duplicate names; seen on ResNet50 with several managed steps in
    # one process: the step was refused and ran as plain TensorFlow). Locked, a graph the collector held from before the
    # read (the background's, instantiated with run metadata off) is dropped when the read begins (seen in CI: 1 of 30
    # merged with the lock alone). Unlocked, the test shows merges still happen and are caught (the graph read again).
    # A user's thread instantiating functions of its own is outside the lock: a merged read is caught and read again,
    # and the user's calls are not cancelled by the read's cancelled call (TensorFlow's get_cancelable_function sets
    # one manager for every thread).
    r = simulated_device(GRAPH_READ_BESIDE_INSTANTIATIONS, limit_mb=256, env={"GRAPH_READ_MODE": mode})
    assert r.get("wrong", 0) == 0, r  # never a merged graph taken for the step's own
    if mode == "unlocked":
        assert r["detected"] > 0, r
    elif mode == "locked":
        assert r["own"] == r["read"] == 30, r
    else:  # a read merged in every attempt is refused with MergedGraphError (seen once in 30 under CI's load)
        assert r["own"] + r.get("refused", 0) == r["read"] == 30 and r["own"] >= 25, r
        assert r["user_calls"] > 0 and r.get("user_cancelled", 0) == 0, r
