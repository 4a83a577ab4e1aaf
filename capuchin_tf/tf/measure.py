"""The measured execution: run one real training step while recording its access pattern.

`measure_step(step, args)` runs the step once, for real (its variable updates happen, exactly as in a plain step),
under TensorFlow's profiler with run metadata on, and returns the step's outputs and its AccessTrace: every executed
kernel with its measured start and duration (the profiler's host tracer), every allocation and free the device
allocator made with the op that made it (the profiler's memory events), and the post-optimization graph the executor
ran (run metadata). docs/decisions.md says why the profiler and not timestamp ops.
"""

from __future__ import annotations

import glob
import os
import platform
import shutil
import tempfile
import time

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.graph_model import fold_views
from capuchin_tf.core.trace_assembly import KernelEvent, MemoryEvent, assemble_trace, fold_pool_ops, stalled_within
from capuchin_tf.tf import capture, function_surgery, ops, rewrite
from capuchin_tf.tf.simulated_device import DEVICE


def _stat_value(stat, stat_metadata):
    which = stat.WhichOneof("value")
    if which == "ref_value":
        return stat_metadata[stat.ref_value].name
    return getattr(stat, which) if which else None


ANCHOR = "capuchin_tf/clock_anchor"


# The allocator wrapper's small-tensor pool (cc/kernels/device_allocator.cc).
SMALL_POOL_ALLOCATOR = "capuchin_small_pool"


