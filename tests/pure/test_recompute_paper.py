"""The paper's worked examples of recomputation (paper.md §1.7, §1.11) on the T1 -> T2 -> T3 -> T4 chain."""

import pytest
from conftest import MB, MS, paper_chain

from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.policy import make_plan
from capuchin_tf.policy.candidates import candidate_pairs, make_context, recompute_pair
from capuchin_tf.policy.recompute import RecomputeSelector, Residency, assemble
from capuchin_tf.policy.simulator import simulate

SLOW_LINK = DeviceModel.symmetric(1e6)  # swaps are useless: recomputation must do the work


def selector(trace, **kw):
    ctx = make_context(trace, trace.persistent_bytes + 6 * MB, SLOW_LINK, min_candidate_bytes=1)
    pairs = candidate_pairs(ctx)
    res = Residency(ctx.idx)
    return ctx, pairs, res, RecomputeSelector(ctx, (recompute_pair(p) for p in pairs.values()), res, **kw)


def test_candidates_are_the_tensors_alive_across_the_peak_and_accessed_more_than_once():
    ctx, pairs, _, _ = selector(paper_chain())
    assert set(pairs) == {"op1:0", "op2:0", "op4:0"}  # T3 dies at T4's forward op, before the peak
    assert "x:0" not in pairs  # persistent: never a candidate
    # T4's pairs: its production is right before its read by `big` (nothing runs in between), so only big -> b4
    assert [(p.k, p.back_pos - p.ev_pos) for p in pairs["op4:0"]] == [(1, 2)]


def test_a_pair_with_nothing_made_while_the_tensor_would_be_away_is_no_candidate():
    """T0 is made by op0 and read by op1, with only a scalar made in between (BatchNorm's product and its add: the
    per-channel vectors in between), then read again in the backward pass. The memory is highest at op0 and op1, where
    T0 must be on the device, so evicting it between them lowers no peak: only its forward-to-backward pair counts."""
    from conftest import BWD

    from capuchin_tf.core.synthetic import TraceBuilder

    b = TraceBuilder(gap_s=1e-6)
    x = b.persistent("x", MB)
    (pre,) = b.op("pre", "MatMul", (x,), (6 * MB,), duration=MS)  # memory is above the limit from here on
    (t0,) = b.op("op0", "Mul", (pre,), (MB,), duration=MS)
    (v,) = b.op("vec", "Mul", (x,), (4,), duration=0.01 * MS)
    (t1,) = b.op("op1", "AddV2", (t0, v), (MB,), duration=MS)
    (f,) = b.op("big", "MatMul", (t1,), (8 * MB,), duration=2 * MS)
    (loss,) = b.op("loss", "Sum", (f,), (4,), duration=0.1 * MS)
    (g,) = b.op("b1", "MatMul", (loss, t1), (MB,), role=BWD, duration=MS)
    (g,) = b.op("b0", "MatMul", (g, t0), (MB,), role=BWD, duration=MS)
    b.op("bpre", "MatMul", (g, pre), (MB,), role=BWD, duration=MS)
    trace = b.build()
    ctx = make_context(trace, trace.persistent_bytes + 6 * MB, SLOW_LINK)
    assert ctx.min_bytes > 4  # the vector is below what the planner counts
    pairs = candidate_pairs(ctx)
    assert [(p.k, ctx.idx.op_names[p.ev_pos], ctx.idx.op_names[p.back_pos]) for p in pairs["op0:0"]] == [
        (1, "op1", "b0")]


def test_candidates_count_as_resident_and_t4_is_rebuilt_from_t2_when_t3_dies_in_forward():
    _, _, _, rs = selector(paper_chain())
    t4 = rs.cands["op4:0"]
    assert t4.srcs == {"op2:0"}  # T3 is dead at T4's back-access; T2 (a candidate) counts as resident
    assert [rs.idx.op_names[o] for o in t4.ops] == ["op3", "op4"]
    assert t4.rp_time == pytest.approx(2 * MS)
    assert rs.cands["op2:0"].srcs == {"op1:0"}
    assert rs.cands["op1:0"].srcs == {"x:0"}  # untracked (persistent) inputs are always resident


def test_t4_is_rebuilt_from_t3_when_t3_outlives_t4s_back_access():
    _, _, _, rs = selector(paper_chain(t3_backward="after"))
    t4 = rs.cands["op4:0"]
    assert t4.srcs == {"op3:0"}
    assert [rs.idx.op_names[o] for o in t4.ops] == ["op4"]


def test_t3_must_be_recomputed_too_when_its_last_backward_use_precedes_t4s_back_access():
    _, _, _, rs = selector(paper_chain(t3_backward="before"))
    t4 = rs.cands["op4:0"]
    assert t4.srcs == {"op2:0"}
    assert [rs.idx.op_names[o] for o in t4.ops] == ["op3", "op4"]


