"""The access recorder and the allocator statistics op."""

import time

import numpy as np
import tensorflow as tf

import capuchin_tf


def test_record_access_forwards_the_tensor_and_records_every_access_in_order():
    @tf.function
    def step(x):
        a = capuchin_tf.record_access(tf.sin(x), "a", 0)
        b = capuchin_tf.record_access(a * 2.0, "b", 0)
        a1 = capuchin_tf.record_access(a, "a", 1)
        with tf.control_dependencies([b]):
            c = a1 + b
        return capuchin_tf.record_access(c, "c", 0)

    x = tf.random.stateless_uniform([256, 256], seed=[1, 2])
    capuchin_tf.drain_access_records()
    t0 = time.monotonic_ns()
    out = step(x)
    t1 = time.monotonic_ns()
    expected = tf.sin(x) + tf.sin(x) * 2.0
    assert np.array_equal(out.numpy(), expected.numpy())
    rec = capuchin_tf.drain_access_records()
    assert len(rec["tensor_id"]) == 4
    pairs = list(zip(rec["tensor_id"], rec["access_index"].tolist()))
    assert set(pairs) == {("a", 0), ("b", 0), ("a", 1), ("c", 0)}
    assert pairs.index(("a", 0)) < pairs.index(("b", 0)) < pairs.index(("c", 0))
    assert pairs[-1] == ("c", 0)
    times = rec["time_ns"]
    assert np.all(np.diff(times) >= 0)
    assert t0 <= times[0] and times[-1] <= t1, "timestamps are CLOCK_MONOTONIC, comparable with time.monotonic_ns()"
    assert np.all(rec["bytes_in_use"] >= 256 * 256 * 4), "bytes in use come from the BFC allocator"
    # drained: the buffer is empty now
    assert len(capuchin_tf.drain_access_records()["tensor_id"]) == 0


def test_record_access_does_not_copy():
    x = tf.random.stateless_uniform([1 << 20], seed=[3, 4])
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    y = capuchin_tf.record_access(x, "x")
    after = tf.config.experimental.get_memory_info("CPU:0")["current"]
    assert after == before
    assert y.numpy().tobytes() == x.numpy().tobytes()
    capuchin_tf.drain_access_records()


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
