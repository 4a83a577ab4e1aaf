"""`capuchin_tf.function`: argument checks, the plain path when nothing needs saving, and training under a budget
that plain TensorFlow cannot fit, with plain TensorFlow's numbers bit for bit (each budgeted run in a fresh process).
"""

import functools
import hashlib
import pathlib
import statistics

import numpy as np
import pytest
import tensorflow as tf

import capuchin_tf
from capuchin_tf.cli import models

MiB = 1 << 20


def digest(variables):
    h = hashlib.sha256()
    for v in variables:
        h.update(np.asarray(v.numpy()).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"memory_budget": "lots"}, ValueError, "invalid memory budget"),
    ({"memory_budget": 0}, ValueError, "positive"),
    ({"memory_budget": "1TiB"}, ValueError, "larger than the device"),
    ({"policy": "magic"}, ValueError, "unknown policy 'magic'"),
    ({"link": "pcie"}, ValueError, "link must be one of"),
    ({"link": -5.0}, ValueError, "link must be one of"),
    ({"feedback": "yes"}, TypeError, "feedback must be True or False"),
    ({"max_replans": -1}, ValueError, "max_replans must be a non-negative integer"),
    ({"plan_cache": 42}, TypeError, "plan_cache must be a directory path"),
])
def test_bad_arguments_are_refused_with_a_clear_message(kwargs, error, match):
    with pytest.raises(error, match=match):
        capuchin_tf.function(lambda x: x, **kwargs)


def test_xla_steps_and_keyword_calls_are_refused():
    with pytest.raises(ValueError, match="jit_compile"):
        capuchin_tf.function(tf.function(lambda x: x * 2.0, jit_compile=True))
    step = capuchin_tf.function(lambda x: x * 2.0)
    with pytest.raises(TypeError, match="positional arguments only"):
        step(x=tf.ones([2]))


def test_a_budget_string_is_parsed_and_the_default_is_the_device_limit():
    assert capuchin_tf.function(lambda x: x, memory_budget="1.5GiB").options.budget_bytes == 3 * 512 * MiB
    assert capuchin_tf.function(lambda x: x).options.budget_bytes == int(capuchin_tf.allocator_stats()["bytes_limit"])


def test_nothing_to_save_runs_the_plain_step_bit_for_bit():
    plain = models.build("mlp", 64)
    expected = [float.hex(float(plain.train_step(*plain.inputs))) for _ in range(3)]
    setup = models.build("mlp", 64)
    step = capuchin_tf.function(setup.train_step)
    got = [float.hex(float(step(*setup.inputs))) for _ in range(3)]
    assert got == expected and digest(setup.variables) == digest(plain.variables)
    (report,) = step.report().values()
    assert [s["phase"] for s in report["steps"]] == ["measured", "plain", "plain"]
    assert report["swapped_tensors"] == report["recomputed_tensors"] == 0


RUN = """
import hashlib, json
import numpy as np
import tensorflow as tf
import capuchin_tf
from capuchin_tf.cli import models

setup = models.build("cnn", 128)
result = {{}}
try:
    if "{policy}" == "tf":
        losses = [setup.train_step(*setup.inputs) for _ in range({steps})]
    else:
        step = capuchin_tf.function(setup.train_step, memory_budget={budget}, policy="{policy}", link="{link}")
        losses = [step(*setup.inputs) for _ in range({steps})]
        (report,) = step.report().values()
        result["report"] = {{k: v for k, v in report.items() if k != "steps"}}
        result["peaks"] = [s["peak_bytes"] for s in report["steps"]]
        result["phases"] = [s["phase"] for s in report["steps"]]
        result["evicted"] = [s["passive_evicted_bytes"] for s in report["steps"]]
        result["changed"] = [bool(s["plan_changed"] or s["retried"]) for s in report["steps"]]
    result["losses"] = [float.hex(float(x)) for x in losses]
except tf.errors.ResourceExhaustedError as e:
    result["oom"] = "OOM when allocating" in str(e)
h = hashlib.sha256()
for v in setup.variables:
    h.update(np.asarray(v.numpy()).tobytes())
result["digest"] = h.hexdigest()
print(json.dumps(result))
"""

# The cnn at batch 128: plain peak about 229 MiB with 4.3 MiB persistent; 139 MiB is persistent + 0.6 x the
# transient peak. At 0.5 (117 MiB) the step runs within 4 MiB of its floor (the planner predicts 113 MiB) and BFC
# fragmentation makes guided steps fail now and then (recorded commands, docs/results.md): not for a CI test. Swap-only
# runs on the native link: on the p100 link its swaps cannot leave the device in time for this model's backward
# peak, which recomputation can.
BUDGET_MB, STEPS = 139, 5


@functools.cache  # for the whole process (under pytest-xdist a waiting worker tears module fixtures down)
def _plain_reference(simulated_device):
    return simulated_device(RUN.format(policy="tf", link="native", steps=STEPS, budget=None), limit_mb=4096,
                            timeout=600)


@pytest.fixture(scope="module")
def plain_reference(simulated_device):
    return _plain_reference(simulated_device)


def test_plain_tensorflow_does_not_fit_the_budget(simulated_device):
    result = simulated_device(RUN.format(policy="tf", link="native", steps=1, budget=None), limit_mb=BUDGET_MB,
                              timeout=600)
    assert result.get("oom") is True


@pytest.mark.parametrize("policy,link", [("capuchin", "p100"), ("recompute-only", "p100"), ("swap-only", "native")])
def test_trains_under_a_budget_plain_tensorflow_cannot_fit_bit_for_bit(simulated_device, plain_reference, policy, link,
                                                                       assert_plan_fits_policy):
    # The device is twice the budget: the allocator holds the budget, so the peak check can fail.
    result = simulated_device(RUN.format(policy=policy, link=link, steps=STEPS, budget=BUDGET_MB * MiB),
                              limit_mb=2 * BUDGET_MB, timeout=900)
    assert "oom" not in result, result
    assert result["losses"] == plain_reference["losses"]
    assert result["digest"] == plain_reference["digest"]
    assert result["phases"][0] == "measured" and set(result["phases"][1:]) == {"guided"}
    assert max(result["peaks"]) <= BUDGET_MB * MiB
    assert_plan_fits_policy(policy, result["report"])
    # The running plan's prediction moves on demand what its own guided steps evicted (their median).
    last = max((i for i, c in enumerate(result["changed"]) if c), default=0)
    ran = result["evicted"][last + 1:]
    prediction = result["report"]["prediction"]
    assert prediction["on_demand_from"] == "measured", prediction
    assert prediction["on_demand_bytes"] == int(statistics.median(ran)), (prediction, result["evicted"])


CLOCKED = """
import json
import capuchin_tf
from capuchin_tf.cli import models
from capuchin_tf.frontend import decorator

setup = models.build("cnn", 16)
options = decorator.make_options("48MiB", policy="recompute-only", link="p100", link_clock_s={clock})
step = decorator.wrap_step(setup.train_step, options)
speedups, trace_steps = [], []
for _ in range(4):
    step(*setup.inputs)
    (report,) = step.report().values()
    speedups.append(report["speedup"])
    trace_steps.append(report["prediction"]["trace_step_s"])
print(json.dumps(dict(speedups=speedups, trace_steps=trace_steps, phases=[s["phase"] for s in report["steps"]],
                      retimed=[s["retimed"] for s in report["steps"]])))
"""


