"""How tightly the planned layout packs a guided step's allocations: per guided step of a managed step run with the
layout always on (feedback off, so that one plan runs), the region the allocator laid out from that step's record
(cc/kernels/step_layout.cc, Layout), the most the recorded allocations hold at once (no packing can be smaller), and
what one greedy order alone packs the same record into (largest first, TensorFlow Lite's greedy by size, the
layout's only order until 2026-12-07; and by lifetime), computed here from the record; whether the next step got
its region, and what it evicted on demand.

    TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=117 TF_ENABLE_ONEDNN_OPTS=0 \
        .venv/bin/python tools/probe_layout_packing.py --model cnn --batch 128 --budget-mb 117 --json out.json

The device is the budget's size (TF_CPU_BFC_MEM_LIMIT_IN_MB); the records are written with the result.
"""

from __future__ import annotations

from probe_common import step_parser, write_stamped

MiB = 1 << 20


def live_peak(record: list[list[int]]) -> int:
    """The most bytes `record` ([bytes, allocated, freed] in events, freed >= 0) holds at once."""
    events = sorted([(a, b) for b, a, _ in record] + [(f, -b) for b, _, f in record])
    live = most = 0
    for _, change in events:
        live += change
        most = max(most, live)
    return most


def greedy(record: list[list[int]], key) -> int:
    """The region one greedy order packs `record` into: each allocation, in the order of `key`, at the smallest gap
    between those placed that are live at the same time, else above them (best fit)."""
    placed, top = [], 0
    for nbytes, a, f in sorted(record, key=key):
        prev, pick = 0, None
        for offset, size in sorted((o, b) for o, b, pa, pf in placed if pa < f and a < pf):
            if offset - prev >= nbytes and (pick is None or offset - prev < pick[1]):
                pick = (prev, offset - prev)
            prev = max(prev, offset + size)
        offset = pick[0] if pick else prev
        placed.append((offset, nbytes, a, f))
        top = max(top, offset + nbytes)
    return top


def main() -> int:
    p = step_parser(__doc__, policy="capuchin")
    p.add_argument("--steps", type=int, default=5, help="managed steps (the first is the measured one)")
    a = p.parse_args()

    import capuchin_tf  # noqa: F401  (installs the allocator wrapper before the first op)
    from capuchin_tf.cli import models
    from capuchin_tf.frontend import decorator
    from capuchin_tf.tf import ops

    setup = models.build(a.model, a.batch)
    step = decorator.wrap_step(setup.train_step, decorator.make_options(
        a.budget_mb * MiB, policy=a.policy, link=a.link, passive_rescue=False, planned_layout=True, feedback=False))
    rows = []
    for i in range(a.steps):
        step(*setup.inputs)
        last = next(iter(step.report().values()))["steps"][-1]
        stats = ops.layout_stats()
        if last["phase"] != "guided":
            continue
        rec = ops.layout_record()
        record = [[int(b), int(al), int(fr)] for b, al, fr in zip(rec["bytes"], rec["allocated"], rec["freed"])
                  if fr >= 0]
        row = {"step": i + 1, "seconds": last["seconds"], "had_region": last["layout_bytes"] > 0,
               "misses": last["layout_misses"], "evicted_on_demand_bytes": last["passive_evicted_bytes"],
               "laid_out": len(record), "region_bytes": stats["region_bytes"], "live_peak_bytes": live_peak(record),
               "largest_first_bytes": greedy(record, lambda r: (-r[0], r[1])),
               "longest_first_bytes": greedy(record, lambda r: (-(r[2] - r[1]), -r[0])), "record": record}
        rows.append(row)
        print(f"step {row['step']}: region {'yes' if row['had_region'] else 'no '} misses {row['misses']:4d} evicted "
              f"{row['evicted_on_demand_bytes'] / MiB:5.1f} MiB | its record: {row['laid_out']} allocations, "
              f"{row['live_peak_bytes'] / MiB:.1f} MiB at once; laid out {row['region_bytes'] / MiB:.1f} MiB "
              f"(largest first {row['largest_first_bytes'] / MiB:.1f}, longest first "
              f"{row['longest_first_bytes'] / MiB:.1f})", flush=True)
    write_stamped(a, {"policy": a.policy, "steps": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
