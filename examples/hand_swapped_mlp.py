"""Demo, foundation stage: train an MLP under a device-memory budget that plain TensorFlow cannot fit.

The swap ops of capuchin_tf are placed by hand around the MLP's activations: each hidden activation is swapped out to
host memory right after the forward pass has used it, prefetched one layer ahead during the backward pass, and
swapped in at its back-access. (Later stages replace this hand placement with the measured access pattern, the
policy and the graph rewriter.)

Three runs, each in a fresh process on the simulated device (TensorFlow's BFC allocator with a hard limit,
design.md), on the same seed and data:
  1. plain TensorFlow with enough memory: the reference losses and weights, and the step's measured peak;
  2. plain TensorFlow under the budget (persistent memory + half the transient peak): out of memory;
  3. the hand-swapped step under the same budget: its measured peak, and its losses and weights compared bit for
     bit with the reference.

    python examples/hand_swapped_mlp.py [--layers 16] [--width 512] [--batch 2048] [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20
REFERENCE_DEVICE_MB = 4096


def build_and_train(mode: str, layers: int, width: int, batch: int, steps: int, classes: int = 10) -> dict:
    """Runs in the child process: builds the MLP and trains it for `steps` steps. mode: 'plain' or 'swapped'."""
    import numpy as np
    import tensorflow as tf

    import capuchin_tf

    tf.config.experimental.enable_op_determinism()
    swapped = mode == "swapped"

    def init(shape, seed):
        return tf.random.stateless_normal(shape, seed=[seed, 0], stddev=(2.0 / shape[0]) ** 0.5)

    weights = [tf.Variable(init([width, width], i), name=f"w{i}") for i in range(layers)]
    biases = [tf.Variable(tf.zeros([width]), name=f"b{i}") for i in range(layers)]
    w_out = tf.Variable(init([width, classes], layers), name="w_out")
    b_out = tf.Variable(tf.zeros([classes]), name="b_out")
    variables = weights + biases + [w_out, b_out]
    x0 = tf.random.stateless_uniform([batch, width], seed=[42, 1])
    labels = tf.random.stateless_uniform([batch], seed=[42, 2], maxval=classes, dtype=tf.int32)
    lr = 0.01

    @tf.function
    def train_step(x, y):
        # Forward. acts[i] is the input of hidden layer i; acts[0] is the data.
        acts = [x]
        handles = {}
        after = []  # ordering edge: the next layer starts only once the previous swap-out was issued
        for i in range(layers):
            with tf.control_dependencies(after):
                acts.append(tf.nn.relu(tf.matmul(acts[i], weights[i]) + biases[i]))
            if swapped and 1 <= i:
                # acts[i] has had its last forward use (this layer's matmul): evict it.
                handles[i] = capuchin_tf.swap_out(acts[i], name=f"act{i}")
                after = [handles[i]]
        with tf.control_dependencies(after):
            logits = tf.matmul(acts[layers], w_out) + b_out
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

        # Backward, by hand, updating each layer as soon as its gradient is known (plain SGD).
        g = (tf.nn.softmax(logits) - tf.one_hot(y, classes)) / float(batch)
        d_act = tf.matmul(g, w_out, transpose_b=True)
        updates = [w_out.assign_sub(lr * tf.matmul(acts[layers], g, transpose_a=True)),
                   b_out.assign_sub(lr * tf.reduce_sum(g, 0))]
        out_act = acts[layers]  # the output of hidden layer i, needed for its ReLU gradient
        for i in reversed(range(layers)):
            if swapped and i in handles:
                with tf.control_dependencies([d_act]):  # back-access: not before this layer's backward starts
                    if i - 1 in handles:
                        handles[i - 1] = capuchin_tf.prefetch(handles[i - 1])  # in-trigger for layer i-1's input
                    in_act = capuchin_tf.swap_in(handles[i], tf.float32, [batch, width])
            else:
                in_act = acts[i]
            dz = tf.raw_ops.ReluGrad(gradients=d_act, features=out_act)
            dw = tf.matmul(in_act, dz, transpose_a=True)
            db = tf.reduce_sum(dz, 0)
            if i > 0:
                d_act = tf.matmul(dz, weights[i], transpose_b=True)
                with tf.control_dependencies([d_act]):  # weights[i] is read above before it is updated
                    updates.append(weights[i].assign_sub(lr * dw))
            else:
                updates.append(weights[i].assign_sub(lr * dw))
            updates.append(biases[i].assign_sub(lr * db))
            out_act = in_act
        with tf.control_dependencies(updates):
            return tf.identity(loss)

    train_step.get_concrete_function(x0, labels)  # trace outside the measured region
    persistent = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    capuchin_tf.reset_host_store_stats()
    result = {"mode": mode, "ok": True, "error": None, "losses": [], "step_s": []}
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            result["losses"].append(float(train_step(x0, labels)))
            result["step_s"].append(time.perf_counter() - t0)
    except tf.errors.ResourceExhaustedError as e:
        result["ok"] = False
        lines = [ln.strip() for ln in e.message.splitlines() if "OOM when allocating" in ln] or [e.message.strip()]
        result["error"] = f"{type(e).__name__}: {lines[0]}"
    info = tf.config.experimental.get_memory_info("CPU:0")
    digest = hashlib.sha256()
    for v in variables:
        digest.update(np.asarray(v.numpy()).tobytes())
    result.update(
        peak_bytes=info["peak"],
        persistent_bytes=persistent,
        budget_bytes=capuchin_tf.allocator_stats()["bytes_limit"],
        variables_sha256=digest.hexdigest(),
        losses_hex=[float.hex(v) for v in result["losses"]],
        host_store=capuchin_tf.host_store_stats(),
    )
    return result


def run_child(mode: str, limit_mb: int, args) -> dict:
    """Runs one mode in a fresh process whose device is a BFC allocator of `limit_mb` MiB."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # importing capuchin_tf below loads TensorFlow here too
    from capuchin_tf.tf.simulated_device import simulated_device_env

    env = simulated_device_env(limit_mb, inter_op_threads=None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--layers", str(args.layers),
           "--width", str(args.width), "--batch", str(args.batch), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"the {mode} run at {limit_mb} MiB failed (exit code {proc.returncode})")
    return json.loads(lines[-1])


def mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16, help="hidden layers (default 16)")
    parser.add_argument("--width", type=int, default=512, help="units per hidden layer (default 512)")
    parser.add_argument("--batch", type=int, default=2048, help="batch size (default 2048)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    parser.add_argument("--json", help="also write the three runs' results to this file")
    parser.add_argument("--child", choices=["plain", "swapped"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("layers", "width", "batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")

    if args.child:
        print(json.dumps(build_and_train(args.child, args.layers, args.width, args.batch, args.steps)))
        return 0

    print(f"capuchin_tf demo (hand-placed swaps): {args.layers}-layer MLP, width {args.width}, batch {args.batch}, "
          f"SGD, {args.steps} steps, on the simulated device (BFC allocator with a hard limit)\n")
    print(f"[1/3] plain TensorFlow, {REFERENCE_DEVICE_MB} MiB device ...", flush=True)
    ref = run_child("plain", REFERENCE_DEVICE_MB, args)
    transient = ref["peak_bytes"] - ref["persistent_bytes"]
    budget_mb = -(-(ref["persistent_bytes"] + transient // 2) // MiB)  # persistent + half the transient peak
    print(f"      peak {mib(ref['peak_bytes'])} = persistent {mib(ref['persistent_bytes'])} + transient "
          f"{mib(transient)}; losses {ref['losses']}")
    print(f"      budget = persistent + transient/2 = {budget_mb} MiB\n")

    print(f"[2/3] plain TensorFlow, {budget_mb} MiB device ...", flush=True)
    plain = run_child("plain", budget_mb, args)
    print(f"      {'ran (unexpected)' if plain['ok'] else plain['error']}\n")

    print(f"[3/3] hand-swapped step, {budget_mb} MiB device ...", flush=True)
    swap = run_child("swapped", budget_mb, args)
    if not swap["ok"]:
        print(f"      {swap['error']}")
        return 1
    hs = swap["host_store"]
    equal = swap["losses_hex"] == ref["losses_hex"] and swap["variables_sha256"] == ref["variables_sha256"]
    speed = (sum(swap["step_s"][1:]) or swap["step_s"][0]) / (sum(ref["step_s"][1:]) or ref["step_s"][0])
    print(f"      peak {mib(swap['peak_bytes'])} (budget {budget_mb} MiB, plain TF {mib(ref['peak_bytes'])}); "
          f"losses {swap['losses']}")
    print(f"      host store: {hs['swap_outs']} swap-outs and {hs['swap_ins']} swap-ins of "
          f"{mib(hs['bytes_out'])} in all, host peak {mib(hs['peak_host_bytes'])}, "
          f"late prefetches {hs['late_prefetches']}")
    print(f"      step time vs plain TF with enough memory: {speed:.2f}x")
    print(f"      bit-for-bit equal to plain TensorFlow (losses and every variable): {'yes' if equal else 'NO'}\n")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reference": ref, "plain_at_budget": plain, "swapped_at_budget": swap,
                       "budget_mb": budget_mb}, f, indent=2)
    success = (not plain["ok"]) and swap["peak_bytes"] <= budget_mb * MiB and equal
    print("OK: plain TensorFlow ran out of memory; the swapped step trained within the budget, bit for bit equal."
          if success else "FAILED: see above.")
    return 0 if success else 1


if __name__ == "__main__":
    sys.exit(main())
