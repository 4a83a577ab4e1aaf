"""AccessTrace.from_json validates its input: every malformed trace raises TraceFormatError naming the field and
what was expected, and every valid trace loads as before. No TensorFlow."""

import copy
import gzip
import json
import math
import pathlib

import pytest
from conftest import paper_chain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capuchin_tf.core import synthetic
from capuchin_tf.core.access_trace import AccessTrace, TraceError, TraceFormatError
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.core.graph_model import GraphModel
from capuchin_tf.core.trace_index import TraceIndex
from capuchin_tf.policy import make_plan

TRACES = pathlib.Path(__file__).parents[2] / "docs" / "results" / "traces"


def valid_json() -> dict:
    """paper_chain's trace as JSON text would give it back (lists, not tuples)."""
    return json.loads(json.dumps(paper_chain(t3_backward="after").to_json()))


def tensor_index(d: dict, tid: str) -> int:
    return next(i for i, t in enumerate(d["tensors"]) if t["id"] == tid)


# ---- valid traces load as before ---------------------------------------------------------------------------------
def test_the_exception_is_a_value_error_and_a_trace_error():
    assert issubclass(TraceFormatError, TraceError) and issubclass(TraceFormatError, ValueError)


@pytest.mark.parametrize("make", [lambda: paper_chain(), lambda: synthetic.transformer(2),
                                  lambda: synthetic.resnet(2), lambda: synthetic.random_model(3)])
def test_valid_traces_round_trip(make):
    trace = make()
    d = json.loads(json.dumps(trace.to_json()))
    back = AccessTrace.from_json(d)
    assert back.to_json() == d
    assert back == AccessTrace.from_json(trace.to_json())  # tuples and lists alike


@pytest.mark.parametrize("name", ["2026-11-29-mlp_b2048.json.gz", "2026-11-29-cnn_b32.json.gz",
                                  "2026-11-30-passive-cnn_b128_117mib.json.gz"])
def test_measured_traces_still_load(name):
    d = json.loads(gzip.decompress((TRACES / name).read_bytes()))
    trace = AccessTrace.from_json(d)
    assert trace.graph == GraphModel.from_json(d["graph"])
    out = trace.to_json()
    del out["graph"]  # the graph model may have gained fields (with defaults) since the file was written
    assert {k: d[k] for k in out} == out  # the measured file is what to_json writes, plus extra keys of its own


def test_unknown_sizes_stay_allowed_in_the_graph_model():
    d = valid_json()
    d["graph"]["tensors"][0]["nbytes"] = -1
    del d["graph"]["tensors"][1]["nbytes"]
    d["graph"]["tensors"][2]["shape"] = [-1, 4]
    g = AccessTrace.from_json(d).graph
    assert g.tensors[d["graph"]["tensors"][0]["id"]].nbytes == -1
    assert g.tensors[d["graph"]["tensors"][1]["id"]].nbytes == -1
    assert g.tensors[d["graph"]["tensors"][2]["id"]].shape == (-1, 4)


def test_optional_fields_keep_their_defaults():
    d = valid_json()
    for k in ("evicted_bytes", "stall_time", "budget_bytes", "meta", "released", "replayed_peak_bytes"):
        d.pop(k, None)
    trace = AccessTrace.from_json(d)
    assert (trace.evicted_bytes, trace.stall_time, trace.budget_bytes, dict(trace.meta), trace.released) == (
        0, 0.0, None, {}, ())


def test_integral_floats_are_integers():
    d = valid_json()
    d["peak_bytes"] = 1024.0
    d["tensors"][0]["nbytes"] = float(d["tensors"][0]["nbytes"])
    trace = AccessTrace.from_json(d)
    assert trace.peak_bytes == 1024 and type(trace.peak_bytes) is int
    assert type(trace.tensors[d["tensors"][0]["id"]].nbytes) is int


