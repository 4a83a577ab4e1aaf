"""control_flow.analyze on hand-made lowered graphs: which ops always run, and in which frame."""

from capuchin_tf.core.control_flow import ROOT, FlowNode, analyze


def N(name, op="Op", inputs=(), control=(), frame=None):
    return FlowNode(name, op, tuple(inputs), tuple(control), frame)


def lowered_cond():
    """x -> Switch(x, p) -> then: a (reads :1), else: b (reads :0) -> Merge(a, b) -> y; a side effect w in `then`
    with a control edge into the branch_executed Merge, as TensorFlow's cond lowering makes them."""
    return [
        N("x"), N("p"),
        N("sw", "Switch", ["x", "p"]),
        N("sp", "Switch", ["p", "p"]),
        N("pivot_t", "Identity", ["sp:1"]), N("pivot_f", "Identity", ["sp:0"]),
        N("a", "Mul", ["sw:1"], control=["pivot_t"]),
        N("b", "Neg", ["sw:0"], control=["pivot_f"]),
        N("w", "AssignVariableOp", ["a"]),
        N("m", "Merge", ["a", "b"]),
        N("executed", "Merge", ["pivot_t", "pivot_f"], control=["w"]),
        N("y", "Square", ["m"]),
        N("after", "NoOp", control=["executed"]),
    ]


def test_a_cond_branch_may_not_run_and_its_merge_always_runs():
    flow = analyze(lowered_cond())
    assert all(flow.always_runs(n) for n in ("x", "p", "sw", "sp", "m", "executed", "y", "after"))
    assert not any(flow.always_runs(n) for n in ("pivot_t", "pivot_f", "a", "b", "w"))
    assert flow.has_control_flow


def test_a_control_edge_from_a_branch_op_makes_its_destination_conditional():
    nodes = lowered_cond() + [N("z", "Relu", ["x"], control=["a"])]
    assert not analyze(nodes).always_runs("z")


def test_a_merge_of_one_branch_only_may_not_run():
    nodes = lowered_cond() + [N("half", "Merge", ["a", "w"])]
    assert not analyze(nodes).always_runs("half")


def test_nested_conds_resolve_to_the_outer_branch():
    nodes = lowered_cond() + [
        N("q"),
        N("sw2", "Switch", ["a", "q"]),
        N("c", "Exp", ["sw2:1"]), N("d", "Log", ["sw2:0"]),
        N("m2", "Merge", ["c", "d"]),  # runs whenever `a` runs: in the outer then-branch
        N("m3", "Merge", ["m2", "b"]),  # the outer cond's output: always
    ]
    flow = analyze(nodes)
    assert not flow.always_runs("m2") and flow.guard["m2"] == flow.guard["a"]
    assert flow.always_runs("m3")


def lowered_loop():
    """i0 -> Enter -> Merge <- NextIteration <- body; Switch(Merge, LoopCond) -> Exit (0) / body (1)."""
    return [
        N("i0"), N("x"),
        N("enter", "Enter", ["i0"], frame="while/ctx"),
        N("enter_x", "Enter", ["x"], frame="while/ctx"),
        N("merge", "Merge", ["enter", "next"]),
        N("less", "Less", ["merge", "enter_x"]),
        N("cond", "LoopCond", ["less"]),
        N("switch", "Switch", ["merge", "cond"]),
        N("body", "AddV2", ["switch:1", "enter_x"]),
        N("next", "NextIteration", ["body"]),
        N("exit", "Exit", ["switch:0"]),
        N("after", "Square", ["exit"]),
        N("late", "NoOp", control=["after"]),
    ]


def test_loop_bodies_are_in_their_frame_and_the_loop_output_is_not():
    flow = analyze(lowered_loop())
    for n in ("enter", "enter_x", "merge", "less", "cond", "switch", "body", "next", "exit"):
        assert flow.frame[n] == ("while/ctx",), n  # a frame name with a slash stays one frame
        assert not flow.always_runs(n)
    assert flow.frame["after"] == ROOT and flow.always_runs("after") and flow.always_runs("late")
    assert flow.always_runs("i0")


def test_nested_loops_get_nested_frames():
    nodes = lowered_loop() + [
        N("inner_enter", "Enter", ["body"], frame="inner"),
        N("inner_exit", "Exit", ["inner_enter"]),
        N("use", "Relu", ["inner_exit"]),
    ]
    flow = analyze(nodes)
    assert flow.frame["inner_enter"] == ("while/ctx", "inner")
    assert flow.frame["use"] == ("while/ctx",)


