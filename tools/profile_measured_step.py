"""Where the first call of a managed step goes, by part (issue 16: "the measured step at most 1.5x a plain step").

    TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=207 TF_ENABLE_ONEDNN_OPTS=0 \
        .venv/bin/python tools/profile_measured_step.py --model resnet50 --batch 32 --budget-mb 207 --json out.json

Runs the model's first call under `capuchin_tf.function` with each part of it timed (wrappers around the functions
that do it: the step's optimized graph and its shapes, the passive graph and function, the variables' compaction and
host snapshot, the profiled run, reading the profile, the trace's assembly, planning and installing the first plan),
then two more calls of the passive function alone under the budget (the run without the profiler, once
instantiated) and two guided calls. Prints one line per part and writes them as JSON, stamped. The two extra passive
calls update the variables; the tool measures, it does not train. Plain TensorFlow's step for comparison: `bench run
--policy tf` on a device that fits it.
"""

from __future__ import annotations

import collections
import functools
import time

from probe_common import step_parser, write_stamped


def main() -> int:
    p = step_parser(__doc__, model="resnet50", batch=32, link="native")
    p.add_argument("--plain", action="store_true",
                   help="plain TensorFlow's first call and three calls after it instead (run it on a device that fits)")
    a = p.parse_args()

    import capuchin_tf  # noqa: F401  (the allocator wrapper, before TensorFlow's first op)
    from capuchin_tf.cli import models
    from capuchin_tf.frontend import decorator
    from capuchin_tf.runtime import managed_step, recovery
    from capuchin_tf.tf import capture, function_surgery, measure, ops, rewrite

    if a.plain:
        return _plain(a)
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0

        setattr(owner, name, wrapper)

    for owner, name, label in (
            (capture, "optimized_graph", "optimized_graph_s"),
            (rewrite, "shapes_graph", "shapes_graph_s"),
            (managed_step.ManagedStep, "_prepare", "prepare_s (the two above, what it writes, the floor)"),
            (rewrite, "passive_graph", "passive_graph_s"),
            (rewrite, "passive_step", "passive_function_s"),
            (recovery, "compact_variables", "compact_variables_s"),
            (recovery.Snapshot, "take", "host_snapshot_s"),
            (capture, "run_with_post_optimization_graph", "profiled_run_s"),
            (measure, "read_xspace", "read_profile_s"),
            (measure, "assemble_trace", "assemble_trace_s"),
            (capture, "graph_model", "graph_model_s (every call: the floor's, the measured graph's)"),
            (measure, "fold_pool_ops", "fold_pool_ops_s"),
            (measure, "fold_views", "fold_views_s (the measured graph's)"),
            (managed_step, "make_plan", "make_plan_s"),
            (managed_step.ManagedStep, "_install", "install_s"),
    ):
        timed(owner, name, label)

    setup = models.build(a.model, a.batch)
    options = decorator.make_options(a.budget_mb * 2**20, policy="capuchin", link=a.link, feedback=False)
    managed = decorator.wrap_step(setup.train_step, options)
    t0 = time.perf_counter()
    managed(*setup.inputs)
    first_call = time.perf_counter() - t0
    (state,) = managed.states().values()
    measured = state.history[0].seconds
    parts = dict(spent)
    # The passive function alone, instantiated, under the budget (passive mode on, no profiler).
    passive = rewrite.passive_step(state.concrete, setup.inputs, state.passive_def)
    runs = []
    for _ in range(2):
        ops.set_passive_mode(True)
        ops.set_memory_budget(a.budget_mb * 2**20)
        t0 = time.perf_counter()
        try:
            function_surgery.call_without_grappler(passive, *setup.inputs)
        finally:
            runs.append(time.perf_counter() - t0)
            ops.set_passive_mode(False)
            ops.set_memory_budget(None)
    guided = []
    for _ in range(2):
        t0 = time.perf_counter()
        managed(*setup.inputs)
        guided.append(time.perf_counter() - t0)
    result = write_stamped(a, {"first_call_s": first_call, "measured_step_s (the report's)": measured, "parts": parts,
                               "passive_calls_after_s": runs, "guided_calls_after_s": guided})
    for key, value in result.items():
        if key not in ("machine", "parts"):
            print(f"{key:40s} {value}")
    for key, value in parts.items():
        print(f"  {key:56s} {value:8.3f}")
    return 0


def _plain(a) -> int:
    """Plain TensorFlow's first call of the same step (tracing, Grappler, instantiation and the run) and three calls
    after it: what the measured step is compared with."""
    from capuchin_tf.cli import models

    setup = models.build(a.model, a.batch)
    calls = []
    for _ in range(4):
        t0 = time.perf_counter()
        setup.train_step(*setup.inputs)
        calls.append(time.perf_counter() - t0)
    result = write_stamped(a, {"plain": True, "first_call_s": calls[0], "calls_after_s": calls[1:]})
    for key, value in result.items():
        if key != "machine":
            print(f"{key:40s} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
