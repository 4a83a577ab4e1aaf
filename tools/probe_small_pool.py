"""The small-tensor pool on a device of exactly the budget: each managed step's outcome and the pool's use after it.

    CAPUCHIN_TF_SMALL_POOL_MB=3 TF_NUM_INTEROP_THREADS=1 TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=69 \
        TF_ENABLE_ONEDNN_OPTS=0 PYTHONPATH=.:tools .venv/bin/python tools/probe_small_pool.py \
        --model zoo/efficientnetb1 --batch 32 --budget-mb 69 --link native --json out.json

The pool's size is the process's (`CAPUCHIN_TF_SMALL_POOL_MB`, default 1/128 of the device, 1-8 MiB; recorded). Per
step: completed or the error's first line, and `ops.allocator_stats()`'s pool bytes in use, peak and limit and the
device's largest free run. Writes JSON, stamped (docs/decisions.md, "Small tensors have a pool of their own").
"""

from __future__ import annotations

import os

from probe_common import step_parser, write_stamped


def main() -> int:
    p = step_parser(__doc__, policy="capuchin", link="native")
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()

    import capuchin_tf
    from capuchin_tf.cli import models
    from capuchin_tf.frontend import decorator
    from capuchin_tf.tf import ops

    setup = models.build(a.model, a.batch)
    managed = decorator.wrap_step(setup.train_step, decorator.make_options(a.budget_mb * 2**20, policy=a.policy,
                                                                           link=a.link))
    rows = []
    for i in range(a.steps):
        try:
            managed(*setup.inputs)
            outcome = "completed"
        except capuchin_tf.CapuchinError as e:
            outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:600]}"
        stats = ops.allocator_stats()
        rows.append({"step": i + 1, "outcome": outcome, **{k: stats[k] for k in (
            "small_pool_bytes_in_use", "small_pool_peak_bytes_in_use", "small_pool_bytes_limit", "largest_free")}})
        print(rows[-1], flush=True)
    write_stamped(a, {"policy": a.policy, "small_pool_mb_env": os.environ.get("CAPUCHIN_TF_SMALL_POOL_MB"),
                      "device_mb": os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB"), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
