"""The runtime: measured execution, then guided execution, per input signature (paper.md §1.3, §1.6, §1.11).

`ManagedStep` runs a `tf.function` training step. The first call for an input signature is the measured execution
(profile.measure_step: a real step in passive mode under the device limit); its trace and the budget give a plan
(policy.make_plan); the plan is applied to the step's optimized graph (rewrite.apply_plan) and every later call runs
that guided step. After each guided step the runtime reads what the host store saw (which swap-ins waited for their
copy and how long, the allocator's peak) and adjusts the plan (capuchin_tf.feedback): a late prefetch moves that
tensor's in-trigger earlier by 5% of its swap time (the paper) or by its wait, if longer; a prefetch evicted again
before its use moves it later; a peak over the budget re-plans for a tighter budget (beyond the paper). The step is
re-rewritten only when the plan changed, at most once per step and at most `max_replans` times; it is settled after
`settle_steps` steps without a change. The emulated link (p100) follows the speed the guided steps compute at.

Safety: for capuchin's policies (capuchin, swap-only, recompute-only) every guided step keeps passive mode's pool:
tensors the plan does not handle are handed to it as in the measured step, and what the plan did not foresee is
evicted on demand (the baselines swap-all and checkpoint run their plans alone). Guided steps also run with a host
copy of the variables the step writes (by default every step; with `protect_steps=N`, the N steps after each plan
change); an out-of-memory error restores them and retries the step with a tighter plan (the planner's model does not
see BFC fragmentation, and copies and prefetches vary in timing from step to step, so a plan that fitted can fail
later; a tighter plan is one that fits a tighter budget, never one predicted higher than the plan that failed, else
the same plan runs again: ManagedStep._tighten); after `max_retries` tries the step runs in passive mode (the
measured step's mechanism, which completed under the budget; run once more, the variables restored, if it runs out of
memory; `passive_rescue = False` raises instead) and the next steps go on with the tightened plan. Without a copy,
the guided graph being pinned to one order
(schedule.guided_order), the ops before a failing op are exactly the ones that ran: an out-of-memory error before the
first variable write is retried the same way; after it, the step fails with a message saying that updates may be
partial, never repeating one. A step that cannot be rewritten runs as plain
TensorFlow, with one warning. The measured step, which has no plan to tighten, is run once more after an
out-of-memory error, its written variables restored from a host copy first (where it fails depends on BFC
fragmentation, which varies from run to run); if it fails again, the variables are restored before the error is
raised.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
import warnings
from typing import Any, Mapping

import numpy as np
import tensorflow as tf

from capuchin_tf import capture, ops, profile, rewrite
from capuchin_tf.device_model import DeviceModel
from capuchin_tf.feedback import move_triggers
from capuchin_tf.plan import Plan
from capuchin_tf.plan_cache import CacheKey, PlanCache
from capuchin_tf.policy import make_plan
from capuchin_tf.schedule import guided_order, is_variable_writer
from capuchin_tf.trace import AccessTrace

DEVICE = "CPU:0"
TIGHTEN = 0.95  # a guided step over budget, or out of memory, re-plans for this fraction of the budget in use
TIGHTEN_PROBES = 3  # if no plan fits that budget: plans bisecting toward the current one (ManagedStep._tighten)
# The plain step runs unrewritten when the measured step evicted nothing and peaked under this fraction of the budget
# (the plain executor's own order can peak higher than the measured one: 77 against 68 MiB on the cnn at batch 32).
NOTHING_TO_SAVE = 0.85
CAPUCHIN_POLICIES = frozenset({"capuchin", "swap-only", "recompute-only"})


MEASURED_RETRIES = 1  # reruns of the measured step, or of a passive rescue, after an out-of-memory error


def oom_line(error: Exception) -> str:
    """The line of an error's message that says what could not be allocated (else its first line), at most 300
    characters: what the CLIs and CapuchinError quote."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()] or [""]
    return next((ln for ln in lines if "OOM when allocating" in ln), lines[0])[:300]


