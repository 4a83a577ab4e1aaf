"""The plan: what a policy decided for one AccessTrace, and why. Pure Python: imports no TensorFlow.

A plan is immutable (frozen dataclasses, tuples) and round-trips through JSON with a schema version. It holds one
decision per evicted tensor, in the paper's words (paper.md §1.5):

- the **evicted-access** (the access after which the tensor leaves the device, once that op is done) and the
  **back-access** (the first access after it, where the tensor must be back);
- for a **swap**: the **in-trigger** (the access after whose op the prefetch is issued; None = on demand at the
  back-access), the **free time** FT = SwapInStart - SwapOutEnd, and the two SwapTimes;
- for a **recompute**: the sources (tensors resident when the replay runs), the ops to replay in order, the trigger
  (``on-demand``: the back-access itself, the replay runs just before its op, as in the paper; ``early``: the replay
  runs after the trigger's op), MSPS, the tensors kept by collective recomputation and, for a tensor that an earlier
  replay already rebuilt and kept, which one.

Every access names an op of the trace, so the rewriter can map it to a graph node by name. The plan-level numbers
(predicted peak, step time, stalls) come from the simulator (simulator.py) with the plan's device model.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
from collections.abc import Iterable, Mapping
from typing import Union

from capuchin_tf.core.budget import MiB
from capuchin_tf.core.device_model import DeviceModel

PLAN_SCHEMA_VERSION = 1
PLAN_KIND = "capuchin_tf.Plan"



class _Name(str, enum.Enum):
    """A name written as its value in JSON, in f-strings and by str()."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class DecisionKind(_Name):
    SWAP = "swap"
    RECOMPUTE = "recompute"


class TriggerMode(_Name):
    """When a recomputation runs: at its back-access (the paper) or after an earlier trigger op."""

    ON_DEMAND = "on-demand"
    EARLY = "early"


SWAP, RECOMPUTE = DecisionKind.SWAP, DecisionKind.RECOMPUTE
ON_DEMAND, EARLY = TriggerMode.ON_DEMAND, TriggerMode.EARLY



class PlanError(ValueError):
    """The plan file is malformed or of an unsupported schema version."""


@dataclasses.dataclass(frozen=True)
class AccessRef:
    """One access {tensor_id, access index} (the paper's pair), with the op that makes it and its recorded time.
    Index -1: a trigger the feedback moved to an op that does not access that tensor (policy.feedback.move_triggers),
    which fires after `op` runs."""

    tensor: str
    index: int
    op: str
    time: float

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "index": self.index, "op": self.op, "time": self.time}

    @classmethod
    def from_json(cls, d: Mapping | None) -> AccessRef | None:
        if d is None:
            return None
        return cls(str(d["tensor"]), int(d["index"]), str(d["op"]), float(d["time"]))


