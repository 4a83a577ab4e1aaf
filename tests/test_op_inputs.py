"""Every op of the library that takes scalar inputs rejects a non-scalar one with an error, never by aborting.

A kernel that reads `.scalar<T>()` of a tensor with more than one element trips a CHECK in TensorFlow and aborts the
whole process. The calls run in a fresh process, so that a regression fails the tests instead of killing pytest, and
each is tried three ways: eagerly (no shape function runs: the kernel must check), in a graph where the shape is
known (the shape function must refuse it) and in a graph where it is not (the kernel again).
"""

import pytest

# (op wrapper, the index of the input made non-scalar, its name in the op's definition, the other inputs' values).
# A handle input gets a vector of two pool handles.
CASES = {
    "Capuchin>SetPassiveMode": ("capuchin_set_passive_mode", 0, "enabled", [True]),
    "Capuchin>SetSmallPool": ("capuchin_set_small_pool", 0, "enabled", [False]),
    "Capuchin>SizeSmallPool": ("capuchin_size_small_pool", 0, "bytes", [1]),
    "Capuchin>SetLinkBandwidth/0": ("capuchin_set_link_bandwidth", 0, "device_to_host_bytes_per_sec", [0.0, 0.0]),
    "Capuchin>SetLinkBandwidth/1": ("capuchin_set_link_bandwidth", 1, "host_to_device_bytes_per_sec", [0.0, 0.0]),
    "Capuchin>SetMemoryBudget": ("capuchin_set_memory_budget", 0, "bytes", [0]),
    "Capuchin>Prefetch": ("capuchin_prefetch", 0, "handle", ["handle"]),
    "Capuchin>SwapIn": ("capuchin_swap_in", 0, "handle", ["handle"]),
    "Capuchin>Get": ("capuchin_get", 0, "handle", ["handle"]),
    "Capuchin>HandleStatus": ("capuchin_handle_status", 0, "handle", ["handle"]),
    "Capuchin>ReleaseHandle": ("capuchin_release_handle", 0, "handle", ["handle"]),
}

CHILD = """
import json
import sys
import tensorflow as tf
from capuchin_tf.tf import ops

CASES = {cases!r}

def outcome(call):
    try:
        call()
        return {{"error": None}}
    except Exception as e:  # the type and message are what the tests check
        return {{"error": type(e).__name__, "message": str(e)}}

def run(case, wrapper, index, values):
    op = case.split("/")[0]
    fn = getattr(ops._ops, wrapper)
    attrs = {{"dtype": tf.float32}} if op in ("Capuchin>SwapIn", "Capuchin>Get") else {{}}
    # SwapIn reads swap handles, the others pool handles.
    make_handle = ops.swap_out if op == "Capuchin>SwapIn" else ops.hold
    handles = [make_handle(tf.constant([1.0, 2.0]), "a"), make_handle(tf.constant([3.0]), "b")]

    def constant(v, shape):
        dtype = {{float: tf.float64, int: tf.int64, bool: tf.bool}}[type(v)]
        return tf.fill(shape, tf.constant(v, dtype))

    def scalar(v):
        return handles[0] if v == "handle" else constant(v, [])

    def vector(v):
        return tf.stack(handles) if v == "handle" else constant(v, [2])

    def call(*inputs):
        fn(*inputs, **attrs)  # outputs, if any, are not needed (and an op with none returns an Operation)

    def args(make):
        return [make(v) if i == index else scalar(v) for i, v in enumerate(values)]

    result = {{}}
    print(case, "eager", file=sys.stderr, flush=True)  # where a child that aborted got to
    result["eager"] = outcome(lambda: call(*args(vector)))
    print(case, "known shape", file=sys.stderr, flush=True)
    result["known_shape"] = outcome(lambda: tf.function(lambda: call(*args(vector))).get_concrete_function())
    print(case, "unknown shape", file=sys.stderr, flush=True)
    vec = args(vector)[index]
    unknown = tf.function(lambda x: call(*[x if i == index else a for i, a in enumerate(args(vector))]),
                          input_signature=[tf.TensorSpec(None, vec.dtype)])
    result["unknown_shape"] = outcome(lambda: unknown(vec))
    # The op still works with scalars.
    result["scalar"] = outcome(lambda: call(*args(scalar)))
    return result

print(json.dumps({{case: run(case, wrapper, index, values) for case, (wrapper, index, _, values) in CASES.items()}}))
"""


@pytest.fixture(scope="module")
def outcomes(simulated_device):
    """Every case, in one fresh process: if a call aborts it, every test of this file fails with the child's stderr,
    whose last lines name the call."""
    return simulated_device(CHILD.format(cases=CASES), limit_mb=64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_non_scalar_input_is_an_error_not_an_abort(case, outcomes):
    name = CASES[case][2]
    r = outcomes[case]
    op = case.split("/")[0]
    for how in ("eager", "unknown_shape"):
        assert r[how]["error"] == "InvalidArgumentError", (how, r[how])
        assert f"{op}: input '{name}' must be a scalar" in r[how]["message"], (how, r[how])
    assert r["known_shape"]["error"] == "ValueError", r["known_shape"]
    assert "must be rank 0" in r["known_shape"]["message"] and op in r["known_shape"]["message"], r
    assert r["scalar"]["error"] is None, r["scalar"]