# ---- malformed traces --------------------------------------------------------------------------------------------
def _set(path, value):
    def mutate(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return d
    return mutate


def _del(path):
    def mutate(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
        return d
    return mutate


def _each_tensor(key, fn):
    def mutate(d):
        for t in d["tensors"]:
            t[key] = fn(t[key])
        return d
    return mutate


def _t1(d):  # the index of op1's output T1 in the tensor list (read three times: production, op2, b1)
    return tensor_index(d, "op1:0")


def _on_t1(fn):
    return lambda d: fn(d, d["tensors"][_t1(d)])


def _accesses_backwards(d, t):
    t["accesses"][2][1] = t["accesses"][1][1] / 2
    return d


def _free_before_alloc(d, t):
    t["alloc"] = t["free"] * 2
    return d


def _start_backwards(d):
    d["ops"][3][2] = d["ops"][2][2] / 2
    return d


def _access_op(d, t):
    t["accesses"][1][2] = "not_an_op"
    return d


def _dangling(d):
    d["graph"]["ops"][1]["inputs"] = ["ghost:0"]
    return d


BAD = [
    # (mutation, message pattern)
    (lambda d: [d], r"^trace: expected a JSON object, got a list"),
    (lambda d: "trace", r"^trace: expected a JSON object, got 'trace'"),
    (_set(["kind"], "capuchin_tf.Plan"), r"^trace.kind: not a capuchin_tf access trace"),
    (_set(["schema_version"], 2), r"^trace.schema_version: trace schema version 2 is not supported"),
    (_del(["tensors"]), r"^trace: missing required key 'tensors'"),
    (_del(["graph"]), r"^trace: missing required key 'graph'"),
    (_del(["step_time"]), r"^trace: missing required key 'step_time'"),
    (_set(["tensors"], {}), r"^trace.tensors: expected a JSON list, got an object"),
    (_set(["tensors", 3], 7), r"^trace.tensors\[3\]: expected a JSON object, got 7$"),
    (_set(["tensors", 3, "nbytes"], "abc"),
     r"^trace.tensors\[3\].nbytes: expected a non-negative integer, got 'abc'$"),
    (_set(["tensors", 3, "nbytes"], "4096"), r"^trace.tensors\[3\].nbytes: expected a non-negative integer"),
    (_set(["tensors", 3, "nbytes"], -4096), r"^trace.tensors\[3\].nbytes: expected a non-negative integer, got -4096"),
    (_set(["tensors", 3, "nbytes"], -1), r"^trace.tensors\[3\].nbytes: expected a non-negative integer, got -1"),
    (_set(["tensors", 3, "nbytes"], 1.5), r"^trace.tensors\[3\].nbytes: expected a non-negative integer, got 1.5"),
    (_set(["tensors", 3, "nbytes"], 1 << 63),
     r"^trace.tensors\[3\].nbytes: expected a non-negative integer of at most 2\*\*63 - 1, got 92233"),
    (_set(["tensors", 3, "nbytes"], True), r"^trace.tensors\[3\].nbytes: expected a non-negative integer, got true"),
    (_set(["tensors", 3, "nbytes"], None), r"^trace.tensors\[3\].nbytes: expected a non-negative integer, got null"),
    (_each_tensor("nbytes", lambda n: -n), r"^trace.tensors\[0\].nbytes: expected a non-negative integer"),
    (_del(["tensors", 3, "id"]), r"^trace.tensors\[3\]: missing required key 'id'"),
    (_set(["tensors", 3, "id"], 3), r"^trace.tensors\[3\].id: expected a string, got 3"),
    (lambda d: _set(["tensors", 3, "id"], d["tensors"][2]["id"])(d), r"^trace.tensors\[3\].id: duplicate tensor id"),
    (_set(["tensors", 3, "alloc"], "0.1"), r"^trace.tensors\[3\].alloc: expected a non-negative number \(seconds\)"),
    (_set(["tensors", 3, "alloc"], -0.5), r"^trace.tensors\[3\].alloc: expected a non-negative number"),
    (_set(["tensors", 3, "alloc"], math.nan), r"^trace.tensors\[3\].alloc: expected a non-negative number"),
    (_set(["tensors", 3, "free"], "later"), r"^trace.tensors\[3\].free: expected null \(alive at the step's end\)"),
    (_on_t1(_free_before_alloc), r"^trace.tensors\[\d+\].free: a tensor is freed after it is allocated"),
    (_set(["tensors", 3, "accesses"], None), r"^trace.tensors\[3\].accesses: expected a JSON list, got null"),
    (_set(["tensors", 3, "accesses", 0], [0, 0.1]),
     r"^trace.tensors\[3\].accesses\[0\]: expected \[index, time, op\], got a list of 2 items"),
    (_set(["tensors", 3, "accesses", 0, 0], 5), r"^trace.tensors\[3\].accesses\[0\]\[0\] \(index\): expected 0"),
    (_set(["tensors", 3, "accesses", 0, 1], "soon"), r"^trace.tensors\[3\].accesses\[0\]\[1\] \(time\): expected a"),
    (_set(["tensors", 3, "accesses", 0, 1], -1.0), r"^trace.tensors\[3\].accesses\[0\]\[1\] \(time\): expected a"),
    (_on_t1(_accesses_backwards), r"^trace.tensors\[\d+\].accesses\[2\]\[1\] \(time\): accesses are in time order"),
    (_on_t1(_access_op), r"^trace.tensors\[\d+\].accesses\[1\]\[2\] \(op\): 'not_an_op' is not an executed op"),
    (_set(["tensors", 3, "accesses", 0, 2], None), r"^trace.tensors\[3\].accesses\[0\]\[2\] \(op\): expected a str"),
    (_set(["ops"], None), r"^trace.ops: expected a JSON list, got null"),
    (_set(["ops", 2], {"name": "op2"}), r"^trace.ops\[2\]: expected \[name, type, start, duration, role\]"),
    (_set(["ops", 2, 2], "0.1"), r"^trace.ops\[2\]\[2\] \(start\): expected a non-negative number"),
    (_set(["ops", 2, 3], -1e-3), r"^trace.ops\[2\]\[3\] \(duration\): expected a non-negative number.*got -0.001"),
    (_set(["ops", 2, 4], "sideways"), r"^trace.ops\[2\]\[4\] \(role\): expected one of 'forward', 'backward'"),
    (_set(["ops", 2, 0], 12), r"^trace.ops\[2\]\[0\] \(name\): expected a string, got 12"),
    (lambda d: _set(["ops", 3, 0], d["ops"][2][0])(d), r"^trace.ops\[3\]\[0\] \(name\): op 'op.' appears twice"),
    (_start_backwards, r"^trace.ops\[3\]\[2\] \(start\): ops are in executed order"),
    (_set(["peak_bytes"], -1), r"^trace.peak_bytes: expected a non-negative integer, got -1"),
    (_set(["peak_bytes"], "big"), r"^trace.peak_bytes: expected a non-negative integer, got 'big'"),
    (_set(["persistent_bytes"], -(1 << 20)), r"^trace.persistent_bytes: expected a non-negative integer"),
    (_set(["evicted_bytes"], [1]), r"^trace.evicted_bytes: expected a non-negative integer, got a list of 1 item"),
    (_set(["stall_time"], -0.1), r"^trace.stall_time: expected a non-negative number"),
    (_set(["step_time"], math.inf), r"^trace.step_time: expected a non-negative number \(seconds\), got inf"),
    (_set(["step_time"], 10**400), r"^trace.step_time: expected a non-negative number \(seconds\), got 1000"),
    (_set(["budget_bytes"], -5), r"^trace.budget_bytes: expected null \(no budget\) or a non-negative integer"),
    (_set(["budget_bytes"], "1GiB"), r"^trace.budget_bytes: expected null \(no budget\) or a non-negative integer"),
    (_set(["meta"], [1, 2]), r"^trace.meta: expected a JSON object, got a list of 2 items"),
    (_set(["memory_curve"], [[0.0, 10], [0.1, -5]]), r"^trace.memory_curve\[1\]\[1\] \(bytes\): expected a non-neg"),
    (_set(["memory_curve"], [[0.2, 10], [0.1, 5]]), r"^trace.memory_curve\[1\]\[0\] \(time\): .* time order"),
    (_set(["memory_curve"], [[0.2, 10, 3]]), r"^trace.memory_curve\[0\]: expected \[time, bytes\]"),
    (_set(["released"], [[0.1, -4096]]), r"^trace.released\[0\]\[1\] \(bytes\): expected a non-negative integer"),
    (_set(["released"], 3), r"^trace.released: expected a JSON list, got 3"),
    (_set(["graph"], []), r"^trace.graph: expected a JSON object, got a list of 0 items"),
    (_del(["graph", "ops"]), r"^trace.graph: missing required key 'ops'"),
    (_set(["graph", "ops", 1], "op1"), r"^trace.graph.ops\[1\]: expected a JSON object, got 'op1'"),
    (_del(["graph", "ops", 1, "name"]), r"^trace.graph.ops\[1\]: missing required key 'name'"),
    (_set(["graph", "ops", 1, "inputs"], "x:0"), r"^trace.graph.ops\[1\].inputs: expected a JSON list of strings"),
    (_set(["graph", "ops", 1, "inputs"], [0]), r"^trace.graph.ops\[1\].inputs\[0\]: expected a string, got 0"),
    (_set(["graph", "ops", 1, "role"], "up"), r"^trace.graph.ops\[1\].role: expected one of 'forward'"),
    (_set(["graph", "ops", 1, "stateful"], "no"), r"^trace.graph.ops\[1\].stateful: expected true or false"),
    (_set(["graph", "ops", 1, "always_runs"], 1), r"^trace.graph.ops\[1\].always_runs: expected true or false"),
    (_set(["graph", "tensors", 1, "nbytes"], -2),
     r"^trace.graph.tensors\[1\].nbytes: expected a non-negative integer or -1 \(unknown\), got -2"),
    (_set(["graph", "tensors", 1, "nbytes"], "abc"),
     r"^trace.graph.tensors\[1\].nbytes: expected a non-negative integer or -1 \(unknown\), got 'abc'"),
    (_set(["graph", "tensors", 1, "shape"], [2, "x"]), r"^trace.graph.tensors\[1\].shape\[1\]: expected an integer"),
    (_set(["graph", "tensors", 1, "shape"], 4), r"^trace.graph.tensors\[1\].shape: expected null \(unknown rank\)"),
    (_set(["graph", "tensors", 1, "persistent"], 1), r"^trace.graph.tensors\[1\].persistent: expected true or false"),
    (lambda d: _set(["graph", "tensors", 2, "id"], d["graph"]["tensors"][1]["id"])(d),
     r"^trace.graph.tensors\[2\].id: duplicate tensor id"),
    (_dangling, r"^trace.graph: op 'op1' names unknown tensor 'ghost:0'"),
]


@pytest.mark.parametrize("mutate,pattern", BAD, ids=[f"{i}:{p[:48]}" for i, (_, p) in enumerate(BAD)])
def test_malformed_traces_name_the_field_and_what_was_expected(mutate, pattern):
    d = mutate(valid_json())
    with pytest.raises(TraceFormatError, match=pattern) as info:
        AccessTrace.from_json(d)
    assert "\n" not in str(info.value)


def test_a_huge_value_is_shown_shortened():
    d = valid_json()
    d["tensors"][3]["nbytes"] = "x" * 10_000
    with pytest.raises(TraceFormatError) as info:
        AccessTrace.from_json(d)
    assert len(str(info.value)) < 200


def test_load_reports_unreadable_contents_as_format_errors(tmp_path):
    p = tmp_path / "t.json"
    p.write_bytes(gzip.compress(json.dumps(valid_json()).encode()))
    with pytest.raises(TraceFormatError, match="not valid JSON.*gzip"):
        AccessTrace.load(p)
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        AccessTrace.load(p)
    p.write_text("[" * 100_000)
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        AccessTrace.load(p)
    p.write_text(json.dumps([1, 2]))
    with pytest.raises(TraceFormatError, match="^trace: expected a JSON object"):
        AccessTrace.load(p)


# ---- any mutation: a trace or a TraceFormatError, never anything else --------------------------------------------
def _paths(node, prefix=()):
    """Every path into a JSON tree (the root excluded)."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return
    for k, v in items:
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,))


REPLACEMENTS = [None, True, False, 0, -1, 1.5, -2.5, math.nan, math.inf, "", "abc", "0", [], {}, [0, 0.0, "x"],
                {"id": "x"}, 1 << 70, 10**400]

BASE = valid_json()
BASE_PATHS = list(_paths(BASE))


@st.composite
def mutated_traces(draw):
    d = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(d))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = d
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        value = parent[key]
        kind = draw(st.sampled_from(["drop", "replace", "negate", "swap"]))
        if kind == "drop":
            del parent[key]
        elif kind == "negate" and isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[key] = -value if value else -1
        elif kind == "swap":
            other = draw(st.sampled_from(BASE_PATHS))
            src = BASE
            for k in other:
                src = src[k]
            parent[key] = copy.deepcopy(src)
        else:
            parent[key] = copy.deepcopy(draw(st.sampled_from(REPLACEMENTS)))
    return d


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_traces())
def test_any_mutation_loads_or_raises_trace_format_error(d):
    try:
        trace = AccessTrace.from_json(d)
    except TraceFormatError as e:
        assert str(e) and "\n" not in str(e)
        return
    # What loads has no negative size or time and is indexable by the planner.
    assert trace.peak_bytes >= 0 and trace.persistent_bytes >= 0 and trace.evicted_bytes >= 0
    assert all(t.nbytes >= 0 and t.alloc >= 0 for t in trace.tensors.values())
    assert all(o.start >= 0 and o.duration >= 0 for o in trace.ops)
    assert all(b >= 0 for _, b in trace.replayed_curve())
    TraceIndex(trace)
    make_plan(trace, 6 << 20, "capuchin", DeviceModel.from_link("native"))  # and plannable


def test_a_retimed_trace_takes_the_new_durations_keeps_the_gaps_and_moves_every_event_with_its_op():
    from capuchin_tf.core.synthetic import linear_chain

    trace = linear_chain(n_layers=4, batch=8, width=64)
    forward = [o.name for o in trace.ops if o.role.name == "FORWARD"]
    assert forward
    halved = {name: next(o.duration for o in trace.ops if o.name == name) / 2 for name in forward}
    new = trace.retimed(halved, source="a guided step")
    by_name = {o.name: o for o in new.ops}
    for o in trace.ops:
        want = o.duration / 2 if o.name in halved else o.duration
        assert abs(by_name[o.name].duration - want) < 1e-12, o.name
    old_gaps = [b.start - a.end for a, b in zip(trace.ops, trace.ops[1:])]
    new_gaps = [b.start - a.end for a, b in zip(new.ops, new.ops[1:])]
    assert all(abs(x - y) < 1e-12 for x, y in zip(old_gaps, new_gaps))
    saved = sum(halved.values())
    assert abs(new.step_time - (trace.step_time - saved)) < 1e-9
    # Every access stays at its op's start; every event keeps its order; the bytes are the same.
    starts = {o.name: o.start for o in new.ops}
    old_starts = {o.name: o.start for o in trace.ops}
    at_start = [(t.id, a.index) for t in trace.tensors.values() for a in t.accesses
                if abs(a.time - old_starts[a.op]) < 1e-12]
    assert at_start
    for tid, i in at_start:
        a = new.tensors[tid].accesses[i]
        assert abs(a.time - starts[a.op]) < 1e-12
    old_order = [e for _, e in sorted((time, i) for i, (time, _) in enumerate(trace.memory_curve))]
    new_order = [e for _, e in sorted((time, i) for i, (time, _) in enumerate(new.memory_curve))]
    assert old_order == new_order
    assert new.replayed_peak_bytes() == trace.replayed_peak_bytes()
    assert new.meta["retimed"]["source"] == "a guided step"
    same = trace.retimed({})  # nothing named: nothing moves
    assert all(abs(a.start - b.start) < 1e-12 and abs(a.duration - b.duration) < 1e-12
               for a, b in zip(same.ops, trace.ops))
