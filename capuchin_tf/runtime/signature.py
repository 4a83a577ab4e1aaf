"""What the runtime keeps per input signature of a step, and per call of it."""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.plan import Plan
from capuchin_tf.runtime import recovery


@dataclasses.dataclass
class StepRecord:
    """One call of a managed step."""

    phase: str  # "measured", "guided", "plain", "passive" (a guided step that ran out of memory, rerun in passive mode)
    seconds: float
    peak_bytes: int
    late_prefetches: int = 0
    late_wait_s: float = 0.0  # total time swap-ins waited for their copies
    plan_changed: bool = False
    retried: int = 0
    # A measured step's last run, when it ran under a budget lowered after split free memory (the allocator's budget
    # then, bytes; 0: the step's own budget; ManagedStep._split_retry_budget).
    lowered_budget_bytes: int = 0
    evictions: int = 0  # prefetched tensors evicted again by the safety net (passive mode during guided steps)
    passive_evictions: int = 0  # pooled tensors the safety net evicted on demand (what the plan did not save)
    passive_evicted_bytes: int = 0
    moved_bytes: int = 0  # pooled tensors' bytes the safety net moved inside the device instead (no link copy)
    # The allocator's planned layout (cc/kernels/step_layout.h): the region's bytes this step ran with (0: none, the
    # step was recorded), and the laid-out allocations that did not go where the layout said.
    layout_bytes: int = 0
    layout_misses: int = 0
    planned_bytes: int = 0  # bytes the plan this step ran saved (swapped + recomputed)
    waited_s: dict = dataclasses.field(default_factory=dict)  # stall kind -> seconds the step waited (core/stalls.py)
    adjust_s: float = 0.0  # seconds the feedback took after the step (a plan change: planning, rewriting, building)
    # The step ran while a plan change was planned and built off the critical path (ManagedStep, "background
    # builds"): its time shares the machine with that work, and it is no measurement of its plan.
    building: bool = False
    # The step ran under the profiler and the trace took its kernel times (ManagedStep._retime).
    retimed: bool = False


@dataclasses.dataclass
class SignatureState:
    """Everything capuchin_tf keeps for one input signature of the step."""

    concrete: Any
    key: str = ""
    trace: AccessTrace | None = None
    plan: Plan | None = None
    plan_budget: int = 0  # the budget the current plan was made for (tightened after failures)
    fn: Any = None  # the guided ConcreteFunction; None: run the plain step
    guided_def: Any = None  # the GraphDef `fn` runs
    optimized: Any = None  # the optimized GraphDef the plan is applied to
    shaped: Any = None  # the optimized graph imported with the call's shapes (static shapes of every tensor)
    optimized_model: Any = None  # capture.graph_model of `optimized` (made once: the floor, the passive graph)
    tensor_info: dict = dataclasses.field(default_factory=dict)  # tensor id -> (dtype name, shape)
    arg_specs: tuple | None = None  # the last call's arguments, (dtype, device) each (function_surgery.arg_specs)
    writes: recovery.StateWrites | None = None  # what the step writes
    snapshot: recovery.Snapshot | None = None  # host copies of it
    floor_bytes: int = 0  # persistent bytes + the working-set floor (graph_model.working_set_floor)
    floor_op: str = ""
    start_bytes: int = 0  # the device's bytes in use when the measured step started (persistent state)
    history: list = dataclasses.field(default_factory=list)  # StepRecord per call
    replans: int = 0
    steps_since_change: int = 0
    fallback_reason: str | None = None  # set: capuchin_tf refused the signature, which runs as plain TensorFlow
    kept_failure: str | None = None  # where the last planning failure was kept (Options.keep_failures)
    from_cache: bool = False
    passive_fn: Any = None  # the step with passive mode's tensor pool (the last resort after repeated OOM)
    passive_only: bool = False  # no plan fits: every step runs in passive mode, as the measured one
    passive_def: Any = None
    # How much faster guided steps compute than the measured step's trace says: trace step time over the fastest
    # guided step's time without its waits for copies (recomputation included, so an underestimate).
    speedup: float = 1.0
    protected_steps: int = 0  # guided steps left that run with a host snapshot of `written` (after a plan change)
    untightenable_at: int = 0  # a plan budget for which no tighter plan was found (not searched again)
    # The plan of the last guided step that completed (after retries or not): (plan, plan budget, fn, its GraphDef).
    good: tuple | None = None
    earlier_frozen: bool = False  # late prefetches no longer move triggers earlier (that had run out of memory)
    # Measured arbitration (policy.feedback.wants_trial): the trial under way, as a dict (incumbent: (plan, plan
    # budget, fn, GraphDef) of the plan that ran before; incumbent_s: its median step; policy; steps: steps run with
    # the trial plan; seconds: those measured, after the first), and each policy considered -> what came of it.
    trial: dict | None = None
    tried: dict = dataclasses.field(default_factory=dict)
    # What guided steps were measured to need beyond their plan's predicted placement (feedback.placement_error): the
    # largest seen; the learned margin's plan is made with it.
    placement_error: int = 0
    # The trace took its ops' kernel times from a profiled guided step (ManagedStep._retime): attempted once, on the
    # first guided step that completes its profiled attempt.
    retimed: bool = False
    build: Any = None  # a plan change under way off the critical path (managed_step.Build), or None
    # The plan function whose guided steps last ran under the allocator's planned layout (None: none has; with
    # Options.planned_layout "auto", set when a guided step evicted tensors on demand: ManagedStep._layout_wanted).
    # A later plan's first step starts from its layout.
    layout_fn: Any = None


def signature_key(concrete, args) -> str:
    """The concrete function's name and the dtypes and shapes of the call's tensors."""
    name = concrete.name if isinstance(concrete.name, str) else concrete.name.decode()
    parts = [f"{t.dtype.name}{list(t.shape)}" for t in tf.nest.flatten(args, expand_composites=True)
             if isinstance(t, (tf.Tensor, tf.Variable))]
    return f"{name}({', '.join(parts)})"
