"""One policy's plan run with and without capuchin_tf's safety net (the guided step's pool and passive mode), per step:
seconds, peak, bytes evicted on demand and the waits by kind. What the pool itself costs a plan.

    TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=200 TF_ENABLE_ONEDNN_OPTS=0 \
        .venv/bin/python tools/probe_safety_net.py --model transformer --batch 32 --budget-mb 79 \
        --policy checkpoint --safety-net on --json out.json

The policy is registered again under `<policy>+net` or `<policy>-net` with the safety net on or off (its planning
function unchanged) and runs under `capuchin_tf.function` for `--steps` calls; the device's size is the simulated
device's (TF_CPU_BFC_MEM_LIMIT_IN_MB), larger than the budget to see what the plan needs beyond it. Prints one line
per step and writes them as JSON, stamped.

With `--safety-net paired`, both run in one process (no spread between processes): each plan's measured step and
two guided steps, then `--steps` rounds of one step of each, in turn (which goes first alternates); prints each one's
median step and the median of the paired ratios (off / on), and writes the rounds.
"""

from __future__ import annotations

import json
import os
import time

from probe_common import step_parser, write_stamped


def main() -> int:
    p = step_parser(__doc__, policy=None)
    p.add_argument("--safety-net", choices=("on", "off", "paired"), required=True)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()

    import capuchin_tf
    from capuchin_tf import policy as policies
    from capuchin_tf.cli import models
    from capuchin_tf.cli.common import git_commit, machine

    base = policies.POLICIES[a.policy]
    for net in ("on", "off"):
        policies.register_policy(f"{a.policy}{'+' if net == 'on' else '-'}net", base.plan, safety_net=net == "on",
                                 runtime_options=dict(base.runtime_options))
    setup = models.build(a.model, a.batch)
    if a.safety_net == "paired":
        return _paired(a, setup)
    name = f"{a.policy}{'+' if a.safety_net == 'on' else '-'}net"
    step = capuchin_tf.function(setup.train_step, memory_budget=a.budget_mb * 2**20, policy=name, link=a.link)
    for _ in range(a.steps):
        step(*setup.inputs)
    (report,) = step.report().values()
    rows = [{k: s[k] for k in ("phase", "seconds", "peak_bytes", "passive_evicted_bytes", "waited_s")}
            for s in report["steps"]]
    for r in rows:
        print(f"{r['phase']:9s} {r['seconds']:7.3f} s  peak {r['peak_bytes'] / 2**20:6.1f} MiB  evicted on demand "
              f"{r['passive_evicted_bytes'] / 2**20:5.1f} MiB  {r['waited_s']}")
    result = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": a.model,
              "batch": a.batch, "budget_mb": a.budget_mb, "device_mb": int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB",
                                                                                          0)),
              "policy": a.policy, "safety_net": a.safety_net, "link": a.link,
              "predicted_peak_bytes": report["prediction"]["predicted_peak_bytes"] if report["prediction"] else None,
              "steps": rows}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def _paired(a, setup) -> int:
    """Both plans in one process, a round of one step each at a time (see the module docstring)."""
    import statistics

    import capuchin_tf

    steps = {net: capuchin_tf.function(setup.train_step, memory_budget=a.budget_mb * 2**20,
                                       policy=f"{a.policy}{'+' if net == 'on' else '-'}net", link=a.link)
             for net in ("on", "off")}
    for step in steps.values():
        for _ in range(3):  # measured, first guided (instantiates), one more
            step(*setup.inputs)
    rounds = []
    for r in range(a.steps):
        row = {}
        for net in (("on", "off") if r % 2 == 0 else ("off", "on")):
            t0 = time.perf_counter()
            steps[net](*setup.inputs)
            row[net] = time.perf_counter() - t0
        rounds.append(row)
    phases = {net: [s["phase"] for s in next(iter(step.report().values()))["steps"]] for net, step in steps.items()}
    medians = {net: statistics.median(r[net] for r in rounds) for net in steps}
    paired = statistics.median(r["off"] / r["on"] for r in rounds)
    write_stamped(a, {"policy": a.policy, "safety_net": "paired", "device_mb": int(os.environ.get(
        "TF_CPU_BFC_MEM_LIMIT_IN_MB", 0)), "rounds": rounds, "median_step_s": medians, "paired_off_over_on": paired,
        "phases": phases})
    print(f"median step: net on {medians['on']:.4f} s, off {medians['off']:.4f} s; off/on paired by round "
          f"{paired:.3f} ({len(rounds)} rounds); phases on {''.join(p[0] for p in phases['on'])}, off "
          f"{''.join(p[0] for p in phases['off'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
