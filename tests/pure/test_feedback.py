"""Plan feedback (capuchin_tf.policy.feedback.move_triggers) on a synthetic trace: late prefetches move earlier,
prefetches
evicted again move later, triggers stay between the evicted-access and the back-access, nothing else changes."""

from capuchin_tf.core import synthetic
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.policy import make_plan
from capuchin_tf.policy.feedback import LATE_TRIGGER_STEP, move_triggers

TRACE = synthetic.resnet(3)
PLAN = make_plan(TRACE, synthetic.budget_fraction(TRACE, 0.6), "swap-only", DeviceModel.from_link("p100", TRACE))
PREFETCHED = [d for d in PLAN.swaps if d.in_trigger is not None]


def _by_tensor(plan):
    return {d.tensor: d for d in plan.decisions}


def test_the_plan_prefetches_something():
    assert len(PREFETCHED) >= 2


def test_nothing_to_move_returns_the_same_plan():
    assert move_triggers(PLAN, TRACE, earlier={}, later=set()) is PLAN
    assert move_triggers(PLAN, TRACE, earlier={"no such tensor:0": 1.0}, later={"nor this:0"}) is PLAN


def test_a_late_prefetch_moves_earlier_by_at_least_the_paper_step_and_the_wait():
    d = PREFETCHED[0]
    for wait in (0.0, d.swap_in_s):
        moved = _by_tensor(move_triggers(PLAN, TRACE, earlier={d.tensor: wait}, later=set()))[d.tensor]
        if moved.in_trigger == d.in_trigger:
            # only allowed when no op of the trace starts early enough and after the evicted-access
            starts = [o.start for o in TRACE.ops
                      if d.evicted_access.time < o.start <= d.in_trigger.time - max(LATE_TRIGGER_STEP * d.swap_in_s,
                                                                                   wait)]
            assert not starts
            continue
        assert moved.in_trigger.time <= d.in_trigger.time - max(LATE_TRIGGER_STEP * d.swap_in_s, wait) + 1e-12
        assert moved.in_trigger.time > d.evicted_access.time
        assert "moved earlier" in moved.reason


def test_an_early_prefetch_moves_later_but_stays_before_the_back_access():
    moved_any = False
    for d in PREFETCHED:
        moved = _by_tensor(move_triggers(PLAN, TRACE, earlier={}, later={d.tensor}))[d.tensor]
        assert moved.in_trigger.time < d.back_access.time
        if moved.in_trigger != d.in_trigger:
            moved_any = True
            assert moved.in_trigger.time >= d.in_trigger.time + LATE_TRIGGER_STEP * d.swap_in_s - 1e-12
            assert "moved later" in moved.reason
    assert moved_any


def test_only_the_named_tensors_change():
    d = PREFETCHED[0]
    new = move_triggers(PLAN, TRACE, earlier={d.tensor: d.swap_in_s}, later=set())
    old_by, new_by = _by_tensor(PLAN), _by_tensor(new)
    assert set(old_by) == set(new_by)
    for t, decision in old_by.items():
        if t != d.tensor:
            assert new_by[t] == decision
