"""The plan's JSON (schema version, round trip, errors) and the device model's links."""

import dataclasses
import json

import pytest

from capuchin_tf.core import synthetic
from capuchin_tf.core.device_model import NATIVE_BYTES_PER_S, P100_FLOP_PER_BYTE, DeviceModel, DeviceModelError
from capuchin_tf.core.plan import PLAN_SCHEMA_VERSION, Plan, PlanError
from capuchin_tf.policy import make_plan


@pytest.fixture(scope="module")
def plan():
    trace = synthetic.transformer(2)
    return make_plan(trace, synthetic.budget_fraction(trace, 0.5), "capuchin", DeviceModel.from_link("p100", trace))


def test_the_plan_round_trips_through_json(plan, tmp_path):
    assert plan.swaps and plan.recomputes
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == PLAN_SCHEMA_VERSION and data["kind"] == "capuchin_tf.Plan"
    again = Plan.load(path)
    assert again == dataclasses.replace(plan, options=again.options)
    assert dict(again.options) == dict(plan.options)
    assert again.to_json() == plan.to_json()


def test_the_plan_is_immutable(plan):
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.feasible = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.decisions[0].tensor = "x"
    assert isinstance(plan.decisions, tuple)


def test_plan_files_of_another_kind_or_version_are_refused(plan, tmp_path):
    d = plan.to_json()
    with pytest.raises(PlanError, match="schema version 99"):
        Plan.from_json({**d, "schema_version": 99})
    with pytest.raises(PlanError, match="not a capuchin_tf plan"):
        Plan.from_json({**d, "kind": "capuchin_tf.AccessTrace"})
    bad = {**d, "decisions": [{**d["decisions"][0], "kind": "teleport"}]}
    with pytest.raises(PlanError, match="unknown kind 'teleport'"):
        Plan.from_json(bad)
    p = tmp_path / "junk.json"
    p.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(p)


def test_plan_totals(plan):
    assert plan.swapped_bytes == sum(d.nbytes for d in plan.swaps)
    assert plan.recomputed_bytes == sum(d.nbytes for d in plan.recomputes)
    assert plan.predicted_overhead == pytest.approx(plan.predicted_step_s / plan.trace_step_s - 1)
    text = plan.summary()
    assert "swapped" in text and "recomputed" in text and "predicted peak" in text


def test_links():
    trace = synthetic.linear_chain(2)
    native = DeviceModel.from_link("native", trace)
    assert native.d2h_bytes_per_s == native.h2d_bytes_per_s == NATIVE_BYTES_PER_S == 6e9
    assert native.swap_out_time(6e9) == pytest.approx(1.0)
    p100 = DeviceModel.from_link("p100", trace)
    assert p100.h2d_bytes_per_s == pytest.approx(trace.meta["flops"] / trace.step_time / P100_FLOP_PER_BYTE)
    assert DeviceModel.from_link("2.5e9").d2h_bytes_per_s == 2.5e9
    assert DeviceModel.from_link(1e9).swap_in_time(5e8) == pytest.approx(0.5)
    assert DeviceModel(1e9, 2e9).swap_in_time(2e9) == pytest.approx(1.0)
    assert DeviceModel.from_json(p100.to_json()) == p100


def test_bad_links_are_refused_clearly():
    trace = synthetic.linear_chain(2)
    with pytest.raises(DeviceModelError, match="meta\\['flops'\\]"):
        DeviceModel.from_link("p100", dataclasses.replace(trace, meta={}))
    with pytest.raises(DeviceModelError, match="needs the trace"):
        DeviceModel.from_link("p100")
    with pytest.raises(DeviceModelError, match="unknown link 'pcie9'"):
        DeviceModel.from_link("pcie9")
    for bad in ("-1", "0", "inf", "nan"):
        with pytest.raises(DeviceModelError):
            DeviceModel.from_link(bad)
    with pytest.raises(DeviceModelError):
        DeviceModel(0, 1e9)


def test_a_plan_over_its_budget_is_predicted_with_the_excess_moved_on_demand_when_a_net_keeps_the_budget(plan):
    # Under a safety net that evicts on demand, a plan predicted over the budget moves at least the excess out and
    # back each step in the step's path, and its peak is the budget; without a net the simulator's figures stand.
    budget = plan.predicted_peak_bytes - 8 * (1 << 20)
    bare, netted = plan.prediction(), plan.prediction(net_budget_bytes=budget)
    moved = plan.device.swap_out_time(8 << 20) + plan.device.swap_in_time(8 << 20)
    assert bare["predicted_over_budget_bytes"] == 0 and bare["predicted_on_demand_s"] == 0
    assert bare["predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert netted["predicted_over_budget_bytes"] == 8 << 20 and netted["predicted_on_demand_s"] == pytest.approx(moved)
    assert netted["predicted_peak_bytes"] == budget
    assert netted["predicted_step_ratio"] == pytest.approx(bare["predicted_step_ratio"] + moved / plan.trace_step_s)
    # A plan within the net's budget is predicted as the simulator says.
    assert plan.prediction(net_budget_bytes=plan.predicted_peak_bytes) == bare


def test_a_running_plan_is_predicted_with_the_bytes_its_steps_evicted_on_demand(plan):
    # Where the plan's guided steps ran, the bytes they were measured to evict on demand are the bytes it moves: more
    # than the predicted excess where the free memory was split (a plan predicted within the budget that evicts),
    # less where the simulator's peak was high; the simulator's own step stays beside it.
    budget = plan.predicted_peak_bytes
    fits = plan.prediction(net_budget_bytes=budget)
    learned = plan.prediction(net_budget_bytes=budget, evicted_on_demand_bytes=16 << 20)
    moved = plan.device.swap_out_time(16 << 20) + plan.device.swap_in_time(16 << 20)
    assert fits["on_demand_from"] == "predicted" and fits["on_demand_bytes"] == 0
    assert learned["on_demand_from"] == "measured" and learned["on_demand_bytes"] == 16 << 20
    assert learned["predicted_on_demand_s"] == pytest.approx(moved)
    assert learned["predicted_step_ratio"] == pytest.approx(fits["predicted_step_ratio"] + moved / plan.trace_step_s)
    assert learned["simulated_step_ratio"] == fits["simulated_step_ratio"] == fits["predicted_step_ratio"]
    assert learned["predicted_peak_bytes"] == fits["predicted_peak_bytes"]  # the peak stays the simulator's
    over = plan.prediction(net_budget_bytes=budget - (8 << 20), evicted_on_demand_bytes=2 << 20)
    assert over["predicted_over_budget_bytes"] == 8 << 20 and over["on_demand_bytes"] == 2 << 20
    assert over["predicted_on_demand_s"] == pytest.approx(plan.device.swap_out_time(2 << 20)
                                                          + plan.device.swap_in_time(2 << 20))
    assert plan.prediction(net_budget_bytes=budget, evicted_on_demand_bytes=0)["predicted_on_demand_s"] == 0