def test_a_p100_link_with_a_clock_runs_at_that_clocks_rate_from_the_first_guided_step(simulated_device):
    """Options.link_clock_s: the guided steps are taken to run at that clock from the measured step on (speedup:
    the trace's step time over it), and the emulated link does not follow the steps' own speed (a clock far slower
    than the steps: without the clock, the first guided step would raise the speedup). The first guided step
    re-times the trace (ManagedStep._retime): the speedup follows the trace's new clock, the link's rate does not
    change."""
    clock = 10.0
    result = simulated_device(CLOCKED.format(clock=clock), limit_mb=96, timeout=600)
    assert result["phases"] == ["measured"] + ["guided"] * 3, result
    assert result["retimed"] == [False, True, False, False], result
    assert result["trace_steps"][1] != result["trace_steps"][0], result
    assert result["speedups"] == [pytest.approx(t / clock) for t in result["trace_steps"]], result


FIRST_GUIDED_FAILS = """
import json
import tensorflow as tf
from capuchin_tf.cli import models
from capuchin_tf.frontend import decorator
from capuchin_tf.tf import function_surgery

setup = models.build("cnn", 16)
options = decorator.make_options("48MiB", policy="recompute-only", link="p100")
step = decorator.wrap_step(setup.train_step, options)
real, failed = function_surgery.call_without_grappler, []

def first_guided_attempt_fails(fn, *args):
    states = list(step.states().values())
    if states and fn is states[0].fn and not failed:
        failed.append(True)
        raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[16,32,32,32]")
    return real(fn, *args)

function_surgery.call_without_grappler = first_guided_attempt_fails
for _ in range(4):
    step(*setup.inputs)
(report,) = step.report().values()
print(json.dumps(dict(failed=len(failed), retried=[s["retried"] for s in report["steps"]],
                      retimed=[s["retimed"] for s in report["steps"]], phases=[s["phase"] for s in report["steps"]])))
"""


def test_a_first_guided_step_that_runs_out_of_memory_leaves_the_re_timing_to_the_next(simulated_device):
    """The first guided step runs under the profiler to re-time the trace (ManagedStep._retime); when its attempt
    runs out of memory, its retry runs unprofiled and the next guided step re-times the trace, so that later plans
    and the report's prediction are not left on the measured step's times (dropout-bn b128 at 102 MiB: a trace never
    re-timed predicted 2.92x a plain step for a plan measured at 1.79x)."""
    result = simulated_device(FIRST_GUIDED_FAILS, limit_mb=96, timeout=600)
    assert result["failed"] == 1, result
    assert result["phases"][0] == "measured" and result["retried"][1] >= 1, result
    assert result["retimed"] == [False, False, True, False], result


CACHED = """
import hashlib, json, warnings
import numpy as np
import tensorflow as tf
import capuchin_tf
from capuchin_tf.cli import models

setup = models.build("cnn", 16)
if {restore!r}:
    for v, w in zip(setup.variables, np.load({state!r}, allow_pickle=False).values()):
        v.assign(w)
step = capuchin_tf.function(setup.train_step, memory_budget="41MiB", policy="recompute-only", plan_cache={cache!r})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    losses = [float.hex(float(step(*setup.inputs))) for _ in range(2)]
np.savez({state!r}, *[v.numpy() for v in setup.variables])
(report,) = step.report().values()
h = hashlib.sha256()
for v in setup.variables:
    h.update(np.asarray(v.numpy()).tobytes())
print(json.dumps(dict(losses=losses, phases=[s["phase"] for s in report["steps"]], from_cache=report["from_cache"],
                      recomputed=report["recomputed_tensors"], digest=h.hexdigest(),
                      warnings=[str(w.message) for w in caught if "plan cache" in str(w.message)])))
"""


# One inter-op thread, as the bench workers run: with TensorFlow's pool two convolution gradients can run at once,
# each with a 27 MiB workspace, and whether a plan fits 41 MiB varies from run to run.
ONE_THREAD = {"TF_NUM_INTEROP_THREADS": "1"}


def test_a_cached_plan_skips_the_measured_step_and_a_corrupt_one_is_ignored(simulated_device, tmp_path):
    plain = models.build("cnn", 16)
    expected = [float.hex(float(plain.train_step(*plain.inputs))) for _ in range(4)]
    cache, state = str(tmp_path / "plans"), str(tmp_path / "state.npz")

    first = simulated_device(CACHED.format(restore=False, state=state, cache=cache), limit_mb=4096, env=ONE_THREAD)
    assert first["phases"] == ["measured", "guided"] and first["recomputed"] > 0 and not first["from_cache"]
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1

    # A restarted job (a new process, same graph, signature, budget, policy, link) goes on from the saved state.
    second = simulated_device(CACHED.format(restore=True, state=state, cache=cache), limit_mb=4096, env=ONE_THREAD)
    assert second["from_cache"] and second["phases"] == ["guided", "guided"]
    assert first["losses"] + second["losses"] == expected and second["digest"] == digest(plain.variables)

    # A corrupt entry: one warning, and the job measures again.
    (entry,) = (tmp_path / "plans").glob("*.json")
    entry.write_text("{not json")
    third = simulated_device(CACHED.format(restore=False, state=state, cache=cache), limit_mb=4096, env=ONE_THREAD)
    assert third["phases"] == ["measured", "guided"] and not third["from_cache"]
    assert len(third["warnings"]) == 1 and "ignoring plan cache entry" in third["warnings"][0]


BELOW_FLOOR = """
import hashlib, json, warnings
import numpy as np
import tensorflow as tf
import capuchin_tf
from capuchin_tf.cli import models

setup = models.build("cnn", 128)

def digest():
    h = hashlib.sha256()
    for v in setup.variables:
        h.update(np.asarray(v.numpy()).tobytes())
    return h.hexdigest()

before = digest()
step = capuchin_tf.function(setup.train_step, memory_budget="24MiB", policy="capuchin", link="native")
result = {}
try:
    step(*setup.inputs)
except capuchin_tf.BudgetError as e:
    result["error"] = str(e)
result["measured"] = sum(len(r["steps"]) for r in step.report().values())
result["unchanged"] = digest() == before
print(json.dumps(result))
"""


def test_a_budget_below_the_working_set_floor_is_refused_before_anything_runs(simulated_device):
    # 24 MiB on a 256 MiB device: below the cnn's floor at batch 128 (persistent 4.3 MiB, and its first convolution
    # reads and writes 16 MiB activations): BudgetError names the op and the smallest budget that can work, before
    # the step ever runs.
    result = simulated_device(BELOW_FLOOR, limit_mb=256, timeout=600)
    assert "No budget below" in result["error"] and "op '" in result["error"], result
    assert result["measured"] == 0 and result["unchanged"], result


def _fake_snapshot(log):
    from types import SimpleNamespace

    return SimpleNamespace(take=lambda: log.append("take"), restore=lambda only=None: log.append(("restore", only)))


def _counter_step():
    """A variable and a managed step that adds its input to it and returns twice the sum (a budget of 1 GiB)."""
    v = tf.Variable(1.0)

    @tf.function
    def f(x):
        v.assign_add(x)
        return v * 2.0

    return v, capuchin_tf.function(f, memory_budget=1 << 30)