class CapuchinError(RuntimeError):
    """A managed step failed in a way capuchin_tf cannot recover from (the message says what was written)."""


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
    evictions: int = 0  # prefetched tensors evicted again by the safety net (passive mode during guided steps)
    passive_evictions: int = 0  # pooled tensors the safety net evicted on demand (what the plan did not save)
    passive_evicted_bytes: int = 0
    planned_bytes: int = 0  # bytes the plan this step ran saved (swapped + recomputed)


@dataclasses.dataclass
class SignatureState:
    """Everything capuchin_tf keeps for one input signature of the step."""

    concrete: Any
    trace: AccessTrace | None = None
    plan: Plan | None = None
    plan_budget: int = 0  # the budget the current plan was made for (tightened after failures)
    fn: Any = None  # the guided ConcreteFunction; None: run the plain step
    optimized: Any = None  # the optimized GraphDef the plan is applied to
    tensor_info: dict = dataclasses.field(default_factory=dict)  # tensor id -> (dtype name, shape)
    order: dict = dataclasses.field(default_factory=dict)  # node name -> position in the enforced order
    first_write: int = 0  # position of the first variable write in that order
    history: list = dataclasses.field(default_factory=list)  # StepRecord per call
    replans: int = 0
    steps_since_change: int = 0
    fallback_reason: str | None = None
    from_cache: bool = False
    written: list = dataclasses.field(default_factory=list)  # the variables the step writes
    passive_fn: Any = None  # the step with passive mode's tensor pool (the last resort after repeated OOM)
    # How much faster guided steps compute than the measured step's trace says: trace step time over the fastest
    # guided step's time without its waits for copies (recomputation included, so an underestimate).
    speedup: float = 1.0
    protected_steps: int = 0  # guided steps left that run with a host snapshot of `written` (after a plan change)
    untightenable_at: int = 0  # a plan budget for which no tighter plan was found (not searched again)
    # The plan of the last guided step that completed (after retries or not): (plan, plan budget, fn).
    good: tuple | None = None
    earlier_frozen: bool = False  # late prefetches no longer move triggers earlier (that had run out of memory)


