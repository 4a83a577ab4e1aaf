"""The device allocator wrapper's small-tensor pool: allocations of at most 64 KiB get a region of their own once
capuchin_tf turned the pool on, so that small tensors that outlive large neighbours do not split the free memory
(docs/decisions.md). Each case runs in a fresh process on a simulated device (64 MiB: the pool's default 1 MiB)."""

import math

import pytest

MiB = 1 << 20

FRAGMENT = """
import json
import tensorflow as tf
import capuchin_tf
from capuchin_tf.tf import ops

if {pool}:
    ops.set_small_pool(True)
# 4 MiB and 8 KiB tensors in turn, as activations and their LayerNorm statistics are made in a forward pass; the
# large ones are freed, the small ones live on (they wait for the backward pass).
large, small = [], []
for i in range(12):
    large.append(tf.fill([1 << 20], float(i)))
    small.append(tf.fill([2048], float(i)))
del large
in_use = capuchin_tf.allocator_stats()["bytes_in_use"]
try:
    x = tf.fill([12 << 20], 1.0)  # 48 MiB in one piece
    fits = True
except tf.errors.ResourceExhaustedError:
    fits = False
print(json.dumps({{"fits": fits, "in_use": in_use, "small_values": [float(s[0]) for s in small],
                   "stats": capuchin_tf.allocator_stats()}}))
"""


@pytest.mark.parametrize("pool", [False, True])
def test_small_tensors_that_outlive_large_ones_split_the_memory_unless_the_pool_holds_them(simulated_device, pool):
    r = simulated_device(FRAGMENT.format(pool=pool), limit_mb=64)
    assert r["small_values"] == [float(i) for i in range(12)]
    assert r["in_use"] < 2 * MiB, "the large tensors were freed: about 48 MiB of the device is free"
    stats = r["stats"]
    assert stats["small_pool_bytes_limit"] == 1 * MiB
    if pool:
        assert r["fits"], "the small tensors are in the pool: the free memory is one run"
        assert stats["small_pool_bytes_in_use"] >= 12 * 8192
    else:
        assert not r["fits"], "off, the small tensors sit between the freed large ones: no 48 MiB run is left"
        assert stats["small_pool_bytes_in_use"] == 0


def test_the_pool_takes_small_allocations_only_and_hands_what_does_not_fit_to_the_device(simulated_device):
    r = simulated_device("""
    import json
    import numpy as np
    import tensorflow as tf
    import capuchin_tf
    from capuchin_tf.tf import ops

    def stats():
        return capuchin_tf.allocator_stats()

    before = stats()
    ops.set_small_pool(True)
    large = tf.fill([1 << 18], 2.0)  # 1 MiB: the device
    after_large = stats()
    # 16 MiB of 8 KiB tensors: the first 1 MiB or so in the pool, the rest on the device
    small = [tf.fill([2048], float(i)) for i in range(2048)]
    full = stats()
    values_ok = all(float(t[-1]) == float(i) for i, t in enumerate(small))
    del small
    emptied = stats()
    print(json.dumps({"before": before, "after_large": after_large, "full": full, "emptied": emptied,
                      "values_ok": values_ok, "large": float(tf.reduce_sum(large))}))
    """, limit_mb=64)
    assert r["values_ok"] and r["large"] == float(2 << 18)
    assert r["before"]["small_pool_bytes_in_use"] == 0
    assert r["after_large"]["small_pool_bytes_in_use"] <= 1024, "1 MiB is no small tensor (only scalars came)"
    full = r["full"]
    assert 1 * MiB - 64 * 1024 <= full["small_pool_bytes_in_use"] <= full["small_pool_bytes_limit"] == 1 * MiB
    # what did not fit went to the device: 16 MiB in all, the pool's 1 MiB region included
    assert full["bytes_in_use"] - r["after_large"]["bytes_in_use"] >= 15 * MiB
    assert r["emptied"]["small_pool_bytes_in_use"] <= 1024
    # the pool's region stays taken (one allocation on the device)
    assert r["emptied"]["bytes_in_use"] >= r["after_large"]["bytes_in_use"]