def read_xspace(path: str) -> tuple[list[KernelEvent], list[MemoryEvent], list[int]]:
    """Kernel and allocator events of the host plane of an XSpace file, times in ns on the profiler's clock, and the
    start times of the clock anchors (see `_anchor`)."""
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    kernels, memory, anchors = [], [], []
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        md, sm = plane.event_metadata, plane.stat_metadata
        for line in plane.lines:
            base = line.timestamp_ns
            for ev in line.events:
                name = md[ev.metadata_id].name
                start = base + ev.offset_ps // 1000
                if name == ANCHOR:
                    anchors.append(start)
                elif name in ("MemoryAllocation", "MemoryDeallocation"):
                    stats = {sm[s.metadata_id].name: _stat_value(s, sm) for s in ev.stats}
                    if stats.get("allocator_name") == SMALL_POOL_ALLOCATOR:
                        # Inside the small-tensor pool's region, which the device counts as one allocation: its
                        # events carry the pool's own bytes in use, not the device's.
                        continue
                    memory.append(MemoryEvent(
                        time=start, allocation=name == "MemoryAllocation", addr=int(stats.get("addr", 0)),
                        nbytes=int(stats.get("allocation_bytes", 0)), requested=int(stats.get("requested_bytes", 0)),
                        in_use_after=int(stats.get("bytes_allocated", -1)), op=str(stats.get("tf_op", "") or ""),
                        region=str(stats.get("region_type", "") or ""),
                    ))
                else:  # kernels run on the executor's threads, or inline on the caller's
                    op, sep, op_type = name.rpartition(":")
                    if sep and op and "::" not in name:
                        kernels.append(KernelEvent(op, op_type, start, start + ev.duration_ps // 1000))
    return kernels, memory, anchors


def _anchor() -> int:
    """Emits a profiler event and returns CLOCK_MONOTONIC at that moment: the offset between the profiler's clock
    and the host store's (stalls are logged on CLOCK_MONOTONIC)."""
    with tf.profiler.experimental.Trace(ANCHOR):
        return time.monotonic_ns()


def measure_step(step, args, *, passive: bool = True, budget_bytes: int | None = None, meta: dict | None = None,
                 keep_profile: str | None = None, graph_def=None, shaped=None):
    """Runs `step(*args)` once as the measured execution. Returns (outputs, AccessTrace).

    `step` is a tf.function training step; `args` its inputs (tensors). The step really runs: its updates happen, with
    the same results as a plain step. With `passive` (the default), the step runs as `rewrite.passive_step` (tensors
    that wait while memory is allocated are held by capuchin_tf's tensor pool) with passive mode on: if an allocation
    would fail, pooled tensors are evicted to host memory and brought back when read, so the step completes under a
    device limit it does not fit in; the trace is corrected to the ideal timeline and records the evicted bytes (the
    saving target). `graph_def`: the passive step's graph (`rewrite.passive_graph`), if already made, with `shaped`
    (`rewrite.shapes_graph` of the optimized graph it was made from: the static shapes of its tensors).
    """
    concrete = capture.concrete_step(step, args)  # traces the function and refuses jit_compile
    if passive:
        if graph_def is None or shaped is None:
            optimized = capture.optimized_graph(concrete, args)  # without running the step: it may not fit
            shaped = shaped if shaped is not None else rewrite.shapes_graph(concrete, optimized, args)
            graph_def = graph_def if graph_def is not None else rewrite.passive_graph(concrete, args, optimized,
                                                                                       shaped)
        fn = rewrite.passive_step(concrete, args, graph_def)
        run, func_graph, names = (lambda: function_surgery.call_without_grappler(fn, *args)), shaped, fn.node_names
    else:
        run, func_graph = (lambda: step(*args)), concrete.graph
        names = {op.name for op in concrete.graph.get_operations()}
    logdir = keep_profile or tempfile.mkdtemp(prefix="capuchin_profile_")
    before = ops.host_store_stats()
    ops.drain_stalls()
    try:
        persistent = tf.config.experimental.get_memory_info(DEVICE)["current"]
        tf.config.experimental.reset_memory_stats(DEVICE)
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0,
                                                           device_tracer_level=0)
        tf.profiler.experimental.start(logdir, options=options)
        try:
            mono = [_anchor()]
            ops.set_passive_mode(passive)
            t0 = time.perf_counter()
            try:
                outputs, executed_def = capture.run_with_post_optimization_graph(run, names)
            finally:
                wall = time.perf_counter() - t0
                ops.set_passive_mode(False)
            mono.append(_anchor())
        finally:
            tf.profiler.experimental.stop()
        peak = tf.config.experimental.get_memory_info(DEVICE)["peak"]
        files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError(f"the profiler wrote no XSpace under {logdir}")
        kernels, memory, anchors = read_xspace(max(files, key=os.path.getmtime))
    finally:
        if keep_profile is None:
            shutil.rmtree(logdir, ignore_errors=True)
    after = ops.host_store_stats()
    stalls = ops.drain_stalls()
    # profiler clock = monotonic clock - offset
    offset = sum(m - a for m, a in zip(mono, anchors)) // max(len(anchors), 1) if len(anchors) == len(mono) else 0
    stall_spans = [(int(s) - offset, int(e) - offset) for s, e in zip(stalls["start_ns"], stalls["end_ns"])]
    model, aliases = fold_pool_ops(capture.graph_model(executed_def, func_graph))
    model = fold_views(model)  # reads through views are reads of the buffer they view
    info = dict(meta or {})
    info.setdefault("tf_version", tf.__version__)
    info.setdefault("date", time.strftime("%Y-%m-%d"))
    info.setdefault("machine", {"cores": os.cpu_count(), "platform": platform.platform()})
    info.update(measured_wall_s=wall, passive=passive,
                passive_evictions=after["passive_evictions"] - before["passive_evictions"],
                passive_swap_ins=after["passive_swap_ins"] - before["passive_swap_ins"])
    trace = assemble_trace(model, kernels, memory, peak_bytes=peak, persistent_bytes=persistent,
                           stalls=stall_spans, budget_bytes=budget_bytes, meta=info, buffer_aliases=aliases,
                           evicted_bytes=after["passive_evicted_bytes"] - before["passive_evicted_bytes"])
    return outputs, trace


def profiled_call(call):
    """Runs `call()` under TensorFlow's profiler; returns (its result, its kernel events, its allocator events, the
    offset of the profiler's clock from CLOCK_MONOTONIC, for `kernel_seconds`)."""
    logdir = tempfile.mkdtemp(prefix="capuchin_profile_")
    try:
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0,
                                                           device_tracer_level=0)
        tf.profiler.experimental.start(logdir, options=options)
        try:
            mono = [_anchor()]
            result = call()
            mono.append(_anchor())
        finally:
            tf.profiler.experimental.stop()
        files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        kernels, memory, anchors = read_xspace(max(files, key=os.path.getmtime)) if files else ([], [], [])
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    offset = sum(m - a for m, a in zip(mono, anchors)) // len(anchors) if len(anchors) == len(mono) else 0
    return result, kernels, memory, offset