@dataclasses.dataclass(frozen=True)
class SwapDecision:
    """Swap `tensor` out after its evicted-access and prefetch it at its in-trigger, back before its back-access."""

    tensor: str
    nbytes: int
    evicted_access: AccessRef
    back_access: AccessRef
    in_trigger: AccessRef | None  # None: swapped in on demand at the back-access (the paper's passive case)
    free_time_s: float  # FT = SwapInStartTime - SwapOutEndTime, with the ideal SwapInStartTime
    swap_out_s: float
    swap_in_s: float
    planned_swap_in_start_s: float | None = None  # when the planner expects the copy to start (link queue included)
    predicted_stall_s: float = 0.0  # from the simulator: how long the back-access waited for the swap-in
    reason: str = ""

    kind = SWAP

    def to_json(self) -> dict:
        return {
            "kind": SWAP,
            "tensor": self.tensor,
            "nbytes": self.nbytes,
            "evicted_access": self.evicted_access.to_json(),
            "back_access": self.back_access.to_json(),
            "in_trigger": None if self.in_trigger is None else self.in_trigger.to_json(),
            "free_time_s": self.free_time_s,
            "swap_out_s": self.swap_out_s,
            "swap_in_s": self.swap_in_s,
            "planned_swap_in_start_s": self.planned_swap_in_start_s,
            "predicted_stall_s": self.predicted_stall_s,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> SwapDecision:
        return cls(
            tensor=str(d["tensor"]),
            nbytes=int(d["nbytes"]),
            evicted_access=AccessRef.from_json(d["evicted_access"]),
            back_access=AccessRef.from_json(d["back_access"]),
            in_trigger=AccessRef.from_json(d.get("in_trigger")),
            free_time_s=float(d["free_time_s"]),
            swap_out_s=float(d["swap_out_s"]),
            swap_in_s=float(d["swap_in_s"]),
            planned_swap_in_start_s=_opt_float(d.get("planned_swap_in_start_s")),
            predicted_stall_s=float(d.get("predicted_stall_s", 0.0)),
            reason=str(d.get("reason", "")),
        )


@dataclasses.dataclass(frozen=True)
class RecomputeDecision:
    """Free `tensor` after its evicted-access and rebuild it by replaying `replay_ops` from `sources`."""

    tensor: str
    nbytes: int
    evicted_access: AccessRef
    back_access: AccessRef
    sources: tuple[str, ...]  # tensors the replay reads that it does not produce (resident when it runs)
    replay_ops: tuple[str, ...]  # trace op names, in execution order; () when `regenerated_by` rebuilt it
    trigger: AccessRef  # on-demand: the back-access; early: an access of the op after which the replay runs
    trigger_mode: TriggerMode = ON_DEMAND
    recompute_s: float = 0.0  # measured time of the replayed ops
    msps: float | None = None  # memory saving per second when the policy chose it (Algorithm 2)
    keeps: tuple[str, ...] = ()  # recompute targets this replay rebuilds and keeps (collective recomputation)
    regenerated_by: str | None = None  # the target whose replay rebuilt and kept this tensor
    predicted_stall_s: float = 0.0  # from the simulator: time the replay added to the step
    reason: str = ""

    kind = RECOMPUTE

    def to_json(self) -> dict:
        return {
            "kind": RECOMPUTE,
            "tensor": self.tensor,
            "nbytes": self.nbytes,
            "evicted_access": self.evicted_access.to_json(),
            "back_access": self.back_access.to_json(),
            "sources": list(self.sources),
            "replay_ops": list(self.replay_ops),
            "trigger": self.trigger.to_json(),
            "trigger_mode": self.trigger_mode,
            "recompute_s": self.recompute_s,
            "msps": self.msps,
            "keeps": list(self.keeps),
            "regenerated_by": self.regenerated_by,
            "predicted_stall_s": self.predicted_stall_s,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> RecomputeDecision:
        try:
            mode = TriggerMode(str(d.get("trigger_mode", ON_DEMAND)))
        except ValueError:
            raise PlanError(f"recompute of {d.get('tensor')!r}: unknown trigger_mode "
                            f"{d.get('trigger_mode')!r}") from None
        return cls(
            tensor=str(d["tensor"]),
            nbytes=int(d["nbytes"]),
            evicted_access=AccessRef.from_json(d["evicted_access"]),
            back_access=AccessRef.from_json(d["back_access"]),
            sources=tuple(d.get("sources", ())),
            replay_ops=tuple(d.get("replay_ops", ())),
            trigger=AccessRef.from_json(d["trigger"]),
            trigger_mode=mode,
            recompute_s=float(d.get("recompute_s", 0.0)),
            msps=_opt_float(d.get("msps")),
            keeps=tuple(d.get("keeps", ())),
            regenerated_by=d.get("regenerated_by"),
            predicted_stall_s=float(d.get("predicted_stall_s", 0.0)),
            reason=str(d.get("reason", "")),
        )


Decision = Union[SwapDecision, RecomputeDecision]


def decision_from_json(d: Mapping) -> Decision:
    kind = d.get("kind")
    if kind == SWAP:
        return SwapDecision.from_json(d)
    if kind == RECOMPUTE:
        return RecomputeDecision.from_json(d)
    raise PlanError(f"decision of {d.get('tensor')!r}: unknown kind {kind!r} "
                    f"(expected {SWAP.value!r} or {RECOMPUTE.value!r})")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A policy's decisions for one trace and budget, with the simulator's predictions."""

    policy: str
    budget_bytes: int
    device: DeviceModel
    decisions: tuple[Decision, ...]
    feasible: bool
    predicted_peak_bytes: int  # simulated peak, including the margin
    predicted_step_s: float
    trace_step_s: float
    saving_target_bytes: int = 0
    margin_bytes: int = 0  # allocator bytes the tensor model does not see (measured peak - replayed peak)
    reason: str | None = None  # why the plan is not feasible (names the op), or None
    unreachable_op: str | None = None  # the op whose working set alone exceeds the budget, if any
    predicted_peak_op: str | None = None
    predicted_stall_s: float = 0.0  # total time ops waited for swap-ins
    predicted_recompute_s: float = 0.0  # total time replays added to the step
    trace_peak_bytes: int = 0  # the ideal (replayed) peak of the trace, before any plan
    persistent_bytes: int = 0
    planning_s: float = 0.0
    options: tuple[tuple[str, object], ...] = ()
    # What a best-fit placement of the plan's buffers needs beyond the bytes live at once (policy/placement.py)
    predicted_fragmentation_bytes: int = 0

    # ---- derived -------------------------------------------------------------------------------------------------
    @property
    def swaps(self) -> tuple[SwapDecision, ...]:
        return tuple(d for d in self.decisions if d.kind == SWAP)

    @property
    def recomputes(self) -> tuple[RecomputeDecision, ...]:
        return tuple(d for d in self.decisions if d.kind == RECOMPUTE)

    @property
    def swapped_bytes(self) -> int:
        return sum(d.nbytes for d in self.swaps)

    @property
    def recomputed_bytes(self) -> int:
        return sum(d.nbytes for d in self.recomputes)

    @property
    def predicted_placed_peak_bytes(self) -> int:
        """The device the plan needs when its buffers are placed, not only counted: the predicted peak plus the
        placement's fragmentation."""
        return self.predicted_peak_bytes + self.predicted_fragmentation_bytes

    @property
    def predicted_overhead(self) -> float:
        """Predicted step time over the trace's step time, minus 1 (0.05 = 5% slower)."""
        return self.predicted_step_s / self.trace_step_s - 1.0 if self.trace_step_s > 0 else 0.0

    def prediction(self, lower_bound_s: float | None = None, net_budget_bytes: int | None = None,
                   evicted_on_demand_bytes: int | None = None) -> dict:
        """What the planner predicts of a step under this plan, as ratios of the trace's step (which stands for the
        plain step): the simulated step and peak, and `lower_bound_s` (simulator.lower_bound_s) when given. A
        benchmark multiplies the ratios by the plain step it measured and sets them beside the measured ones.

        `net_budget_bytes`: the plan runs with a safety net that keeps the device under this budget by evicting on
        demand (the runtime's pool). A plan predicted over it then moves at least the excess out and back on demand
        each step, in the step's path (the allocation waits for the eviction, the reader for the copy back): that
        time is added (`predicted_on_demand_s`, a lower estimate: each excess byte once each way), and the peak is
        the budget. Without a net such a plan runs out of memory; the figures are then the simulator's alone.

        `evicted_on_demand_bytes`: what the plan's own guided steps were measured to evict on demand a step (their
        median), where they ran: it replaces the predicted excess as the bytes moved on demand. The simulator counts
        bytes; the allocator also needs them in one piece, and on a device of the budget's size the free memory is
        split (docs/decisions.md, "A running plan's prediction learns its copies on demand"). `on_demand_from` says
        which; `simulated_step_ratio` is the simulator's step alone."""
        trace = self.trace_step_s
        excess = max(self.predicted_peak_bytes - net_budget_bytes, 0) if net_budget_bytes else 0
        moved = excess if evicted_on_demand_bytes is None else max(int(evicted_on_demand_bytes), 0)
        on_demand_s = (self.device.swap_out_time(moved) + self.device.swap_in_time(moved)) if moved else 0.0
        return {
            "predicted_step_ratio": (self.predicted_step_s + on_demand_s) / trace if trace > 0 else None,
            "simulated_step_ratio": self.predicted_step_s / trace if trace > 0 else None,
            "lower_bound_ratio": lower_bound_s / trace if trace > 0 and lower_bound_s is not None else None,
            "predicted_peak_bytes": self.predicted_peak_bytes - excess,
            "predicted_over_budget_bytes": excess,
            "predicted_on_demand_s": on_demand_s,
            "on_demand_bytes": moved,
            "on_demand_from": "predicted" if evicted_on_demand_bytes is None else "measured",
            "predicted_stall_s": self.predicted_stall_s,
            "predicted_recompute_s": self.predicted_recompute_s,
            "trace_step_s": trace,
            "feasible": self.feasible,
            "link_d2h_bytes_per_s": self.device.d2h_bytes_per_s,
            "link_h2d_bytes_per_s": self.device.h2d_bytes_per_s,
        }

    def decision_for(self, tensor: str) -> Decision | None:
        for d in self.decisions:
            if d.tensor == tensor:
                return d
        return None

    def summary(self) -> str:
        """A few readable lines: what is swapped and recomputed, the predicted peak and overhead."""
        status = "feasible" if self.feasible else "NOT feasible"
        lines = [
            f"policy {self.policy}: {status} under a budget of {self.budget_bytes / MiB:.1f} MiB "
            f"(link {self.device.link}: {self.device.d2h_bytes_per_s / 1e9:.3g} GB/s out, "
            f"{self.device.h2d_bytes_per_s / 1e9:.3g} GB/s in)",
            f"  trace: ideal peak {self.trace_peak_bytes / MiB:.1f} MiB (persistent {self.persistent_bytes / MiB:.1f}"
            f" MiB), step {self.trace_step_s * 1e3:.2f} ms; saving target {self.saving_target_bytes / MiB:.1f} MiB",
            f"  swapped: {len(self.swaps)} tensors, {self.swapped_bytes / MiB:.1f} MiB",
            f"  recomputed: {len(self.recomputes)} tensors, {self.recomputed_bytes / MiB:.1f} MiB",
            f"  predicted peak {self.predicted_peak_bytes / MiB:.1f} MiB"
            + (f" (at op {self.predicted_peak_op})" if self.predicted_peak_op else "")
            + f", step {self.predicted_step_s * 1e3:.2f} ms ({self.predicted_overhead * 100:+.1f}%: "
            f"stalls {self.predicted_stall_s * 1e3:.2f} ms, recomputation {self.predicted_recompute_s * 1e3:.2f} ms)",
        ]
        if self.reason:
            lines.append(f"  reason: {self.reason}")
        return "\n".join(lines)

    # ---- JSON ----------------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "kind": PLAN_KIND,
            "policy": self.policy,
            "budget_bytes": self.budget_bytes,
            "saving_target_bytes": self.saving_target_bytes,
            "margin_bytes": self.margin_bytes,
            "feasible": self.feasible,
            "reason": self.reason,
            "unreachable_op": self.unreachable_op,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_peak_op": self.predicted_peak_op,
            "predicted_fragmentation_bytes": self.predicted_fragmentation_bytes,
            "predicted_step_s": self.predicted_step_s,
            "trace_step_s": self.trace_step_s,
            "predicted_overhead": self.predicted_overhead,
            "predicted_stall_s": self.predicted_stall_s,
            "predicted_recompute_s": self.predicted_recompute_s,
            "trace_peak_bytes": self.trace_peak_bytes,
            "persistent_bytes": self.persistent_bytes,
            "swapped_bytes": self.swapped_bytes,
            "recomputed_bytes": self.recomputed_bytes,
            "n_swaps": len(self.swaps),
            "n_recomputes": len(self.recomputes),
            "planning_s": self.planning_s,
            "device": self.device.to_json(),
            "options": {k: v for k, v in self.options},
            "decisions": [d.to_json() for d in self.decisions],
        }

    @classmethod
    def from_json(cls, d: Mapping) -> Plan:
        if d.get("kind") != PLAN_KIND:
            raise PlanError(f"not a capuchin_tf plan (kind != {PLAN_KIND!r})")
        if d.get("schema_version") != PLAN_SCHEMA_VERSION:
            raise PlanError(
                f"plan schema version {d.get('schema_version')!r} is not supported (this is {PLAN_SCHEMA_VERSION})"
            )
        return cls(
            policy=str(d["policy"]),
            budget_bytes=int(d["budget_bytes"]),
            device=DeviceModel.from_json(d["device"]),
            decisions=tuple(decision_from_json(x) for x in d.get("decisions", ())),
            feasible=bool(d["feasible"]),
            predicted_peak_bytes=int(d["predicted_peak_bytes"]),
            predicted_step_s=float(d["predicted_step_s"]),
            trace_step_s=float(d["trace_step_s"]),
            saving_target_bytes=int(d.get("saving_target_bytes", 0)),
            margin_bytes=int(d.get("margin_bytes", 0)),
            reason=d.get("reason"),
            unreachable_op=d.get("unreachable_op"),
            predicted_peak_op=d.get("predicted_peak_op"),
            predicted_stall_s=float(d.get("predicted_stall_s", 0.0)),
            predicted_recompute_s=float(d.get("predicted_recompute_s", 0.0)),
            trace_peak_bytes=int(d.get("trace_peak_bytes", 0)),
            persistent_bytes=int(d.get("persistent_bytes", 0)),
            planning_s=float(d.get("planning_s", 0.0)),
            predicted_fragmentation_bytes=int(d.get("predicted_fragmentation_bytes", 0)),
            options=tuple(sorted((str(k), v) for k, v in dict(d.get("options", {})).items())),
        )

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Plan:
        try:
            data = json.loads(pathlib.Path(path).read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not valid JSON ({e})") from e
        return cls.from_json(data)


def _opt_float(v) -> float | None:
    return None if v is None else float(v)


def options_tuple(options: Mapping | Iterable[tuple[str, object]]) -> tuple[tuple[str, object], ...]:
    """Policy options as a sorted tuple of JSON-friendly pairs (for Plan.options)."""
    items = options.items() if isinstance(options, Mapping) else options
    out = []
    for k, v in items:
        if not isinstance(v, (str, int, float, bool, type(None))):
            v = repr(v)
        out.append((str(k), v))
    return tuple(sorted(out))