def test_a_measured_step_that_runs_out_of_memory_twice_restores_raises_and_is_measured_again_next_time(monkeypatch):
    # Out of memory in the measured step: what it may have written is restored, it runs once more, and a second
    # failure raises BudgetError with the variables as they were; the signature is not left marked: the next call
    # measures again (a failed first call must not make every later call run plain TensorFlow).
    from capuchin_tf.runtime import managed_step
    from capuchin_tf.tf import measure

    v, step = _counter_step()
    runs, log = [], []
    oom = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[640,8192]")

    def failing_measure(fn, args, **kwargs):
        runs.append(1)
        raise oom

    monkeypatch.setattr(measure, "measure_step", failing_measure)
    real_prepare = step._prepare

    def prepare(state, args):
        real_prepare(state, args)
        state.snapshot = _fake_snapshot(log)

    monkeypatch.setattr(step, "_prepare", prepare)
    with pytest.raises(capuchin_tf.BudgetError, match="ran out of memory twice"):
        step(tf.constant(1.0))
    assert len(runs) == 1 + managed_step.MEASURED_RETRIES and log == ["take", ("restore", None), ("restore", None)]
    assert step.states() == {}
    monkeypatch.undo()
    assert float(step(tf.constant(1.0))) == 4.0  # measured now, for real
    (report,) = step.report().values()
    assert [s["phase"] for s in report["steps"]] == ["measured"]


@pytest.mark.parametrize("in_use_mb,lowered_mb", [(600, 999), (950, None)])
def test_a_measured_step_that_found_the_free_memory_split_runs_again_under_a_lower_budget(monkeypatch, in_use_mb,
                                                                                           lowered_mb):
    # The first run's refusal: 100 MiB asked, the largest free run 80 MiB. With 600 MiB in use the bytes were there
    # (600 + 100 <= 1024): the free memory was split, and the retry runs under 1024 - 100/4 MiB. With 950 MiB in use
    # they were not: the retry runs under the step's own budget. Either way the variable is as it was.
    from capuchin_tf.runtime import managed_step
    from capuchin_tf.tf import measure

    v, step = _counter_step()
    refusals = {"refusals": 0}
    oom = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[100,1024,256]")
    real_stats = managed_step.ops.allocator_stats

    def failing_measure(fn, args, **kwargs):
        refusals["refusals"] += 1
        raise oom

    def stats():
        return {**real_stats(), **refusals, "refused_bytes": 100 * MiB, "refused_in_use": in_use_mb * MiB,
                "refused_largest_free": 80 * MiB, "refused_op": "conv"}

    budgets = []
    monkeypatch.setattr(measure, "measure_step", failing_measure)
    monkeypatch.setattr(managed_step, "device_limit_bytes", lambda: 2048 * MiB)
    monkeypatch.setattr(managed_step.ops, "allocator_stats", stats)
    monkeypatch.setattr(managed_step.ops, "set_memory_budget", budgets.append)
    with pytest.raises(capuchin_tf.BudgetError) as raised:
        step(tf.constant(1.0))
    second = 1024 * MiB if lowered_mb is None else 1024 * MiB - 25 * MiB
    assert budgets == [1024 * MiB, None, second, None]
    assert ("the second time under 999.0 MiB" in str(raised.value)) == (lowered_mb is not None)
    assert float(v.numpy()) == 1.0 and step.states() == {}  # as it was


def test_a_measured_step_whose_graph_came_back_merged_is_restored_and_run_again_its_update_applied_once(monkeypatch):
    # The measured step ran, but the graph read back with it had another function's merged in (a thread instantiating
    # functions of its own; capture.MergedGraphError): its trace cannot be taken from that graph. Its writes are
    # restored and it runs once more: the variable is updated once, the outputs are the plain step's.
    from capuchin_tf.tf import capture

    v, step = _counter_step()
    real_run = capture.run_with_post_optimization_graph
    runs = []

    def merged_once(call, names):
        result = real_run(call, names)  # the step really ran: its update happened
        runs.append(1)
        if len(runs) == 1:
            raise capture.MergedGraphError("the optimized graph TensorFlow returned has another function's graph "
                                           "merged in (forced)")
        return result

    monkeypatch.setattr(capture, "run_with_post_optimization_graph", merged_once)
    assert float(step(tf.constant(1.0))) == 4.0 and float(v) == 2.0
    assert len(runs) == 2
    (report,) = step.report().values()
    assert [s["phase"] for s in report["steps"]] == ["measured"] and report["steps"][0]["retried"] == 1, report
    assert report["fallback_reason"] is None, report


def test_tightening_after_a_failure_never_installs_a_plan_predicted_above_the_one_that_failed(monkeypatch):
    # The policies are greedy: a plan for a tighter budget can be predicted higher than the plan that failed
    # (docs/decisions.md, "Out of memory in a guided step: tighten, never upward, ..."). Plans are stood in for by
    # (feasible, predicted peak) as a function of the budget; `_install` records what would be rewritten.
    from types import SimpleNamespace

    from capuchin_tf.policy.feedback import TIGHTEN_PROBES
    from capuchin_tf.runtime import managed_step
    from capuchin_tf.runtime.signature import SignatureState

    step = capuchin_tf.function(lambda x: x, memory_budget=100 * MiB)
    step._device_model = lambda trace, state: None
    calls, installed = [], []

    def run(plan_of_budget):
        calls.clear(), installed.clear()

        def make_plan(trace, budget, policy, device_model, **options):
            calls.append(budget)
            feasible, peak = plan_of_budget(budget)
            return SimpleNamespace(feasible=feasible, predicted_peak_bytes=peak)

        monkeypatch.setattr(managed_step, "make_plan", make_plan)
        monkeypatch.setattr(step, "_install",
                            lambda state, plan, budget: installed.append((budget, plan)) or True)
        state = SignatureState(concrete=None, trace=SimpleNamespace(peak_bytes=200 * MiB),
                                       plan=SimpleNamespace(feasible=True, predicted_peak_bytes=99 * MiB),
                                       plan_budget=100 * MiB)
        return state, step._tighten(state, reason="out of memory")

    # The plan for 95% of the budget fits: it is installed, nothing else is planned.
    state, changed = run(lambda b: (True, b - MiB))
    assert changed and calls == [95 * MiB] and installed[0][0] == 95 * MiB

    # Plans fit from 98 MiB up: bisection between 95 and 100 MiB finds the tightest of its probes that fits.
    state, changed = run(lambda b: (b >= 98 * MiB, b - MiB if b >= 98 * MiB else 130 * MiB))
    assert changed and len(calls) == 1 + TIGHTEN_PROBES
    assert installed == [(min(b for b in calls if b >= 98 * MiB), installed[0][1])]
    assert 98 * MiB <= installed[0][0] < 99 * MiB

    # Nothing tighter fits and every plan is predicted above the current one: the current plan stays, and the
    # search is not repeated for the same budget.
    state, changed = run(lambda b: (False, 130 * MiB))
    assert not changed and not installed and state.untightenable_at == 100 * MiB
    calls.clear()
    assert step._tighten(state, reason="out of memory") is False and calls == []

    # Nothing fits, but one plan is predicted below the current one: the lowest is installed.
    state, changed = run(lambda b: (False, 97 * MiB if b == 95 * MiB else 120 * MiB))
    assert changed and installed[0][0] == 95 * MiB and installed[0][1].predicted_peak_bytes == 97 * MiB


