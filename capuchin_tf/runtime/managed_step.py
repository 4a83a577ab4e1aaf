"""The runtime: measured execution, then guided execution, per input signature (paper.md §1.3, §1.6, §1.11).

`ManagedStep` runs a `tf.function` training step. A signature is the concrete function and the shapes and dtypes of
the call's tensors: each gets its own measurement and plan (at most `max_signatures`, least recently used first out,
with a warning). The first call of a signature is the measured execution (measure.measure_step: a real step in
passive mode under the budget); its trace and the budget give a plan (policy.make_plan); the plan is applied to the
step's optimized graph (rewrite.apply_plan) and every later call runs that guided step. After each guided step the
runtime reads what the host store saw (which swap-ins waited for their copy and how long, the allocator's peak) and
adjusts the plan (capuchin_tf.policy.feedback): a late prefetch moves that tensor's in-trigger earlier by 5% of its swap
time (the paper) or by its wait, if longer; a prefetch evicted again before its use moves it later; a peak over the
budget re-plans for a tighter budget (beyond the paper). The step is re-rewritten only when the plan changed, at most
once per step and at most `max_replans` times; it is settled after `settle_steps` steps without a change. The emulated
link (p100) follows the speed the guided steps compute at.

Background builds (`background_builds`, on by default): a plan change the feedback or a measured arbitration asks for
is planned, rewritten and built (`Build`: a thread of its own) while the current plan keeps running, and runs from the
step after the one during which it became ready; steps that ran while it was built (`StepRecord.building`) give no
feedback and are no measurement of their plan (they share the machine with the build, which runs at the lowest
priority and is waited for after BUILD_WAIT_STEPS of them). A plan change after an out-of-memory error is made at
once, and drops any under way.

The budget holds: while a managed step runs, the device allocator enforces `budget_bytes` when it is below the
device's size (ops.set_memory_budget: passive eviction at the budget, an out-of-memory error past it). A budget below
what the step can ever need (the working-set floor: persistent state plus the largest op's transient inputs and
outputs, graph_model.working_set_floor) is refused with `BudgetError` before anything runs.

Same numbers or a clear refusal (design.md, promises 1 and 4). What the step writes is found in its optimized graph
(recovery.state_writes: variables, optimizer state, seed generators, random generators, in cond branches and loop
bodies too), and host copies of it are taken before every attempt that can fail part-way. An attempt that fails has
whatever it may have written restored (recovery.possibly_written: every write that does not depend on the failing
op) before anything else happens, so a retry never applies an update twice:
- the measured step, out of memory: restored and run once more (where it fails depends on BFC fragmentation, which
  varies from run to run); a second failure raises `BudgetError`, the variables as they were;
- a guided step, out of memory: restored and retried with a tighter plan (ManagedStep._tighten), or the plan of the
  last guided step that completed; after `max_retries` tries the step runs in passive mode (the measured step's
  mechanism), once more after another failure, then raises `CapuchinError`;
- any other error of a capuchin_tf graph: restored, then the plain step runs; if it fails too the error is the
  step's own and is raised; else capuchin_tf refuses the signature.
A signature capuchin_tf cannot manage (it writes state that cannot be copied back; its plan cannot be applied; its
measured or guided graph fails) runs as plain TensorFlow from then on, with one warning naming the reason
(`strict=True` raises `CapuchinError` instead, the variables as they were). A first call that raises leaves nothing
behind: the next call measures again. One managed step runs at a time in a process (the profiler, the allocator's
modes and the host store are process-wide): calls from several threads wait for each other.

Safety net: for capuchin's policies (capuchin, swap-only, recompute-only) every guided step keeps passive mode's
pool: tensors the plan does not handle are handed to it as in the measured step, and what the plan did not foresee
is evicted on demand (the baselines swap-all and checkpoint run their plans alone). When the planner finds no plan
its model says fits the budget, the best one runs; if it runs out of memory where the measured step fitted, the steps
run in passive mode from then on, as the measured one (phase "passive"; the report's `passive_only`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import math
import os
import re
import statistics
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Mapping

import tensorflow as tf

from capuchin_tf import _version
from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.budget import format_bytes
from capuchin_tf.core.device_model import DeviceModel, link_is_emulated, link_needs_flops
from capuchin_tf.core.graph_model import fold_views, shape_of, split_tensor_id, working_set_floor
from capuchin_tf.core.plan import Plan
from capuchin_tf.core.schedule import small_tensor_peak
from capuchin_tf.core.stalls import summarize as summarize_stalls
from capuchin_tf.policy import POLICIES, make_plan
from capuchin_tf.policy.feedback import (
    LEARNED_MARGIN,
    TIGHTEN,
    TRIAL_STEPS,
    margin_candidate,
    on_demand_s,
    placement_error,
    plan_after_step,
    tighter_plan,
    trial_candidate,
    trial_expected_s,
    trial_keeps,
    trial_may_win,
    wants_trial,
)
from capuchin_tf.policy.hybrid import assumed_placement_error, placed_step_s
from capuchin_tf.policy.plan_cache import CacheKey, PlanCache
from capuchin_tf.policy.simulator import lower_bound_s, simulate
from capuchin_tf.runtime import heap, recovery
from capuchin_tf.runtime.errors import (
    BudgetError,
    CapuchinError,
    Refusal,
    in_use_breakdown,
    keep_planning_failure,
    oom_line,
)
from capuchin_tf.runtime.options import Options
from capuchin_tf.runtime.signature import SignatureState, StepRecord, signature_key
from capuchin_tf.tf import capture, function_surgery, measure, ops, rewrite
from capuchin_tf.tf.simulated_device import DEVICE

# The plain step runs unrewritten when the measured step evicted nothing and peaked under this fraction of the budget
# (the plain executor's own order can peak higher than the measured one; docs/decisions.md, "Nothing to save").
NOTHING_TO_SAVE = 0.85
# The emulated link follows the guided steps' speed (_device_model); when it speeds up by more than this fraction after
# a step, that step's prefetch timings are not feedback for the link that follows.
RELINK_FRACTION = 0.05
# The first guided step of a signature with feedback runs under the profiler and re-times the trace (_retime), if its
# profile names at least this fraction of the trace's ops.
RETIME_COVERAGE = 0.9
MEASURED_RETRIES = 1  # reruns of the measured step, or of a passive rescue, after an out-of-memory error
# A measured step that ran out of memory with the bytes free but not in one run runs again under a budget lower by
# this fraction of the refused request (_split_retry_budget).
SPLIT_RETRY_FRACTION = 0.25
# The allocator's small-tensor pool is sized from the process's first managed step before anything uses it: this
# multiple of the peak of the step's small tensors in the executor's estimated order (schedule.small_tensor_peak; the
# measured peak was 0.7-1.3x it), at least SMALL_POOL_MIN_BYTES, at most 1/SMALL_POOL_BUDGET_SHARE of the budget or
# SMALL_POOL_MOST_BYTES, whichever is more. The pool's region is the budget's for the whole step, and the step's
# tightest moment is not its small tensors' peak: with the pool sized to that peak alone (up to a sixteenth of the
# device), ResNet101 b16's measured step ran out of bytes where the 1/128 share ran guided (docs/decisions.md, "Small
# tensors have a pool of their own").
SMALL_POOL_MARGIN = 1.4
SMALL_POOL_MIN_BYTES = 256 << 10
SMALL_POOL_MOST_BYTES = 1 << 20
SMALL_POOL_BUDGET_SHARE = 128

# One managed step at a time in a process: the profiler, the allocator's passive mode and budget, the host store's
# link emulation and stall log are process-wide.
_PROCESS_LOCK = threading.RLock()


# Background builds still running at exit are waited for (a thread stopped inside TensorFlow's importer can crash the
# interpreter's shutdown).
_BUILDS: weakref.WeakSet = weakref.WeakSet()


def wait_for_builds() -> float:
    """Waits until no plan change of any managed step is being built in the background; the seconds waited (what
    `bench interleaved` keeps out of the next policy's step: a build otherwise shares the machine with it)."""
    t0 = time.perf_counter()
    for thread in list(_BUILDS):
        thread.join()
    return time.perf_counter() - t0


atexit.register(wait_for_builds)
# While a build runs, the interpreter hands the GIL over after this many seconds instead of its default 5 ms: the
# step's thread takes it back after each TensorFlow call, hundreds of times a step (the host snapshot's reads, the
# host store's counters), and at 5 ms a wait that is most of a short step (docs/decisions.md, "Plan changes off the
# critical path").
BUILD_SWITCH_INTERVAL_S = 0.0002
# The build thread runs at this niceness (Linux): the step's kernels get the cores first and the build what they leave
# (the steps a ResNet50 build overlaps: 0.3-0.5 s slower in all, against 0.7-1.1 s at the step's own priority; the
# build arrives a step or two later; docs/decisions.md, "Plan changes off the critical path").
BUILD_NICE = 19
# A build not done after it overlapped this many steps is waited for at the end of the last of them (a niced thread
# on a machine busy with other work could otherwise wait indefinitely).
BUILD_WAIT_STEPS = 3
_switch = {"builds": 0, "interval": None}
_switch_lock = threading.Lock()


def _builds_running(delta: int) -> None:
    with _switch_lock:
        _switch["builds"] += delta
        if delta > 0 and _switch["builds"] == 1:
            _switch["interval"] = sys.getswitchinterval()
            sys.setswitchinterval(BUILD_SWITCH_INTERVAL_S)
        elif delta < 0 and _switch["builds"] == 0 and _switch["interval"] is not None:
            sys.setswitchinterval(_switch["interval"])


class Build:
    """A plan change under way off the critical path: `job` (planning, rewriting and building a guided step; it
    changes nothing the running step uses) runs in a thread of its own while the current plan keeps running, and
    `then(result)` applies its result in the step's thread once it is done (ManagedStep._take_build)."""

    def __init__(self, job, then):
        self.then = then
        self.steps = 0  # steps that ran while it was built
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(job,), name="capuchin-tf-build", daemon=True)
        _BUILDS.add(self.thread)
        _builds_running(+1)
        try:
            self.thread.start()
        except BaseException:
            _builds_running(-1)
            raise

    def _run(self, job) -> None:
        try:
            if sys.platform.startswith("linux"):  # a thread's own priority (elsewhere it would be the process's)
                try:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BUILD_NICE)
                except OSError:
                    pass
            with heap.young_heap():
                self.result = job()
        except BaseException as e:  # noqa: BLE001  (reported when the result is taken)
            self.error = e
        finally:
            _builds_running(-1)

    def done(self) -> bool:
        return not self.thread.is_alive()


