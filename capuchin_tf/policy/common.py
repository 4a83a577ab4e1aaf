"""What every policy shares: turning chosen evictions into plan decisions, and simulating them into a Plan."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

from capuchin_tf.core.plan import AccessRef, Decision, Plan, SwapDecision, options_tuple
from capuchin_tf.core.trace_index import TraceIndex
from capuchin_tf.policy.candidates import CandidatePair, Context
from capuchin_tf.policy.placement import place
from capuchin_tf.policy.simulator import InfeasiblePlanError, SimulationResult, simulate


def access_ref(idx: TraceIndex, tid: str, k: int) -> AccessRef:
    a = idx.access(tid, k)
    return AccessRef(tid, k, a.op, a.time)


def op_ref(idx: TraceIndex, pos: int) -> AccessRef:
    """An access made by the op at `pos`, naming it as a trigger."""
    a = idx.representative_access(pos)
    return AccessRef(a.tensor, a.index, a.op, a.time)


def swap_decision(
    idx: TraceIndex,
    pair: CandidatePair,
    trigger_pos: int | None,
    reason: str,
    planned_start: float | None = None,
) -> SwapDecision:
    return SwapDecision(
        tensor=pair.tensor,
        nbytes=pair.nbytes,
        evicted_access=access_ref(idx, pair.tensor, pair.k),
        back_access=access_ref(idx, pair.tensor, pair.k + 1),
        in_trigger=None if trigger_pos is None else op_ref(idx, trigger_pos),
        free_time_s=pair.free_time,
        swap_out_s=pair.swap_out_s,
        swap_in_s=pair.swap_in_s,
        planned_swap_in_start_s=planned_start,
        reason=reason,
    )


def with_predictions(decisions: Sequence[Decision], sim: SimulationResult) -> tuple[Decision, ...]:
    return tuple(dataclasses.replace(d, predicted_stall_s=float(sim.stalls.get(d.tensor, 0.0))) for d in decisions)


def simulate_feasible(trace, decisions: Sequence[Decision], device_model, index) -> tuple[list, SimulationResult]:
    """(decisions, their simulation), less the decisions the simulator names as infeasible, one round at a time.
    The planners check a replay's sources and a swap's accesses on positions in the trace; the simulator checks them
    on the times it replays (a source freed before a replay it triggers early, a read between an eviction and its
    back-access that the positions did not see), and it decides: the decision it names stays on the device. Raises
    InfeasiblePlanError when it names none of them."""
    decisions = list(decisions)
    while True:
        try:
            return decisions, simulate(trace, decisions, device_model, index=index)
        except InfeasiblePlanError as e:
            message = str(e)
            named = [d for d in decisions if repr(d.tensor) in message]
            if not named:
                raise
            first = min(named, key=lambda d: message.index(repr(d.tensor)))
            decisions = [d for d in decisions if d is not first]


def fits(ctx: Context, sim: SimulationResult) -> bool:
    return sim.peak_bytes + ctx.margin <= ctx.budget


def finalize(
    ctx: Context,
    policy: str,
    decisions: Sequence[Decision],
    *,
    options: Mapping | None = None,
    started: float | None = None,
    sim: SimulationResult | None = None,
    reason: str | None = None,
) -> Plan:
    """Simulates `decisions` (unless `sim` is given) and wraps them into a Plan. Simulated here, a decision the
    simulator finds infeasible stays on the device (`simulate_feasible`; the plan's options count them,
    ``kept_on_device``)."""
    if sim is None:
        made = len(decisions)
        decisions, sim = simulate_feasible(ctx.trace, decisions, ctx.dm, ctx.idx)
        if len(decisions) < made:
            options = {**(options or {}), "kept_on_device": made - len(decisions)}
    feasible = fits(ctx, sim)
    peak = sim.peak_bytes + ctx.margin
    if feasible:
        reason = None
    elif ctx.unreachable_op is not None:
        reason = (
            f"the budget is unreachable: op {ctx.unreachable_op!r} alone needs {ctx.unreachable_bytes} bytes "
            f"(its inputs + outputs + persistent {ctx.trace.persistent_bytes} bytes), more than the budget "
            f"{ctx.budget} bytes" + (f" minus the margin {ctx.margin}" if ctx.margin else "")
        )
    elif reason is None:
        reason = f"predicted peak {peak} bytes at op {sim.peak_op!r} exceeds the budget {ctx.budget} bytes"
    return Plan(
        policy=policy,
        budget_bytes=ctx.budget,
        device=ctx.dm,
        decisions=with_predictions(decisions, sim),
        feasible=feasible,
        predicted_peak_bytes=peak,
        predicted_step_s=sim.step_time,
        trace_step_s=ctx.trace.step_time,
        saving_target_bytes=ctx.target,
        margin_bytes=ctx.margin,
        reason=reason,
        unreachable_op=ctx.unreachable_op,
        predicted_peak_op=sim.peak_op,
        predicted_stall_s=sim.stall_s,
        predicted_recompute_s=sim.recompute_s,
        trace_peak_bytes=ctx.idx.replayed_peak(),
        persistent_bytes=ctx.trace.persistent_bytes,
        planning_s=(time.perf_counter() - started) if started is not None else 0.0,
        options=options_tuple(options or {}),
        predicted_fragmentation_bytes=place(sim.events).fragmentation,
    )