def test_the_planned_layout_comes_on_for_a_plan_whose_guided_steps_evict_on_demand():
    """Options.planned_layout "auto" (the default): a signature's plans run on BFC's placement until a guided step
    evicts on demand, then under the planned layout, later plans too; True and False are always and never."""
    from types import SimpleNamespace

    from capuchin_tf.runtime.signature import SignatureState, StepRecord

    step = capuchin_tf.function(lambda x: x, memory_budget=100 * MiB)
    assert step.options.planned_layout == "auto"
    first, second = object(), object()
    state = SignatureState(concrete=None, trace=SimpleNamespace(peak_bytes=200 * MiB), fn=first)
    assert not step._layout_wanted(state)
    step._note_layout(state, StepRecord("guided", 1.0, 90 * MiB, passive_evicted_bytes=0))
    assert not step._layout_wanted(state)
    step._note_layout(state, StepRecord("guided", 1.0, 100 * MiB, passive_evicted_bytes=16 * MiB))
    assert step._layout_wanted(state) and state.layout_fn is first
    state.fn = second  # a plan change: under the layout from its first step (starting from the first plan's)
    assert step._layout_wanted(state)
    state.layout_fn = None
    for setting, wanted in ((True, True), (False, False)):
        fixed = capuchin_tf.function(lambda x: x, memory_budget=100 * MiB, planned_layout=setting)
        fixed._note_layout(state, StepRecord("guided", 1.0, 100 * MiB, passive_evicted_bytes=16 * MiB))
        assert fixed._layout_wanted(state) is wanted and state.layout_fn is None
    with pytest.raises(TypeError, match="planned_layout must be True, False or 'auto'"):
        capuchin_tf.function(lambda x: x, memory_budget=100 * MiB, planned_layout="always")


def test_a_passive_rescue_that_runs_out_of_memory_runs_once_more_after_restoring_the_variables(monkeypatch):
    # Where a passive run fails depends on BFC fragmentation: like the measured step, the rescue gets one more run;
    # every failed run has what it may have written restored first, the last one too, before the error is raised.
    from types import SimpleNamespace

    from tensorflow.core.framework import graph_pb2

    from capuchin_tf.runtime import recovery
    from capuchin_tf.runtime.signature import SignatureState
    from capuchin_tf.tf import function_surgery

    step = capuchin_tf.function(lambda x: x, memory_budget=100 * MiB)
    runs, log = [], []
    oom = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[640,8192]")

    def call(fn, *args):
        runs.append(fn)
        if len(runs) <= fails:
            raise oom
        return "outputs"

    monkeypatch.setattr(function_surgery, "call_without_grappler", call)
    for fails, ok in [(1, True), (2, False)]:
        log.clear(), runs.clear()
        state = SignatureState(concrete=None, trace=SimpleNamespace(peak_bytes=200 * MiB),
                                       passive_fn="passive step", passive_def=graph_pb2.GraphDef(),
                                       writes=recovery.StateWrites({"w": (0,)}), snapshot=_fake_snapshot(log))
        if ok:
            assert step._passive(state, (), 2, oom) == "outputs"
            assert log == ["take", ("restore", None)] and len(runs) == 2
            assert state.history[-1].phase == "passive" and state.history[-1].retried == 3
        else:
            with pytest.raises(capuchin_tf.CapuchinError, match="even in passive mode"):
                step._passive(state, (), 2, oom)
            assert len(runs) == 2 and log == ["take", ("restore", None), ("restore", None)]


def test_a_passive_rescue_that_fails_for_split_memory_says_so(monkeypatch):
    # When the allocator refused the last passive run's allocation with enough bytes free but not in one piece, the
    # error is a BudgetError that says so (the zoo's `fragmented`), not the general "even in passive mode" error.
    from types import SimpleNamespace

    from tensorflow.core.framework import graph_pb2

    from capuchin_tf.runtime import recovery
    from capuchin_tf.runtime.errors import BudgetError
    from capuchin_tf.runtime.signature import SignatureState
    from capuchin_tf.tf import function_surgery, ops

    step = capuchin_tf.function(lambda x: x, memory_budget=100 * MiB)
    oom = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[640,8192]")

    def call(fn, *args):
        raise oom

    seen = []

    def stats():
        seen.append(1)
        refused = len(seen) > 1  # the first read is before the runs, the next after they failed
        return {"refusals": 5 + refused, "refused_bytes": 20 * MiB, "refused_in_use": 70 * MiB,
                "refused_largest_free": 12 * MiB, "refused_op": "conv_grad", "refused_store_shared": 0,
                "refused_store_idle": 0, "bytes_limit": 256 * MiB}

    monkeypatch.setattr(function_surgery, "call_without_grappler", call)
    monkeypatch.setattr(ops, "allocator_stats", stats)
    state = SignatureState(concrete=None, trace=SimpleNamespace(peak_bytes=200 * MiB),
                                   passive_fn="passive step", passive_def=graph_pb2.GraphDef(),
                                   writes=recovery.StateWrites({"w": (0,)}), snapshot=_fake_snapshot([]))
    with pytest.raises(BudgetError, match="free memory was split: op 'conv_grad' asked for 20.0 MiB "
                                                  "with 30.0 MiB free, the largest free run 12.0 MiB"):
        step._passive(state, (), 2, oom)


def test_what_a_failed_attempt_may_have_written_is_what_does_not_depend_on_the_failing_op():
    # recovery.state_writes finds every write of the optimized graph (here two variable updates and a random
    # generator's state); possibly_written keeps those that do not depend on the failing node, and a Snapshot
    # assigns exactly those back. Restoring every written variable would move variables the failed attempt never
    # wrote (an embedding table, Adam slots) to fresh device buffers wherever BFC has room.
    from capuchin_tf.runtime import recovery
    from capuchin_tf.tf import capture

    first, second = tf.Variable([1.0, 2.0]), tf.Variable(3.0)
    gen = tf.random.Generator.from_seed(1)

    @tf.function
    def f(x):
        first.assign_add(x)
        y = tf.reduce_sum(first) * 2.0 + gen.normal([])
        second.assign(y)
        return y

    args = (tf.ones([2]),)
    concrete = f.get_concrete_function(*args)
    graph_def = capture.optimized_graph(concrete, args)
    n_user = len(concrete.graph.inputs) - len(concrete.graph.captures)
    writes = recovery.state_writes(graph_def, n_user)
    assert not writes.unknown
    captures = [external for external, _ in concrete.graph.captures]
    index = {id(h): i for i, h in enumerate(captures)}
    assert set(writes.captures) == {index[id(first.handle)], index[id(second.handle)], index[id(gen.state.handle)]}
    add = next(w for w, idx in writes.writers.items() if idx == (index[id(first.handle)],))
    assign = next(w for w, idx in writes.writers.items() if idx == (index[id(second.handle)],))
    # failing at the second assignment: it and nothing after it ran
    assert index[id(second.handle)] not in recovery.possibly_written(graph_def, writes, assign)
    assert index[id(first.handle)] in recovery.possibly_written(graph_def, writes, assign)
    # failing at the first update: the second depends on it
    assert index[id(second.handle)] not in recovery.possibly_written(graph_def, writes, add)
    assert recovery.possibly_written(graph_def, writes, "not a node") is None

    snapshot = recovery.Snapshot(captures, writes.captures).take()
    state_before = gen.state.numpy().copy()
    f(*args)
    assert first.numpy().tolist() == [2.0, 3.0] and (gen.state.numpy() != state_before).any()
    snapshot.restore(only={index[id(first.handle)], index[id(gen.state.handle)]})
    assert first.numpy().tolist() == [1.0, 2.0] and float(second.numpy()) != 3.0
    assert (gen.state.numpy() == state_before).all()
    snapshot.restore()
    assert float(second.numpy()) == 3.0


