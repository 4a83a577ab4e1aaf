"""The allocator statistics op."""

import tensorflow as tf

import capuchin_tf


def test_allocator_stats_match_tensorflows_memory_info():
    keep = tf.ones([1 << 20])  # noqa: F841  (4 MiB in use while we compare)
    stats = capuchin_tf.allocator_stats()
    info = tf.config.experimental.get_memory_info("CPU:0")
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