def kernel_seconds(kernels, offset: int, stalls) -> dict[str, float]:
    """Seconds each op's kernels ran (all its runs), less the time they stalled waiting for memory: the host store's
    stall spans (`ops.drain_stalls()` of the same call, CLOCK_MONOTONIC; `offset` from `profiled_call`) that fall
    inside them, as the measured step's trace removes them (trace_assembly.stalled_within)."""
    stalled = stalled_within([(int(s) - offset, int(e) - offset) for s, e in zip(stalls["start_ns"], stalls["end_ns"])])
    out: dict[str, float] = {}
    for k in kernels:
        out[k.op] = out.get(k.op, 0.0) + max(k.end - k.start - stalled(k.start, k.end), 0) / 1e9
    return out


def memory_curve(call):
    """Runs `call()` under TensorFlow's profiler; returns (its result, the device allocator's bytes in use after each
    allocation and free, as [(seconds since the first event, bytes)])."""
    result, _, memory, _ = profiled_call(call)
    points = sorted((m.time, m.in_use_after) for m in memory if m.in_use_after >= 0)
    t0 = points[0][0] if points else 0
    return result, [((t - t0) / 1e9, b) for t, b in points]


def count_flops(concrete) -> int:
    """Floating-point operations of one step, counted from its graph by TensorFlow's v1 profiler (benchmarks.md:
    the p100 link regime divides the step's FLOP rate by 258 FLOP per byte). Ops without a registered count
    contribute nothing."""
    from tensorflow.compat.v1 import profiler as v1_profiler

    opts = v1_profiler.ProfileOptionBuilder(v1_profiler.ProfileOptionBuilder.float_operation()).with_empty_output()
    result = v1_profiler.profile(concrete.graph, options=opts.build())
    return int(result.total_float_ops)


def plot_memory_curve(trace: AccessTrace, path: str, title: str = "") -> None:
    """A PNG of the measured and replayed memory curves, with the peak window and the budget marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # an optional extra
        raise RuntimeError("plotting needs matplotlib: pip install 'capuchin_tf[plot]' (or matplotlib)") from e
    mib = float(1 << 20)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    mt, mb = zip(*trace.memory_curve)
    ax.step(mt, [b / mib for b in mb], where="post", label="allocator (measured)", lw=1.2)
    rt, rb = zip(*trace.replayed_curve())
    ax.step(rt, [b / mib for b in rb], where="post", label="replayed from the trace", lw=1.0, ls="--")
    w0, w1 = trace.peak_window()
    ax.axvspan(w0, w1, color="orange", alpha=0.15, label="peak window")
    ax.axhline(trace.persistent_bytes / mib, color="gray", lw=0.8, ls=":", label="persistent")
    ax.axhline(trace.peak_bytes / mib, color="red", lw=0.8, ls=":", label=f"BFC peak {trace.peak_bytes / mib:.1f} MiB")
    if trace.budget_bytes:
        ax.axhline(trace.budget_bytes / mib, color="black", lw=1.2, label=f"budget {trace.budget_bytes / mib:.0f} MiB")
    ax.set_xlabel("time in step (s, ideal timeline)")
    ax.set_ylabel("device memory (MiB)")
    ax.set_title(title or "capuchin_tf measured step")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
