"""Property tests (hypothesis) over random synthetic models, budgets and links."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capuchin_tf.core import synthetic
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.core.plan import Plan
from capuchin_tf.policy import POLICIES, make_plan
from capuchin_tf.policy.candidates import candidate_pairs, make_context
from capuchin_tf.policy.common import swap_decision
from capuchin_tf.policy.hybrid import _Hybrid
from capuchin_tf.policy.simulator import lower_bound_s, simulate
from capuchin_tf.policy.swap import SwapPlanner

_TRACES: dict = {}
_CHECKED: list[int] = []


def random_trace(seed: int, n_layers: int):
    key = (seed, n_layers)
    if key not in _TRACES:
        _TRACES[key] = synthetic.random_model(seed, n_layers=n_layers)
    return _TRACES[key]


seeds = st.integers(min_value=0, max_value=40)
layers = st.integers(min_value=2, max_value=7)
fractions = st.floats(min_value=0.05, max_value=1.05)
links = st.one_of(st.sampled_from(["native", "p100"]), st.floats(min_value=2e7, max_value=2e10))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(seed=seeds, n=layers, frac=fractions, link=links, policy=st.sampled_from(list(POLICIES)))
def test_an_accepted_plan_simulates_at_or_under_its_budget(seed, n, frac, link, policy):
    trace = random_trace(seed, n)
    dm = DeviceModel.from_link(link, trace)
    budget = synthetic.budget_fraction(trace, frac)
    plan = make_plan(trace, budget, policy, dm)
    # what the rewriter will read back: the JSON, simulated afresh
    again = Plan.from_json(plan.to_json())
    sim = simulate(trace, again)
    assert sim.peak_bytes + plan.margin_bytes == plan.predicted_peak_bytes
    assert sim.step_time == pytest.approx(plan.predicted_step_s)
    if plan.feasible:
        assert sim.peak_bytes + plan.margin_bytes <= budget
        assert max(b for _, b in sim.curve) <= budget
    else:
        assert plan.reason and any(o.name in plan.reason for o in trace.ops)
    assert sim.step_time >= trace.step_time - 1e-12  # a plan never makes the step faster
    # nor faster than its own lower bound: compute plus replays, and each copy direction's busy time
    assert sim.step_time >= lower_bound_s(trace, plan) * (1 - 1e-9) - 1e-12
    for d in plan.decisions:
        assert d.predicted_stall_s >= 0


@SETTINGS
@given(seed=seeds, n=layers, frac=st.floats(min_value=0.05, max_value=0.95), link=links)
def test_a_swap_with_non_negative_free_time_and_a_trigger_outside_the_peak_predicts_no_stall(seed, n, frac, link):
    trace = random_trace(seed, n)
    dm = DeviceModel.from_link(link, trace)
    ctx = make_context(trace, synthetic.budget_fraction(trace, frac), dm, min_candidate_bytes=1)
    idx = ctx.idx
    checked = 0
    for pairs in candidate_pairs(ctx).values():
        for p in pairs:
            if p.free_time < 0:
                continue
            ideal = p.t_back - p.swap_in_s
            possible = [
                j for j in range(p.ev_pos, p.back_pos)
                if idx.has_access(j) and idx.end[j] <= ideal and not ctx.in_trigger_window(idx.end[j])
            ]
            opt = SwapPlanner(ctx).evaluate(p)  # nothing else queued on the link
            if not possible:
                continue
            assert opt is not None and opt.hidden, (p, possible)
            assert not ctx.in_trigger_window(idx.end[opt.trigger_pos])
            d = swap_decision(idx, p, opt.trigger_pos, "test")
            sim = simulate(trace, [d], dm, index=idx)
            assert sim.stalls[p.tensor] <= 1e-12
            # no stall: the step is the trace's plus what the copies take from compute (the CPU device's memcpy)
            assert sim.copy_compute_s == pytest.approx(2 * dm.copy_compute_time(p.nbytes))
            assert sim.step_time == pytest.approx(trace.step_time + sim.copy_compute_s)
            checked += 1
    _CHECKED.append(checked)


def test_the_free_time_property_is_exercised():
    """The property above is not vacuous: most drawn cases have swaps with FT >= 0 and a trigger to check."""
    _CHECKED.clear()
    test_a_swap_with_non_negative_free_time_and_a_trigger_outside_the_peak_predicts_no_stall()
    assert len(_CHECKED) >= 100 and sum(1 for c in _CHECKED if c) >= len(_CHECKED) // 2


@SETTINGS
@given(seed=seeds, n=layers, frac=st.floats(min_value=0.05, max_value=0.95), link=links)
def test_swaps_the_planner_calls_hidden_stall_nowhere_together(seed, n, frac, link):
    """The planner's link queues are the simulator's: a set of swaps it chose as hidden predicts no stall at all."""
    trace = random_trace(seed, n)
    dm = DeviceModel.from_link(link, trace)
    ctx = make_context(trace, synthetic.budget_fraction(trace, frac), dm)
    h = _Hybrid(ctx, swap=True, recompute=False, collective=True)
    h.free_swaps(ctx.target)
    decisions = h.decisions()
    sim = simulate(trace, decisions, dm, index=ctx.idx)
    assert sim.stall_s <= 1e-9
    assert sim.step_time == pytest.approx(trace.step_time + sim.copy_compute_s)
    if decisions:
        assert sim.peak_bytes <= trace.replayed_peak_bytes()


@SETTINGS
@given(seed=seeds, n=layers, frac=fractions, link=links, error=st.sampled_from([0.0, 0.05, 0.25]))
def test_capuchin_with_its_fallback_is_never_predicted_slower_than_a_half_or_checkpoint_that_fits(seed, n, frac,
                                                                                                   link, error):
    """Predicted slower: by the placed cost (the predicted step and the copies on demand of a placed peak over the
    budget, hybrid.placed_cost), on the device less the placement error assumed: a learned one (`error` of the
    budget's transient bytes) or the prior, the step's largest buffer, whichever is larger."""
    from capuchin_tf.policy.hybrid import HALF_MARGIN, placed_cost

    trace = random_trace(seed, n)
    dm = DeviceModel.from_link(link, trace)
    budget = synthetic.budget_fraction(trace, frac)
    learned = int(error * max(0, budget - trace.persistent_bytes))
    plan = make_plan(trace, budget, "capuchin", dm, fallback=True, placement_error_bytes=learned)
    assumed = max(learned, max(t.nbytes for t in trace.tensors.values()))  # never below the prior, the largest buffer
    assert dict(plan.options).get("placement_error", 0) == assumed
    device = budget - assumed
    for other_policy in ("swap-only", "recompute-only", "checkpoint"):
        other = make_plan(trace, budget, other_policy, dm)
        if other.feasible:
            assert plan.feasible and plan.predicted_peak_bytes <= budget
            assert placed_cost(plan, device) <= placed_cost(other, device) / (1 - HALF_MARGIN) + 1e-12
