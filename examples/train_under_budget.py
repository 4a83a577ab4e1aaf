"""Demo: train a real model under a device-memory budget that plain TensorFlow cannot fit, with the decorator and
nothing else changed.

The training step is the model's own `tf.function` step (capuchin_tf.cli.models, Keras ResNet50 at 64x64 by default);
the only change is `capuchin_tf.function(train_step, memory_budget=..., policy=...)`. Three runs, each in a fresh
process on the simulated device (TensorFlow's BFC allocator with a hard limit, design.md), on the same seed and data,
through `python -m capuchin_tf bench run`:
  1. plain TensorFlow with enough memory: the reference losses and weights, peak and speed;
  2. plain TensorFlow under the budget (default: persistent memory + half the transient peak): out of memory;
  3. the decorated step under the same budget: its measured peak, the plan, the throughput, and its losses and
     weights compared bit for bit with the reference.
The memory curves of the last step of runs 1 and 3 are saved as a picture (--plot).

    python examples/train_under_budget.py [--model resnet50] [--batch 32] [--budget-mb 212] [--policy capuchin]
        [--link native] [--steps 8] [--plot curves.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

MiB = 1 << 20


def bench_run(args: argparse.Namespace, policy: str, device_mb: int, out: pathlib.Path, curve: pathlib.Path | None,
              steps: int) -> dict:
    cmd = [sys.executable, "-m", "capuchin_tf", "bench", "run", "--model", args.model, "--batch", str(args.batch),
           "--budget-mb", str(device_mb), "--policy", policy, "--link", args.link, "--steps", str(steps),
           "--json", str(out)]
    if curve is not None:
        cmd += ["--curve", str(curve)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not out.exists():
        raise SystemExit(f"bench run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("  step"):
            print("     " + line.strip(), flush=True)
    return json.loads(out.read_text())


def plot(before: list, after: list, budget_mb: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for curve, label in ((before, "plain TensorFlow (enough memory)"), (after, "capuchin_tf, guided step")):
        if curve:
            t, b = zip(*curve)
            ax.step(t, [x / MiB for x in b], where="post", lw=1.1, label=label)
    ax.axhline(budget_mb, color="black", lw=1.2, ls="--", label=f"budget {budget_mb:.0f} MiB")
    ax.set_xlabel("time in step (s)")
    ax.set_ylabel("device memory in use (MiB)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--budget-mb", type=int, help="default: persistent + half the transient peak of run 1")
    p.add_argument("--policy", default="capuchin")
    p.add_argument("--link", default="native")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device-mb", type=int, default=16384, help="device of the reference run, MiB")
    p.add_argument("--plot", default="train_under_budget.png")
    p.add_argument("--json")
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first call is the measured step)")
    work = pathlib.Path(tempfile.mkdtemp(prefix="capuchin_demo_"))
    print(f"capuchin_tf demo: {args.model}, batch {args.batch}, {args.steps} steps, policy {args.policy}, link "
          f"{args.link}, on the simulated device (BFC allocator with a hard limit)\n", flush=True)

    print(f"[1/3] plain TensorFlow, {args.device_mb} MiB device ...", flush=True)
    ref = bench_run(args, "tf", args.device_mb, work / "plain.json", work / "plain_curve.json", args.steps)
    if not ref["ok"]:
        raise SystemExit(f"the reference run failed: {ref['error']}")
    peak, persistent = max(ref["step_peak_bytes"]), ref["persistent_bytes"]
    budget_mb = args.budget_mb or -(-int(persistent + (peak - persistent) / 2) // MiB)
    print(f"      peak {peak / MiB:.1f} MiB = persistent {persistent / MiB:.1f} MiB + transient "
          f"{(peak - persistent) / MiB:.1f} MiB; {ref['samples_per_s']:.1f} samples/s")
    print(f"      budget {budget_mb} MiB" + ("" if args.budget_mb else " (persistent + transient/2)") + "\n")

    print(f"[2/3] plain TensorFlow, {budget_mb} MiB device ...", flush=True)
    oom = bench_run(args, "tf", budget_mb, work / "plain_budget.json", None, 1)
    print(f"      {'fits' if oom['ok'] else oom['error']}\n")

    print(f"[3/3] @capuchin_tf.function(memory_budget={budget_mb * MiB}, policy={args.policy!r}), {budget_mb} MiB "
          "device ...", flush=True)
    run = bench_run(args, args.policy, budget_mb, work / "capuchin.json", work / "capuchin_curve.json", args.steps)
    equal = run["ok"] and run["losses_hex"] == ref["losses_hex"] and run["variables_sha256"] == ref["variables_sha256"]
    if run["ok"]:
        print(f"      peak {run['peak_bytes'] / MiB:.1f} MiB (budget {budget_mb} MiB, plain TF {peak / MiB:.1f} MiB)")
        print(f"      plan: swapped {run['swapped_tensors']} tensors ({run['swapped_bytes'] / MiB:.1f} MiB), "
              f"recomputed {run['recomputed_tensors']} ({run['recomputed_bytes'] / MiB:.1f} MiB), "
              f"{run['replans']} re-plans")
        # Settled: the steps after the last plan change less the first (it instantiates the plan), against plain
        # TensorFlow's steps after its first; the step that records the memory curve (--plot) is timed in neither.
        settled, plain_s = run["settled_median_step_s"], ref["settled_median_step_s"] or ref["median_step_s"]
        every = ref["median_step_s"] / run["median_step_s"]
        if settled:
            last = args.steps - (1 if run["curve_step"] is not None else 0)  # the last timed step, counted from 1
            print(f"      settled (steps {last - run['settled_steps'] + 1}-{last}, no plan change): throughput "
                  f"{args.batch / settled:.1f} samples/s = {plain_s / settled:.2f}x plain TensorFlow with enough "
                  f"memory ({every:.2f}x over every step after the first)")
        else:
            print(f"      not settled in {args.steps} steps: throughput over every step after the first {every:.2f}x "
                  "plain TensorFlow with enough memory")
        stolen = [r.get("steal_share") for r in (ref, run)]
        if None not in stolen:
            print(f"      CPU time the hypervisor gave other tenants during the timed steps: {stolen[1]:.1%} (plain "
                  f"TensorFlow's run: {stolen[0]:.1%}; a run that lost more than 3% is made again)")
        print(f"      bit-for-bit equal to plain TensorFlow (losses and every variable): {'yes' if equal else 'NO'}")
    else:
        print(f"      failed: {run['error']}")
    if args.plot and run["ok"]:
        try:
            plot(json.loads((work / "plain_curve.json").read_text()),
                 json.loads((work / "capuchin_curve.json").read_text()), budget_mb, args.plot,
                 f"{args.model}, batch {args.batch}: the last training step's device memory")
            print(f"      memory curves before and after: {args.plot}")
        except ImportError:
            print("      (no picture: matplotlib is not installed)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"budget_mb": budget_mb, "plain": ref, "plain_at_budget": oom,
                                                       "capuchin": run, "bitwise_equal": equal}, indent=1))
    ok = (not oom["ok"]) and run["ok"] and equal and run["peak_bytes"] <= budget_mb * MiB
    print("\nOK: plain TensorFlow ran out of memory; the decorated step trained within the budget, bit for bit equal."
          if ok else "\nNOT OK (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
