"""`Options` (capuchin_tf/runtime/options.py): every option checked once, frozen, and the policy's own runtime
defaults from the registry."""

import dataclasses

import pytest

from capuchin_tf.runtime.options import Options

MiB = 1 << 20


def test_budgets_take_one_syntax_and_stay_within_the_device():
    assert Options.make(memory_budget="512MiB", device_limit=1 << 30).budget_bytes == 512 * MiB
    assert Options.make(memory_budget=3 * MiB, device_limit=None).budget_bytes == 3 * MiB
    assert Options.make(device_limit=1 << 30).budget_bytes == 1 << 30  # default: the device's limit
    with pytest.raises(ValueError, match="larger than the device"):
        Options.make(memory_budget="2GiB", device_limit=1 << 30)
    with pytest.raises(ValueError, match="invalid memory budget"):
        Options.make(memory_budget="lots")


@pytest.mark.parametrize("fields,error,match", [
    ({"policy": "vdnn"}, ValueError, "unknown policy 'vdnn'"),
    ({"link": "pcie"}, ValueError, "link must be one of"),
    ({"link": True}, ValueError, "link must be one of"),
    ({"policy_options": [1]}, TypeError, "policy_options must be a mapping"),
    ({"plan_cache": 3}, TypeError, "plan_cache must be a directory path"),
    ({"keep_failures": 3}, TypeError, "keep_failures must be a directory path"),
    ({"feedback": 1}, TypeError, "feedback must be True or False"),
    ({"passive_rescue": None}, TypeError, "passive_rescue must be True or False"),
    ({"max_replans": -1}, ValueError, "max_replans must be a non-negative integer"),
    ({"max_retries": 1.5}, ValueError, "max_retries must be a non-negative integer"),
    ({"max_signatures": 0}, ValueError, "max_signatures must be a positive integer"),
    ({"protect_steps": True}, ValueError, "protect_steps must be a non-negative integer"),
    ({"link": "p100", "link_clock_s": 0.0}, ValueError, "link_clock_s must be a positive number"),
    ({"link": "p100", "link_clock_s": "1s"}, ValueError, "link_clock_s must be a positive number"),
    ({"link": "native", "link_clock_s": 0.5}, ValueError, "link_clock_s sets the p100 link's clock"),
    ({"budget_bytes": 5}, TypeError, "unknown option"),
    ({"colour": "red"}, TypeError, "unknown option"),
])
def test_a_bad_option_is_refused_with_what_is_accepted(fields, error, match):
    with pytest.raises(error, match=match):
        Options.make(**fields)


def test_options_are_frozen_and_copies_are_checked():
    held = {"fallback": False}
    options = Options.make(policy_options=held, plan_cache="/tmp/plans")
    held["fallback"] = True  # the caller's dict changes; the options do not
    assert dict(options.policy_options) == {"fallback": False}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.policy = "tf"
    with pytest.raises(TypeError):
        options.policy_options["x"] = 1
    assert options.replace(max_retries=5).max_retries == 5
    with pytest.raises(ValueError, match="unknown policy"):
        options.replace(policy="nope")


def test_the_planner_gets_the_policys_registered_defaults_then_the_users_options():
    assert Options.make(policy="capuchin").planner_options() == {"fallback": True}
    assert Options.make(policy="capuchin", policy_options={"fallback": False}).planner_options() == {"fallback": False}
    assert Options.make(policy="swap-all").planner_options() == {}


def test_the_registry_says_which_policies_keep_passive_modes_pool_as_a_safety_net():
    from capuchin_tf.policy import POLICIES, register_policy

    assert {n for n, p in POLICIES.items() if p.safety_net} == {"capuchin", "swap-only", "recompute-only"}
    register_policy("test-netted", POLICIES["tf"], safety_net=True, runtime_options={"x": 1})
    try:
        assert Options.make(policy="test-netted").planner_options() == {"x": 1}
        assert POLICIES["test-netted"].plan is POLICIES["tf"].plan
    finally:
        del POLICIES["test-netted"]
