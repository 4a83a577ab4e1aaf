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

``register_policy`` adds one (a name is a plain string). A policy also declares what the runtime needs to know of
it, so that the runtime names no policy: whether guided steps keep passive mode's pool as a safety net (Capuchin's
policies: what the plan did not foresee is evicted on demand; the baselines run their plans alone, so that their
largest batch is their plan's) and the options the runtime plans with by default (docs/policy.md, "fallback").
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.core.plan import Plan
from capuchin_tf.policy.baselines import plan_checkpoint, plan_swap_all, plan_tf
from capuchin_tf.policy.hybrid import plan_capuchin, plan_recompute_only, plan_swap_only

PolicyFn = Callable[..., Plan]



@dataclasses.dataclass(frozen=True)
class Policy:
    """A registered policy: call it like its planning function."""

    name: str
    plan: PolicyFn
    safety_net: bool = False  # guided steps keep passive mode's pool and evict on demand what the plan missed
    runtime_options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    # Policies whose plans a managed step measures against this one's when its guided steps wait for copies on
    # demand (policy.feedback, "measured arbitration"); kept only if measured faster. "margin" (feedback.LEARNED_MARGIN)
    # names this policy's own plan made again with the placement error its guided steps were measured to have
    # (the policy takes `placement_error_bytes`).
    trials: tuple[str, ...] = ()

    def __call__(self, *args, **kwargs) -> Plan:
        return self.plan(*args, **kwargs)


POLICIES: dict[str, Policy] = {}


class UnknownPolicyError(KeyError):
    """No policy of that name; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError quotes its argument; show the message as is
        return str(self.args[0])


def register_policy(name: str, fn: PolicyFn, *, safety_net: bool = False,
                    runtime_options: Mapping[str, Any] | None = None, trials: Sequence[str] = (),
                    replace: bool = False) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError("a policy name is a non-empty string")
    if name in POLICIES and not replace:
        raise ValueError(f"policy {name!r} is already registered")
    if isinstance(fn, Policy):
        fn = fn.plan
    POLICIES[name] = Policy(name, fn, safety_net, types.MappingProxyType(dict(runtime_options or {})), tuple(trials))


register_policy("tf", plan_tf)
register_policy("swap-all", plan_swap_all)
register_policy("checkpoint", plan_checkpoint)
register_policy("swap-only", plan_swap_only, safety_net=True)
register_policy("recompute-only", plan_recompute_only, safety_net=True)
# A step must run a plan that fits: when the hybrid greedy paints itself into a corner and one of its halves fits,
# that half's plan runs (docs/policy.md, "fallback"); the policy benchmarks call plan_capuchin without it, so that they
# compare the paper's algorithm as it is. Beyond the paper, when the copies on demand make guided steps slow, a managed
# step measures against the plan that runs: its own plan made again with the placement error its guided steps were
# measured to have (a learned margin), the checkpoint plan and each of its halves', the one expected fastest first
# (policy.feedback, "measured arbitration"); Capuchin's halves, run as baselines, do not.
register_policy("capuchin", plan_capuchin, safety_net=True, runtime_options={"fallback": True},
                trials=("margin", "checkpoint", "recompute-only", "swap-only"))


def get_policy(name: str) -> Policy:
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
    "Policy",
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