def device_limit_bytes() -> int | None:
    """The device allocator's limit (the simulated device's size), or None when it has none."""
    limit = int(ops.allocator_stats()["bytes_limit"])
    return limit if limit > 0 else None


class ManagedStep:
    """A training step under capuchin_tf. Call it like the tf.function it wraps (positional arguments)."""

    def __init__(self, tf_fn, options: Options | None = None):
        self._fn = tf_fn
        self.options = Options() if options is None else options
        self.cache = PlanCache(self.options.plan_cache) if self.options.plan_cache else None
        self.safety_net = POLICIES[self.options.policy].safety_net
        self._states: collections.OrderedDict[str, SignatureState] = collections.OrderedDict()
        self._warned_signatures = False

    # ---- public ------------------------------------------------------------------------------------------------
    @property
    def python_function(self):
        return self._fn

    def states(self) -> dict[str, SignatureState]:
        """Per input signature (concrete function and the call's shapes), what capuchin_tf measured and planned."""
        return dict(self._states)

    def report(self) -> dict:
        """A JSON-able summary of every signature: plan counts, peaks, late prefetches, re-plans, settled or not, and
        what the planner predicts of a step under the current plan."""
        out = {}
        for key, st in self._states.items():
            plan = st.plan
            out[key] = {
                "phase": st.history[-1].phase if st.history else None,
                "budget_bytes": self.options.budget_bytes,
                "plan_budget_bytes": st.plan_budget,
                "floor_bytes": st.floor_bytes,
                "swapped_tensors": len(plan.swaps) if plan else 0,
                "swapped_bytes": plan.swapped_bytes if plan else 0,
                "recomputed_tensors": len(plan.recomputes) if plan else 0,
                "recomputed_bytes": plan.recomputed_bytes if plan else 0,
                "replans": st.replans,
                "settled": st.steps_since_change >= self.options.settle_steps and st.build is None,
                "building": st.build is not None,  # a plan change under way off the critical path
                "fallback_reason": st.fallback_reason,
                "kept_failure": st.kept_failure,  # where a planning failure was kept (Options.keep_failures)
                # the policy whose plan runs (another than the step's policy after a measured arbitration), and each
                # trial policy considered -> what came of it (policy.feedback, "measured arbitration")
                "plan_policy": plan.policy if plan else None,
                # which of its plans the policy chose (plan_capuchin's fallback: a half, "covered", "placed",
                # "checkpoint")
                "plan_fallback": dict(plan.options).get("fallback") if plan else None,
                "trials": dict(st.tried),
                "placement_error_bytes": st.placement_error,  # learned from the bytes evicted on demand
                "planned_layout": st.fn is not None and self._layout_wanted(st),  # the running plan's steps
                "passive_only": st.passive_only,
                "from_cache": st.from_cache,
                "speedup": st.speedup,
                # the current plan's predicted step, peak and lower bound, as ratios of the trace's step
                "prediction": self._prediction(st) if plan else None,
                "steps": [dataclasses.asdict(r) for r in st.history],
            }
        return out

    def _prediction(self, st: SignatureState) -> dict:
        """The running plan's prediction (Plan.prediction), on the signature's trace: a plan made before the trace
        was re-timed (_retime) is simulated again on it, with the link model of its clock. Where the plan's guided
        steps have run, the bytes they evicted on demand (their median) are the bytes it moves on demand."""
        plan, trace = st.plan, st.trace
        net = (self.options.budget_bytes or st.plan_budget) if self.safety_net else None  # what the pool keeps to
        ran = self._plan_steps(st)
        evicted = int(statistics.median(r.passive_evicted_bytes for r in ran)) if ran and self.safety_net else None
        if plan.trace_step_s == trace.step_time or trace.step_time <= 0:
            return plan.prediction(lower_bound_s(trace, plan), net_budget_bytes=net, evicted_on_demand_bytes=evicted)
        try:
            plan = dataclasses.replace(plan, device=DeviceModel.from_link(self.options.link, trace))
            sim = simulate(trace, plan)
        except Exception as e:  # noqa: BLE001  (a report never fails: the plan's own prediction, and why)
            return {**st.plan.prediction(lower_bound_s(trace, st.plan), net_budget_bytes=net,
                                         evicted_on_demand_bytes=evicted),
                    "on_retimed_trace": False, "retimed_error": f"{type(e).__name__}: {e}"}
        out = dataclasses.replace(plan, predicted_step_s=sim.step_time, trace_step_s=trace.step_time,
                                  predicted_peak_bytes=sim.peak_bytes + plan.margin_bytes,
                                  predicted_stall_s=sim.stall_s, predicted_recompute_s=sim.recompute_s,
                                  ).prediction(lower_bound_s(trace, plan), net_budget_bytes=net,
                                               evicted_on_demand_bytes=evicted)
        return {**out, "on_retimed_trace": True}

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError("a capuchin_tf.function step takes positional arguments only; got keyword arguments "
                            f"{sorted(kwargs)}")
        with _PROCESS_LOCK:
            return self._call(args)

    def _call(self, args):
        concrete = capture.concrete_step(self._fn, args)
        key = signature_key(concrete, args)
        state = self._states.get(key)
        if state is None or state.trace is None:
            with heap.young_heap():  # the signature's first call: capture, measurement and planning, in Python
                return self._call_state(state, concrete, key, args)
        return self._call_state(state, concrete, key, args)

    def _call_state(self, state: SignatureState | None, concrete, key: str, args):
        if state is None:
            state = self._new_state(concrete, key, args)
            self._size_small_pool(state)
        else:
            self._states.move_to_end(key)
        ops.set_small_pool(True)  # small tensors get a pool of their own (the allocator's switch; one small op)
        if state.fallback_reason is not None:
            return self._plain(state, args)
        if state.passive_only:
            return self._passive(state, args, 0, None)
        if state.trace is None:
            if self._load_cached(state, args):
                return self._guided(state, args)
            try:
                return self._measured(state, args)
            except BaseException:
                # Nothing of this call is left behind (the variables were restored): the next call measures again.
                if state.trace is None and self._states.get(key) is state:
                    del self._states[key]
                raise
        return self._guided(state, args)

    # ---- signatures ----------------------------------------------------------------------------------------------
    def _new_state(self, concrete, key: str, args) -> SignatureState:
        state = SignatureState(concrete=concrete, key=key)
        try:
            self._prepare(state, args)
        except Refusal as refusal:
            self._refuse(state, str(refusal))
        if len(self._states) >= self.options.max_signatures:
            old, _ = self._states.popitem(last=False)
            if not self._warned_signatures:
                self._warned_signatures = True
                warnings.warn(f"capuchin_tf: this step was called with more than {self.options.max_signatures} input "
                              f"signatures (shapes); each new one is measured again, and the least recently used "
                              f"({old}) was dropped. Pad or bucket the inputs to a few shapes, or raise "
                              "max_signatures.", RuntimeWarning, stacklevel=4)
        self._states[key] = state
        return state

    def _prepare(self, state: SignatureState, args) -> None:
        """The optimized graph, what it writes, and the working-set floor (before the step ever runs)."""
        concrete = state.concrete
        captures = [external for external, _ in concrete.graph.captures]
        n_user = len(concrete.graph.inputs) - len(captures)
        try:
            state.optimized = capture.optimized_graph(concrete, args)
        except (capture.CaptureError, tf.errors.OpError) as e:
            raise Refusal(f"its optimized graph could not be read ({type(e).__name__}: {oom_line(e)})") from e
        writes = recovery.state_writes(state.optimized, n_user)
        # Assignments write into the variable's own buffer: the variables stay where compaction laid them out.
        state.optimized, _ = rewrite.assignments_in_place(state.optimized)
        not_variables = [f"{w} ({next(n.op for n in state.optimized.node if n.name == w)})"
                         for w, indices in writes.writers.items()
                         if any(recovery.variable_dtype(captures[i]) is None for i in indices)]
        if writes.unknown or not_variables:
            named = list(writes.unknown) + not_variables
            # A summary written in the step would be written again by a retried attempt.
            hint = ("; write summaries outside the managed step (return the values and call tf.summary after it)"
                    if any(re.search(r"\(Write\w*Summary\)$", w) for w in named) else "")
            raise Refusal(f"it writes state capuchin_tf cannot copy and restore after a failure: "
                           f"{', '.join(named[:3])} (a resource that is not a captured variable){hint}")
        try:
            state.snapshot = recovery.Snapshot(captures, writes.captures)
        except ValueError as e:
            raise Refusal(f"it writes a resource capuchin_tf cannot copy ({e})") from e
        state.writes = writes
        try:
            state.shaped = rewrite.shapes_graph(concrete, state.optimized, args)
        except rewrite.RewriteError as e:
            raise Refusal(f"its optimized graph could not be imported ({e})") from e
        state.optimized_model = capture.graph_model(state.optimized, state.shaped)
        floor = working_set_floor(fold_views(state.optimized_model))
        # What is on the device, and what variables that share a buffer will own (Keras' optimizer slots start as one
        # zeros tensor per shape: AdamW with EMA and gradient accumulation has 4x the model's weights in them).
        persistent = (tf.config.experimental.get_memory_info(DEVICE)["current"]
                      + recovery.shared_variable_bytes(captures))
        state.floor_bytes, state.floor_op = persistent + floor.bytes, floor.op
        if self.options.budget_bytes is not None and state.floor_bytes > self.options.budget_bytes:
            raise BudgetError(
                f"capuchin_tf: a memory budget of {format_bytes(self.options.budget_bytes)} is below what this step "
                f"needs at "
                f"once: op {floor.op!r} ({floor.op_type}) reads and writes {format_bytes(floor.bytes)} of tensors "
                f"while {format_bytes(persistent)} of persistent state (variables, optimizer slots, the step's "
                f"inputs; optimizer slots that share one buffer until their first write counted once each) is on the "
                f"device. No budget below "
                f"{format_bytes(state.floor_bytes)} can work (the op's "
                "temporaries come on top); nothing was run.")

    def _size_small_pool(self, state: SignatureState) -> None:
        """Sizes the allocator's small-tensor pool to the step's small tensors (SMALL_POOL_MARGIN), at most a share of
        the budget, if nothing has used the pool yet: the process's first managed step sizes it (a graph with a loop
        gets that share). Used already, or sized by the user, it stays."""
        stats = ops.allocator_stats()
        limit = device_limit_bytes()
        if (limit is None or state.optimized_model is None or stats["small_pool_bytes_limit"] <= 0
                or stats["small_pool_peak_bytes_in_use"] != 0):
            return
        budget = min(limit, self.options.budget_bytes or limit)
        most = max(SMALL_POOL_MOST_BYTES, budget // SMALL_POOL_BUDGET_SHARE)
        peak = small_tensor_peak(state.optimized_model)
        ops.size_small_pool(most if peak is None else
                            min(most, max(SMALL_POOL_MIN_BYTES, math.ceil(SMALL_POOL_MARGIN * peak))))

    def _refuse(self, state: SignatureState, reason: str) -> None:
        """The signature runs as plain TensorFlow from now on, with one warning (strict: CapuchinError)."""
        if self.options.strict:
            raise CapuchinError(f"capuchin_tf cannot manage this step ({state.key}): {reason}")
        state.fallback_reason = reason
        state.fn = state.build = None
        warnings.warn(f"capuchin_tf: running the plain TensorFlow step for this input signature: {reason}",
                      RuntimeWarning, stacklevel=5)

    def _plain(self, state: SignatureState, args):
        tf.config.experimental.reset_memory_stats(DEVICE)
        t0 = time.perf_counter()
        outputs = self._fn(*args)
        state.history.append(StepRecord("plain", time.perf_counter() - t0,
                                        tf.config.experimental.get_memory_info(DEVICE)["peak"]))
        return outputs

    @contextlib.contextmanager
    def _budget(self, plain: bool = False, lowered: int | None = None):
        """The allocator enforces the budget while a managed step runs (on the simulated device: when the budget is
        below the device's size; at or above it the device's own limit does, and the allocator, knowing a budget is
        set, fails an allocation there at once instead of BFC's 10 s wait for frees: docs/decisions.md, "No wait at
        the budget"). A `plain` step (plain TensorFlow's, the `tf` policy) keeps BFC's own behaviour on a device of
        the budget's size: it is the baseline. `lowered`: a lower budget the allocator enforces instead (the measured
        step's retry after split free memory, _split_retry_budget)."""
        limit = device_limit_bytes()
        on = (self.options.budget_bytes is not None and limit is not None
              and (self.options.budget_bytes < limit or not plain))
        if on:
            ops.set_memory_budget(self.options.budget_bytes if lowered is None else lowered)
        try:
            yield
        finally:
            if on:
                ops.set_memory_budget(None)

    def _own_error_or_refuse(self, state: SignatureState, args, error: Exception, what: str):
        """A capuchin_tf graph failed with `error` (not out of memory), its writes restored: the plain step tells
        whose error it is. If it fails too, its error is raised (the step's own); else the signature is refused and
        the plain step's outputs returned. Strict: CapuchinError at once."""
        reason = f"its {what} failed: {type(error).__name__}: {oom_line(error)}"
        if self.options.strict:
            raise CapuchinError(f"capuchin_tf cannot manage this step ({state.key}): {reason}; the variables are "
                                "as they were before the call") from error
        outputs = self._fn(*args)
        self._refuse(state, reason)
        state.history.append(StepRecord("plain", 0.0, tf.config.experimental.get_memory_info(DEVICE)["peak"]))
        return outputs

    # ---- measured execution ------------------------------------------------------------------------------------
    def _meta(self, concrete) -> dict:
        meta = {}
        if link_needs_flops(self.options.link):
            meta["flops"] = measure.count_flops(concrete)
        return meta

    def _device_model(self, trace: AccessTrace, state: SignatureState | None = None) -> DeviceModel:
        """The link model the planner works with, on the trace's clock; also sets the host store's link emulation.

        The measured step runs slower than a guided one (the profiler, the pool's evictions): the trace's clock is
        `speedup` times slower than the guided steps' (measured after each guided step). The plan keeps the trace's
        ratio of compute to transfer; the emulated link runs `speedup` times faster than the planner's, so that at
        run time the ratio is the same (for p100: the step's FLOP count over its real compute time, per byte)."""
        model = DeviceModel.from_link(self.options.link, trace)
        speedup = state.speedup if state is not None else 1.0
        if not link_is_emulated(self.options.link):
            ops.set_link_bandwidth(0.0)
        else:
            ops.set_link_bandwidth(model.d2h_bytes_per_s * speedup, model.h2d_bytes_per_s * speedup)
        return model

    def _measured(self, state: SignatureState, args):
        """The measured step (see the module docstring for what happens when it fails)."""
        t0 = time.perf_counter()
        try:
            meta = self._meta(state.concrete)
            if state.passive_def is None:
                state.passive_def = rewrite.passive_graph(state.concrete, args, state.optimized, state.shaped,
                                                         state.optimized_model)
        except (rewrite.RewriteError, capture.CaptureError, ValueError, KeyError) as e:
            self._refuse(state, f"its measured step could not be built ({type(e).__name__}: {e})")
            return self._plain(state, args)
        if self.options.budget_bytes is not None:
            # The variables in one run of memory, so that the step's free memory is one run too (recovery.py).
            try:
                done = recovery.compact_variables([external for external, _ in state.concrete.graph.captures])
            except recovery.CompactionError as e:
                raise BudgetError(str(e)) from e
            if done is not None and self.options.verbose:
                print(f"capuchin_tf: laid out {done.variables} variables ({format_bytes(done.bytes)}) in one run; "
                      f"the device's largest free run {format_bytes(done.largest_free_before)} -> "
                      f"{format_bytes(done.largest_free_after)}", flush=True)
        state.snapshot.take()
        state.start_bytes = tf.config.experimental.get_memory_info(DEVICE)["current"]
        retried, lowered = 0, None
        while True:
            tf.config.experimental.reset_memory_stats(DEVICE)
            refusals = ops.allocator_stats()["refusals"]
            if lowered is not None:
                meta = {**meta, "ran_under_bytes": lowered}  # its evictions were for that budget (saving_target)
            try:
                with self._budget(lowered=lowered):
                    outputs, trace = measure.measure_step(self._fn, args, budget_bytes=self.options.budget_bytes,
                                                          meta=meta, graph_def=state.passive_def,
                                                          shaped=state.shaped)
                break
            except tf.errors.ResourceExhaustedError as e:
                state.snapshot.restore(recovery.possibly_written(state.passive_def, state.writes,
                                                                 recovery.failed_node(e)))
                if retried >= MEASURED_RETRIES:
                    raise self._measured_oom(state, e, refusals, lowered=lowered) from e
                retried += 1
                lowered = self._split_retry_budget(state, refusals)
                if self.options.verbose:
                    print(f"capuchin_tf: the measured step ran out of memory ({oom_line(e)}); variables restored, "
                          "running it again" + (f" under {format_bytes(lowered)}: the free memory was split"
                                                if lowered is not None else ""), flush=True)
            except capture.MergedGraphError as e:  # the graph it ran was read merged with another thread's function
                state.snapshot.restore()
                if retried >= MEASURED_RETRIES:
                    return self._own_error_or_refuse(state, args, e, "measured step")
                retried += 1
                if self.options.verbose:
                    print(f"capuchin_tf: {e}; variables restored, running the measured step again", flush=True)
            except Exception as e:  # an error of the measured graph: not ours to pass on unless the step's own
                state.snapshot.restore()
                return self._own_error_or_refuse(state, args, e, "measured step")
        seconds = time.perf_counter() - t0
        state.trace = trace
        if self.options.link_clock_s is not None and trace.step_time > 0:
            # The p100 link at a fixed clock (a plain step's time): the guided steps are taken to run that fast, and
            # the emulated link does not follow them (Options.link_clock_s).
            state.speedup = trace.step_time / self.options.link_clock_s
        state.history.append(StepRecord("measured", seconds, trace.peak_bytes, retried=retried,
                                        lowered_budget_bytes=lowered or 0))
        try:
            self._plan_and_rewrite(state, self.options.budget_bytes)
        except (Refusal, Exception) as e:  # noqa: BLE001  (whatever went wrong, the step's update stands, once)
            if self.options.strict:
                state.snapshot.restore()
                raise CapuchinError(f"capuchin_tf cannot manage this step ({state.key}): planning failed "
                                    f"({type(e).__name__}: {e}); the variables are as they were before the call"
                                    + (f"; its trace and error are kept in {state.kept_failure}"
                                       if state.kept_failure else "")) from e
            self._refuse(state, str(e) if isinstance(e, Refusal) else
                         f"planning failed ({type(e).__name__}: {e})"
                         + (f"; its trace and error are kept in {state.kept_failure}" if state.kept_failure else ""))
        if self.cache is not None and state.fn is not None and state.fallback_reason is None:
            try:
                self.cache.store(self._cache_key(state, args), state.plan, extra={"trace": trace.to_json()})
            except OSError as e:
                warnings.warn(f"capuchin_tf: the plan could not be cached ({e})", RuntimeWarning, stacklevel=4)
        return outputs

    def _split_retry_budget(self, state: SignatureState, refusals_before: int) -> int | None:
        """The budget the measured step runs again under after it ran out of memory with enough bytes free but not in
        one run: lower than the one it failed under by SPLIT_RETRY_FRACTION of what the refused allocation asked
        for, no lower than the step's floor. Run again as it was, on the same layout, it fails at the same op; under
        the lower budget passive mode evicts earlier in the step, and the layout that op meets differs (the plan is
        still made for the step's own budget). None when the refusal was for bytes (or none was recorded): the retry
        runs as before."""
        stats = ops.allocator_stats()
        budget, limit = self.options.budget_bytes, device_limit_bytes()
        if budget is None or limit is None or stats["refusals"] <= refusals_before or stats["refused_bytes"] <= 0:
            return None
        asked, in_use = stats["refused_bytes"], stats["refused_in_use"]
        enforced = min(budget, limit)
        if in_use + asked > enforced:
            return None
        lowered = max(enforced - math.ceil(SPLIT_RETRY_FRACTION * asked), state.floor_bytes)
        return lowered if lowered < enforced else None

    def _measured_oom(self, state: SignatureState, error, refusals_before: int,
                      head: str | None = None, lowered: int | None = None) -> BudgetError:
        """The error of a measured step that ran out of memory in both its runs, from what the allocator saw when it
        refused: what the step asked for, and what was in use that passive mode could not evict (tensors the ops that
        run or wait to run hold, persistent state, tensors made or read in cond branches or loop bodies, tensors too
        small to pool), which no budget below their sum can run; or, with enough bytes free, that they were split.
        `lowered`: the budget its second run had (_split_retry_budget)."""
        budget = self.options.budget_bytes or 0
        if head is None:
            again = ("" if lowered is None else
                     f", the second time under {format_bytes(lowered)} (lowered after the first found the free memory "
                     "split)")
            head = (f"capuchin_tf: the measured step ran out of memory twice under a budget of {format_bytes(budget)}"
                    f"{again}; the variables are as they were. ")
        why = self._oom_diagnosis(state, error, refusals_before, evictor="passive mode", budget=lowered)
        return BudgetError(f"{head}{why + ' ' if why else ''}TensorFlow said: {oom_line(error)}")

    def _oom_diagnosis(self, state: SignatureState, error, refusals_before: int, evictor: str,
                       budget: int | None = None) -> str | None:
        """Why an allocation failed, from the allocator's last refusal after `refusals_before` of them: the budget
        (`budget`, else the step's) is below what the step needs at once (what was in use that `evictor` could not
        evict, and the floor), or the device's free memory was split (its largest free run); None when the allocator
        recorded no refusal."""
        budget = budget or self.options.budget_bytes or 0
        stats = ops.allocator_stats()
        if stats["refusals"] <= refusals_before or stats["refused_bytes"] <= 0:
            return None
        asked, in_use, largest = stats["refused_bytes"], stats["refused_in_use"], stats["refused_largest_free"]
        op = stats["refused_op"] or recovery.failed_node(error) or "?"
        limit = min(budget, device_limit_bytes() or budget) if budget else (device_limit_bytes() or 0)
        if in_use + asked > limit:
            return (f"It is below what this step needs at once under capuchin_tf: op {op!r} asked for "
                    f"{format_bytes(asked)} while {format_bytes(in_use)} were in use that {evictor} could not evict "
                    f"({in_use_breakdown(in_use, state.start_bytes, stats)}): no budget below "
                    f"{format_bytes(in_use + asked)} can run this step (its working-set floor alone is "
                    f"{format_bytes(state.floor_bytes)}, at op {state.floor_op!r}).")
        return (f"The device's free memory was split: op {op!r} asked for {format_bytes(asked)} with "
                f"{format_bytes(limit - in_use)} free, the largest free run {format_bytes(largest)}. A budget below "
                "the device's size leaves room for that (memory_budget < the device); or try a larger budget.")

    def _cache_key(self, state: SignatureState, args) -> CacheKey:
        """Everything a plan depends on: the graph (nodes with their attributes), the call's and the variables'
        shapes and dtypes, the budget, policy, options and link, and the versions of TensorFlow and capuchin_tf."""
        signature = ";".join(f"{t.dtype.name}{list(t.shape)}" for t in tf.nest.flatten(args, expand_composites=True)
                             if isinstance(t, (tf.Tensor, tf.Variable)))
        variables = []
        for external, _ in state.concrete.graph.captures:
            described = capture.variable_shapes_and_dtypes(external)
            if described:
                variables.append(";".join(f"{dtype.name}{shape}" for dtype, shape in described))
            else:
                variables.append(f"{external.dtype.name}{list(external.shape)}")
        return CacheKey(graph_fingerprint=capture.graph_fingerprint(state.concrete.graph.as_graph_def()),
                        input_signature=signature, budget_bytes=int(self.options.budget_bytes or 0),
                        policy=self.options.policy,
                        link=str(self.options.link), tf_version=tf.__version__, options=tuple(sorted(
                            self.options.planner_options().items())),
                        capuchin_tf_version=_version.__version__, variables="|".join(variables))

    def _load_cached(self, state: SignatureState, args) -> bool:
        if self.cache is None:
            return False
        entry = self.cache.load_entry(self._cache_key(state, args))
        if entry is None:
            return False
        plan, extra = entry
        try:
            trace = AccessTrace.from_json(extra["trace"])
        except (KeyError, TypeError, ValueError) as e:
            warnings.warn(f"capuchin_tf: the cached plan has no usable trace ({e}); measuring again",
                          RuntimeWarning, stacklevel=4)
            return False
        state.trace, state.from_cache = trace, True
        self._device_model(trace, state)
        try:
            self._install(state, plan, self.options.budget_bytes or 0)
        except Refusal as e:
            warnings.warn(f"capuchin_tf: the cached plan could not be applied ({e}); measuring again",
                          RuntimeWarning, stacklevel=4)
            state.trace, state.from_cache, state.plan = None, False, None
            return False
        return True

    # ---- planning and rewriting --------------------------------------------------------------------------------
    def _plan_and_rewrite(self, state: SignatureState, budget: int | None, force: bool = False) -> None:
        trace = state.trace
        device_model = self._device_model(trace, state)
        if not force and (budget is None or (trace.evicted_bytes == 0
                                             and trace.peak_bytes <= NOTHING_TO_SAVE * self.options.budget_bytes)):
            state.plan, state.plan_budget, state.fn = None, budget or 0, None  # nothing to save: run the plain step
            return
        try:
            plan = make_plan(trace, budget, self.options.policy, device_model, **self.options.planner_options())
        except Exception as e:
            self._keep_planning_failure(state, e, budget, device_model)
            raise
        self._install(state, plan, budget)

    def _keep_planning_failure(self, state: SignatureState, error: Exception, budget: int, device_model) -> None:
        """With Options.keep_failures: the trace and the error planning failed on, kept (state.kept_failure)."""
        if self.options.keep_failures is None:
            return
        try:
            path = keep_planning_failure(self.options.keep_failures, state.trace, error, budget_bytes=budget,
                                         policy=self.options.policy, planner_options=self.options.planner_options(),
                                         device_model=device_model, signature=str(state.key))
        except OSError as e:
            warnings.warn(f"capuchin_tf: the planning failure could not be kept in {self.options.keep_failures} "
                          f"({e})", RuntimeWarning, stacklevel=5)
            return
        state.kept_failure = str(path)

    def _install(self, state: SignatureState, plan: Plan, budget: int) -> bool:
        """Rewrites the step for `plan` now (a change under way off the critical path is dropped). If that fails: the
        first plan raises Refusal; a later one (feedback, a tighter plan) warns and keeps the plan that runs. True when
        the new plan is installed."""
        state.build = None
        if self.options.verbose:
            print(f"capuchin_tf: plan for {budget / 2**20:.1f} MiB: {plan.summary()}", flush=True)
        try:
            with heap.young_heap():
                fn, graph_def = self._build(state, plan, *self._tensor_info(state))
        except (rewrite.RewriteError, capture.CaptureError, ValueError, KeyError) as e:
            if state.fn is None and state.plan is None:
                raise Refusal(f"its plan could not be applied ({type(e).__name__}: {e})") from e
            warnings.warn(f"capuchin_tf: a new plan could not be applied ({type(e).__name__}: {e}); the current "
                          "plan stays", RuntimeWarning, stacklevel=4)
            return False
        self._commit(state, plan, budget, fn, graph_def)
        return True

    def _tensor_info(self, state: SignatureState) -> tuple[dict, dict]:
        """Tensor id -> dtype name, and -> static shape, for every tensor of the trace in the optimized graph (read
        once, in the calling thread: the shaped graph is not read by a background build)."""
        if not state.tensor_info:
            nodes = {n.name: n for n in state.optimized.node}
            for t in state.trace.tensors:
                try:
                    op, slot = split_tensor_id(t)
                except ValueError:  # a temporary of the trace ("op:temp0"), never planned
                    continue
                static = capture.static_tensor(state.shaped, nodes[op], slot) if op in nodes else None
                if static is None:
                    continue
                shape = shape_of(None if static.shape.rank is None else static.shape.as_list())
                state.tensor_info[t] = (static.dtype.name, shape)
        return ({t: info[0] for t, info in state.tensor_info.items()},
                {t: info[1] for t, info in state.tensor_info.items()})

    def _build(self, state: SignatureState, plan: Plan, dtypes: Mapping[str, str], shapes: Mapping,
               specs: tuple | None = None) -> tuple:
        """The guided step for `plan`: (its ConcreteFunction, its GraphDef). Reads the signature's optimized graph,
        trace and shaped graph, writes nothing of the state: it runs in a background build too. With `specs` (the
        arguments' dtypes and devices, function_surgery.arg_specs), the function is also instantiated, without
        running, for calls with such arguments: a build in the background does that off the critical path, and the
        new plan's first step runs as fast as the next (docs/decisions.md, "Instantiated before the first call")."""
        missing = [d.tensor for d in plan.decisions if d.tensor not in dtypes]
        if missing:
            raise rewrite.RewriteError(f"planned tensors not in the optimized graph: {missing[:3]}")
        # Even a plan with no decisions is applied: the measured order it pins is the one that fitted.
        # Beyond the plan, every tensor that still waits across other work goes to the pool, as in the measured
        # step: what the plan did not foresee (BFC fragmentation, a copy's timing) is evicted on demand instead
        # of failing the step. Capuchin's passive mode: the baselines run their plans alone.
        graph_def = rewrite.guided_graph(state.optimized, plan, state.trace, dtypes, shapes,
                                         state.shaped if self.safety_net else None)
        fn = function_surgery.runnable(state.concrete, graph_def, name="capuchin_guided_step")
        function_surgery.preinstantiate(fn, specs)
        return fn, graph_def

    def _commit(self, state: SignatureState, plan: Plan, budget: int, fn, graph_def) -> None:
        """`plan` runs from the next step on."""
        state.plan, state.plan_budget, state.fn, state.guided_def = plan, budget, fn, graph_def
        state.protected_steps = self.options.protect_steps or 0

    def _in_background(self) -> bool:
        """Whether a plan change is built off the critical path: the option, and no device scope around the call
        (a function built in another thread would not get it)."""
        return self.options.background_builds and not function_surgery.device_scope_around()

    def _change(self, state: SignatureState, plan: Plan, budget: int) -> bool:
        """A plan change the feedback asks for: installed now (True if it was), or built in the background (False:
        the current plan runs until the new one is ready; ManagedStep._take_build)."""
        if not self._in_background():
            return self._install(state, plan, budget)
        if self.options.verbose:
            print(f"capuchin_tf: building the plan for {budget / 2**20:.1f} MiB in the background: {plan.summary()}",
                  flush=True)
        dtypes, shapes = self._tensor_info(state)
        specs = state.arg_specs

        def then(built) -> bool:
            self._commit(state, plan, budget, *built)
            return True

        return self._start_build(state, lambda: self._build(state, plan, dtypes, shapes, specs), then)

    def _start_build(self, state: SignatureState, job, then) -> bool:
        """`job` built in the background (False: the plan has not changed yet), or, when no thread can be started,
        now (True when the plan changed; a job that fails leaves the plan, with a warning)."""
        try:
            state.build = Build(job, then)
            return False
        except RuntimeError:  # "can't start new thread"
            state.build = None
        try:
            result = job()
        except Exception as e:  # noqa: BLE001  (as a background build that fails)
            warnings.warn(f"capuchin_tf: a new plan could not be built ({type(e).__name__}: {e}); the current plan "
                          "stays", RuntimeWarning, stacklevel=5)
            return False
        return then(result)

    def _take_build(self, state: SignatureState, record: StepRecord) -> bool:
        """After a step that ran while a plan change was built: the step is marked `building`; if the change is
        ready (or it has overlapped BUILD_WAIT_STEPS steps: then it is waited for), it runs from the next step (True).
        A build that failed leaves the current plan, with a warning."""
        build = state.build
        record.building = True
        build.steps += 1
        if not build.done():
            if build.steps < BUILD_WAIT_STEPS:
                return False
            build.thread.join()
        state.build = None
        if build.error is not None:
            warnings.warn(f"capuchin_tf: a new plan could not be built ({type(build.error).__name__}: "
                          f"{build.error}); the current plan stays", RuntimeWarning, stacklevel=5)
            return False
        return build.then(build.result)

    # ---- guided execution --------------------------------------------------------------------------------------
    def _guided(self, state: SignatureState, args):
        state.arg_specs = function_surgery.arg_specs(args)
        retried = 0
        while True:
            if self.options.verbose and retried:
                print(f"capuchin_tf: retry {retried}, device memory in use "
                      f"{tf.config.experimental.get_memory_info(DEVICE)['current'] / 2**20:.1f} MiB, host store "
                      f"{ops.host_store_stats()}", flush=True)
            protected = self.options.protect_steps is None or state.protected_steps > 0
            if protected:
                state.snapshot.take()
            before = ops.host_store_stats()
            layout_before = ops.layout_stats()
            ops.drain_stalls()
            tf.config.experimental.reset_memory_stats(DEVICE)
            # The first guided step that runs a plan and no trial runs under the profiler: its kernel times re-time
            # the trace (ManagedStep._retime). An attempt that runs out of memory re-times nothing (its retry runs
            # unprofiled): the next guided step is profiled instead.
            profile = (state.fn is not None and self.options.feedback and not state.retimed and state.trial is None
                       and not retried)
            t0 = time.perf_counter()
            try:
                with self._budget(plain=state.fn is None):
                    if state.fn is None:
                        outputs = self._fn(*args)
                    else:
                        # Passive mode stays on as a safety net: an allocation that would fail first evicts pooled
                        # tensors and prefetched tensors their swap-in has not claimed (both come back on demand).
                        ops.set_passive_mode(self.safety_net)
                        # The allocator's planned layout of this plan's function (Options.planned_layout).
                        layout = self._layout_wanted(state)
                        if layout:
                            if state.layout_fn is not None and state.layout_fn is not state.fn:
                                # A new plan of this signature: its first step is placed by the layout of the plan
                                # it replaces (mostly the same allocations), not recorded on BFC's placement.
                                ops.layout_inherit(id(state.layout_fn))
                            state.layout_fn = state.fn
                            ops.layout_begin(id(state.fn))
                        ok = False
                        try:
                            if profile:
                                outputs, kernels, _, clock_offset = measure.profiled_call(
                                    lambda: function_surgery.call_without_grappler(state.fn, *args))
                            else:
                                outputs = function_surgery.call_without_grappler(state.fn, *args)
                            ok = True
                        finally:
                            if layout:
                                ops.layout_end(ok)
                            ops.set_passive_mode(False)
            except tf.errors.ResourceExhaustedError as e:
                graph_def = state.guided_def if state.fn is not None else state.optimized
                written = recovery.possibly_written(graph_def, state.writes, recovery.failed_node(e))
                if written is None or written:
                    if not protected:
                        raise self._failure(state, e) from e
                    # Only what the failed attempt may have written: restoring moves a variable to a fresh device
                    # buffer wherever BFC has room, which can split the free memory the retry needs.
                    state.snapshot.restore(written)
                retried += 1
                if state.fn is None:
                    # The plain step did not fit the budget after all (its executor's order peaks higher than the
                    # measured one): from now on the plan, made for it.
                    self._plan_and_rewrite(state, self.options.budget_bytes, force=True)
                    continue
                if state.trial is not None:
                    # A trial plan (measured arbitration) ran out of memory: back to the plan that ran before it.
                    self._end_trial(state, keep=False, why="it ran out of memory")
                    continue
                if retried > self.options.max_retries:
                    # The last resort: this step in passive mode (the measured step's mechanism, which completed
                    # under this budget), then back to the tightened plan.
                    if not self.options.passive_rescue:
                        raise self._failure(state, e, rescue_off=True) from e
                    return self._passive(state, args, retried, e)
                if (not state.plan.feasible and self.safety_net
                        and state.trace.peak_bytes <= (self.options.budget_bytes or 0)):
                    if not self.options.passive_rescue:
                        raise self._failure(state, e, rescue_off=True, infeasible=True) from e
                    # A plan the planner itself predicted over the budget ran out of memory, where the measured step
                    # fitted: from now on the steps run in passive mode, as the measured one, rather than retry plans
                    # its model says cannot fit: each such attempt waits for copies and fails again, where passive
                    # steps fit (docs/decisions.md, "No plan that fits: the best one runs, then passive steps"). Until
                    # it fails, such a plan runs: it often completes, the safety net evicting what it did not foresee.
                    state.passive_only = True
                    if self.options.verbose:
                        print(f"capuchin_tf: the plan, predicted at {format_bytes(state.plan.predicted_peak_bytes)} "
                              f"for {format_bytes(state.plan_budget)}, ran out of memory; the steps run in passive "
                              "mode from now on", flush=True)
                    return self._passive(state, args, retried, e)
                if not self._tighten(state, reason=f"out of memory ({oom_line(e)})"):
                    self._back_to_good(state)
                continue
            except Exception as e:
                if state.fn is None:
                    raise  # the plain step's own error
                if not protected:
                    raise CapuchinError(f"capuchin_tf: the guided step failed ({type(e).__name__}: {oom_line(e)}) "
                                        "and its written variables were not saved beforehand: some of this step's "
                                        "updates may have been applied") from e
                state.snapshot.restore()
                return self._own_error_or_refuse(state, args, e, "guided step")
            if state.fn is not None:
                state.good = (state.plan, state.plan_budget, state.fn, state.guided_def)
            state.protected_steps = max(state.protected_steps - 1, 0)
            seconds = time.perf_counter() - t0
            peak = tf.config.experimental.get_memory_info(DEVICE)["peak"]
            after = ops.host_store_stats()
            drained = ops.drain_stalls()
            stalls = summarize_stalls(drained)
            late, early = dict(stalls.late), list(stalls.early)
            plan = state.plan if state.fn is not None else None
            record = StepRecord("guided" if state.fn is not None else "plain", seconds, peak,
                                planned_bytes=(plan.swapped_bytes + plan.recomputed_bytes) if plan else 0,
                                late_prefetches=after["late_prefetches"] - before["late_prefetches"], retried=retried,
                                late_wait_s=sum(late.values()),
                                evictions=after["guided_evictions"] - before["guided_evictions"],
                                passive_evictions=after["passive_evictions"] - before["passive_evictions"],
                                passive_evicted_bytes=after["passive_evicted_bytes"] - before["passive_evicted_bytes"],
                                moved_bytes=after["device_moved_bytes"] - before["device_moved_bytes"],
                                waited_s=dict(stalls.by_kind))
            if state.fn is not None and layout:
                layout_after = ops.layout_stats()
                with_region = layout_after["region_steps"] > layout_before["region_steps"]
                record.layout_bytes = layout_after["attached_bytes"] if with_region else 0
                record.layout_misses = layout_after["step_misses"]
            if state.fn is not None:
                self._note_layout(state, record)
            if profile:  # (an attempt that ran out of memory was retried unprofiled: `profile` is that attempt's)
                state.retimed = True
                record.retimed = self._retime(state, kernels, clock_offset, drained)
            state.history.append(record)
            waited = stalls.waited_s
            relinked = False
            if (state.fn is not None and not retried and seconds - waited > 0 and state.trace.step_time > 0
                    and self.options.link_clock_s is None):
                speedup = max(1.0, state.trace.step_time / (seconds - waited))
                if speedup > state.speedup:
                    # A link that now runs RELINK_FRACTION faster than the one this step ran on: its late and early
                    # prefetches were timed against a link that no longer is, and the feedback leaves them.
                    relinked = link_is_emulated(self.options.link) and speedup > state.speedup * (1 + RELINK_FRACTION)
                    state.speedup = speedup
                    self._device_model(state.trace, state)  # the emulated link follows
            if self.options.feedback and state.fallback_reason is None:
                t_adjust = time.perf_counter()
                if relinked:
                    late, early = {}, []
                if state.build is not None:  # a plan change under way: this step is no feedback on its plan
                    record.plan_changed = self._take_build(state, record)
                else:
                    arbitrated = self._arbitrate(state, record) if state.fn is not None and not retried else None
                    record.plan_changed = (arbitrated if arbitrated is not None else
                                           self._adjust(state, late, early, peak, seconds,
                                                        dict(stalls.evicted)))
                record.adjust_s = time.perf_counter() - t_adjust
            state.steps_since_change = 0 if record.plan_changed or retried else state.steps_since_change + 1
            return outputs

    def _retime(self, state: SignatureState, kernels, clock_offset: int, stalls) -> bool:
        """The trace with the kernel times of a guided step (`kernels`, its profiler events; `stalls`, its waits for
        memory, left out), from which every later plan is made (docs/decisions.md, "Kernel times from a guided step").
        The measured step is the first run of its kernels: its forward pass measured 1.3-2.5x the guided steps' on
        bert-4l, its backward pass about 1x. The link the guided steps run on does not change (the trace's clock
        changes, and `speedup` with it: for p100, the link model follows the trace's FLOP rate). True when the trace
        was re-timed."""
        seconds = measure.kernel_seconds(kernels, clock_offset, stalls)
        names = {o.name for o in state.trace.ops}
        named = {op: s for op, s in seconds.items() if op in names}
        if len(named) < RETIME_COVERAGE * len(names):
            return False  # the profile missed the step's ops (another profiler session running, say)
        measured = state.trace
        state.trace = measured.retimed(named, source="a guided step's kernel times")
        if measured.step_time > 0 and state.trace.step_time > 0:
            # The link is the trace's link model (per second of the trace's clock) times `speedup`: the same rate.
            state.speedup *= state.trace.step_time / measured.step_time
        self._device_model(state.trace, state)
        return True

    def _passive(self, state: SignatureState, args, retried: int, error):
        """The last resort for a guided step: the step in passive mode (the measured step's mechanism). Like the
        measured step, it runs once more after an out-of-memory error; whatever a failed run may have written is
        restored before anything else (where it fails depends on BFC fragmentation, which varies from run to run)."""
        if state.passive_fn is None:
            if state.passive_def is None:
                state.passive_def = rewrite.passive_graph(state.concrete, args, state.optimized, state.shaped,
                                                         state.optimized_model)
            state.passive_fn = rewrite.passive_step(state.concrete, args, state.passive_def)
        state.snapshot.take()
        tf.config.experimental.reset_memory_stats(DEVICE)
        ops.drain_stalls()
        before = ops.host_store_stats()
        t0 = time.perf_counter()
        reruns = 0
        refusals = ops.allocator_stats()["refusals"]
        drained = None
        while True:
            if self.options.verbose and (error is not None or reruns):
                print(f"capuchin_tf: out of memory {'again' if not reruns else 'in passive mode'}; running this step "
                      f"in passive mode; device memory in use "
                      f"{tf.config.experimental.get_memory_info(DEVICE)['current'] / 2**20:.1f} MiB", flush=True)
            ops.set_passive_mode(True)
            try:
                with self._budget():
                    outputs = function_surgery.call_without_grappler(state.passive_fn, *args)
                break
            except tf.errors.ResourceExhaustedError as e:
                failure = e
            finally:
                ops.set_passive_mode(False)
                drained = ops.drain_stalls()
            state.snapshot.restore(recovery.possibly_written(state.passive_def, state.writes,
                                                             recovery.failed_node(failure)))
            if reruns >= MEASURED_RETRIES:
                # Why, from what the allocator saw (the budget below what the step needs at once, or the free memory
                # split), as for the measured step: a BudgetError; else the general one.
                head = (f"capuchin_tf: a guided step ran out of memory under a budget of "
                        f"{format_bytes(self.options.budget_bytes or 0)}, and twice more in passive mode; the "
                        "variables are as they were before this call. ")
                named = self._measured_oom(state, failure, refusals, head=head)
                if named.args[0].startswith(head + "TensorFlow said"):
                    raise self._failure(state, failure, passive=True) from error
                raise named from error
            reruns += 1
        # What the pool evicted and moved on demand (every run of this call) and what the completed run waited for,
        # as a guided step records them: a passive step evicts most of what it saves.
        seconds = time.perf_counter() - t0
        after = ops.host_store_stats()
        state.history.append(StepRecord("passive", seconds, tf.config.experimental.get_memory_info(DEVICE)["peak"],
                                        retried=retried + reruns,
                                        passive_evictions=after["passive_evictions"] - before["passive_evictions"],
                                        passive_evicted_bytes=(after["passive_evicted_bytes"]
                                                               - before["passive_evicted_bytes"]),
                                        moved_bytes=after["device_moved_bytes"] - before["device_moved_bytes"],
                                        waited_s=dict(summarize_stalls(drained).by_kind) if drained else {}))
        state.steps_since_change = 0
        return outputs

    def _failure(self, state: SignatureState, error, passive: bool = False, rescue_off: bool = False,
                 infeasible: bool = False) -> CapuchinError:
        if infeasible:
            what = ("in a guided step whose plan was predicted over the budget (no plan fits it; the variables were "
                    "restored; passive-mode rescue is off)")
        elif rescue_off:
            what = (f"in {self.options.max_retries + 1} guided attempts with tighter plans (the variables were "
                    "restored; passive-mode rescue is off)")
        elif passive:
            what = ("even in passive mode (the variables were restored; what must stay on the device at once does not "
                    "fit)")
        else:
            what = ("in a guided step whose written variables were not saved beforehand, after it may have written "
                    "some of them: some of this step's updates may have been applied, and it is not retried")
        budget = format_bytes(self.options.budget_bytes or 0)
        # Guided attempts that ran out of memory with rescue off: what the allocator saw at the last one (the pool,
        # the guided steps' safety net, evicts on demand as passive mode does).
        why = self._oom_diagnosis(state, error, -1, evictor="the pool") if rescue_off else None
        return CapuchinError(f"capuchin_tf: out of memory under a budget of {budget} {what}. "
                             f"{why + ' ' if why else ''}TensorFlow said: {oom_line(error)}")

    def _tighten(self, state: SignatureState, reason: str) -> bool:
        """Re-plans for a tighter budget after an out-of-memory error or a peak over the budget (the choice:
        policy.feedback.tighter_plan); True if the plan changed. A budget for which no tighter plan was found is not
        searched again."""
        current = state.plan_budget or self.options.budget_bytes or state.trace.peak_bytes
        if self.options.verbose:
            print(f"capuchin_tf: {reason}; re-planning for {int(current * TIGHTEN)} bytes", flush=True)
        if state.plan is not None and state.untightenable_at == current:
            if self.options.verbose:
                print("capuchin_tf: no tighter plan fits (found before); retrying the current plan", flush=True)
            return False
        device_model = self._device_model(state.trace, state)

        def plan_for(budget: int) -> Plan:
            return make_plan(state.trace, budget, self.options.policy, device_model, **self.options.planner_options())

        choice = tighter_plan(plan_for, current, state.plan)
        state.replans += 1
        if choice is None:
            state.untightenable_at = current
            if self.options.verbose:
                print("capuchin_tf: no tighter plan is predicted below the current one; retrying it", flush=True)
            return False
        budget, plan = choice
        return self._install(state, plan, budget)

    def _layout_wanted(self, state: SignatureState) -> bool:
        """Whether this guided step runs under the allocator's planned layout (Options.planned_layout): always, never,
        or ("auto") once a guided step of this signature evicted tensors on demand (its later plans too, each starting
        from the layout of the plan it replaces). Where BFC's placement leaves a plan's working set room, the layout
        changes nothing measurable; where it splits the free memory so that allocations evict on demand, the layout
        removes those evictions (docs/decisions.md, "Planned layout")."""
        if self.options.planned_layout == "auto":
            return state.layout_fn is not None
        return bool(self.options.planned_layout)

    def _note_layout(self, state: SignatureState, record: StepRecord) -> None:
        """With Options.planned_layout "auto": a guided step that evicted on demand puts its signature's plans under the
        planned layout (the plan's next step is recorded, the ones after it placed; a later plan's steps are placed
        from its first, `_layout_wanted`)."""
        if (self.options.planned_layout != "auto" or record.passive_evicted_bytes <= 0
                or state.layout_fn is not None):
            return
        state.layout_fn = state.fn
        if self.options.verbose:
            print(f"capuchin_tf: the guided step evicted {format_bytes(record.passive_evicted_bytes)} on demand; the "
                  "plan's next steps run under the planned layout", flush=True)

    def _back_to_good(self, state: SignatureState) -> None:
        """After an out-of-memory error that no tighter plan answers: back to the last plan that ran, if the feedback
        has changed it since. Moving prefetches earlier for the late ones raises the memory where they land, and a
        plan changed that way can run out of memory in every later step (docs/decisions.md, "Out of memory in a guided
        step: tighten, never upward, then back to the last plan that ran"). From then on late prefetches no longer move
        triggers earlier for this signature (early ones still move later)."""
        if state.good is None or state.good[0] is state.plan:
            return
        state.plan, state.plan_budget, state.fn, state.guided_def = state.good
        state.build = None
        state.earlier_frozen = True
        if self.options.verbose:
            print("capuchin_tf: back to the plan of the last guided step that completed; late prefetches no longer "
                  "move triggers earlier", flush=True)

    def _arbitrate(self, state: SignatureState, record: StepRecord) -> bool | None:
        """Measured arbitration after a guided step (policy.feedback: wants_trial, trial_candidate, trial_expected_s,
        trial_may_win, trial_keeps): a settled step that waited for copies on demand for TRIAL_FRACTION of its time has
        the policy's `trials` planned (in the background) and the one expected fastest of those that fit and may be
        kept tried for TRIAL_STEPS measured steps, kept only if measured faster. True: the plan changed;
        False: it did not and the feedback leaves this step (a trial under way); None: no arbitration, the feedback
        goes on."""
        trial = state.trial
        if trial is not None:
            trial["steps"] += 1
            if trial["steps"] > 1:  # the first step of the trial plan instantiates it
                trial["seconds"].append(record.seconds)
            if len(trial["seconds"]) < TRIAL_STEPS:
                return False
            keep = trial_keeps(trial["incumbent_s"], trial["seconds"])
            self._end_trial(state, keep, why=f"median step {statistics.median(trial['seconds']):.3f} s (expected "
                                              f"{trial['expected_s']:.3f} s) against {trial['incumbent_s']:.3f} s")
            return not keep
        # (a trial that is the plan running, chosen by the policy's own fallback, is not tried again)
        running_as = dict(state.plan.options).get("fallback") if state.plan is not None else None
        untried = [n for n in POLICIES[self.options.policy].trials
                   if n not in state.tried and n not in (self.options.policy, running_as)]
        if not self.safety_net or not untried or state.replans >= self.options.max_replans:
            return None
        # What the running plan's steps (the one that instantiated it included) needed beyond its predicted
        # placement: the most any of them evicted on demand (it varies from step to step on one plan: 14 or 33 MiB on
        # the quick tier's transformer). Learned for the signature, the largest seen (docs/decisions.md, "A placement
        # error, assumed then learned").
        own = [r for r in state.history[-(state.steps_since_change + 1):] if r.phase == "guided"] or [record]
        evicted = max(r.passive_evicted_bytes for r in own)
        least_evicted = min(r.passive_evicted_bytes for r in own)  # what a trial may be predicted over the budget by
        state.placement_error = max(state.placement_error,
                                    placement_error(state.plan, self.options.budget_bytes or state.plan_budget,
                                                    evicted))
        if not wants_trial(record.waited_s, record.seconds):
            return None
        early = state.steps_since_change < 1
        if early and (LEARNED_MARGIN not in untried or state.placement_error <= 0):
            # The first step of a plan instantiates it: the next one, unchanged, is the one the trial is measured
            # against (moving triggers for late prefetches first would put the trial off by a step per change).
            # Only the learned margin starts now: its evidence is the bytes evicted on demand, and it is measured
            # against the steps that run while it is built.
            return False
        device_model = self._device_model(state.trace, state)
        candidates = []
        for name in ([LEARNED_MARGIN] if early else untried):
            options = {}
            if name == LEARNED_MARGIN:
                # The policy's own plan made again with the placement error learned so far.
                if state.placement_error <= 0:
                    state.tried[name] = "not tried: nothing evicted on demand beyond the predicted placement"
                    continue
                options = {"placement_error_bytes": state.placement_error}
            candidates.append((name, options))
        if not candidates:
            return None
        incumbent_s, incumbent_waited_s = self._incumbent(state, record)
        plan_budget, running = state.plan_budget, state.plan
        dtypes, shapes = self._tensor_info(state)
        background = self._in_background()
        specs = state.arg_specs if background else None  # instantiated in the build, off the critical path
        if self.options.verbose:
            print(f"capuchin_tf: guided steps wait {record.waited_s} for copies on demand; planning the trials of "
                  f"{', '.join(name for name, _ in candidates)}", flush=True)

        def job():
            """Of the candidates that plan, are predicted to fit and are expected to be kept (trial_expected_s,
            trial_may_win), the one expected fastest that builds: (what came of each, (name, plan, budget, expected,
            fn, GraphDef) or None); the others stay untried, for a later arbitration. Planning and building only: it
            runs in a background build too."""
            tried = {}
            budget = plan_budget
            try:  # the running plan on the trace and device model the trials are planned on
                running_s = simulate(state.trace, running, device_model).step_time
            except Exception:  # noqa: BLE001  (its own prediction, on the trace it was made on)
                running_s = running.predicted_step_s
            # Each plan costed with the copies its placement needs beyond the device less the placement error (the
            # one the running plan's steps were measured to have, at least the prior), as plan_capuchin costs them.
            error = assumed_placement_error(state.trace, state.placement_error)
            running_cost = placed_step_s(running_s, running.predicted_placed_peak_bytes, plan_budget - error,
                                         device_model)
            may_win = []
            for name, learned in candidates:
                # The margin is this policy's own plan, made as its other plans are; other trials are their policies
                # as they are.
                policy, options = ((self.options.policy, {**self.options.planner_options(), **learned})
                                   if name == LEARNED_MARGIN else (name, {}))
                try:
                    plan = make_plan(state.trace, budget, policy, device_model, **options)
                except Exception as e:  # a trial is an optimization: a policy that cannot plan this step is not tried
                    tried[name] = f"not tried: {type(e).__name__}: {e}"
                    continue
                fits = (margin_candidate(plan, running, plan_budget) if name == LEARNED_MARGIN
                        else trial_candidate(plan, plan_budget, least_evicted, running))
                if not fits:
                    tried[name] = (f"not tried: op {plan.unreachable_op!r} does not fit"
                                   if plan.unreachable_op is not None else
                                   f"not tried: predicted peak {plan.predicted_peak_bytes} bytes for a budget of "
                                   f"{plan_budget} (the running plan's steps evicted {least_evicted} bytes on demand; "
                                   f"placed at {plan.predicted_placed_peak_bytes} bytes against the running plan's "
                                   f"{running.predicted_placed_peak_bytes})"
                                   if plan.predicted_peak_bytes > plan_budget else
                                   f"not tried: placed at {plan.predicted_placed_peak_bytes} bytes, not below the "
                                   f"running plan's {running.predicted_placed_peak_bytes}")
                    continue
                cost = placed_step_s(plan.predicted_step_s, plan.predicted_placed_peak_bytes, plan_budget - error,
                                     device_model)
                expected = trial_expected_s(cost, running_cost, incumbent_s)
                if not trial_may_win(expected, incumbent_s):
                    tried[name] = (f"not tried: expected {expected:.3f} s a step (predicted "
                                   f"{cost / running_cost:.3f}x the running plan's step with their placements' "
                                   f"copies on demand; the running plan's was measured {incumbent_s:.3f} s with "
                                   f"{incumbent_waited_s:.3f} s of waits on demand)")
                    continue
                may_win.append((expected, len(may_win), name, plan))
            for expected, _, name, plan in sorted(may_win):
                try:
                    built = self._build(state, plan, dtypes, shapes, specs)
                except (rewrite.RewriteError, capture.CaptureError, ValueError, KeyError) as e:
                    tried[name] = f"not tried: the plan could not be applied ({type(e).__name__}: {e})"
                    continue
                return tried, (name, plan, budget, expected, *built)
            return tried, None

        def then(result) -> bool:
            tried, found = result
            state.tried.update(tried)
            if self.options.verbose:
                for name, what in tried.items():
                    print(f"capuchin_tf: the {name} plan is {what}", flush=True)
            if found is None:
                return False
            name, plan, budget, expected, fn, graph_def = found
            incumbent = (state.plan, state.plan_budget, state.fn, state.guided_def)
            # Started at the instantiating step: measured against the incumbent's steps that ran since (and expected
            # at the same fraction of them).
            against = self._incumbent(state, record)[0] if early else incumbent_s
            expected *= against / incumbent_s if incumbent_s > 0 else 1.0
            self._commit(state, plan, budget, fn, graph_def)
            state.replans += 1
            state.trial = {"incumbent": incumbent, "incumbent_s": against, "expected_s": expected, "policy": name,
                           "steps": 0, "seconds": []}
            state.tried[name] = "on trial"
            fallback = dict(plan.options).get("fallback")
            if name == LEARNED_MARGIN and fallback in POLICIES[self.options.policy].trials:
                state.tried.setdefault(fallback, "not tried: it is the margin plan")
            if self.options.verbose:
                print(f"capuchin_tf: trying the {name} plan (for {format_bytes(budget)}) against a median step of "
                      f"{against:.3f} s", flush=True)
            return True

        if background:
            return self._start_build(state, job, then)
        return then(job()) or None

    @staticmethod
    def _plan_steps(state: SignatureState) -> list[StepRecord]:
        """The guided steps the running plan ran (after the one that changed it)."""
        if state.steps_since_change < 1:
            return []
        return [r for r in state.history[-state.steps_since_change:] if r.phase == "guided"]

    @staticmethod
    def _incumbent(state: SignatureState, record: StepRecord) -> tuple[float, float]:
        """The median of the running plan's last three guided steps after the one that instantiated it, those that
        ran beside a build only if no other did (`record` when there are none), and the median of what they waited for
        copies on demand."""
        ran = ManagedStep._plan_steps(state)
        ran = ([r for r in ran if not r.building] or ran or [record])[-3:]
        return (statistics.median([r.seconds for r in ran]),
                statistics.median([on_demand_s(r.waited_s) for r in ran]))

    def _end_trial(self, state: SignatureState, keep: bool, why: str) -> None:
        trial, state.trial = state.trial, None
        state.tried[trial["policy"]] = f"{'kept' if keep else 'dropped'}: {why}"
        if not keep:
            state.plan, state.plan_budget, state.fn, state.guided_def = trial["incumbent"]
            state.good = trial["incumbent"]
        if self.options.verbose:
            print(f"capuchin_tf: the {trial['policy']} plan {'stays' if keep else 'is dropped'} ({why})", flush=True)

    def _adjust(self, state: SignatureState, late: Mapping[str, float], early: list[str], peak: int,
                seconds: float, early_waits: Mapping[str, float] | None = None) -> bool:
        """Feedback after a guided step (policy.feedback.plan_after_step; a peak over the budget tightens); True when
        the plan changed (and the step was rewritten)."""
        if state.plan is None or state.replans >= self.options.max_replans:
            return False
        if self.options.budget_bytes is not None and peak > self.options.budget_bytes and state.fn is not None:
            return self._tighten(state, reason=f"peak {peak} over the budget")
        plan = plan_after_step(state.plan, state.trace, late, early, seconds, state.earlier_frozen, early_waits)
        if plan is state.plan:
            return False
        state.replans += 1
        return self._change(state, plan, state.plan_budget)
