"""Policies: pure decisions on an AccessTrace, registered by name. Pure Python: imports no TensorFlow.

Every policy is a function ``(trace, budget_bytes, device_model, **options) -> Plan``; the plan it returns has been
simulated (simulator.py). Registered names (benchmarks.md):

| name | what it is |
|---|---|
| ``tf`` | nothing evicted (plain TensorFlow) |
| ``swap-all`` | vDNN-like: every tensor the backward pass needs, swapped, prefetched one layer ahead |
| ``checkpoint`` | Chen et al. sqrt(n) checkpointing over the forward chain's articulation points |
| ``swap-only`` | Capuchin's swap half alone |
| ``recompute-only`` | Capuchin's recomputation half alone (Algorithm 2) |
| ``capuchin`` | Capuchin's hybrid policy (Algorithm 1) |

``register_policy`` adds one (a name is a plain string; no enums).
"""

from __future__ import annotations

from typing import Callable

from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.core.plan import Plan
from capuchin_tf.policy.baselines import plan_checkpoint, plan_swap_all, plan_tf
from capuchin_tf.policy.hybrid import plan_capuchin, plan_recompute_only, plan_swap_only
from capuchin_tf.core.trace import AccessTrace

PolicyFn = Callable[..., Plan]

POLICIES: dict[str, PolicyFn] = {
    "tf": plan_tf,
    "swap-all": plan_swap_all,
    "checkpoint": plan_checkpoint,
    "swap-only": plan_swap_only,
    "recompute-only": plan_recompute_only,
    "capuchin": plan_capuchin,
}


class UnknownPolicyError(KeyError):
    """No policy of that name; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError quotes its argument; show the message as is
        return str(self.args[0])


def register_policy(name: str, fn: PolicyFn, *, replace: bool = False) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError("a policy name is a non-empty string")
    if name in POLICIES and not replace:
        raise ValueError(f"policy {name!r} is already registered")
    POLICIES[name] = fn


def get_policy(name: str) -> PolicyFn:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown policy {name!r}; the registered policies are: {', '.join(POLICIES)}"
        ) from None


def make_plan(
    trace: AccessTrace,
    budget_bytes: int,
    policy: str = "capuchin",
    device_model: DeviceModel | None = None,
    **options,
) -> Plan:
    """Plans `trace` under `budget_bytes` with the named policy (native link unless a device model is given)."""
    fn = get_policy(policy)
    if device_model is None:
        device_model = DeviceModel.from_link("native", trace)
    return fn(trace, int(budget_bytes), device_model, **options)


__all__ = [
    "POLICIES",
    "PolicyFn",
    "UnknownPolicyError",
    "get_policy",
    "make_plan",
    "register_policy",
    "plan_tf",
    "plan_swap_all",
    "plan_checkpoint",
    "plan_swap_only",
    "plan_recompute_only",
    "plan_capuchin",
]
