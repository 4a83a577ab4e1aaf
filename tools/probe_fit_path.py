"""The fit path against the decorator: one keras.applications model trained through `model.fit` with
`CapuchinCallback`, and through `capuchin_tf.function` around `model.train_step`, under the same budget, each in a
fresh process on a simulated device twice the budget; plain `model.fit` as the reference (time and final weights).

    .venv/bin/python tools/probe_fit_path.py --app MobileNetV2 --size 96 --batch 32 --budget-mb 120 --steps 10 \
        --json out.json

Per variant: the wall time of each batch (a Keras callback's batch begin to end for fit; the call and reading the
loss for the decorator), the managed steps' own seconds and phases (the report), and the final weights' digest
(fit with the callback must give plain fit's bits). Prints a summary and writes it as JSON, stamped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time

WORKER = """
import hashlib, json, time
import numpy as np
import tensorflow as tf
import keras
import capuchin_tf

mode, app, size, batch, budget, steps = {mode!r}, {app!r}, {size}, {batch}, {budget}, {steps}
keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()
model = getattr(keras.applications, app)(weights=None, input_shape=(size, size, 3), classes=10)
model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy", jit_compile=False)
rng = np.random.default_rng(0)
x = rng.standard_normal((batch, size, size, 3), dtype=np.float32)
y = rng.integers(0, 10, (batch,)).astype(np.int64)
model.optimizer.build(model.trainable_variables)
persistent = tf.config.experimental.get_memory_info("CPU:0")["current"]
tf.config.experimental.reset_memory_stats("CPU:0")  # the peak of training, not of building the model
times = []


class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None):
        self.t = time.perf_counter()

    def on_train_batch_end(self, b, logs=None):
        times.append(time.perf_counter() - self.t)


report = None
if mode in ("plain", "fit"):
    callbacks = [Timer()]
    if mode == "fit":
        managed = capuchin_tf.CapuchinCallback(memory_budget=budget)
        callbacks = [managed] + callbacks
    model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(steps), epochs=1, verbose=0, callbacks=callbacks)
    if mode == "fit":
        (report,) = managed.report().values()
else:
    step = capuchin_tf.function(lambda a, b: model.train_step((a, b)), memory_budget=budget)
    xs, ys = tf.constant(x), tf.constant(y)
    for _ in range(steps):
        t = time.perf_counter()
        logs = step(xs, ys)
        float(logs["loss"])
        times.append(time.perf_counter() - t)
    (report,) = step.report().values()
h = hashlib.sha256()
for v in model.weights:
    h.update(np.asarray(v.numpy()).tobytes())
out = dict(mode=mode, times=times, digest=h.hexdigest(), persistent_bytes=persistent,
           peak_bytes=tf.config.experimental.get_memory_info("CPU:0")["peak"])
if report is not None:
    out["steps"] = [dict(phase=s["phase"], seconds=s["seconds"], adjust_s=s["adjust_s"], building=s["building"],
                         plan_changed=s["plan_changed"]) for s in report["steps"]]
    out["plan"] = dict(swapped=report["swapped_tensors"], recomputed=report["recomputed_tensors"],
                       replans=report["replans"])
print(json.dumps(out))
"""


def run(mode: str, a, device_mb: int) -> dict:
    from capuchin_tf.tf.simulated_device import simulated_device_env

    code = WORKER.format(mode=mode, app=a.app, size=a.size, batch=a.batch, budget=(a.budget_mb or 0) * 2**20,
                         steps=a.steps)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=simulated_device_env(device_mb), timeout=a.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.strip()][-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--app", default="MobileNetV2", help="a keras.applications class")
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--batch", type=int, default=32)
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-mb", type=int)
    budget.add_argument("--transient-fraction", type=float,
                        help="budget: plain fit's persistent bytes + this fraction of its transient peak, in MiB up")
    p.add_argument("--steps", type=int, default=10, help="batches per variant (at least 3)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    from capuchin_tf.cli.common import git_commit, machine

    results = {"plain": run("plain", a, 16384)}
    if a.budget_mb is None:
        plain = results["plain"]
        persistent = plain["persistent_bytes"]
        a.budget_mb = -(-int(persistent + a.transient_fraction * (plain["peak_bytes"] - persistent)) // 2**20)
        print(f"budget {a.budget_mb} MiB (plain fit: persistent {persistent / 2**20:.1f} MiB, peak "
              f"{plain['peak_bytes'] / 2**20:.1f} MiB)", flush=True)
    for mode in ("fit", "decorator"):
        results[mode] = run(mode, a, 2 * a.budget_mb)
    for r in results.values():  # after the first two batches (the measured step and the first guided one)
        r["median_batch_s"] = statistics.median(r["times"][2:])
    plain_s = results["plain"]["median_batch_s"]
    for mode, r in results.items():
        guided = [s["seconds"] for s in r.get("steps", []) if s["phase"] == "guided"]
        r["median_guided_step_s"] = statistics.median(guided) if guided else None
        r["bit_for_bit_with_plain_fit"] = r["digest"] == results["plain"]["digest"]
        print(f"{mode:9s} median batch {r['median_batch_s']:.3f} s ({plain_s / r['median_batch_s']:.2f}x plain), "
              f"median guided step (report) {r['median_guided_step_s'] or 0:.3f} s, peak "
              f"{r['peak_bytes'] / 2**20:.1f} MiB, plan {r.get('plan')}, same weights as plain fit: "
              f"{r['bit_for_bit_with_plain_fit']}", flush=True)
    out = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(), "app": a.app,
           "size": a.size, "batch": a.batch, "budget_mb": a.budget_mb, "steps": a.steps, "results": results}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