class ManagedStep:
    """A training step under capuchin_tf. Call it like the tf.function it wraps (positional arguments)."""

    def __init__(self, tf_fn, *, budget_bytes: int | None, policy: str, link: str | float,
                 policy_options: Mapping[str, Any] | None = None, cache_dir: str | None = None,
                 feedback: bool = True, max_replans: int = 20, settle_steps: int = 10, max_retries: int = 2,
                 protect_steps: int | None = None, verbose: bool = False):
        self._fn = tf_fn
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.link = link
        self.policy_options = dict(policy_options or {})
        if policy == "capuchin":
            # A step must run a plan that fits: when the hybrid greedy paints itself into a corner and one of its
            # halves fits, that half's plan runs (docs/policy.md, "fallback"; the policy benchmarks of issue 4 keep
            # it off so that they compare the paper's algorithm as it is). Seen on dropout-bn at half its transient
            # peak (p100): the hybrid plan was 30 MiB over the budget at a BatchNorm gradient, recompute-only fit.
            self.policy_options.setdefault("fallback", True)
        self.cache = PlanCache(cache_dir) if cache_dir else None
        self.feedback = feedback
        self.max_replans = max_replans
        self.settle_steps = settle_steps
        self.max_retries = max_retries
        self.protect_steps = protect_steps  # None: every guided step
        # Passive mode during guided steps (the pool and on-demand eviction) is Capuchin's; the baselines (swap-all,
        # checkpoint) run their plans alone, so that their max batch is their plan's.
        self.safety_net = policy in CAPUCHIN_POLICIES
        self.passive_rescue = True  # off: a guided step that keeps running out of memory raises CapuchinError
        self.verbose = verbose
        self._states: dict[str, SignatureState] = {}

    # ---- public ------------------------------------------------------------------------------------------------
    @property
    def python_function(self):
        return self._fn

    def states(self) -> dict[str, SignatureState]:
        """Per input signature (the concrete function's name), what capuchin_tf measured and planned."""
        return dict(self._states)

    def report(self) -> dict:
        """A JSON-able summary of every signature: plan counts, peaks, late prefetches, re-plans, settled or not."""
        out = {}
        for key, st in self._states.items():
            plan = st.plan
            out[key] = {
                "phase": st.history[-1].phase if st.history else None,
                "budget_bytes": self.budget_bytes,
                "plan_budget_bytes": st.plan_budget,
                "swapped_tensors": len(plan.swaps) if plan else 0,
                "swapped_bytes": plan.swapped_bytes if plan else 0,
                "recomputed_tensors": len(plan.recomputes) if plan else 0,
                "recomputed_bytes": plan.recomputed_bytes if plan else 0,
                "replans": st.replans,
                "settled": st.steps_since_change >= self.settle_steps,
                "fallback_reason": st.fallback_reason,
                "from_cache": st.from_cache,
                "speedup": st.speedup,
                "steps": [dataclasses.asdict(r) for r in st.history],
            }
        return out

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError("a capuchin_tf.function step takes positional arguments only; got keyword arguments "
                            f"{sorted(kwargs)}")
        ops.set_small_pool(True)  # small tensors get a pool of their own (the allocator's switch; one small op)
        concrete = capture.concrete_step(self._fn, args)
        key = concrete.name if isinstance(concrete.name, str) else concrete.name.decode()
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = SignatureState(concrete=concrete)
            if self._load_cached(state, args):
                return self._guided(state, args)
            return self._measured(state, args)
        return self._guided(state, args)

    # ---- measured execution ------------------------------------------------------------------------------------
    def _meta(self, concrete) -> dict:
        meta = {}
        if self.link == "p100":
            meta["flops"] = profile.count_flops(concrete)
        return meta

    def _device_model(self, trace: AccessTrace, state: SignatureState | None = None) -> DeviceModel:
        """The link model the planner works with, on the trace's clock; also sets the host store's link emulation.

        The measured step runs slower than a guided one (the profiler, the pool's evictions): the trace's clock is
        `speedup` times slower than the guided steps' (measured after each guided step). The plan keeps the trace's
        ratio of compute to transfer; the emulated link runs `speedup` times faster than the planner's, so that at
        run time the ratio is the same (for p100: the step's FLOP count over its real compute time, per byte)."""
        model = DeviceModel.from_link(self.link, trace)
        speedup = state.speedup if state is not None else 1.0
        if self.link == "native":
            ops.set_link_bandwidth(0.0)
        else:
            ops.set_link_bandwidth(model.d2h_bytes_per_s * speedup, model.h2d_bytes_per_s * speedup)
        return model

    def _measured(self, state: SignatureState, args):
        """The measured step. It has no plan to tighten, but where it fails depends on BFC fragmentation, which varies
        from run to run (a tensor the pool cannot evict, in use at that moment, splits the free memory): once, an
        out-of-memory error restores the written variables from a host copy and runs the measured step again."""
        t0 = time.perf_counter()
        meta = self._meta(state.concrete)
        snapshot = self._snapshot(state) if self.max_retries > 0 else None
        retried = 0
        while True:
            tf.config.experimental.reset_memory_stats(DEVICE)
            try:
                outputs, trace = profile.measure_step(self._fn, args, budget_bytes=self.budget_bytes, meta=meta)
                break
            except tf.errors.ResourceExhaustedError as e:
                if snapshot is not None:
                    self._restore(state, snapshot)  # no update is lost or half made, retried or not
                if snapshot is None or retried >= MEASURED_RETRIES:
                    raise
                retried += 1
                if self.verbose:
                    print(f"capuchin_tf: the measured step ran out of memory ({oom_line(e)}); variables restored, "
                          "running it again", flush=True)
        seconds = time.perf_counter() - t0
        state.trace = trace
        state.history.append(StepRecord("measured", seconds, trace.peak_bytes, retried=retried))
        self._plan_and_rewrite(state, args, self.budget_bytes)
        if self.cache is not None and state.plan is not None and state.fallback_reason is None:
            self.cache.store(self._cache_key(state, args), state.plan, extra={"trace": trace.to_json()})
        return outputs

    def _cache_key(self, state: SignatureState, args) -> CacheKey:
        graph = state.concrete.graph.as_graph_def()
        h = hashlib.sha256()
        for node in graph.node:
            h.update(f"{node.name}|{node.op}|{','.join(node.input)};".encode())
        signature = ";".join(f"{a.dtype.name}{list(a.shape)}" for a in args)
        return CacheKey(graph_fingerprint=h.hexdigest(), input_signature=signature,
                        budget_bytes=int(self.budget_bytes or 0), policy=self.policy, link=str(self.link),
                        tf_version=tf.__version__, options=tuple(sorted(self.policy_options.items())))

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
                          RuntimeWarning, stacklevel=3)
            return False
        state.trace, state.from_cache = trace, True
        self._device_model(trace, state)
        self._install(state, args, plan, self.budget_bytes or 0)
        return state.fallback_reason is None

    # ---- planning and rewriting --------------------------------------------------------------------------------
    def _plan_and_rewrite(self, state: SignatureState, args, budget: int | None) -> None:
        trace = state.trace
        device_model = self._device_model(trace, state)
        if budget is None or (trace.evicted_bytes == 0 and trace.peak_bytes <= NOTHING_TO_SAVE * self.budget_bytes):
            state.plan, state.plan_budget, state.fn = None, budget or 0, None  # nothing to save: run the plain step
            return
        plan = make_plan(trace, budget, self.policy, device_model, **self.policy_options)
        self._install(state, args, plan, budget)

    def _install(self, state: SignatureState, args, plan: Plan, budget: int) -> None:
        """Rewrites the step for `plan` (or falls back to the plain step, with one warning)."""
        # Even a plan with no decisions is applied: the measured order it pins is the one that fitted.
        state.plan, state.plan_budget = plan, budget
        state.protected_steps = self.protect_steps or 0
        if self.verbose:
            print(f"capuchin_tf: plan for {budget / 2**20:.1f} MiB: {plan.summary()}", flush=True)
        try:
            if state.optimized is None:
                state.optimized = capture.optimized_graph(state.concrete, args)
                shaped = rewrite.rebuild(state.concrete, state.optimized, name="capuchin_shapes").graph
                for t in state.trace.tensors:
                    try:
                        tensor = shaped.get_tensor_by_name(t)
                    except (KeyError, ValueError):
                        continue
                    shape = None if tensor.shape.rank is None else tuple(
                        -1 if d is None else d for d in tensor.shape.as_list())
                    state.tensor_info[t] = (tensor.dtype.name, shape)
                names = {n.name for n in state.optimized.node}
                order = [n for n in guided_order(state.trace.graph, {o.name: o.start for o in state.trace.ops})
                         if n in names]
                state.order = {n: i for i, n in enumerate(order)}
                writes = [state.order[n] for n in order if is_variable_writer(state.trace.graph.ops[n].type)]
                state.first_write = min(writes) if writes else len(order)
            missing = [d.tensor for d in plan.decisions if d.tensor not in state.tensor_info]
            if missing:
                raise rewrite.RewriteError(f"planned tensors not in the optimized graph: {missing[:3]}")
            dtypes = {t: info[0] for t, info in state.tensor_info.items()}
            shapes = {t: info[1] for t, info in state.tensor_info.items()}
            graph_def = rewrite.apply_plan(state.optimized, plan, state.trace, dtypes, shapes)
            # Beyond the plan, every tensor that still waits across other work goes to the pool, as in the measured
            # step: what the plan did not foresee (BFC fragmentation, a copy's timing) is evicted on demand instead
            # of failing the step. Capuchin's passive mode: the baselines run their plans alone.
            if self.safety_net:
                graph_def = profile.pooled(state.concrete, graph_def)
            state.fn = rewrite.rebuild(state.concrete, graph_def, name="capuchin_guided_step")
        except (rewrite.RewriteError, capture.CaptureError, ValueError, KeyError) as e:
            self._fall_back(state, f"the plan could not be applied: {e}")

    def _fall_back(self, state: SignatureState, reason: str) -> None:
        state.fn, state.fallback_reason = None, reason
        warnings.warn(f"capuchin_tf: running the plain TensorFlow step for this input signature ({reason})",
                      RuntimeWarning, stacklevel=4)

    # ---- guided execution --------------------------------------------------------------------------------------
    def _guided(self, state: SignatureState, args):
        retried = 0
        while True:
            if self.verbose and retried:
                print(f"capuchin_tf: retry {retried}, device memory in use "
                      f"{tf.config.experimental.get_memory_info(DEVICE)['current'] / 2**20:.1f} MiB, host store "
                      f"{ops.host_store_stats()}", flush=True)
            protected = self.protect_steps is None or state.protected_steps > 0
            snapshot = self._snapshot(state) if state.fn is not None and protected else None
            before = ops.host_store_stats()
            ops.drain_stalls()
            tf.config.experimental.reset_memory_stats(DEVICE)
            t0 = time.perf_counter()
            try:
                if state.fn is None:
                    outputs = self._fn(*args)
                else:
                    # Passive mode stays on as a safety net: an allocation that would fail first evicts pooled
                    # tensors and prefetched tensors their swap-in has not claimed (both come back on demand).
                    ops.set_passive_mode(self.safety_net)
                    try:
                        outputs = rewrite.call_without_grappler(state.fn, *args)
                    finally:
                        ops.set_passive_mode(False)
            except tf.errors.ResourceExhaustedError as e:
                # Failed before the first variable write of the pinned order: nothing was written, so nothing is
                # restored. Restoring anyway moves the variables: the assignments take fresh device buffers
                # wherever BFC has room (seen on the transformer: its 4 MiB embedding table and Adam slots scattered
                # over the free memory after a retry, and the 20 MiB tensors of its head no longer fit).
                # Failed later: only the variables written before the failing op are restored (on the transformer,
                # the dropout layers' seed generators, written early in the forward pass, and not the embedding table
                # and its Adam slots, which the optimizer writes at the end).
                pos = self._failing_position(state, e) if state.fn is not None else None
                untouched = pos is not None and pos < state.first_write
                restored = not untouched and snapshot is not None and self._restore(
                    state, snapshot, only=None if pos is None else self._written_before(state, pos))
                if not (restored or untouched):
                    raise self._failure(state, e) from e
                retried += 1
                if retried > self.max_retries:
                    # The last resort: this step in passive mode (the measured step's mechanism, which completed
                    # under this budget), then back to the tightened plan.
                    if not self.passive_rescue:
                        raise self._failure(state, e, rescue_off=True) from e
                    return self._passive(state, args, retried, e, snapshot)
                if not self._tighten(state, args, reason=f"out of memory ({oom_line(e)})"):
                    self._back_to_good(state)
                continue
            snapshot = None
            if state.fn is not None:
                state.good = (state.plan, state.plan_budget, state.fn)
            state.protected_steps = max(state.protected_steps - 1, 0)
            seconds = time.perf_counter() - t0
            peak = tf.config.experimental.get_memory_info(DEVICE)["peak"]
            after = ops.host_store_stats()
            stalls = ops.drain_stalls()
            late: dict[str, float] = {}  # tensor -> how long its swap-in waited
            for n, k, b, e in zip(stalls["name"], stalls["kind"], stalls["start_ns"], stalls["end_ns"]):
                if k == 2:
                    late[str(n)] = late.get(str(n), 0.0) + (int(e) - int(b)) / 1e9
            early = [str(n) for n, k in zip(stalls["name"], stalls["kind"]) if k == 3]
            plan = state.plan if state.fn is not None else None
            record = StepRecord("guided" if state.fn is not None else "plain", seconds, peak,
                                planned_bytes=(plan.swapped_bytes + plan.recomputed_bytes) if plan else 0,
                                late_prefetches=after["late_prefetches"] - before["late_prefetches"], retried=retried,
                                late_wait_s=sum(late.values()),
                                evictions=after["guided_evictions"] - before["guided_evictions"],
                                passive_evictions=after["passive_evictions"] - before["passive_evictions"],
                                passive_evicted_bytes=after["passive_evicted_bytes"] - before["passive_evicted_bytes"])
            state.history.append(record)
            waited = sum(int(e) - int(b) for e, b, k in zip(stalls["end_ns"], stalls["start_ns"], stalls["kind"])
                         if k in (0, 1, 2)) / 1e9
            if state.fn is not None and not retried and seconds - waited > 0 and state.trace.step_time > 0:
                speedup = max(1.0, state.trace.step_time / (seconds - waited))
                if speedup > state.speedup:
                    state.speedup = speedup
                    self._device_model(state.trace, state)  # the emulated link follows
            if self.feedback and state.fallback_reason is None:
                record.plan_changed = self._adjust(state, args, late, early, peak)
            state.steps_since_change = 0 if record.plan_changed or retried else state.steps_since_change + 1
            return outputs

    @staticmethod
    def _writers(state: SignatureState) -> dict:
        """Each variable-writing op of the step's graph -> the variable it writes (None: a resource capuchin_tf cannot
        read)."""
        graph = state.concrete.graph
        internal_to_external = {internal.name: external for external, internal in graph.captures}
        by_handle = {id(v.handle): v for v in graph.variables}
        writers = {}
        for op in graph.get_operations():
            if is_variable_writer(op.type) and op.inputs:
                external = internal_to_external.get(op.inputs[0].name)
                writers[op.name] = by_handle.get(id(external)) if external is not None else None
        return writers

    def _written_variables(self, state: SignatureState) -> list | None:
        """The variables the step writes, or None if a written resource is not a variable capuchin_tf can read."""
        variables = list(self._writers(state).values())
        if any(v is None for v in variables):
            return None
        return list({id(v): v for v in variables}.values())

    def _snapshot(self, state: SignatureState) -> list | None:
        """Host copies of the variables the step writes (taken before a protected step), or None if not possible."""
        if not state.written:
            state.written = self._written_variables(state) or []
        if not state.written:
            return None
        return [np.array(v.numpy(), copy=True) for v in state.written]

    def _written_before(self, state: SignatureState, pos: int) -> set[int] | None:
        """ids of the variables that ops before position `pos` of the pinned order write (the ops from `pos` on
        cannot have run: each waits for the one before it), or None if a writer cannot be matched to a variable."""
        writers = self._writers(state)
        ids = set()
        for name, i in state.order.items():
            if i >= pos or not is_variable_writer(state.trace.graph.ops[name].type):
                continue
            variable = writers.get(name)
            if variable is None:
                return None
            ids.add(id(variable))
        return ids

    def _restore(self, state: SignatureState, snapshot: list, only: set[int] | None = None) -> bool:
        """Assigns the host copies back: to every written variable, or to those whose id is in `only`."""
        for v, value in zip(state.written, snapshot):
            if only is not None and id(v) not in only:
                continue
            # A tensor made from a numpy array can keep the array's (host) memory, and the assignment can adopt it:
            # the variable would leave the device allocator (seen: ResNet50's 92.7 MiB of variables, then 0.6 MiB
            # in use). DeepCopy allocates the value on the device first; holding a reference to it while assigning
            # makes the assignment copy into the variable's own buffer rather than adopt the value's.
            with tf.device(v.device):
                held = tf.raw_ops.DeepCopy(x=tf.constant(value))
            v.assign(held)
            del held
        return True

    def _passive(self, state: SignatureState, args, retried: int, error, snapshot: list | None):
        """The last resort for a guided step: the step in passive mode (the measured step's mechanism). Like the
        measured step, it runs once more after an out-of-memory error, its written variables restored first, if a
        host copy of them was taken: where it fails depends on BFC fragmentation, which varies from run to run (seen
        on the transformer at 83 MiB, swap-only: a passive run failed on a 20 MiB tensor with 43 MiB free, in pieces
        split by small chunks in use, where other passive runs from the same state completed)."""
        if state.passive_fn is None:
            state.passive_fn = profile.passive_step(state.concrete, args)
        tf.config.experimental.reset_memory_stats(DEVICE)
        t0 = time.perf_counter()
        reruns = 0
        while True:
            if self.verbose:
                print(f"capuchin_tf: out of memory {'again' if not reruns else 'in passive mode'}; running this step "
                      f"in passive mode; device memory in use "
                      f"{tf.config.experimental.get_memory_info(DEVICE)['current'] / 2**20:.1f} MiB", flush=True)
            ops.set_passive_mode(True)
            try:
                outputs = rewrite.call_without_grappler(state.passive_fn, *args)
                break
            except tf.errors.ResourceExhaustedError as e:
                failure = e
            finally:
                ops.set_passive_mode(False)
                ops.drain_stalls()
            if snapshot is None or reruns >= MEASURED_RETRIES:
                raise self._failure(state, failure, passive=True) from error
            self._restore(state, snapshot)
            reruns += 1
        state.history.append(StepRecord("passive", time.perf_counter() - t0,
                                        tf.config.experimental.get_memory_info(DEVICE)["peak"],
                                        retried=retried + reruns))
        state.steps_since_change = 0
        return outputs

    def _failing_position(self, state: SignatureState, error) -> int | None:
        m = re.findall(r"\{\{node ([^}]+)\}\}", str(error))
        if not m or not state.order:
            return None
        name = m[-1]
        if name in state.order:
            return state.order[name]
        # An inserted node (capuchin/...): it runs before the first original op that depends on it, through its
        # data or control outputs and other inserted nodes (a Get feeding a recomputation's clones, for instance).
        if state.fn is None:
            return None
        try:
            failed = state.fn.graph.get_operation_by_name(name)
        except (KeyError, ValueError):
            return None
        seen, frontier, reached = {failed.name}, [failed], []
        while frontier:
            op = frontier.pop()
            for c in [c for out in op.outputs for c in out.consumers()] + list(op._control_outputs):  # noqa: SLF001
                if c.name in state.order:
                    reached.append(state.order[c.name])
                elif c.name not in seen:
                    seen.add(c.name)
                    frontier.append(c)
        return min(reached) if reached else None

    def _failure(self, state: SignatureState, error, passive: bool = False, rescue_off: bool = False) -> CapuchinError:
        pos = self._failing_position(state, error)
        if rescue_off:
            what = (f"in {self.max_retries + 1} guided attempts with tighter plans (the variables were restored; "
                    "passive-mode rescue is off)")
        elif passive:
            what = "even in passive mode (what must stay on the device at once does not fit)"
        elif state.fn is None:
            what = "in the plain TensorFlow step (no plan was needed, or the plan could not be applied)"
        elif pos is not None and pos >= state.first_write:
            what = ("after the step had started updating variables: some of this step's updates may have been "
                    "applied and the step is not retried (retrying would apply them twice)")
        else:
            what = "in a guided step whose written variables could not be saved beforehand, so it is not retried"
        return CapuchinError(f"capuchin_tf: out of memory under a budget of {self.budget_bytes} bytes {what}. "
                             f"TensorFlow said: {oom_line(error)}")

    def _tighten(self, state: SignatureState, args, reason: str) -> bool:
        """Re-plans for a tighter budget after an out-of-memory error or a peak over the budget; True if the plan
        changed.

        The policies are greedy, so a plan for a tighter budget can be worse than the one that failed (dropout-bn
        at 106 MiB: the plan for 106 MiB was predicted at 105.1 MiB, the one for 100.7 MiB at 134.6 MiB, not
        feasible, and every guided step ran out of memory after it). So the tightest budget of TIGHTEN, then
        bisection toward the current one (TIGHTEN_PROBES plans), whose plan fits is taken; if none fits, the
        lowest predicted peak, if below the current plan's; else the current plan stays and the step is retried as
        it is (what failed may have been a copy's timing or BFC fragmentation, which vary from step to step).
        """
        current = state.plan_budget or self.budget_bytes or state.trace.peak_bytes
        target = int(current * TIGHTEN)
        if self.verbose:
            print(f"capuchin_tf: {reason}; re-planning for {target} bytes", flush=True)
        if state.plan is not None and state.untightenable_at == current:
            if self.verbose:
                print("capuchin_tf: no tighter plan fits (found before); retrying the current plan", flush=True)
            return False
        device_model = self._device_model(state.trace, state)

        def plan_for(budget: int) -> Plan:
            return make_plan(state.trace, budget, self.policy, device_model, **self.policy_options)

        tried = [(target, plan_for(target))]
        if not tried[0][1].feasible and state.plan is not None:
            lo, hi = target, current  # lo: no plan fits; hi: the plan that failed
            for _ in range(TIGHTEN_PROBES):
                mid = (lo + hi) // 2
                tried.append((mid, plan_for(mid)))
                if tried[-1][1].feasible:
                    hi = mid
                else:
                    lo = mid
        state.replans += 1
        fitting = [(b, p) for b, p in tried if p.feasible]
        if fitting:
            budget, plan = min(fitting, key=lambda bp: bp[0])
        else:
            budget, plan = min(tried, key=lambda bp: bp[1].predicted_peak_bytes)
            if state.plan is not None and plan.predicted_peak_bytes >= state.plan.predicted_peak_bytes:
                state.untightenable_at = current
                if self.verbose:
                    print(f"capuchin_tf: no tighter plan fits (best predicted peak "
                          f"{plan.predicted_peak_bytes / 2**20:.1f} MiB); retrying the current plan", flush=True)
                return False
        self._install(state, args, plan, budget)
        return True

    def _back_to_good(self, state: SignatureState) -> None:
        """After an out-of-memory error that no tighter plan answers: back to the last plan that ran, if the feedback
        has changed it since. Moving prefetches earlier for the late ones raises the memory where they land; on the
        transformer at 82-96 MiB under swap-only, the plan after the first guided step's feedback ran out of memory
        in every later step, each then rescued in passive mode. From then on late prefetches no longer move
        triggers earlier for this signature (early ones still move later)."""
        if state.good is None or state.good[0] is state.plan:
            return
        state.plan, state.plan_budget, state.fn = state.good
        state.earlier_frozen = True
        if self.verbose:
            print("capuchin_tf: back to the plan of the last guided step that completed; late prefetches no longer "
                  "move triggers earlier", flush=True)

    def _adjust(self, state: SignatureState, args, late: Mapping[str, float], early: list[str], peak: int) -> bool:
        """Feedback after a guided step; True when the plan changed (and the step was rewritten)."""
        if state.plan is None or state.replans >= self.max_replans:
            return False
        if self.budget_bytes is not None and peak > self.budget_bytes and state.fn is not None:
            return self._tighten(state, args, reason=f"peak {peak} over the budget")
        if not late and not early:
            return False
        # A prefetch evicted again before its use came too early for the memory there: its trigger moves later
        # (beyond the paper); a late one moves earlier (the paper). Eviction wins when a tensor was both.
        earlier = {} if state.earlier_frozen else {t: w for t, w in late.items() if t not in early}
        plan = move_triggers(state.plan, state.trace, earlier=earlier, later=set(early))
        if plan is state.plan:
            return False
        state.replans += 1
        self._install(state, args, plan, state.plan_budget)
        return True