def test_no_control_flow():
    flow = analyze([N("a"), N("b", "Relu", ["a"]), N("c", "NoOp", control=["b"])])
    assert not flow.has_control_flow and all(flow.always_runs(n) for n in "abc")


def test_nodes_on_a_cycle_are_never_claimed_to_run():
    flow = analyze([N("a", "Relu", ["b"]), N("b", "Relu", ["a"]), N("c")])
    assert not flow.always_runs("a") and not flow.always_runs("b") and flow.always_runs("c")


# ---- IncrementalOrder ------------------------------------------------------------------------------------------------
import itertools  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from capuchin_tf.core.control_flow import IncrementalOrder  # noqa: E402


def _reach(succ, u, v):
    stack, seen = [u], {u}
    while stack:
        x = stack.pop()
        if x == v:
            return True
        for s in succ.get(x, ()):
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return False


def _order_and_successors(nodes, base):
    order = IncrementalOrder(nodes, base)
    succ = {}
    for u, v in base:
        succ.setdefault(u, set()).add(v)
    return order, succ


def _add_edge_and_check(order, succ, u, v):
    """add_edge refuses u -> v exactly when it closes a cycle of `succ` (kept up to date)."""
    closes = u == v or _reach(succ, v, u)
    assert order.add_edge(u, v) == (not closes)
    if not closes:
        succ.setdefault(u, set()).add(v)


def _check_topological(order, succ):
    for a, b in itertools.chain.from_iterable(((x, y) for y in ys) for x, ys in succ.items()):
        assert order.ord[a] < order.ord[b]


def test_an_edge_against_the_order_is_added_when_it_closes_no_cycle():
    order = IncrementalOrder("abcd", [("a", "b"), ("c", "d")])
    assert order.add_edge("d", "a")  # against the initial order a b c d, no cycle: reordered
    assert order.ord["d"] < order.ord["a"] < order.ord["b"]
    assert not order.add_edge("b", "c")  # b -> c -> d -> a -> b
    assert order.reaches("c", "b") and not order.reaches("b", "c")


def test_a_new_node_goes_right_after_its_inputs():
    order = IncrementalOrder("abc", [("a", "b"), ("b", "c")])
    order.add_node("x", after=["a"])
    assert order.ord["a"] < order.ord["x"] < order.ord["b"]
    assert order.add_edge("x", "b") and not order.add_edge("c", "x")
    for i in range(200):  # many nodes into one gap: renumbering keeps them apart
        order.add_node(f"y{i}", after=["a"])
    assert len(set(order.ord.values())) == len(order.ord)


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 14).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=30),
    st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=30))))
def test_add_edge_refuses_exactly_the_edges_that_close_a_cycle(case):
    n, initial, added = case
    nodes = [str(i) for i in range(n)]
    base = [(str(min(u, v)), str(max(u, v))) for u, v in initial if u != v]  # a DAG
    order, succ = _order_and_successors(nodes, base)
    for u, v in ((str(a), str(b)) for a, b in added):
        _add_edge_and_check(order, succ, u, v)
        _check_topological(order, succ)


def test_a_new_node_with_its_reader_goes_right_before_it():
    order = IncrementalOrder("abcd", [("a", "b"), ("b", "c"), ("c", "d")])
    order.add_node("x", after=["a"], before="d")
    assert order.ord["c"] < order.ord["x"] < order.ord["d"]
    order.add_node("y", after=["c"], before="b")  # its reader comes before its input: right after the input
    assert order.ord["c"] < order.ord["y"]
    order.add_node("z", before="a")  # no input, placed before the first node
    assert order.ord["z"] < order.ord["a"]


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 12).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=20),
    st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.integers(0, 30)), max_size=40))))
def test_nodes_placed_before_their_readers_keep_the_order_exact(case):
    """New nodes placed after their inputs or before a reader, mixed with edges: the order stays a topological order
    and add_edge still refuses exactly the edges that close a cycle."""
    n, initial, steps = case
    nodes = [str(i) for i in range(n)]
    base = [(str(min(u, v)), str(max(u, v))) for u, v in initial if u != v]
    order, succ = _order_and_successors(nodes, base)
    for new_node, a, b in steps:
        if new_node:
            name, src, reader = f"n{len(nodes)}", nodes[a % len(nodes)], nodes[b % len(nodes)]
            order.add_node(name, after=[src], before=reader)
            nodes.append(name)
            succ.setdefault(src, set()).add(name)
            continue
        _add_edge_and_check(order, succ, nodes[a % len(nodes)], nodes[b % len(nodes)])
    _check_topological(order, succ)
