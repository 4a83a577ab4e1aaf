"""What one plan change costs a guided step, by part (issue 16: "a plan change costs under 10% of a step").

    TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=207 TF_ENABLE_ONEDNN_OPTS=0 \
        .venv/bin/python tools/profile_plan_change.py --model resnet50 --batch 32 --budget-mb 207 --link p100 \
        --json out.json

With --background, the same change is built off the critical path as the runtime builds it (the steps that ran
while it was built and the first on the new plan, against the guided steps before). Otherwise:
runs the model's measured step and two guided steps under `capuchin_tf.function`, then makes the plan change the
feedback makes for late prefetches (every in-trigger moved earlier: policy.feedback.move_triggers) and times its
parts: planning from scratch (what a tighter plan costs), the graph edits (rewrite.plan_editor, rewrite.pooled on
its editor), the function made of them (function_surgery.runnable) and the first and second guided calls after it,
against the guided step before. Prints one line per part and writes them as JSON, stamped. With --cprofile FILE,
the edits and the function (guided_graph and runnable, as a build makes them) are made once more under cProfile,
its statistics written to FILE (read with `python -m pstats FILE`) and the 25 costliest calls by own time printed.
"""

from __future__ import annotations

import time

from probe_common import step_parser, write_stamped


def main() -> int:
    p = step_parser(__doc__, model="resnet50", batch=32)
    p.add_argument("--background", action="store_true",
                   help="the same change built off the critical path (ManagedStep._change, as the feedback makes it): "
                        "the steps that ran while it was built and the first after it, against the guided step before")
    p.add_argument("--cprofile", metavar="FILE", help="also profile the edits and the function with cProfile")
    a = p.parse_args()

    import capuchin_tf  # noqa: F401  (the allocator wrapper, before TensorFlow's first op)
    from capuchin_tf.cli import models
    from capuchin_tf.frontend import decorator
    from capuchin_tf.policy import make_plan
    from capuchin_tf.tf import function_surgery, rewrite

    setup = models.build(a.model, a.batch)
    options = decorator.make_options(a.budget_mb * 2**20, policy="capuchin", link=a.link, feedback=False)
    managed = decorator.wrap_step(setup.train_step, options)
    calls = []
    for _ in range(3):  # measured, guided (instantiates), guided
        t0 = time.perf_counter()
        managed(*setup.inputs)
        calls.append(time.perf_counter() - t0)
    (state,) = managed.states().values()
    plan = state.plan
    parts: dict[str, float] = {"guided_call_before_s": calls[-1]}
    if a.background:
        return _background(a, managed, state, setup, calls)

    t0 = time.perf_counter()
    make_plan(state.trace, state.plan_budget, "capuchin", plan.device, **options.planner_options())
    parts["make_plan_s"] = time.perf_counter() - t0
    moved = _earlier_triggers(plan, state.trace)
    dtypes = {t: info[0] for t, info in state.tensor_info.items()}
    shapes = {t: info[1] for t, info in state.tensor_info.items()}
    t0 = time.perf_counter()
    editor = rewrite.plan_editor(state.optimized, moved, state.trace, dtypes, shapes)
    parts["apply_plan_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph_def = rewrite.pooled(editor.graph, state.shaped, editor=editor)
    parts["pooled_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    function_surgery.runnable(state.concrete, graph_def, name="capuchin_guided_step")
    parts["runnable_s"] = time.perf_counter() - t0
    if a.cprofile:
        _cprofile(a.cprofile, lambda: function_surgery.runnable(  # what ManagedStep._build does
            state.concrete, rewrite.guided_graph(state.optimized, moved, state.trace, dtypes, shapes, state.shaped),
            name="capuchin_profiled"))
    t0 = time.perf_counter()
    installed = managed._install(state, moved, state.plan_budget)  # the same edits, installed
    parts["install_s"] = time.perf_counter() - t0
    for name in ("first_call_after_s", "second_call_after_s"):
        t0 = time.perf_counter()
        managed(*setup.inputs)
        parts[name] = time.perf_counter() - t0
    parts["plan_change_s"] = parts["install_s"] + parts["first_call_after_s"] - parts["second_call_after_s"]
    write_stamped(a, {"installed": installed, "swaps": len(plan.swaps), "recomputes": len(plan.recomputes),
                      "graph_nodes": len(graph_def.node), "calls_s": calls, **parts})
    for k, v in parts.items():
        print(f"{k:24s} {v:8.3f}")
    print(f"plan change: {parts['plan_change_s']:.2f} s, {parts['plan_change_s'] / parts['second_call_after_s']:.2f}x "
          f"a guided step ({len(graph_def.node)} nodes)")
    return 0


def _cprofile(path: str, work) -> None:
    """`work()` under cProfile; its statistics to `path`, the costliest calls by own time printed."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(work)
    profiler.dump_stats(path)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def _earlier_triggers(plan, trace):
    """The feedback's change for late prefetches: every in-trigger of `plan` moved earlier."""
    from capuchin_tf.policy.feedback import move_triggers

    return move_triggers(plan, trace, earlier={d.tensor: 0.0 for d in plan.swaps if d.in_trigger}, later=set())


def _background(a, managed, state, setup, calls) -> int:
    """The change built in the background: guided steps run while it is built (each marked `building`; after each,
    ManagedStep._take_build, as with the feedback on), then it is taken. Its cost: the time those steps and the
    first step on the new plan took beyond as many guided steps at the median before it (two more guided steps are
    run first for that median)."""
    import statistics

    for _ in range(2):
        t0 = time.perf_counter()
        managed(*setup.inputs)
        calls.append(time.perf_counter() - t0)
    before = statistics.median(calls[-3:])
    moved = _earlier_triggers(state.plan, state.trace)
    t0 = time.perf_counter()
    installed_now = managed._change(state, moved, state.plan_budget)
    start_s = time.perf_counter() - t0
    overlapped, after = [], []
    for _ in range(12):
        building = state.build is not None
        t0 = time.perf_counter()
        managed(*setup.inputs)
        if building:  # what the runtime does after such a step with the feedback on (this run has it off)
            managed._take_build(state, state.history[-1])
        (overlapped if building else after).append(time.perf_counter() - t0)
        if not building and len(after) >= 2:
            break
    cost = start_s + sum(overlapped) + after[0] - (len(overlapped) + 1) * before
    result = write_stamped(a, {"background": True, "installed_at_once": installed_now, "taken": state.plan is moved,
                               "calls_s": calls, "guided_median_before_s": before, "start_s": start_s,
                               "overlapped_steps_s": overlapped, "steps_after_s": after, "plan_change_s": cost})
    for k in ("guided_median_before_s", "start_s", "overlapped_steps_s", "steps_after_s", "taken"):
        print(f"{k:24s} {result[k]}")
    print(f"plan change in the background: {cost:.2f} s beyond {len(overlapped) + 1} guided steps, "
          f"{cost / before:.2f}x a guided step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
