"""Plans' guided steps against plain TensorFlow's, alternated in one process: the ratios of their median steps
without the spread between processes (one process can run 15-40% slower than another with the same plan on the
shared 2-core machine; docs/decisions.md, "A suite point is the run of the median step of its rounds").

    PYTHONPATH=.:tools TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=1000 \
        TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python tools/probe_interleaved.py --model resnet50 --batch 32 \
        --budget-mb 207 --policy capuchin,checkpoint --json out.json
    # every policy against the others on a device of the budget's size, as the suite runs them:
    ... TF_CPU_BFC_MEM_LIMIT_IN_MB=207 ... --policy capuchin,swap-only,recompute-only,checkpoint,swap-all \
        --feedback --no-plain --pairs 8 --json out.json

Each policy of --policy (comma-separated) gets its own managed step with `memory_budget` = --budget-mb, on a device
of TF_CPU_BFC_MEM_LIMIT_IN_MB: larger than the budget, plain TensorFlow's step runs beside them; with --no-plain it
is left out and the device can be the budget's size (the suite's throughput points), where fragmentation is the
device's. The feedback is off (the plan made at the measured step runs every guided step) unless --feedback, which
lets each step adjust its plan as in `bench run` (its re-plans counted). After the measured step and one warm guided
step of each, --pairs rounds are timed, each running plain's step and every policy's once, the order rotated from
round to round. A policy whose first two steps fail is left out (said, with the error). Prints each step's times,
the ratio of its median to plain's (or the first policy's) and to the first policy's, and the planner's prediction;
then checks every step's loss and the final variables against plain TensorFlow's run of as many steps in a fresh
process (each step continues from the variables the step before, of whichever policy, left). Writes JSON, stamped;
exits 1 when the bits differ. The emulated p100 link follows each trace's FLOP rate (not clocked by a plain run).
"""

from __future__ import annotations

import os
import statistics
import time
import traceback

from probe_common import step_parser, write_stamped


def main() -> int:
    p = step_parser(__doc__, policy="capuchin")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--feedback", action="store_true")
    p.add_argument("--no-plain", action="store_true", help="leave plain TensorFlow's step out (on a device of the "
                   "budget's size, where it does not fit); the ratios are then to the first policy's")
    a = p.parse_args()

    import tensorflow as tf

    import capuchin_tf
    from capuchin_tf.cli import models
    from capuchin_tf.runtime.errors import CapuchinError

    setup = models.build(a.model, a.batch)
    policies = a.policy.split(",")
    steps = {}
    if not a.no_plain:
        steps["plain"] = setup.train_step
        setup.train_step(*setup.inputs)
    failed = {}
    losses = []  # every step's loss, in the order the steps ran: plain TensorFlow's run of as many steps has them

    def call(fn):
        losses.append(float(fn(*setup.inputs)))

    for name in list(policies):
        step = capuchin_tf.function(setup.train_step, memory_budget=a.budget_mb << 20, policy=name, link=a.link,
                                    feedback=a.feedback)
        try:
            call(step)  # the measured step
            call(step)  # the first guided step instantiates the rewritten step
        except (CapuchinError, tf.errors.ResourceExhaustedError) as e:  # a policy that cannot run at this budget
            failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
            policies.remove(name)
            print(f"  {name}: {failed[name]}")
            continue
        steps[name] = step
    times = {name: [] for name in steps}
    order = list(steps)
    for i in range(a.pairs):
        for name in order[i % len(order):] + order[:i % len(order)]:
            t0 = time.perf_counter()
            call(steps[name])
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    bits = _bit_check(a, losses, setup.variables_sha256(), failed)
    reference = policies[0] if a.no_plain else "plain"
    result = {"pairs": a.pairs, "feedback": a.feedback, "plain_step_s": times.get("plain"), "policies": {}, **bits,
              "failed": failed, "device_mb": int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", 0))}
    print(f"{a.model} b{a.batch} @{a.budget_mb} MiB ({a.link}), device {result['device_mb']} MiB, feedback "
          f"{'on' if a.feedback else 'off'}: plain {[round(x, 3) for x in times.get('plain', [])]}")
    for name in policies:
        (state,) = steps[name].states().values()
        plan = state.plan
        fields = {"guided_step_s": times[name], "ratio_of_medians": median[name] / median[reference],
                  f"against_{policies[0]}": median[name] / median[policies[0]],
                  "predicted_step_ratio": plan.predicted_step_s / state.trace.step_time,
                  "swapped_tensors": len(plan.swaps), "recomputed_tensors": len(plan.recomputes),
                  "fallback": dict(plan.options).get("fallback"), "replans": state.replans}
        result["policies"][name] = fields
        print(f"  {name}: {[round(x, 3) for x in times[name]]}; guided / {reference} "
              f"{fields['ratio_of_medians']:.3f} by the medians, / {policies[0]} "
              f"{fields[f'against_{policies[0]}']:.3f}, predicted "
              f"{fields['predicted_step_ratio']:.3f} of the trace's step ({fields['swapped_tensors']} swapped, "
              f"{fields['recomputed_tensors']} recomputed, fallback {fields['fallback']}, {state.replans} re-plans)")
    if len(policies) == 1:  # the fields of the one-policy JSONs recorded before
        result.update(policy=policies[0], guided_step_s=times[policies[0]],
                      ratio_of_medians=result["policies"][policies[0]]["ratio_of_medians"])
    print(f"  bit for bit with plain TensorFlow's {len(losses)} steps: {bits['bitwise_equal']}")
    write_stamped(a, result)
    return 0 if bits["bitwise_equal"] is not False else 1


def _bit_check(a, losses: list[float], variables_sha256: str, failed: dict) -> dict:
    """Plain TensorFlow's run of as many steps (a fresh process, a device it fits): every step's loss and the final
    variables the same bits as this process's, whose steps were every policy's in turn (each step of each policy
    continues from the variables the one before left). Not checked (None) when a step failed: a failed step of the
    plain step a refused signature fell back to may have written part of its update."""
    if failed:
        return {"bitwise_equal": None, "losses_hex": [float.hex(x) for x in losses]}
    from capuchin_tf.cli import bench
    from capuchin_tf.cli.suite import BIG_DEVICE_MB

    plain = bench.plain_run(a.model, a.batch, a.link, len(losses), BIG_DEVICE_MB)
    same = (plain["losses_hex"] == [float.hex(x) for x in losses] and plain["variables_sha256"] == variables_sha256)
    return {"bitwise_equal": same, "losses_hex": [float.hex(x) for x in losses],
            "plain_losses_hex": plain["losses_hex"], "variables_sha256": variables_sha256,
            "plain_variables_sha256": plain["variables_sha256"]}


if __name__ == "__main__":
    raise SystemExit(main())
