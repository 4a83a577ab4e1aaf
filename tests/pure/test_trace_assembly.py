"""Trace assembly and the trace data model on synthetic events: no TensorFlow."""

import dataclasses
import json

import pytest

from capuchin_tf.core.access_trace import AccessTrace, TraceError
from capuchin_tf.core.graph_model import GraphModel, GraphModelError, OpInfo, Role, TensorInfo, fold_views, view_base
from capuchin_tf.core.trace_assembly import KernelEvent, MemoryEvent, assemble_trace, fold_pool_ops

MB = 1 << 20


def chain_graph():
    """x -> a = f(x) -> b = relu(a) (forwards a's buffer) -> loss; backward reads b and a's view."""
    ops = [
        OpInfo("x", "_Arg", (), (), ("x:0",), Role.OTHER, stateful=False, replayable=False),
        OpInfo("a", "MatMul", ("x:0",), (), ("a:0",), Role.FORWARD),
        OpInfo("b", "Relu", ("a:0",), (), ("b:0",), Role.FORWARD),
        OpInfo("loss", "Sum", ("b:0",), (), ("loss:0",), Role.FORWARD),
        OpInfo("gradient_tape/g", "ReluGrad", ("loss:0", "b:0"), (), ("gradient_tape/g:0",), Role.BACKWARD),
        OpInfo("gradient_tape/h", "Mul", ("gradient_tape/g:0", "b:0"), (), ("gradient_tape/h:0",), Role.BACKWARD),
    ]
    tensors = [
        TensorInfo("x:0", "x", nbytes=2 * MB, consumers=("a",), persistent=True),
        TensorInfo("a:0", "a", nbytes=4 * MB, consumers=("b",)),
        TensorInfo("b:0", "b", nbytes=4 * MB, consumers=("loss", "gradient_tape/g", "gradient_tape/h")),
        TensorInfo("loss:0", "loss", nbytes=4, consumers=("gradient_tape/g",)),
        TensorInfo("gradient_tape/g:0", "gradient_tape/g", nbytes=4 * MB, consumers=("gradient_tape/h",)),
        TensorInfo("gradient_tape/h:0", "gradient_tape/h", nbytes=4 * MB),
    ]
    return GraphModel.build(ops, tensors)


def chain_events():
    us = 1000  # ns
    k = [
        KernelEvent("x", "_Arg", 0, 1 * us),
        KernelEvent("a", "MatMul", 10 * us, 110 * us),
        KernelEvent("b", "Relu", 120 * us, 150 * us),
        KernelEvent("loss", "Sum", 160 * us, 170 * us),
        KernelEvent("gradient_tape/g", "ReluGrad", 180 * us, 230 * us),
        KernelEvent("gradient_tape/h", "Mul", 240 * us, 300 * us),
    ]
    base = 2 * MB
    m = [
        MemoryEvent(12 * us, True, 0xA, 4 * MB, 4 * MB, base + 4 * MB, "a", "output"),
        # b forwards a's buffer: no allocation
        MemoryEvent(162 * us, True, 0xB, 256, 4, base + 4 * MB + 256, "loss", "output"),
        MemoryEvent(165 * us, True, 0xC, 1 * MB, 1 * MB, base + 5 * MB + 256, "loss", "temp"),
        MemoryEvent(168 * us, False, 0xC, 1 * MB, 1 * MB, base + 4 * MB + 256),
        MemoryEvent(182 * us, True, 0xD, 4 * MB, 4 * MB, base + 8 * MB + 256, "gradient_tape/g", "output"),
        MemoryEvent(232 * us, False, 0xB, 256, 4, base + 8 * MB),
        MemoryEvent(242 * us, True, 0xE, 4 * MB, 4 * MB, base + 12 * MB, "gradient_tape/h", "output"),
        MemoryEvent(299 * us, False, 0xA, 4 * MB, 4 * MB, base + 8 * MB),
        MemoryEvent(300 * us, False, 0xD, 4 * MB, 4 * MB, base + 4 * MB),
    ]
    return k, m


