"""The host store and swap ops: exact round trips, memory really leaving the device, nothing leaked, clear errors."""

import gc
import os
import time

import numpy as np
import pytest
import tensorflow as tf

import capuchin_tf
from capuchin_tf import HandleStatus

MiB = 1 << 20
BFC_MIN_CHUNK = 256  # the BFC allocator's smallest allocation
DEVICE_LIMIT_BYTES = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * MiB  # set by conftest.py


@pytest.fixture(autouse=True)
def _small_tensors_on_the_device():
    """These tests count BFC chunks exactly (a handle is one 256-byte chunk), so small tensors stay out of the allocator
    wrapper's small-tensor pool, which a managed step run earlier in this process turned on (the next one turns it on
    again)."""
    capuchin_tf.tf.ops.set_small_pool(False)


def wait_until(predicate, timeout=30.0, interval=0.002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def wait_for_idle_store():
    """Copies finish asynchronously: wait until the store holds nothing and no copy is in flight."""
    assert wait_until(
        lambda: (lambda s: s["live_handles"] == 0 and s["host_bytes"] == 0 and s["pending_copies"] == 0)(
            capuchin_tf.host_store_stats()
        )
    ), capuchin_tf.host_store_stats()


def bfc_current():
    return tf.config.experimental.get_memory_info("CPU:0")["current"]


def random_tensor(dtype, shape, seed=0):
    """A tensor of `dtype` with random bit patterns (NaN payloads, denormals and all for floats)."""
    rng = np.random.default_rng(seed)
    if dtype == tf.bool:
        return tf.constant(rng.integers(0, 2, size=shape).astype(bool))
    n = int(np.prod(shape))
    raw = rng.integers(0, 256, size=n * dtype.size, dtype=np.uint8)
    as_bytes = tf.reshape(tf.constant(raw), list(shape) + [dtype.size])
    return tf.bitcast(as_bytes, dtype) if dtype.size > 1 else tf.bitcast(tf.reshape(as_bytes, shape), dtype)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@tf.function
def graph_roundtrip(x):
    handle = capuchin_tf.prefetch(capuchin_tf.swap_out(x, name="x"))
    return capuchin_tf.swap_in(handle, x.dtype, x.shape)


TRAINING_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.bool]
OTHER_DTYPES = [tf.int8, tf.uint8, tf.int16, tf.uint16, tf.uint32, tf.uint64, tf.complex64, tf.complex128]


@pytest.mark.parametrize("dtype", TRAINING_DTYPES + OTHER_DTYPES, ids=lambda d: d.name)
def test_round_trip_is_bit_exact(dtype):
    x = random_tensor(dtype, (37, 129), seed=dtype.as_datatype_enum)
    # eager, on demand
    y = capuchin_tf.swap_in(capuchin_tf.swap_out(x), dtype, x.shape)
    assert same_bits(x, y)
    # in a graph, with prefetch
    assert same_bits(x, graph_roundtrip(x))
    wait_for_idle_store()


