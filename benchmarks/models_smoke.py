"""Smoke run of the benchmark model zoo (capuchin_tf.cli.models): build each model, run a few steps, print a table.

    python benchmarks/models_smoke.py resnet50 bert-4l --batch 8 [--steps 2] [--limit-mb 4096] [--stock] [--json out]
    python benchmarks/models_smoke.py resnet50:8 bert-4l:4        # per-model batch
    python benchmarks/models_smoke.py --list

Each model runs in a fresh process on the simulated device (TF_CPU_ALLOCATOR_USE_BFC=true, a BFC limit of --limit-mb
MiB), as docs/benchmarks.md requires. Reported per model: build time, first step time (includes graph optimization)
and the last step's time, the losses, the persistent memory in use before the first step (weights, optimizer state,
the input batch), the step's peak from `get_memory_info('CPU:0')['peak']` and the transient peak (peak minus
persistent), and the variables' bytes. With --stock the child does not load capuchin_tf's op library (plain
TensorFlow allocator); by default it imports capuchin_tf first, as a benchmark run would.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

MIB = 1 << 20


def _child(name: str, batch: int, steps: int) -> dict:
    import tensorflow as tf

    if os.environ.get("CAPUCHIN_TF_PURE") != "1":
        import capuchin_tf  # noqa: F401  (loads the op library before the first op, as a benchmark would)
    from capuchin_tf.cli import models

    t0 = time.perf_counter()
    setup = models.build(name, batch)
    build_s = time.perf_counter() - t0
    persistent = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = setup.train_step(*setup.inputs)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    info = setup.info
    return {
        "model": name,
        "batch": batch,
        "tier": info["tier"],
        "input_size": list(info["input_size"]),
        "params": info["params"],
        "param_bytes": info["param_bytes"],
        "persistent_var_bytes": info["persistent_bytes"],
        "build_s": build_s,
        "step_s": times,
        "losses": losses,
        "persistent_bytes": persistent,
        "peak_bytes": peak,
        "transient_peak_bytes": peak - persistent,
        "traces": setup.train_step.experimental_get_tracing_count(),
        "tf_version": tf.__version__,
        "capuchin_tf_loaded": os.environ.get("CAPUCHIN_TF_PURE") != "1",
    }


def _run_child(name: str, batch: int, args) -> dict:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # as on the simulated device (docs/decisions.md)
    env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(args.limit_mb)
    if args.stock:
        env["CAPUCHIN_TF_PURE"] = "1"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
    cmd += ["--batch", str(batch), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"model": name, "batch": batch, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(rows: list[dict]) -> str:
    head = (
        f"{'model':<18} {'batch':>5} {'input':>10} {'params':>11} {'param MiB':>9} {'vars MiB':>8} {'build s':>7} "
        f"{'step1 s':>7} {'step s':>7} {'persist MiB':>11} {'peak MiB':>8} {'transient':>9}  losses"
    )
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<18} {r['batch']:>5}  ERROR: {r['error']}")
            continue
        inp = "x".join(str(d) for d in r["input_size"])
        lines.append(
            f"{r['model']:<18} {r['batch']:>5} {inp:>10} {r['params']:>11,} {r['param_bytes'] / MIB:>9.1f} "
            f"{r['persistent_var_bytes'] / MIB:>8.1f} {r['build_s']:>7.1f} {r['step_s'][0]:>7.3f} "
            f"{r['step_s'][-1]:>7.3f} {r['persistent_bytes'] / MIB:>11.1f} {r['peak_bytes'] / MIB:>8.1f} "
            f"{r['transient_peak_bytes'] / MIB:>9.1f}  " + " ".join(f"{x:.5f}" for x in r["losses"])
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", help="model names, optionally NAME:BATCH")
    p.add_argument("--batch", type=int, default=8, help="batch for models given without :BATCH")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--limit-mb", type=int, default=4096, help="simulated device size, MiB")
    p.add_argument("--stock", action="store_true", help="do not load capuchin_tf's op library in the child")
    p.add_argument("--json", help="write the rows (with machine facts) to this file")
    p.add_argument("--list", action="store_true", help="list the model names and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        print(json.dumps(_child(args.child, args.batch, args.steps)))
        return 0
    if args.list or not args.models:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
        os.environ["CAPUCHIN_TF_PURE"] = "1"
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from capuchin_tf.cli import models

        print(models.describe())
        return 0 if args.list else 2

    rows = []
    for spec in args.models:
        name, _, b = spec.partition(":")
        rows.append(_run_child(name, int(b) if b else args.batch, args))
    print(_table(rows))
    if args.json:
        meta = {"machine": platform.node(), "cores": os.cpu_count(), "python": platform.python_version(),
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "limit_mb": args.limit_mb, "stock": args.stock}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