def test_every_read_is_an_access_at_the_readers_measured_start():
    g = chain_graph()
    k, m = chain_events()
    trace = assemble_trace(g, k, m, peak_bytes=14 * MB)
    b = trace.tensors["b:0"]
    assert [(a.index, a.op) for a in b.accesses] == [(0, "b"), (1, "loss"), (2, "gradient_tape/g"),
                                                     (3, "gradient_tape/h")]
    starts = {e.op: (e.start - k[0].start) / 1e9 for e in k}
    assert b.accesses[2].time == pytest.approx(starts["gradient_tape/g"])
    assert b.accesses[0].time == pytest.approx(150e-6)  # production: the end of its producer
    # every executed edge of the graph appears as an access of its tensor
    for op in g.ops.values():
        for t in op.inputs:
            if t in trace.tensors:
                assert any(a.op == op.name and a.index > 0 for a in trace.tensors[t].accesses), (op.name, t)


def test_forwarded_buffer_moves_to_the_output_and_replay_matches_the_allocator():
    g = chain_graph()
    k, m = chain_events()
    trace = assemble_trace(g, k, m, peak_bytes=14 * MB)
    a, b = trace.tensors["a:0"], trace.tensors["b:0"]
    assert a.free == pytest.approx(b.alloc) == pytest.approx(150e-6)
    assert b.nbytes == 4 * MB and b.free == pytest.approx(299e-6)
    assert "loss:temp0" in trace.tensors  # the op's temporary is kept, so the replay sees it
    assert trace.persistent_bytes == 2 * MB
    assert trace.replayed_peak_bytes() == max(b for _, b in trace.memory_curve) == 14 * MB


def test_stalls_are_removed_from_the_timeline():
    g = chain_graph()
    k, m = chain_events()
    stall = (185_000, 215_000)  # 30 us inside ReluGrad
    trace = assemble_trace(g, k, m, peak_bytes=14 * MB, stalls=[stall], evicted_bytes=4 * MB)
    ops = {o.name: o for o in trace.ops}
    assert ops["gradient_tape/g"].duration == pytest.approx(20e-6)
    assert ops["gradient_tape/h"].start == pytest.approx((240 - 30) * 1e-6)
    assert trace.stall_time == pytest.approx(30e-6)
    assert trace.step_time == pytest.approx(270e-6)
    assert trace.saving_target(budget_bytes=13 * MB) == 4 * MB  # passive mode evicted more than peak - budget
    assert trace.saving_target(budget_bytes=8 * MB) == 6 * MB
    # measured under 12 MiB (a retry after split free memory): for 13 MiB it evicted 1 MiB more than it needed to
    lowered = dataclasses.replace(trace, meta={**trace.meta, "ran_under_bytes": 12 * MB})
    assert lowered.saving_target(budget_bytes=13 * MB) == 3 * MB
    assert lowered.saving_target(budget_bytes=8 * MB) == 6 * MB


def test_peak_window_and_access_list():
    g = chain_graph()
    k, m = chain_events()
    trace = assemble_trace(g, k, m, peak_bytes=14 * MB)
    w0, w1 = trace.peak_window(threshold_bytes=11 * MB)
    assert w0 == pytest.approx(242e-6) and w1 == pytest.approx(299e-6)
    times = [a.time for a in trace.access_list()]
    assert times == sorted(times)


def test_trace_json_round_trip_and_schema_check(tmp_path):
    g = chain_graph()
    k, m = chain_events()
    trace = assemble_trace(g, k, m, peak_bytes=14 * MB, meta={"model": "chain"})
    path = tmp_path / "t.json"
    trace.save(path)
    back = AccessTrace.load(path)
    assert back.to_json() == trace.to_json()
    data = json.loads(path.read_text())
    data["schema_version"] = 999
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match="schema version"):
        AccessTrace.load(path)
    path.write_text("{not json")
    with pytest.raises(TraceError, match="not valid JSON"):
        AccessTrace.load(path)


