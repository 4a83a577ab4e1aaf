"""The statistics ops: the device allocator's and the host store's."""

import pytest
import tensorflow as tf

import capuchin_tf


def test_allocator_stats_match_tensorflows_memory_info():
    keep = tf.ones([1 << 20])  # noqa: F841  (4 MiB in use while we compare)
    # TensorFlow's figures first: the stats op's own output, allocated after it read the wrapper's, can raise the peak
    info = tf.config.experimental.get_memory_info("CPU:0")
    stats = capuchin_tf.allocator_stats()
    assert stats["wrapped"], "the library loaded before TensorFlow created its devices: the wrapper is in place"
    assert stats["bytes_in_use"] == info["current"] >= 4 << 20
    assert stats["peak_bytes_in_use"] == info["peak"]
    assert stats["bytes_limit"] > 0
    big = tf.ones([16 << 20])  # 64 MiB: raises the peak
    del big
    assert capuchin_tf.allocator_stats()["peak_bytes_in_use"] >= 68 << 20
    tf.config.experimental.reset_memory_stats("CPU:0")
    after_reset = capuchin_tf.allocator_stats()
    # the peak restarts from what is in use (plus the stats op's own seven scalar outputs)
    assert 0 <= after_reset["peak_bytes_in_use"] - after_reset["bytes_in_use"] <= 7 * 256


def test_host_store_stats_are_named_by_the_library():
    from capuchin_tf.tf import ops

    values = ops._ops.capuchin_host_store_stats().numpy().tolist()
    stats = capuchin_tf.host_store_stats()
    # The names come from the op's definition, which the library makes from its one list of the fields.
    assert tuple(stats) == ops.HOST_STORE_STAT_FIELDS
    assert len(ops.HOST_STORE_STAT_FIELDS) == len(values) == len(set(ops.HOST_STORE_STAT_FIELDS))
    assert ops.HOST_STORE_STAT_FIELDS[:3] == ("host_bytes", "peak_host_bytes", "live_handles")
    assert ops.HOST_STORE_STAT_FIELDS[-3:] == ("expedited_swap_outs", "device_moves", "device_moved_bytes")
    assert all(isinstance(v, int) for v in stats.values())


def test_host_store_stats_refuses_other_field_names():
    from capuchin_tf.tf import ops

    with pytest.raises(tf.errors.InvalidArgumentError, match="fields attr is fixed"):
        ops._ops.capuchin_host_store_stats(fields=["host_bytes"])