def test_the_pool_size_can_be_set_and_turned_off(simulated_device):
    code = """
    import json
    import tensorflow as tf
    import capuchin_tf
    from capuchin_tf.tf import ops
    ops.set_small_pool(True)
    keep = tf.fill([2048], 1.0)
    print(json.dumps(capuchin_tf.allocator_stats()))
    """
    sized = simulated_device(code, limit_mb=64, env={"CAPUCHIN_TF_SMALL_POOL_MB": "2"})
    assert sized["small_pool_bytes_limit"] == 2 * MiB and sized["small_pool_bytes_in_use"] >= 8192
    off = simulated_device(code, limit_mb=64, env={"CAPUCHIN_TF_SMALL_POOL_MB": "0"})
    assert off["small_pool_bytes_limit"] == -1 and off["small_pool_bytes_in_use"] == -1


def test_the_pool_is_sized_before_its_first_use_and_fixed_from_then_on(simulated_device):
    code = """
    import json
    import tensorflow as tf
    import capuchin_tf
    from capuchin_tf.tf import ops
    before = capuchin_tf.allocator_stats()["small_pool_bytes_limit"]
    asked = ops.size_small_pool(300 * 1024 + 1)  # rounded up to 256
    again = ops.size_small_pool(512 * 1024)  # not used yet: sized again
    ops.set_small_pool(True)
    keep = tf.fill([2048], 1.0)
    used = capuchin_tf.allocator_stats()
    after = ops.size_small_pool(4 << 20)  # used: stays
    print(json.dumps({"before": before, "asked": asked, "again": again, "used": used, "after": after,
                      "limit_after": capuchin_tf.allocator_stats()["small_pool_bytes_limit"]}))
    """
    r = simulated_device(code, limit_mb=64)
    assert r["before"] == 1 * MiB  # the allocator's default at 64 MiB (1/128 of the device, at least 1 MiB)
    assert r["asked"] == 300 * 1024 + 256
    assert r["again"] == 512 * 1024
    assert r["used"]["small_pool_bytes_limit"] == 512 * 1024 and r["used"]["small_pool_bytes_in_use"] >= 8192
    assert r["after"] == r["limit_after"] == 512 * 1024
    fixed = simulated_device(code, limit_mb=64, env={"CAPUCHIN_TF_SMALL_POOL_MB": "2"})
    assert fixed["asked"] == fixed["again"] == fixed["after"] == fixed["limit_after"] == 2 * MiB
    off = simulated_device(code, limit_mb=64, env={"CAPUCHIN_TF_SMALL_POOL_MB": "0"})
    assert off["asked"] == off["after"] == 0 and off["limit_after"] == -1


def test_the_first_managed_step_sizes_the_pool_to_its_small_tensors(simulated_device):
    r = simulated_device("""
    import json
    import math
    import tensorflow as tf
    import capuchin_tf
    from capuchin_tf.cli import models
    from capuchin_tf.core.schedule import small_tensor_peak
    from capuchin_tf.runtime import managed_step

    setup = models.build("transformer", 8)
    step = capuchin_tf.function(setup.train_step, memory_budget=200 * 2**20)
    step(*setup.inputs)
    state = next(iter(step.states().values()))
    peak = small_tensor_peak(state.optimized_model)
    stats = capuchin_tf.allocator_stats()
    # a second step of another model in the same process: the pool is used, its size stays
    other = models.build("mlp", 256)
    capuchin_tf.function(other.train_step, memory_budget=200 * 2**20)(*other.inputs)
    print(json.dumps({"peak": peak, "stats": stats, "margin": managed_step.SMALL_POOL_MARGIN,
                      "least": managed_step.SMALL_POOL_MIN_BYTES, "most": managed_step.SMALL_POOL_MOST_BYTES,
                      "share": managed_step.SMALL_POOL_BUDGET_SHARE,
                      "limit_after": capuchin_tf.allocator_stats()["small_pool_bytes_limit"]}))
    """, limit_mb=400)
    want = max(r["least"], math.ceil(r["margin"] * r["peak"]))
    assert 0 < r["peak"] and want < max(r["most"], 200 * MiB // r["share"])  # under the cap (a share of the budget)
    assert r["stats"]["small_pool_bytes_limit"] == -(-want // 256) * 256
    # the step's small tensors came to about the estimate, within the margin: the pool was never full
    assert r["peak"] / 2 <= r["stats"]["small_pool_peak_bytes_in_use"] < r["stats"]["small_pool_bytes_limit"]
    assert r["limit_after"] == r["stats"]["small_pool_bytes_limit"]