def test_graph_model_rejects_dangling_references():
    with pytest.raises(GraphModelError, match="unknown tensor"):
        GraphModel.build([OpInfo("a", "Relu", ("missing:0",), (), ())], [])
    g = chain_graph()
    assert GraphModel.from_json(json.loads(json.dumps(g.to_json()))) == g


def test_no_kernel_of_the_graph_is_an_error():
    with pytest.raises(ValueError, match="nothing was measured"):
        assemble_trace(chain_graph(), [KernelEvent("other", "X", 0, 1)], [], peak_bytes=0)


def test_ops_reading_backward_tensors_are_backward():
    from capuchin_tf.core.graph_model import propagate_backward_roles

    ops = [
        OpInfo("a", "MatMul", (), (), ("a:0",), Role.FORWARD),
        OpInfo("gradient_tape/g1", "MatMul", ("a:0",), (), ("gradient_tape/g1:0",), Role.BACKWARD),
        OpInfo("gradient_tape/g2", "MatMul", ("a:0",), (), ("gradient_tape/g2:0",), Role.BACKWARD),
        OpInfo("AddN", "AddN", ("gradient_tape/g1:0", "gradient_tape/g2:0"), (), ("AddN:0",), Role.FORWARD),
        OpInfo("Scale", "Mul", ("AddN:0",), (), ("Scale:0",), Role.FORWARD),
        OpInfo("sgd/update", "AssignSubVariableOp", ("Scale:0",), (), (), Role.OPTIMIZER),
    ]
    tensors = [TensorInfo(t, t.split(":")[0]) for o in ops for t in o.outputs]
    model = propagate_backward_roles(GraphModel.build(ops, tensors))
    roles = {n: o.role for n, o in model.ops.items()}
    assert roles["a"] == Role.FORWARD
    assert roles["AddN"] == roles["Scale"] == Role.BACKWARD
    assert roles["sgd/update"] == Role.OPTIMIZER


def test_constants_under_the_tape_scope_do_not_make_forward_ops_backward():
    from capuchin_tf.core.graph_model import propagate_backward_roles

    ops = [
        # Grappler folds constants and may name them under the tape's scope; forward ops can share them.
        OpInfo("ConstantFolding/gradient_tape/c", "Const", (), (), ("ConstantFolding/gradient_tape/c:0",),
               Role.BACKWARD),
        OpInfo("a", "Mul", ("ConstantFolding/gradient_tape/c:0",), (), ("a:0",), Role.FORWARD),
    ]
    tensors = [TensorInfo(t, t.rsplit(":", 1)[0]) for o in ops for t in o.outputs]
    model = propagate_backward_roles(GraphModel.build(ops, tensors))
    assert model.ops["a"].role == Role.FORWARD