@pytest.mark.parametrize("written,restores", [(set(), False), ({0}, True)])
def test_a_guided_step_that_no_tighter_plan_rescues_goes_back_to_the_last_plan_that_ran(monkeypatch, written,
                                                                                        restores):
    # Feedback moved triggers (plan B) after plan A's step completed; B runs out of memory and nothing tighter is
    # predicted to fit: the retry runs A, and late prefetches stop moving triggers earlier. A failure before any
    # write restores nothing; one after a write restores what it may have written.
    from types import SimpleNamespace

    from capuchin_tf.runtime import recovery
    from capuchin_tf.runtime.signature import SignatureState
    from capuchin_tf.tf import function_surgery

    step = capuchin_tf.function(lambda x: x, memory_budget=100 * MiB)
    plan_a = SimpleNamespace(name="A", swapped_bytes=1, recomputed_bytes=0, feasible=True)
    plan_b = SimpleNamespace(name="B", swapped_bytes=2, recomputed_bytes=0, feasible=True)
    log = []
    state = SignatureState(concrete=None, trace=SimpleNamespace(peak_bytes=200 * MiB, step_time=0.0),
                                   plan=plan_b, plan_budget=90 * MiB, fn="step B", guided_def="graph B",
                                   good=(plan_a, 95 * MiB, "step A", "graph A"), snapshot=_fake_snapshot(log),
                                   writes=recovery.StateWrites({"w": (0,)}))
    runs = []
    oom = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[640,8192]")

    def call(fn, *args):
        runs.append(fn)
        if fn == "step B":
            raise oom
        return "outputs"

    monkeypatch.setattr(function_surgery, "call_without_grappler", call)
    monkeypatch.setattr(recovery, "possibly_written", lambda graph_def, writes, node: written)
    monkeypatch.setattr(step, "_tighten", lambda state, reason: False)
    assert step._guided(state, ()) == "outputs"
    assert runs == ["step B", "step A"]
    assert [x for x in log if x != "take"] == ([("restore", written)] if restores else [])
    assert state.plan is plan_a and state.plan_budget == 95 * MiB and state.fn == "step A"
    assert state.guided_def == "graph A"
    assert state.earlier_frozen and state.good == (plan_a, 95 * MiB, "step A", "graph A")
    assert state.history[-1].phase == "guided" and state.history[-1].retried == 1


@pytest.mark.parametrize("rescue", [True, False])
def test_a_plan_predicted_over_the_budget_that_runs_out_of_memory_goes_passive_only_if_rescue_is_on(monkeypatch,
                                                                                                    rescue):
    # No plan fits, the best one runs and runs out of memory where the measured step fitted: with passive rescue on,
    # this and the following steps run in passive mode; with it off (`bench --stop-on-rescue`), the step refuses
    # with the variables restored, and no step after it runs in passive mode.
    from types import SimpleNamespace

    from capuchin_tf.frontend import decorator
    from capuchin_tf.runtime import recovery
    from capuchin_tf.runtime.signature import SignatureState
    from capuchin_tf.tf import function_surgery

    step = decorator.wrap_step(lambda x: x, decorator.make_options(100 * MiB, passive_rescue=rescue))
    assert step.safety_net
    plan = SimpleNamespace(name="over", swapped_bytes=1, recomputed_bytes=0, feasible=False,
                           predicted_peak_bytes=120 * MiB)
    log = []
    state = SignatureState(concrete=None, trace=SimpleNamespace(peak_bytes=90 * MiB, step_time=0.0), plan=plan,
                           plan_budget=100 * MiB, fn="step", guided_def="graph", snapshot=_fake_snapshot(log),
                           writes=recovery.StateWrites({"w": (0,)}))
    oom = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[640,8192]")

    def call(fn, *args):
        raise oom

    passive = []
    monkeypatch.setattr(function_surgery, "call_without_grappler", call)
    monkeypatch.setattr(recovery, "possibly_written", lambda graph_def, writes, node: {0})
    monkeypatch.setattr(step, "_passive", lambda state, args, retried, error: passive.append(retried) or "passive")
    if rescue:
        assert step._guided(state, ()) == "passive"
        assert state.passive_only and passive == [1]
    else:
        with pytest.raises(capuchin_tf.CapuchinError, match="predicted over the budget.*rescue is off"):
            step._guided(state, ())
        assert not state.passive_only and not passive
    assert ("restore", {0}) in log


def test_guided_attempts_that_fail_with_rescue_off_say_what_the_allocator_saw(monkeypatch):
    # With passive rescue off (`bench --stop-on-rescue`), a guided step that runs out of memory refuses; the error says
    # why from the allocator's last refusal, as a measured step's does: here the free memory was split (shaped after
    # bert-4l b112 at 391 MiB: a 56 MiB activation refused in the forward, retried with tighter plans to no avail).
    from types import SimpleNamespace

    from capuchin_tf.frontend import decorator
    from capuchin_tf.runtime import recovery
    from capuchin_tf.runtime.signature import SignatureState
    from capuchin_tf.tf import function_surgery, ops

    step = decorator.wrap_step(lambda x: x, decorator.make_options(100 * MiB, passive_rescue=False))
    plan = SimpleNamespace(name="over", swapped_bytes=1, recomputed_bytes=0, feasible=False,
                           predicted_peak_bytes=120 * MiB)
    state = SignatureState(concrete=None, trace=SimpleNamespace(peak_bytes=90 * MiB, step_time=0.0), plan=plan,
                           plan_budget=100 * MiB, fn="step", guided_def="graph", snapshot=_fake_snapshot([]),
                           writes=recovery.StateWrites({"w": (0,)}))
    oom = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[112,128,1024]")

    def call(fn, *args):
        raise oom

    stats = {"refusals": 7, "refused_bytes": 56 * MiB, "refused_in_use": 30 * MiB,
             "refused_largest_free": 30 * MiB, "refused_op": "Gelu/Pow", "refused_store_shared": 0,
             "refused_store_idle": 0, "bytes_limit": 256 * MiB}
    monkeypatch.setattr(function_surgery, "call_without_grappler", call)
    monkeypatch.setattr(recovery, "possibly_written", lambda graph_def, writes, node: {0})
    monkeypatch.setattr(ops, "allocator_stats", lambda: stats)
    with pytest.raises(capuchin_tf.CapuchinError, match="rescue is off.*free memory was split: op 'Gelu/Pow' asked "
                                                        "for 56.0 MiB with 70.0 MiB free, the largest free run "
                                                        "30.0 MiB.*TensorFlow said"):
        step._guided(state, ())
    stats.update(refused_in_use=80 * MiB)  # 80 + 56 > 100: the budget is below what the step needs at once
    with pytest.raises(capuchin_tf.CapuchinError, match="rescue is off.*in use that the pool could not evict"):
        step._guided(state, ())


# The end of the scripts below: without a budget, plain TensorFlow's steps; then the losses and the variables' digest.
_RESULT_TAIL = """else:
    losses = [setup.train_step(*setup.inputs) for _ in range({steps})]
    result = {{}}
result["losses"] = [float.hex(float(x)) for x in losses]
h = hashlib.sha256()
for v in setup.variables:
    h.update(np.asarray(v.numpy()).tobytes())
result["digest"] = h.hexdigest()
print(json.dumps(result))
"""