def test_picking_t2_first_makes_t4s_source_t1_and_counts_the_repeated_work():
    # T2 cheap: the largest MSPS, picked first (Algorithm 2)
    _, _, _, rs = selector(paper_chain(durations=(1, 0.5, 1, 1)))
    assert rs.top().tensor == "op2:0"
    d1 = 1 * MS
    t1 = rs.cands["op1:0"]
    assert t1.ext_time == 0 and t1.msps == pytest.approx(MB / d1)
    rs.choose("op2:0")
    t4 = rs.cands["op4:0"]
    assert t4.srcs == {"op1:0"}  # T2 is no longer a source: T4 starts from T2's source
    assert [rs.idx.op_names[o] for o in t4.ops] == ["op2", "op3", "op4"]
    assert t4.rp_time == pytest.approx((0.5 + 1 + 1) * MS)  # rp_time grew by T2's recompute time
    # T1 is a source of one chosen target (T2): choosing T1 would replay it once more for T2
    assert t1.ext_time == pytest.approx(1 * d1)
    assert t1.msps == pytest.approx(MB / (2 * d1))  # UpdateMSPS: mem / (rp_time + ext_time)
    rs.choose("op4:0")
    assert t1.ext_time == pytest.approx(2 * d1)  # now T2 and T4 both start from T1
    assert t1.msps == pytest.approx(MB / (3 * d1))


def test_choosing_the_source_of_a_chosen_target_reroutes_it():
    _, _, res, rs = selector(paper_chain())
    rs.choose("op4:0")  # from T2
    rs.choose("op2:0")
    assert rs.chosen["op4:0"].srcs == {"op1:0"}  # T4 (chosen) now starts from T1 too
    assert [rs.idx.op_names[o] for o in rs.chosen["op4:0"].ops] == ["op2", "op3", "op4"]
    assert rs.cands["op1:0"].ext_time == pytest.approx(2 * MS)  # T2 and T4 use T1


def test_collective_recomputation_rebuilds_the_chain_once_and_keeps_the_targets():
    ctx, pairs, res, rs = selector(paper_chain())
    for t in ("op4:0", "op2:0", "op1:0"):
        rs.choose(t)
    chosen = [rs.chosen[t].pair for t in rs.order]
    cr = {d.tensor: d for d in assemble(ctx, chosen, res, collective=True)}
    assert cr["op4:0"].replay_ops == ("op1", "op2", "op3", "op4")  # needed first (backward order), from x
    assert cr["op4:0"].sources == ("x:0",)
    assert set(cr["op4:0"].keeps) == {"op1:0", "op2:0"}
    assert cr["op2:0"].replay_ops == () and cr["op2:0"].regenerated_by == "op4:0"
    assert cr["op1:0"].replay_ops == () and cr["op1:0"].regenerated_by == "op4:0"
    with_cr = simulate(ctx.trace, list(cr.values()), SLOW_LINK)
    assert with_cr.recompute_s == pytest.approx(4 * MS)  # O(n): each op once

    res2 = Residency(ctx.idx)
    for t, p in zip(rs.order, chosen):
        res2.evict(t, p.ev_pos, p.back_pos, "recompute")
    plain = {d.tensor: d for d in assemble(ctx, chosen, res2, collective=False)}
    assert plain["op2:0"].replay_ops == ("op1", "op2") and plain["op1:0"].replay_ops == ("op1",)
    without = simulate(ctx.trace, list(plain.values()), SLOW_LINK)
    assert without.recompute_s == pytest.approx((4 + 2 + 1) * MS)  # O(n^2) without CR
    assert with_cr.peak_bytes >= without.peak_bytes  # keeping costs memory; the policy drops keeps if needed


def test_ops_that_cannot_be_replayed_exactly_are_never_recomputed():
    trace = paper_chain(stateful_op3=True)
    _, _, _, rs = selector(trace)
    assert "op4:0" not in rs.cands  # its only way back runs through the stateful op3
    plan = make_plan(trace, trace.persistent_bytes + 6 * MB, "recompute-only", SLOW_LINK, min_candidate_bytes=1)
    for d in plan.recomputes:
        assert "op3" not in d.replay_ops


def test_recompute_only_plan_on_the_chain_is_feasible_and_simulates():
    trace = paper_chain()
    budget = trace.persistent_bytes + 11 * MB  # ideal peak: persistent + 12 MiB
    plan = make_plan(trace, budget, "recompute-only", SLOW_LINK, min_candidate_bytes=1)
    assert plan.feasible and plan.predicted_peak_bytes <= budget
    assert plan.recomputes and not plan.swaps
    assert plan.predicted_recompute_s > 0