def test_reads_through_an_unprofiled_view_are_accesses_of_the_buffer_it_views():
    """g = f(x) early; r = Reshape(g) (the profiler shows no kernel of it); a backward op reads r much later. Folded
    (graph_model.fold_views), that read is an access of g: the planner sees g's 4 MB wait through the forward pass
    (the transformer's MLM-loss gradient)."""
    ops = [
        OpInfo("x", "_Arg", (), (), ("x:0",), Role.OTHER, stateful=False, replayable=False),
        OpInfo("g", "UnsortedSegmentSum", ("x:0",), (), ("g:0",), Role.BACKWARD),
        OpInfo("r", "Reshape", ("g:0",), (), ("r:0",), Role.BACKWARD),
        OpInfo("r2", "ExpandDims", ("r:0",), (), ("r2:0",), Role.BACKWARD),
        OpInfo("f", "MatMul", ("x:0",), (), ("f:0",), Role.FORWARD),
        OpInfo("gradient_tape/s", "Sub", ("r2:0", "f:0"), (), ("gradient_tape/s:0",), Role.BACKWARD),
    ]
    tensors = [
        TensorInfo("x:0", "x", nbytes=2 * MB, consumers=("g", "f"), persistent=True),
        TensorInfo("g:0", "g", nbytes=4 * MB, consumers=("r",)),
        TensorInfo("r:0", "r", nbytes=4 * MB, consumers=("r2",)),
        TensorInfo("r2:0", "r2", nbytes=4 * MB, consumers=("gradient_tape/s",)),
        TensorInfo("f:0", "f", nbytes=4 * MB, consumers=("gradient_tape/s",)),
        TensorInfo("gradient_tape/s:0", "gradient_tape/s", nbytes=4 * MB),
    ]
    g = fold_views(GraphModel.build(ops, tensors))
    s = g.ops["gradient_tape/s"]
    assert s.inputs == ("g:0", "f:0") and set(s.control_inputs) == {"r", "r2"}  # orders stay orders of the graph
    assert g.tensors["g:0"].consumers == ("r", "r2", "gradient_tape/s") and g.tensors["r2:0"].consumers == ()
    assert view_base(g, "r2:0") == "g:0" and view_base(g, "f:0") == "f:0"
    us = 1000
    k = [
        KernelEvent("x", "_Arg", 0, 1 * us),
        KernelEvent("g", "UnsortedSegmentSum", 10 * us, 20 * us),
        KernelEvent("f", "MatMul", 30 * us, 200 * us),
        KernelEvent("gradient_tape/s", "Sub", 210 * us, 220 * us),
    ]
    base = 2 * MB
    m = [
        MemoryEvent(11 * us, True, 0xA, 4 * MB, 4 * MB, base + 4 * MB, "g", "output"),
        MemoryEvent(31 * us, True, 0xB, 4 * MB, 4 * MB, base + 8 * MB, "f", "output"),
        MemoryEvent(211 * us, True, 0xC, 4 * MB, 4 * MB, base + 12 * MB, "gradient_tape/s", "output"),
        MemoryEvent(219 * us, False, 0xA, 4 * MB, 4 * MB, base + 8 * MB),
        MemoryEvent(220 * us, False, 0xB, 4 * MB, 4 * MB, base + 4 * MB),
    ]
    trace = assemble_trace(g, k, m, peak_bytes=14 * MB)
    rec = trace.tensors["g:0"]
    assert rec.nbytes == 4 * MB and rec.free == pytest.approx(219e-6)
    assert [(a.op, a.time) for a in rec.accesses] == [("g", pytest.approx(20e-6)),
                                                      ("gradient_tape/s", pytest.approx(210e-6))]
    assert trace.replayed_peak_bytes() == 14 * MB


def test_fold_pool_ops_reads_the_tensor_again_through_its_original_views():
    """A Hold/Get pair, and a reader that read the tensor through a Reshape reading a clone of it made on its Get
    (`<get>/view/<reshape>`, rewrite._rewire): folded, the graph is the one without the pool, and the Get's
    allocation belongs to the tensor."""
    get = "capuchin/get/t_0/0"
    ops = [
        OpInfo("t", "MatMul", (), (), ("t:0",), Role.FORWARD),
        OpInfo("r", "Reshape", ("t:0",), (), ("r:0",), Role.FORWARD),
        OpInfo("capuchin/hold/t_0", "Capuchin>Hold", ("t:0",), (), ("capuchin/hold/t_0:0",), Role.OTHER),
        OpInfo(get, "Capuchin>Get", ("capuchin/hold/t_0:0",), ("f",), (f"{get}:0",), Role.OTHER),
        OpInfo(f"{get}/view/r", "Reshape", (f"{get}:0",), (), (f"{get}/view/r:0",), Role.BACKWARD),
        OpInfo("f", "Relu", ("t:0",), (), ("f:0",), Role.FORWARD),
        OpInfo("gradient_tape/s", "Sub", (f"{get}/view/r:0", "f:0"), (), ("gradient_tape/s:0",), Role.BACKWARD),
    ]
    consumers = {"t:0": ("r", "capuchin/hold/t_0", "f"), "capuchin/hold/t_0:0": (get,),
                 f"{get}:0": (f"{get}/view/r",), f"{get}/view/r:0": ("gradient_tape/s",), "f:0": ("gradient_tape/s",)}
    tensors = [TensorInfo(t, o.name, nbytes=4 * MB, consumers=consumers.get(t, ())) for o in ops for t in o.outputs]
    folded, aliases = fold_pool_ops(GraphModel.build(ops, tensors))
    assert set(folded.ops) == {"t", "r", "f", "gradient_tape/s"}
    assert folded.ops["gradient_tape/s"].inputs == ("r:0", "f:0")
    assert folded.tensors["r:0"].consumers == ("gradient_tape/s",)
    assert aliases == {get: "t:0"}
    g = fold_views(folded)
    assert g.ops["gradient_tape/s"].inputs == ("t:0", "f:0") and g.ops["gradient_tape/s"].control_inputs == ("r",)


