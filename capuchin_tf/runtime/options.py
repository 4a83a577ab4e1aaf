"""`Options`: everything a managed step is told, checked once, frozen.

The decorator (`capuchin_tf.function`), the Keras callback and the bench worker build one with `Options.make(...)`,
which checks every value with a message that says what is accepted; `ManagedStep` takes it as it is.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping
from typing import Any

from capuchin_tf.core.budget import format_bytes, parse_budget
from capuchin_tf.core.device_model import LINK_NAMES
from capuchin_tf.policy import POLICIES

MAX_SIGNATURES = 8  # input signatures kept per step (each has its own measurement, plan and rewritten graph)


@dataclasses.dataclass(frozen=True)
class Options:
    """What a managed step does. Build it with `Options.make`, which checks each field.

    budget_bytes: the device memory the plan aims at; None: the device's own limit (or no budget without one).
    policy: a registered policy (`capuchin`, `swap-only`, `recompute-only`, `swap-all`, `checkpoint`, `tf`).
    link: `native` (swaps are memcpys), `p100` (a link emulated at the model's FLOP rate / 258 FLOP per byte) or a
        bandwidth in bytes/s.
    link_clock_s: for `p100`, the time of one step of plain TensorFlow on this machine, which sets the FLOP rate
        once: the link then runs at the step's FLOP count / link_clock_s / 258 bytes per second from the first guided
        step on, whatever the measured step's clock (benchmarks compare policies over one link this way); None: the
        rate of the measured step, corrected by the guided steps' own speed as they run.
    policy_options: extra keyword arguments of the policy, over the policy's own runtime defaults (the registry's).
    plan_cache: a directory; plans are stored there and reused by a restarted job.
    feedback: adjust the plan from late prefetches and the measured peak; max_replans bounds how often.
    settle_steps: guided steps without a plan change after which a signature counts as settled.
    background_builds: a plan change the feedback or a measured arbitration asks for is planned, rewritten and built
        in a background thread while the current plan keeps running, and runs from the step after it is ready;
        False: the step that asked waits for it. Plan changes after an out-of-memory error always wait.
    planned_layout: on the simulated device, a guided step's allocations of more than 64 KiB go where a layout made
        from an earlier step of the same plan says, in one region of the device (cc/kernels/step_layout.h), instead
        of wherever BFC's best fit puts them. "auto" (the default): once a guided step of the input signature evicted
        tensors on demand (the plan's next step is recorded, the ones after it placed; a later plan's steps are placed
        from its first, by the layout of the plan it replaces until its own is made); True: every guided step; False:
        never (docs/decisions.md, "Planned layout").
    max_retries: guided attempts of one call (each with a tighter plan) before it runs in passive mode.
    protect_steps: guided steps after a plan change that run with host snapshots of what the step writes; None: all.
    passive_rescue: a guided step that keeps running out of memory runs in passive mode; False raises CapuchinError.
    strict: raise `CapuchinError` where capuchin_tf would otherwise refuse a step (one warning, then plain TF).
    max_signatures: input signatures kept, each with its own measurement and plan (least recently used out).
    verbose: say what happens (plans, retries, passive rescues) as it goes.
    keep_failures: a directory; when planning fails, the trace and the error are written into a new directory there
        (runtime.errors.keep_planning_failure) and the warning names it: `python -m capuchin_tf plan --replay DIR`
        plans it again as the runtime did.
    """

    budget_bytes: int | None = None
    policy: str = "capuchin"
    link: str | float = "native"
    link_clock_s: float | None = None
    policy_options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    plan_cache: str | None = None
    feedback: bool = True
    max_replans: int = 20
    settle_steps: int = 10
    background_builds: bool = True
    planned_layout: bool | str = "auto"
    max_retries: int = 2
    protect_steps: int | None = None
    passive_rescue: bool = True
    strict: bool = False
    max_signatures: int = MAX_SIGNATURES
    verbose: bool = False
    keep_failures: str | None = None

    @classmethod
    def make(cls, *, memory_budget: int | float | str | None = None, device_limit: int | None = None,
             **fields) -> Options:
        """Checked options. `memory_budget`: bytes or a size string ("2GiB", "512MiB"; core.budget), at most
        `device_limit` (the device's size in bytes) when there is one; None: the device's limit."""
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)} | ({"budget_bytes"} & set(fields))
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}")
        if memory_budget is None:
            budget = device_limit
        else:
            budget = parse_budget(memory_budget)
            if device_limit is not None and budget > device_limit:
                raise ValueError(f"memory_budget {format_bytes(budget)} is larger than the device "
                                 f"({format_bytes(device_limit)}); the budget is what the plan aims at, at most the "
                                 "device's memory")
        options = cls(budget_bytes=budget, **fields)
        options._check()
        return options

    def _check(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; the registered policies are: {', '.join(POLICIES)}")
        link = self.link
        if isinstance(link, bool) or not (link in LINK_NAMES or (isinstance(link, (int, float)) and link > 0)):
            raise ValueError(f"link must be one of {LINK_NAMES} or a bandwidth in bytes/s (a positive number), "
                             f"got {link!r}")
        clock = self.link_clock_s
        if clock is not None and (isinstance(clock, bool) or not isinstance(clock, (int, float)) or not clock > 0
                                  or clock == float("inf")):
            raise ValueError(f"link_clock_s must be a positive number of seconds, got {clock!r}")
        if clock is not None and link != "p100":
            raise ValueError(f"link_clock_s sets the p100 link's clock; the link is {link!r}")
        if not isinstance(self.policy_options, Mapping):
            raise TypeError(f"policy_options must be a mapping of option names to values, got {self.policy_options!r}")
        for name in ("plan_cache", "keep_failures"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name} must be a directory path (str or os.PathLike), got {value!r}")
        for name in ("feedback", "background_builds", "passive_rescue", "strict", "verbose"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.planned_layout, bool) and self.planned_layout != "auto":
            raise TypeError(f"planned_layout must be True, False or 'auto', got {self.planned_layout!r}")
        for name, low in (("max_replans", 0), ("settle_steps", 0), ("max_retries", 0), ("max_signatures", 1),
                          ("protect_steps", 0)):
            value = getattr(self, name)
            if name == "protect_steps" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "positive" if low else "non-negative"
                raise ValueError(f"{name} must be a {kind} integer, got {value!r}")
        # Frozen copies of what the caller may still hold.
        object.__setattr__(self, "policy_options", types.MappingProxyType(dict(self.policy_options)))
        for name in ("plan_cache", "keep_failures"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.fspath(getattr(self, name)))

    def replace(self, **changes) -> Options:
        """A checked copy with `changes` (field names)."""
        options = dataclasses.replace(self, **changes)
        options._check()
        return options

    def planner_options(self) -> dict[str, Any]:
        """The keyword arguments the policy gets: its registered runtime defaults, then `policy_options`."""
        return {**POLICIES[self.policy].runtime_options, **self.policy_options}
