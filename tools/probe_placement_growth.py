"""Where a plan's placement outgrows its bytes, offline: a recorded trace planned by a policy, its simulated step
replayed through the placement model (capuchin_tf/policy/placement.py) allocation by allocation; every allocation
that makes the placed space grow is printed with the bytes live then and the free runs of at least 1 MiB left beside
it (a large allocation that grows the space while such runs are free is one the allocator must evict for on a device
of the budget's size). No TensorFlow.

    CAPUCHIN_TF_PURE=1 PYTHONPATH=. .venv/bin/python tools/probe_placement_growth.py \
        docs/results/bench/2026-12-06-bfc-split/trace-dropout-bn-recompute-only.json.gz --budget-mb 102 \
        --policy recompute-only --link p100

The trace is a trace JSON (gzipped or not) as `--trace-out` of tools/probe_fragmentation.py writes it.
"""

from __future__ import annotations

import argparse
import gzip
import json

MiB = 1 << 20


def growth(events, small_bytes: int) -> list[dict]:
    """The allocations of `events` (SimulationResult.events) that grow the placed space, in order: time, label,
    bytes, the space's new top, the bytes live, the free runs of at least 1 MiB below the top then."""
    from capuchin_tf.policy import placement

    rows, top = [], 0
    for when, key, n, live, _, space in placement.allocations(events, small_bytes):
        if space.top > top:
            top = space.top
            rows.append({"time": when, "label": key, "bytes": n, "top": top, "live": live,
                         "free_runs": sorted((s for _, s in space.free if s >= MiB), reverse=True)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--budget-mb", type=float, required=True)
    p.add_argument("--policy", default="capuchin")
    p.add_argument("--link", default="p100")
    p.add_argument("--last", type=int, default=8, help="print the last N growths (default 8)")
    a = p.parse_args()

    from capuchin_tf.core.access_trace import AccessTrace
    from capuchin_tf.core.device_model import DeviceModel
    from capuchin_tf.policy import make_plan, placement
    from capuchin_tf.policy.simulator import simulate

    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        trace = AccessTrace.from_json(json.load(f))
    plan = make_plan(trace, int(a.budget_mb * MiB), a.policy, DeviceModel.from_link(a.link, trace))
    sim = simulate(trace, plan)
    print(f"{a.policy} at {a.budget_mb:g} MiB ({a.link}): persistent {trace.persistent_bytes / MiB:.1f} MiB, "
          f"predicted peak {sim.peak_bytes / MiB:.1f} MiB, placed {plan.predicted_placed_peak_bytes / MiB:.1f} MiB; "
          f"{sum(1 for _ in plan.decisions)} decisions")
    for r in growth(sim.events, placement.SMALL_BYTES)[-a.last:]:
        print(f"  at {r['time']:.3f} s: {r['bytes'] / MiB:5.1f} MiB {r['label'][:80]} -> space {r['top'] / MiB:6.1f} "
              f"MiB for {r['live'] / MiB:6.1f} live; free runs >= 1 MiB {[round(s / MiB, 1) for s in r['free_runs']]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