TRIAL = """
import hashlib, json
import numpy as np
import tensorflow as tf
import capuchin_tf
import capuchin_tf.policy.feedback as feedback
from capuchin_tf.cli import models

feedback.TRIAL_FRACTION = {fraction}  # 0: any settled guided step opens the trial (the test forces one)
feedback.TRIAL_PREDICTION_SLACK = float("inf")  # and every candidate is tried, whatever its predicted time
# and peak (the allocator holds the budget; one that fails is dropped)
from capuchin_tf.runtime import managed_step
managed_step.trial_candidate = lambda plan, budget, evicted_on_demand=0, running=None: plan.unreachable_op is None
# and the margin is made with a learned placement error of 32 MiB (above the prior, the 20 MiB logits) whatever the
# steps evicted on demand
managed_step.placement_error = lambda plan, budget, evicted: 32 << 20
setup = models.build("transformer", 32)
if {budget}:
    step = capuchin_tf.function(setup.train_step, memory_budget={budget}, policy="capuchin", link="p100")
    losses = [step(*setup.inputs) for _ in range({steps})]
    (report,) = step.report().values()
    result = dict(trials=report["trials"], plan_policy=report["plan_policy"], plan_budget=report["plan_budget_bytes"],
                  placement_error=report["placement_error_bytes"],
                  phases=[s["phase"] for s in report["steps"]], peaks=[s["peak_bytes"] for s in report["steps"]])
""" + _RESULT_TAIL
# The quick tier's transformer at persistent + half its transient peak (docs/results.md, the quick tier's suite).
TRIAL_BUDGET_MB, TRIAL_STEPS = 79, 14


def test_a_measured_arbitration_tries_its_candidates_and_the_step_stays_bit_for_bit(simulated_device):
    """Measured arbitration (policy.feedback, "measured arbitration"), forced: from the second guided step on, the
    capuchin policy's trials run (its own plan made again with the placement error its steps were measured to have
    first, from the first guided step; then, of the checkpoint plan and each half's, the one expected fastest), each
    for two measured steps after the one that
    instantiates it, and stay or are dropped; every step is guided, under the budget on a device twice its size, with
    plain TensorFlow's losses and variables."""
    plain = simulated_device(TRIAL.format(fraction=0.0, budget=0, steps=TRIAL_STEPS), limit_mb=4096, timeout=600)
    result = simulated_device(TRIAL.format(fraction=0.0, budget=TRIAL_BUDGET_MB * MiB, steps=TRIAL_STEPS),
                              limit_mb=2 * TRIAL_BUDGET_MB, timeout=900)
    trials = result["trials"]
    assert list(trials)[:1] == ["margin"], trials  # the first candidate is always looked at first
    concluded = [name for name, outcome in trials.items() if outcome.startswith(("kept", "dropped"))]
    assert concluded, trials
    kept = [name for name in concluded if trials[name].startswith("kept")]
    if trials["margin"].startswith(("kept", "dropped")):
        assert result["placement_error"] > 0, result  # the margin plan is made only from a learned error
    if not kept and not any(o == "on trial" for o in trials.values()):
        assert result["plan_policy"] == "capuchin" and result["plan_budget"] == TRIAL_BUDGET_MB * MiB, result
    assert result["phases"] == ["measured"] + ["guided"] * (TRIAL_STEPS - 1), result["phases"]
    assert max(result["peaks"]) <= TRIAL_BUDGET_MB * MiB
    assert result["losses"] == plain["losses"] and result["digest"] == plain["digest"]


BUILD = """
import dataclasses, hashlib, json, threading, time, warnings
import numpy as np
import tensorflow as tf
import capuchin_tf
import capuchin_tf.policy.feedback as feedback
from capuchin_tf.cli import models
from capuchin_tf.runtime import managed_step

feedback.TRIAL_FRACTION = 2.0  # no measured arbitration: the one plan change is the feedback's
setup = models.build("transformer", 32)
mode = {mode!r}
if mode != "plain":
    asked = []

    def once(plan, *args, **kwargs):  # the feedback asks for one plan change, after the second guided step, and
        asked.append(1)               # no other (the real feedback may move a trigger in a later step: a 2nd build)
        if len(asked) == 2:
            return dataclasses.replace(plan)  # the same decisions, a new plan: rewritten and built again
        return plan

    managed_step.plan_after_step = once
    build = managed_step.ManagedStep._build
    built_in = []

    def slow_build(self, *args):
        background = threading.current_thread() is not threading.main_thread()
        built_in.append("background" if background else "main")
        if background:
            time.sleep(1.0)  # a build longer than a step: the steps go on with the current plan meanwhile
            if mode == "fail":
                raise ValueError("a build that fails")
        return build(self, *args)

    managed_step.ManagedStep._build = slow_build
    if mode == "nothread":  # no thread can be started: the change is built in the step that asks
        start = threading.Thread.start

        def refuse(thread):
            if thread.name == "capuchin-tf-build":
                raise RuntimeError("can't start new thread")
            return start(thread)

        threading.Thread.start = refuse
    step = capuchin_tf.function(setup.train_step, memory_budget={budget}, policy="capuchin", link="p100")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [step(*setup.inputs) for _ in range({steps})]
    (report,) = step.report().values()
    result = dict(built_in=built_in, steps=report["steps"], warned=[str(w.message) for w in caught
                                                                    if "could not be built" in str(w.message)])
""" + _RESULT_TAIL
BUILD_STEPS = 12


@pytest.mark.parametrize("mode", ["build", "fail", "nothread"])
def test_a_plan_change_is_built_off_the_critical_path_and_the_step_stays_bit_for_bit(simulated_device, mode):
    """Background builds: the guided step whose feedback asks for a plan change returns without waiting for the
    build (slowed by 1 s here, longer than a step); the steps after it run the current plan, marked `building`,
    until the build is ready (at most BUILD_WAIT_STEPS of them), and the new plan runs from the step after that one.
    A build that fails leaves the current plan, with one warning; where no thread can be started, the change is built
    in the step that asks. Every step is guided, under the budget on a device twice its size, with plain TensorFlow's
    losses and variables."""
    from capuchin_tf.runtime.managed_step import BUILD_WAIT_STEPS

    plain = simulated_device(BUILD.format(mode="plain", budget=0, steps=BUILD_STEPS), limit_mb=4096, timeout=600)
    result = simulated_device(BUILD.format(mode=mode, budget=TRIAL_BUDGET_MB * MiB, steps=BUILD_STEPS),
                              limit_mb=2 * TRIAL_BUDGET_MB, timeout=900)
    steps = result["steps"]
    assert [s["phase"] for s in steps] == ["measured"] + ["guided"] * (BUILD_STEPS - 1), steps
    building = [i for i, s in enumerate(steps) if s["building"]]
    changed = [i for i, s in enumerate(steps) if s["plan_changed"]]
    if mode == "nothread":
        assert result["built_in"] == ["main", "main"], result["built_in"]
        assert building == [] and changed == [2] and not result["warned"], (building, changed)  # the asking step
        assert result["losses"] == plain["losses"] and result["digest"] == plain["digest"]
        return
    assert result["built_in"] == ["main", "background"], result["built_in"]  # the first plan, then the change
    assert building, steps
    asker = building[0] - 1  # the step after which the feedback asked (the third: the second guided one)
    assert asker == 2 and steps[asker]["adjust_s"] < 1.0 and not steps[asker]["plan_changed"], steps
    assert building == list(range(building[0], building[-1] + 1)), building  # until the build is taken
    assert len(building) <= BUILD_WAIT_STEPS, building
    if mode == "build":
        assert changed == [building[-1]], (changed, building)  # the new plan runs from the step after
        assert not result["warned"]
    else:
        assert changed == [] and len(result["warned"]) == 1, (changed, result["warned"])
    assert max(s["peak_bytes"] for s in steps) <= TRIAL_BUDGET_MB * MiB
    assert result["losses"] == plain["losses"] and result["digest"] == plain["digest"]


