"""The measured execution on the quick tier: a real step, its trace, and the same numbers as plain TensorFlow."""

import functools
import hashlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import capuchin_tf  # noqa: F401  (loads the op library)
from capuchin_tf.cli import models
from capuchin_tf.core import control_flow
from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.graph_model import Role
from capuchin_tf.tf import capture, measure

QUICK = [("mlp", 64), ("cnn", 8), ("transformer", 4), ("dropout-bn", 8)]


def variables_digest(setup):
    h = hashlib.sha256()
    for v in setup.variables:
        h.update(np.asarray(v.numpy()).tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def measured():
    return _measured()


@functools.cache  # for the whole process (under pytest-xdist a waiting worker tears module fixtures down)
def _measured():
    """One measured step per quick model (passive mode on, enough memory), plus a plain run to compare with."""
    out = {}
    for name, batch in QUICK:
        plain = models.build(name, batch)
        plain_losses = [float(plain.train_step(*plain.inputs)) for _ in range(2)]
        setup = models.build(name, batch)
        loss, trace = measure.measure_step(setup.train_step, setup.inputs, meta={"model": name, "batch": batch})
        losses = [float(loss), float(setup.train_step(*setup.inputs))]
        out[name] = dict(trace=trace, losses=losses, plain_losses=plain_losses,
                         digest=variables_digest(setup), plain_digest=variables_digest(plain))
    return out


@pytest.mark.parametrize("name", [n for n, _ in QUICK])
def test_replayed_peak_is_within_10_percent_of_the_bfc_peak(measured, name):
    trace = measured[name]["trace"]
    assert trace.peak_bytes > trace.persistent_bytes > 0
    assert abs(trace.replayed_peak_bytes() - trace.peak_bytes) <= 0.10 * trace.peak_bytes, (
        trace.replayed_peak_bytes(), trace.peak_bytes)


@pytest.mark.parametrize("name", [n for n, _ in QUICK])
def test_every_executed_edge_is_an_access_with_its_own_measured_time(measured, name):
    trace = measured[name]["trace"]
    starts = {o.name: o.start for o in trace.ops}
    checked = 0
    for o in trace.ops:
        for t in trace.graph.ops[o.name].inputs:
            if t not in trace.tensors:
                continue  # persistent (variables, arguments, constants)
            reads = [a for a in trace.tensors[t].accesses if a.op == o.name and a.index > 0]
            assert reads, f"{o.name} reads {t} but the trace has no such access"
            assert reads[0].time == pytest.approx(starts[o.name])
            checked += 1
    assert checked > 20, (checked, len(trace.ops), len(trace.tensors),
                          sum(1 for o in trace.ops for t in trace.graph.ops[o.name].inputs if t in trace.tensors))
    # times are measured, not a graph order: different ops start at different times
    assert len({round(o.start, 9) for o in trace.ops}) > len(trace.ops) // 2


@pytest.mark.parametrize("name", [n for n, _ in QUICK])
def test_measured_step_gives_plain_tensorflows_numbers_bit_for_bit(measured, name):
    m = measured[name]
    assert [float.hex(x) for x in m["losses"]] == [float.hex(x) for x in m["plain_losses"]]
    assert m["digest"] == m["plain_digest"]


def test_the_trace_has_roles_and_round_trips_through_json(measured, tmp_path):
    trace = measured["cnn"]["trace"]
    roles = {o.role for o in trace.ops}
    assert {Role.FORWARD, Role.BACKWARD, Role.OPTIMIZER} <= roles
    candidates = [t for t in trace.tensors.values() if t.access_count > 1 and t.nbytes > 0]
    assert candidates
    path = tmp_path / "trace.json"
    trace.save(path)
    assert AccessTrace.load(path).to_json() == trace.to_json()


def test_memory_curve_plot(measured, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "curve.png"
    measure.plot_memory_curve(measured["mlp"]["trace"], str(path), title="mlp")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jit_compiled_steps_are_refused():
    step = tf.function(lambda x: x * 2.0, jit_compile=True)
    with pytest.raises(capture.CaptureError, match="jit_compile"):
        measure.measure_step(step, (tf.ones([2]),))
    with pytest.raises(capture.CaptureError, match="not a tf.function"):
        measure.measure_step(lambda x: x, (tf.ones([2]),))


def test_control_flow_is_opaque():
    v = tf.Variable(tf.ones([64, 64]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, tf.tanh(a @ v)), (0, x))[1]
            loss = tf.reduce_sum(y)
        v.assign_sub(0.01 * tape.gradient(loss, v))
        return loss

    _, trace = measure.measure_step(step, (tf.ones([64, 64]),))
    # the loop is an opaque op (While) or, lowered by Grappler, a frame whose ops and tensors are not managed
    loops = [o for o in trace.graph.ops.values() if o.type in capture.FUNCTIONAL_OPS | control_flow.CONTROL_FLOW_OPS]
    assert loops and all(not o.replayable for o in loops)
    inner = [t for o in loops for t in o.outputs]
    assert all(not trace.graph.manageable(t) for t in inner)


def test_pure_layers_import_and_test_without_tensorflow():
    """The graph model, trace and planning layers import no TensorFlow: their tests pass with it blocked."""
    code = (
        "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None\n"
        "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/pure']))\n"
    )
    env = {"CAPUCHIN_TF_PURE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


def test_kernel_seconds_sum_an_ops_runs_and_leave_out_its_stalls_for_memory():
    from capuchin_tf.core.trace_assembly import KernelEvent

    ms = 1_000_000
    kernels = [KernelEvent("a", "MatMul", 0, 10 * ms), KernelEvent("b", "Relu", 10 * ms, 14 * ms),
               KernelEvent("a", "MatMul", 20 * ms, 23 * ms)]
    offset = 5 * ms  # the stalls are on CLOCK_MONOTONIC, 5 ms ahead of the profiler's clock
    stalls = {"start_ns": np.array([7 * ms, 8 * ms, 30 * ms]), "end_ns": np.array([9 * ms, 10 * ms, 31 * ms])}
    seconds = measure.kernel_seconds(kernels, offset, stalls)
    # a: 10 ms less its stall from 2 to 5 ms (two overlapping spans, merged), plus its second run's 3 ms; b: none.
    assert seconds == pytest.approx({"a": 0.010, "b": 0.004})


def test_a_profiled_call_returns_its_result_and_the_kernels_it_ran():
    x = tf.random.stateless_uniform([64, 64], seed=[1, 2])
    fn = tf.function(lambda x: tf.nn.relu(tf.matmul(x, x)))
    fn(x)
    result, kernels, _, _ = measure.profiled_call(lambda: fn(x))
    assert np.array_equal(result.numpy(), fn(x).numpy())
    assert {"MatMul", "Relu"} <= {k.type for k in kernels}
    assert all(k.end >= k.start for k in kernels)