def test_an_add_of_a_live_residual_takes_the_buffer_of_its_dead_input():
    """out = AddN(r, m): r (a residual, read again later) and m (read last here) are of out's size, and out has no
    allocation of its own. TensorFlow forwarded m's buffer, the one it could: out owns it from then on (and m ends
    there), even though r comes first among the inputs. Taking r as the source made out a view of r, so out had no
    bytes until passive mode brought it back (the planner then evicted bytes it never counted)."""
    ops = [
        OpInfo("x", "_Arg", (), (), ("x:0",), Role.OTHER, stateful=False, replayable=False),
        OpInfo("r", "MatMul", ("x:0",), (), ("r:0",), Role.FORWARD),
        OpInfo("m", "Mul", ("r:0",), (), ("m:0",), Role.FORWARD),
        OpInfo("out", "AddN", ("r:0", "m:0"), (), ("out:0",), Role.FORWARD),
        OpInfo("gradient_tape/g", "Mul", ("out:0", "r:0"), (), ("gradient_tape/g:0",), Role.BACKWARD),
    ]
    tensors = [
        TensorInfo("x:0", "x", nbytes=MB, consumers=("r",), persistent=True),
        TensorInfo("r:0", "r", nbytes=4 * MB, consumers=("m", "out", "gradient_tape/g")),
        TensorInfo("m:0", "m", nbytes=4 * MB, consumers=("out",)),
        TensorInfo("out:0", "out", nbytes=4 * MB, consumers=("gradient_tape/g",)),
        TensorInfo("gradient_tape/g:0", "gradient_tape/g", nbytes=4 * MB),
    ]
    g = GraphModel.build(ops, tensors)
    us = 1000
    k = [KernelEvent("x", "_Arg", 0, us), KernelEvent("r", "MatMul", 10 * us, 20 * us),
         KernelEvent("m", "Mul", 30 * us, 40 * us), KernelEvent("out", "AddN", 50 * us, 60 * us),
         KernelEvent("gradient_tape/g", "Mul", 70 * us, 80 * us)]
    base = MB
    m = [MemoryEvent(11 * us, True, 0xA, 4 * MB, 4 * MB, base + 4 * MB, "r", "output"),
         MemoryEvent(31 * us, True, 0xB, 4 * MB, 4 * MB, base + 8 * MB, "m", "output"),
         # out forwards m's buffer: no allocation
         MemoryEvent(71 * us, True, 0xC, 4 * MB, 4 * MB, base + 12 * MB, "gradient_tape/g", "output"),
         MemoryEvent(80 * us, False, 0xA, 4 * MB, 4 * MB, base + 8 * MB),
         MemoryEvent(80 * us, False, 0xB, 4 * MB, 4 * MB, base + 4 * MB)]
    trace = assemble_trace(g, k, m, peak_bytes=13 * MB)
    out, mm, r = trace.tensors["out:0"], trace.tensors["m:0"], trace.tensors["r:0"]
    assert out.nbytes == 4 * MB and out.alloc == pytest.approx(60e-6) and out.free == pytest.approx(80e-6)
    assert mm.free == pytest.approx(60e-6)
    assert r.nbytes == 4 * MB and r.free == pytest.approx(80e-6)
    assert trace.replayed_peak_bytes() == 13 * MB