LAYOUT = """
import hashlib, json
import numpy as np
import tensorflow as tf
import capuchin_tf
from capuchin_tf.cli import models
from capuchin_tf.tf import ops

setup = models.build("transformer", 32)
if {budget}:
    step = capuchin_tf.function(setup.train_step, memory_budget={budget}, policy="checkpoint", feedback=False,
                                planned_layout=True)
    losses = [step(*setup.inputs) for _ in range({steps})]
    (report,) = step.report().values()
    record = ops.layout_record()
    result = dict(steps=report["steps"], stats=ops.layout_stats(), in_use=ops.allocator_stats()["bytes_in_use"],
                  start=step.states()[next(iter(step.states()))].start_bytes,
                  record=dict(keys=[str(k) for k in record["keys"]], bytes=record["bytes"].tolist(),
                              allocated=record["allocated"].tolist(), freed=record["freed"].tolist()))
""" + _RESULT_TAIL
# Room below the budget for the checkpoint plan (predicted at 80.3 MiB at 79 MiB, measured near 62 MiB): at 79 its
# first guided step, on BFC alone, can run out of memory.
LAYOUT_STEPS, LAYOUT_BUDGET_MB = 6, 90


def test_the_planned_layout_places_a_guided_steps_allocations_and_the_step_stays_bit_for_bit(simulated_device):
    """Options.planned_layout: the first guided step of a plan is recorded, every later one runs with the layout's
    region, allocated within the budget at the step's start and given back at its end, and its recorded allocations
    go where the layout says (a plan with room below the budget: the transformer's checkpoint plan at 90 MiB, measured
    near 62 MiB). The steps with a region evict nothing on demand; every step is guided, under the budget on a
    device twice its size, with plain TensorFlow's losses and variables."""
    plain = simulated_device(LAYOUT.format(budget=0, steps=LAYOUT_STEPS), limit_mb=4096, timeout=600)
    # One inter-op thread, as the benchmarks run: the step's allocations then come in the same order every time.
    result = simulated_device(LAYOUT.format(budget=LAYOUT_BUDGET_MB * MiB, steps=LAYOUT_STEPS),
                              limit_mb=2 * LAYOUT_BUDGET_MB, timeout=900, env={"TF_NUM_INTEROP_THREADS": "1"})
    steps, stats = result["steps"], result["stats"]
    assert [s["phase"] for s in steps] == ["measured"] + ["guided"] * (LAYOUT_STEPS - 1), steps
    assert steps[1]["layout_bytes"] == 0  # the first guided step is recorded
    with_region = steps[2:]
    assert all(s["layout_bytes"] > 0 for s in with_region), [(s["layout_bytes"], s["layout_misses"]) for s in steps]
    assert stats["region_steps"] == len(with_region) and stats["placed"] > 0, stats
    assert all(s["passive_evicted_bytes"] == 0 for s in with_region), steps
    # The last step's record: every allocation of more than 64 KiB, keyed by its op, freed after it was made (or live
    # at the step's end); at most as many bytes live at once as the region holds.
    record = result["record"]
    assert record["keys"] and all(k.count("#") >= 2 and b > 64 << 10 for k, b in zip(record["keys"], record["bytes"]))
    assert all(f == -1 or f > a for a, f in zip(record["allocated"], record["freed"])), record
    events = sorted([(a, b) for a, b in zip(record["allocated"], record["bytes"])] +
                    [(f, -b) for f, b in zip(record["freed"], record["bytes"]) if f >= 0])
    assert max(np.cumsum([b for _, b in events])) <= max(s["layout_bytes"] for s in with_region)
    assert max(s["peak_bytes"] for s in steps) <= LAYOUT_BUDGET_MB * MiB
    assert result["in_use"] <= result["start"] + 2 * MiB  # the region was given back after the last step
    assert result["losses"] == plain["losses"] and result["digest"] == plain["digest"]


TWO_LAYOUTS = """
import json
import tensorflow as tf
import capuchin_tf
from capuchin_tf.tf import ops

@tf.function
def f(x):
    y = tf.exp(x)
    z = tf.sqrt(y + 1.0)
    w = tf.matmul(z, z, transpose_b=True)
    return tf.reduce_sum(w) + tf.reduce_sum(y * 3.0)

@tf.function
def g(x):
    y = tf.tanh(x)
    z = tf.concat([y, y], axis=0)
    return tf.reduce_sum(tf.matmul(z, z, transpose_a=True))

x = tf.random.stateless_uniform([512, 512], seed=[1, 2])
f(x), g(x)  # instantiated outside the layout
out = {}
def step(fn, fid, name):
    ops.layout_begin(fid)
    ok = False
    try:
        value = fn(x); ok = True
    finally:
        ops.layout_end(ok)
    stats = ops.layout_stats()
    out.setdefault(name, []).append({k: stats[k] for k in ("layouts", "region_steps", "placed", "planned")}
                                    | {"value": float.hex(float(value))})
for fn, fid, name in ((f, 1, "f"), (f, 1, "f"), (g, 2, "g"), (g, 2, "g"), (f, 1, "f"), (g, 2, "g")):
    step(fn, fid, name)
print(json.dumps(out))
"""


def test_two_functions_that_take_turns_keep_a_planned_layout_each(simulated_device):
    """The allocator keeps the planned layout of a function while a step of another runs (two input signatures, two
    managed steps): back to the first, its step is placed by its own layout at once, not recorded again."""
    result = simulated_device(TWO_LAYOUTS, limit_mb=256, env={"TF_NUM_INTEROP_THREADS": "1"})
    f, g = result["f"], result["g"]
    assert f[0]["layouts"] == 1 and f[0]["region_steps"] == 0 and f[0]["planned"] > 0  # recorded, laid out
    assert f[1]["region_steps"] == 1 and f[1]["placed"] == f[0]["planned"]  # placed
    assert g[0]["layouts"] == 2 and g[1]["region_steps"] == 2  # g's own, recorded then placed
    # f again: its layout was kept, so no new one is made and the step runs in its region, every allocation placed.
    assert f[2]["layouts"] == 2 and f[2]["region_steps"] == 3
    assert f[2]["placed"] == g[1]["placed"] + f[0]["planned"]
    assert g[2]["layouts"] == 2 and g[2]["region_steps"] == 4
    assert len({s["value"] for s in f}) == 1 and len({s["value"] for s in g}) == 1