@pytest.mark.parametrize("shape", [(0,), (0, 7), (3, 0, 5)])
def test_round_trip_of_empty_tensors(shape):
    x = tf.zeros(shape, tf.float32)
    y = graph_roundtrip(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    wait_for_idle_store()


def test_round_trip_of_a_tensor_over_256_mib():
    n = 72 * MiB // 4 * 4  # 288 MiB of float32... in elements: 72 Mi elements
    x = tf.random.stateless_uniform([n], seed=[1, 2], dtype=tf.float32)
    assert x.shape.num_elements() * 4 > 256 * MiB
    y = graph_roundtrip(x)
    assert bool(tf.reduce_all(tf.equal(tf.bitcast(x, tf.int32), tf.bitcast(y, tf.int32))))
    stats = capuchin_tf.host_store_stats()
    assert stats["peak_host_bytes"] >= n * 4
    del y
    wait_for_idle_store()


def test_swap_out_lowers_bfc_current_by_the_tensor_size():
    n_bytes = 32 * MiB
    x = tf.random.stateless_uniform([n_bytes // 4], seed=[3, 4])
    expected = x.numpy().tobytes()
    before = bfc_current()
    handle = capuchin_tf.swap_out(x)
    del x
    assert wait_until(lambda: capuchin_tf.handle_status(handle) == HandleStatus.OUT)
    # The device now holds the handle (a scalar: one 256-byte BFC chunk) instead of the tensor.
    assert wait_until(lambda: before - bfc_current() == n_bytes - BFC_MIN_CHUNK), (before, bfc_current())
    assert capuchin_tf.host_store_stats()["host_bytes"] == n_bytes
    capuchin_tf.prefetch(handle)
    assert wait_until(lambda: capuchin_tf.handle_status(handle) == HandleStatus.IN)
    # Back on the device. BFC may hand out a free chunk somewhat larger than asked: it splits a chunk only when the
    # surplus reaches the simulated device's fragmentation threshold (1/128 of its limit,
    # cc/kernels/device_allocator.cc).
    rise = bfc_current() - (before - n_bytes + BFC_MIN_CHUNK)
    assert n_bytes <= rise < n_bytes + DEVICE_LIMIT_BYTES // 128, rise
    y = capuchin_tf.swap_in(handle, tf.float32, [n_bytes // 4])
    assert y.numpy().tobytes() == expected
    assert capuchin_tf.handle_status(handle) == HandleStatus.UNKNOWN
    wait_for_idle_store()


def test_status_follows_the_papers_states():
    capuchin_tf.set_link_bandwidth(200e6)  # slow enough to observe the transitional states
    try:
        x = tf.ones([5_000_000], tf.float32)  # 20 MB: 0.1 s per direction
        handle = capuchin_tf.swap_out(x)
        assert capuchin_tf.handle_status(handle) == HandleStatus.SWAPPING_OUT
        assert wait_until(lambda: capuchin_tf.handle_status(handle) == HandleStatus.OUT)
        capuchin_tf.prefetch(handle)
        assert capuchin_tf.handle_status(handle) == HandleStatus.SWAPPING_IN
        assert wait_until(lambda: capuchin_tf.handle_status(handle) == HandleStatus.IN)
        stats_before = capuchin_tf.host_store_stats()
        capuchin_tf.swap_in(handle, tf.float32)
        stats_after = capuchin_tf.host_store_stats()
        assert stats_after["late_prefetches"] == stats_before["late_prefetches"]  # it was back in time
    finally:
        capuchin_tf.set_link_bandwidth(0)
    wait_for_idle_store()


def test_a_late_prefetch_waits_and_is_counted():
    capuchin_tf.set_link_bandwidth(100e6)
    try:
        x = tf.random.stateless_uniform([2_500_000], seed=[5, 6])  # 10 MB: 0.1 s per direction
        handle = capuchin_tf.swap_out(x)
        assert wait_until(lambda: capuchin_tf.handle_status(handle) == HandleStatus.OUT)
        before = capuchin_tf.host_store_stats()
        capuchin_tf.prefetch(handle)
        y = capuchin_tf.swap_in(handle, tf.float32)  # immediately: the prefetch cannot have finished
        after = capuchin_tf.host_store_stats()
        assert same_bits(x, y)
        assert after["late_prefetches"] == before["late_prefetches"] + 1
        assert after["wait_ns"] - before["wait_ns"] > 0.05e9
    finally:
        capuchin_tf.set_link_bandwidth(0)
    wait_for_idle_store()


def test_unknown_or_consumed_handle_is_invalid_argument():
    not_a_handle = tf.raw_ops.EmptyTensorList(element_shape=tf.constant([], tf.int32), max_num_elements=1,
                                              element_dtype=tf.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not a capuchin_tf swap handle"):
        capuchin_tf.swap_in(not_a_handle, tf.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not a capuchin_tf swap handle"):
        capuchin_tf.prefetch(not_a_handle)
    handle = capuchin_tf.swap_out(tf.ones([4]))
    capuchin_tf.swap_in(handle, tf.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="unknown or already consumed handle"):
        capuchin_tf.swap_in(handle, tf.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="unknown or already consumed handle"):
        capuchin_tf.prefetch(handle)
    assert capuchin_tf.handle_status(handle) == HandleStatus.UNKNOWN
    assert not capuchin_tf.release_handle(handle)


def test_a_handle_dropped_by_python_is_released():
    before = capuchin_tf.host_store_stats()
    handle = capuchin_tf.swap_out(tf.ones([1000]))
    assert wait_until(lambda h=handle: capuchin_tf.handle_status(h) == HandleStatus.OUT)
    del handle
    wait_for_idle_store()
    assert capuchin_tf.host_store_stats()["released_unconsumed"] == before["released_unconsumed"] + 1


def test_wrong_dtype_or_shape_is_invalid_argument_and_keeps_the_handle():
    handle = capuchin_tf.swap_out(tf.ones([2, 3]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="holds float"):
        capuchin_tf.swap_in(handle, tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="holds shape"):
        capuchin_tf.swap_in(handle, tf.float32, [3, 2])
    assert same_bits(capuchin_tf.swap_in(handle, tf.float32, [2, 3]), tf.ones([2, 3]))


def test_unswappable_dtype_is_rejected_at_graph_construction():
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError)):
        capuchin_tf.swap_out(tf.constant(["a", "b"]))


def test_explicit_release_frees_host_memory():
    handles = [capuchin_tf.swap_out(tf.ones([1000]) * i) for i in range(5)]
    assert wait_until(lambda: all(capuchin_tf.handle_status(h) == HandleStatus.OUT for h in handles))
    assert capuchin_tf.release_handle(handles[0])
    assert capuchin_tf.release_all_handles() == 4
    wait_for_idle_store()


def test_host_bytes_return_to_zero_after_many_steps():
    @tf.function
    def step(x):
        total = tf.zeros_like(x)
        handles = []
        a = x
        for i in range(4):
            a = tf.sin(a) + float(i)
            handles.append(capuchin_tf.swap_out(a, name=f"a{i}"))
        for i, h in enumerate(handles):
            with tf.control_dependencies([total]):
                total = total + capuchin_tf.swap_in(capuchin_tf.prefetch(h), tf.float32, x.shape)
        return tf.reduce_sum(total)

    x = tf.random.stateless_uniform([100_000], seed=[7, 8])
    step(x)  # trace and warm up
    wait_for_idle_store()
    gc.collect()  # tensors of earlier tests held only by reference cycles, freed now rather than during the steps
    before = bfc_current()
    before_stats = capuchin_tf.host_store_stats()
    results = {float(step(x)) for _ in range(50)}
    assert len(results) == 1
    wait_for_idle_store()
    assert wait_until(lambda: bfc_current() == before), (before, bfc_current(), capuchin_tf.host_store_stats())
    after_stats = capuchin_tf.host_store_stats()
    assert after_stats["swap_outs"] - before_stats["swap_outs"] == 200
    assert after_stats["swap_ins"] - before_stats["swap_ins"] == 200
    assert after_stats["released_unconsumed"] == before_stats["released_unconsumed"]


def test_a_failed_step_releases_its_handles():
    @tf.function
    def failing_step(x):
        handle = capuchin_tf.swap_out(x * 2.0, name="doomed")
        with tf.control_dependencies([handle]):
            check = tf.debugging.assert_less(tf.reduce_sum(x), -1.0, message="step fails on purpose")
        with tf.control_dependencies([check]):
            return capuchin_tf.swap_in(handle, tf.float32, x.shape)

    x = tf.ones([1_000_000])
    with pytest.raises(tf.errors.InvalidArgumentError):  # traces the function (its constants stay allocated)
        failing_step(x)
    wait_for_idle_store()
    before_stats = capuchin_tf.host_store_stats()
    before = bfc_current()
    for _ in range(3):
        with pytest.raises(tf.errors.InvalidArgumentError, match="step fails on purpose"):
            failing_step(x)
    wait_for_idle_store()
    after_stats = capuchin_tf.host_store_stats()
    assert after_stats["released_unconsumed"] - before_stats["released_unconsumed"] == 3
    assert wait_until(lambda: bfc_current() == before), (before, bfc_current(), capuchin_tf.host_store_stats())


def test_an_unused_handle_is_released_when_its_step_ends():
    @tf.function
    def leaky_step(x):
        return capuchin_tf.swap_out(x + 1.0, name="never_swapped_in")

    before = capuchin_tf.host_store_stats()
    leaky_step(tf.ones([10_000]))  # the handle output is dropped at once
    wait_for_idle_store()
    assert capuchin_tf.host_store_stats()["released_unconsumed"] == before["released_unconsumed"] + 1


def test_link_emulation_takes_bytes_over_bandwidth_and_compute_goes_on():
    bandwidth = 50e6  # bytes/s
    n_bytes = 10_000_000
    expected_s = n_bytes / bandwidth  # 0.2 s
    capuchin_tf.set_link_bandwidth(bandwidth)
    try:
        x = tf.random.stateless_uniform([n_bytes // 4], seed=[9, 10])
        m = tf.random.stateless_uniform([128, 128], seed=[1, 1])
        t0 = time.monotonic()
        handle = capuchin_tf.swap_out(x)
        issue_s = time.monotonic() - t0
        matmuls = 0
        while capuchin_tf.handle_status(handle) != HandleStatus.OUT:
            m = tf.matmul(m, m) / 128.0
            matmuls += 1
        out_s = time.monotonic() - t0
        t1 = time.monotonic()
        capuchin_tf.prefetch(handle)
        while capuchin_tf.handle_status(handle) != HandleStatus.IN:
            time.sleep(0.001)
        in_s = time.monotonic() - t1
        capuchin_tf.swap_in(handle, tf.float32)
        # Two copies in one direction serialize: the second ends about 2N/B after both were issued.
        t2 = time.monotonic()
        _, h2 = capuchin_tf.swap_out(x), capuchin_tf.swap_out(x)
        assert wait_until(lambda: capuchin_tf.handle_status(h2) == HandleStatus.OUT)
        both_s = time.monotonic() - t2
        capuchin_tf.release_all_handles()
    finally:
        capuchin_tf.set_link_bandwidth(0)
    assert issue_s < 0.25 * expected_s, "swap-out must return at once and copy in the background"
    assert expected_s <= out_s < 1.5 * expected_s + 0.05
    assert expected_s <= in_s < 1.5 * expected_s + 0.05
    assert 2 * expected_s <= both_s < 2 * 1.5 * expected_s + 0.05
    assert matmuls >= 5, "compute must keep running while the copy is in flight"
    wait_for_idle_store()


def test_link_bandwidth_is_validated():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="bandwidth"):
            capuchin_tf.set_link_bandwidth(bad)