PACKED_LAYOUT = """
import json
import tensorflow as tf
import capuchin_tf
from capuchin_tf.tf import ops

@tf.function
def f(x, w1, w3, w4):
    t0 = tf.concat([x] * 6, axis=0)  # 768 KiB
    t1 = tf.matmul(t0, w1)  # 768 KiB, while t0 lives
    t2 = tf.matmul(w3, t1)  # 512 KiB, while t1 lives
    t3 = tf.matmul(w4, t2)  # 768 KiB, while t2 lives
    return tf.reduce_sum(t2) + tf.reduce_sum(t3)

def u(*shape):
    return tf.random.stateless_uniform(shape, seed=[1, len(shape)])

args = (u(64, 512), u(512, 512), u(256, 384), u(384, 256))
f(*args)  # instantiated outside the layout
out = {"stats": [], "values": []}
def step(fid, inherit=None):
    if inherit is not None:
        ops.layout_inherit(inherit)
    ops.layout_begin(fid)
    ok = False
    try:
        value = f(*args); ok = True
    finally:
        ops.layout_end(ok)
    out["stats"].append(ops.layout_stats())
    out["values"].append(float.hex(float(value)))
step(1)
record = ops.layout_record()
out["record"] = [[int(b), int(a), int(e)] for b, a, e in zip(record["bytes"], record["allocated"], record["freed"])]
step(1)
step(2, inherit=1)  # a new function starting from function 1's layout
step(2)
print(json.dumps(out))
"""


def _packing_reference():
    """tools/probe_layout_packing.py: the most a record holds at once, and what one greedy order packs it into."""
    import importlib.util
    import sys

    tools = pathlib.Path(__file__).resolve().parent.parent / "tools"
    sys.path.insert(0, str(tools))  # (the probe imports probe_common beside it)
    try:
        spec = importlib.util.spec_from_file_location("probe_layout_packing", tools / "probe_layout_packing.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(tools))
    return module


def test_the_planned_layout_packs_a_step_into_the_most_it_holds_at_once_and_a_new_plan_starts_from_it(
        simulated_device):
    """The layout is the smallest of several greedy packings (cc/kernels/step_layout.cc, Layout): on a chain of four
    buffers that largest-first packs into 2 MiB, the region is 1.5 MiB, the most the step holds at once. A new
    function told to start from this one's layout (a plan replacing another) has its first step placed, not
    recorded."""
    result = simulated_device(PACKED_LAYOUT, limit_mb=256, env={"TF_NUM_INTEROP_THREADS": "1"})
    stats, record = result["stats"], result["record"]
    assert len(record) == 4, record
    reference = _packing_reference()
    most = reference.live_peak(record)
    largest_first = reference.greedy(record, lambda r: (-r[0], r[1]))
    assert most == 1536 * 1024 and largest_first == 2048 * 1024, record  # largest-first packs it loosely
    assert stats[0]["region_bytes"] == most and stats[0]["layouts"] == 1
    assert stats[1]["region_steps"] == 1 and stats[1]["placed"] == 4 and stats[1]["step_misses"] == 0
    # Function 2 begins with function 1's layout: placed in its first step, no new layout made.
    assert stats[2]["region_steps"] == 2 and stats[2]["placed"] == 8 and stats[2]["layouts"] == 1
    assert stats[2]["step_misses"] == 0 and stats[3]["placed"] == 12
    assert len(set(result["values"])) == 1


KEPT_LAYOUT = """
import json
import tensorflow as tf
import capuchin_tf
from capuchin_tf.tf import ops

def body(x, w1, w3, w4, keep):
    big = tf.concat([x] * 16, axis=0)  # 2 MiB, alone: the region's size
    s = tf.reduce_sum(big)
    t0 = tf.concat([x * s] * 6, axis=0)  # 768 KiB
    t1 = tf.matmul(t0, w1)  # 768 KiB, while t0 lives
    t2 = tf.matmul(w3, t1)  # 512 KiB, while t1 (and with keep 1, t0) lives
    t3 = tf.matmul(w4, t2)  # 768 KiB, while t2 (and with keep 1, t0) lives
    out = tf.reduce_sum(t2) + tf.reduce_sum(t3)
    if keep == 1:  # t0 lives to the end: its bytes are free in the region, so a later allocation finds another gap
        out += tf.reduce_sum(t0 * tf.reduce_sum(t3))
    if keep == 2:  # the 2 MiB buffer lives to the end: what comes after it finds no room in the region
        out += tf.reduce_sum(big * tf.reduce_sum(t3))
    return out

steps = [tf.function(lambda *a, keep=keep: body(*a, keep=keep)) for keep in (0, 1, 2)]
def u(*shape):
    return tf.random.stateless_uniform(shape, seed=[1, len(shape)])
args = (u(64, 512), u(512, 512), u(256, 384), u(384, 256))
for f in steps:
    f(*args)  # instantiated outside the layout
out = {"stats": []}
# One function id: the same keys, other lifetimes. (0, 3): the device's room held down to 3 MiB beside what is in use.
for keep, room_mb in ((0, 0), (0, 0), (1, 0), (1, 0), (2, 0), (0, 3), (2, 0), (2, 0)):
    if room_mb:
        ops.set_memory_budget(ops.allocator_stats()["bytes_in_use"] + (room_mb << 20))
    ops.layout_begin(1)
    ok = False
    try:
        steps[keep](*args); ok = True
    finally:
        ops.layout_end(ok)
        ops.set_memory_budget(None)
    out["stats"].append(ops.layout_stats())
print(json.dumps(out))
"""


def test_a_planned_layout_that_held_a_step_stays_and_one_that_fell_short_is_made_again(simulated_device):
    """A step whose allocations all stayed in the region keeps the layout, though one of them missed its place and
    went to another gap; a step where one went to the device allocator lays out again, from its own lifetimes; and
    where the device has no room for that new layout, the step runs with the layout before it, which had its region
    (cc/kernels/step_layout.cc, LayoutWanting, Previous). Before, any miss made a new layout, and on the cnn b128 at
    117 MiB a layout made from a step with 9 misses in the region was larger than the device's free run: the next step
    had no region and evicted 16 MiB on demand (docs/decisions.md, "Planned layout: a layout that holds stays")."""
    stats = simulated_device(KEPT_LAYOUT, limit_mb=256, env={"TF_NUM_INTEROP_THREADS": "1"})["stats"]
    assert stats[0]["layouts"] == 1 and stats[0]["region_bytes"] == 2 << 20  # recorded, laid out in 2 MiB
    assert stats[1]["attached_bytes"] == 2 << 20 and stats[1]["step_misses"] == 0
    for s in stats[2:4]:  # t0 lives longer: one allocation misses its place and finds another gap of the region
        assert s["attached_bytes"] == 2 << 20 and s["step_misses"] >= 1, stats
        assert s["fallbacks"] == 0 and s["layouts"] == 1, stats  # the layout stays
    # The 2 MiB buffer lives to the end: allocations go to the device allocator, and the step lays out again.
    assert stats[4]["fallbacks"] > 0 and stats[4]["layouts"] == 2 and stats[4]["region_bytes"] > 3 << 20, stats
    # With room for 3 MiB only, the next step runs with the 2 MiB layout before it, all placed, and keeps it.
    assert stats[5]["attached_bytes"] == 2 << 20 and stats[5]["previous"] == 1 and stats[5]["step_misses"] == 0, stats
    assert stats[5]["region_bytes"] == 2 << 20 and stats[5]["layouts"] == 2, stats
    # With room again, the long-lived buffer falls short of it once more, and the new layout has its region after.
    assert stats[6]["layouts"] == 3 and stats[7]["attached_bytes"] == stats[6]["region_bytes"] > 3 << 20, stats
    assert stats[7]["step_misses"] == 0 and stats[7]["previous"] == 1, stats
