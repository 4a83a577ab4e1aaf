"""Python wrappers of capuchin_tf's C++ ops (`cc/ops/capuchin_ops.cc`).

The swap ops move a device tensor to capuchin_tf's host store and back:

    handle = swap_out(x)                      # SWAPPING_OUT -> OUT; x's device buffer is freed once copied
    handle = prefetch(handle)                 # OUT -> SWAPPING_IN -> IN, asynchronously
    y = swap_in(handle, x.dtype, x.shape)     # y is x bit for bit; waits only if the prefetch is late

Inside a `tf.function` these are graph nodes; order them with control dependencies (a control edge only means
"not before", see tf-notes.md). Handles left unconsumed are released when their step ends.
"""

from __future__ import annotations

import enum
import numbers

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry  # private (allowed in the tf layer)

from capuchin_tf.tf import loader

_ops = loader.load()


def _stat_fields(op_name: str = "Capuchin>HostStoreStats") -> tuple[str, ...]:
    """The names of a statistics op's output entries, in order: the default of the op's `fields` attr (for
    HostStoreStats the library makes it from its one list of the fields, cc/kernels/host_store_stats.h). Read from
    the op's registered definition, so nothing runs (TensorFlow's devices need not exist yet)."""
    op_def = op_def_registry.get(op_name)
    attr = next(a for a in op_def.attr if a.name == "fields")
    return tuple(s.decode() for s in attr.default_value.list.s)


# The order of the HostStoreStats op's output.
HOST_STORE_STAT_FIELDS = _stat_fields()
# The order of the LayoutStats op's output.
LAYOUT_STAT_FIELDS = _stat_fields("Capuchin>LayoutStats")


class HandleStatus(enum.IntEnum):
    """Residency of a swapped tensor, as in the paper (plus UNKNOWN for consumed or never-issued handles)."""

    UNKNOWN = -1
    IN = 0
    SWAPPING_OUT = 1
    OUT = 2
    SWAPPING_IN = 3


def swap_out(tensor, name: str = "") -> tf.Tensor:
    """Starts copying `tensor` to host memory; returns a scalar int64 handle."""
    return _ops.capuchin_swap_out(tensor, tensor_name=name)


def prefetch(handle) -> tf.Tensor:
    """Starts bringing the tensor of `handle` back to the device; returns the handle."""
    return _ops.capuchin_prefetch(handle)


def swap_in(handle, dtype, shape=None) -> tf.Tensor:
    """Returns the tensor of `handle` (consuming the handle). `shape` is its static shape, if known."""
    dtype = tf.as_dtype(dtype)
    shape = tf.TensorShape(shape)
    return _ops.capuchin_swap_in(handle, dtype=dtype, shape=shape)


def handle_status(handle) -> HandleStatus:
    """The current residency of `handle` (eager only)."""
    return HandleStatus(int(_ops.capuchin_handle_status(handle)))


def release_handle(handle) -> bool:
    """Drops `handle` without consuming it; False if it was unknown or already consumed."""
    return bool(_ops.capuchin_release_handle(handle))


def release_all_handles() -> int:
    """Drops every live handle and frees the pooled host buffers; returns how many handles were dropped."""
    return int(_ops.capuchin_release_all_handles())


def host_store_stats() -> dict[str, int]:
    """Host store statistics: bytes held and peak, copies and bytes per direction, late prefetches, ..."""
    values = _ops.capuchin_host_store_stats().numpy().tolist()
    return dict(zip(HOST_STORE_STAT_FIELDS, values))


def reset_host_store_stats() -> None:
    """Resets the host store's counters (the peak restarts from the bytes held now)."""
    _ops.capuchin_reset_host_store_stats()


def set_link_bandwidth(device_to_host: float = 0.0, host_to_device: float | None = None) -> None:
    """Emulates a link of the given bytes/second per direction (0 = off, the default; one value sets both)."""
    if host_to_device is None:
        host_to_device = device_to_host
    for name, value in (("device_to_host", device_to_host), ("host_to_device", host_to_device)):
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"{name} bandwidth must be a finite number of bytes/s >= 0 (0 = off), got {value!r}")
    _ops.capuchin_set_link_bandwidth(tf.constant(float(device_to_host), tf.float64),
                                     tf.constant(float(host_to_device), tf.float64))


def hold(tensor, name: str = "") -> tf.Tensor:
    """Hands `tensor` to the tensor pool; returns a handle that `get` reads (passive mode can evict it)."""
    return _ops.capuchin_hold(tensor, tensor_name=name)


def get(handle, dtype, shape=None) -> tf.Tensor:
    """The tensor of a `hold` handle (brought back first if passive mode evicted it); the handle stays valid."""
    return _ops.capuchin_get(handle, dtype=tf.as_dtype(dtype), shape=tf.TensorShape(shape))


def assign_in_place(handle, value) -> None:
    """Writes `value` into the buffer of the variable `handle` refers to (a buffer of its own if that one is shared or
    of another shape): unlike AssignVariableOp it never takes over the value's buffer, unlike
    ResourceStridedSliceAssign it leaves the variable out of copy-on-read mode (recovery.Snapshot.restore). Managed
    steps use the op in place of AssignVariableOp (rewrite.assignments_in_place)."""
    value = tf.convert_to_tensor(value)
    _ops.capuchin_assign_in_place(handle, value)


def set_passive_mode(enabled: bool) -> None:
    """Passive mode: when an allocation would fail, evict pooled tensors to host memory and retry."""
    _ops.capuchin_set_passive_mode(tf.constant(bool(enabled)))


def set_small_pool(enabled: bool) -> None:
    """The device allocator wrapper's small-tensor pool (on the simulated device): when on, allocations of at most
    64 KiB come from a pool of their own, so that small tensors that live long do not split the memory large tensors
    need (docs/decisions.md). Every managed step turns it on."""
    _ops.capuchin_set_small_pool(tf.constant(bool(enabled)))


def size_small_pool(nbytes: int) -> int:
    """Sizes the small-tensor pool to `nbytes` (rounded up to 256) if nothing has used it yet and
    CAPUCHIN_TF_SMALL_POOL_MB did not set it; returns the pool's size in effect (0: the device has none). The first
    managed step sizes it from its graph (core/graph_model.small_tensor_peak) before it runs."""
    return int(_ops.capuchin_size_small_pool(tf.constant(int(nbytes), tf.int64)))


def layout_begin(function_id: int, record_only: bool = False) -> None:
    """Begins a guided step of the function `function_id` under the allocator's planned layout (on the simulated
    device; elsewhere nothing): its allocations of more than 64 KiB are recorded and, once a step of the same function
    was recorded, placed in one region of the device where the layout made from it says (cc/kernels/step_layout.h).
    `record_only`: recorded (`layout_record` after its end), not placed."""
    _ops.capuchin_layout_step(tf.constant(3 if record_only else 0, tf.int64), tf.constant(int(function_id), tf.int64))


def layout_inherit(function_id: int) -> None:
    """The next function to begin a step under the planned layout that has no layout of its own starts from a copy of
    function `function_id`'s (a plan that replaces another: its first step is placed, not recorded)."""
    _ops.capuchin_layout_step(tf.constant(4, tf.int64), tf.constant(int(function_id), tf.int64))


def layout_end(ok: bool = True) -> None:
    """Ends the step `layout_begin` began; `ok` False after a failure (the layout is then dropped)."""
    _ops.capuchin_layout_step(tf.constant(1 if ok else 2, tf.int64), tf.constant(0, tf.int64))


def layout_stats() -> dict[str, int]:
    """The planned layout's counters: steps, steps with a region, layouts made, allocations placed as laid out,
    misses (elsewhere in the region), fallbacks (not in the region), the region's bytes (the layout's size), allocations
    laid out, the last step's misses and fallbacks, and the region the last step ran with (`attached_bytes`, 0:
    none)."""
    return dict(zip(LAYOUT_STAT_FIELDS, _ops.capuchin_layout_stats().numpy().tolist()))


def layout_record() -> dict[str, np.ndarray]:
    """The allocations of more than 64 KiB the last step under the planned layout recorded, in allocation order:
    `keys` ("op#bytes#n"), `bytes` (rounded to 256), `allocated` and `freed` (when, counted in the step's allocation and
    free events; freed -1: live at the step's end, -2: the allocation failed), `allocated_ns` and `freed_ns` (the same
    in nanoseconds since the step began; -1: not freed in the step)."""
    keys, nbytes, allocated, freed, allocated_ns, freed_ns = _ops.capuchin_layout_record()
    return {"keys": np.array([k.decode() for k in keys.numpy()], dtype=object), "bytes": nbytes.numpy(),
            "allocated": allocated.numpy(), "freed": freed.numpy(), "allocated_ns": allocated_ns.numpy(),
            "freed_ns": freed_ns.numpy()}


def set_memory_budget(nbytes: int | None) -> None:
    """Sets the memory budget the device allocator enforces, in bytes (None or 0: none, the default).

    While it is set and below the device's limit, no allocation may take the device's bytes in use, hence the peak
    `tf.config.experimental.get_memory_info('CPU:0')` reports, above it: an allocation that might (counting the most
    the device's BFC allocator can hand out for it) fails at once with TensorFlow's usual ResourceExhaustedError, or,
    in passive mode, first evicts pooled tensors and waits for copies in flight. Set it between steps: allocations
    under way are not checked, and bytes already in use stay. Needs the simulated device (FailedPreconditionError
    otherwise); `allocator_stats()["budget_bytes"]` reads it back.
    """
    if nbytes is None:
        nbytes = 0
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
        raise TypeError(f"memory budget must be an int number of bytes or None, got {nbytes!r}")
    if nbytes < 0:
        raise ValueError(f"memory budget must be >= 0 bytes (0 or None: no budget), got {nbytes}")
    _ops.capuchin_set_memory_budget(tf.constant(int(nbytes), tf.int64))


def drain_stalls() -> dict[str, np.ndarray]:
    """Stalls recorded since the last drain: `start_ns`, `end_ns` (CLOCK_MONOTONIC), `bytes`, `kind` (a
    `capuchin_tf.core.stalls.StallKind`) and `name` (the tensor; empty for a passive eviction)."""
    starts, ends, nbytes, kinds, names = _ops.capuchin_drain_stalls()
    return {"start_ns": starts.numpy(), "end_ns": ends.numpy(), "bytes": nbytes.numpy(), "kind": kinds.numpy(),
            "name": np.array([s.decode() for s in names.numpy().tolist()], dtype=object)}


def allocator_stats(device: str = "/device:CPU:0") -> dict[str, int | bool]:
    """The device allocator's bytes in use, peak and limit (-1 if not tracked), whether capuchin_tf wraps it, the
    same three for the wrapper's small-tensor pool (-1 without one; the pool's region counts in the device's bytes in
    use as one allocation), the memory budget set by `set_memory_budget` (`budget_bytes`, 0: none), and the last
    allocation the wrapper could not satisfy (`refusals` so far; `refused_bytes`, the device's `refused_in_use` and
    `refused_largest_free` chunk at that moment, `refused_op`, and the bytes capuchin_tf's host store held on the device
    then, shared with ops that ran or waited to run, `refused_store_shared`, or evictable, `refused_store_idle`); and
    the device's `largest_free` chunk now (-1 unless the device is the simulated one)."""
    with tf.device(device):
        (in_use, peak, limit, wrapped, small_in_use, small_peak, small_limit, budget, refusals, refused_bytes,
         refused_in_use, refused_largest_free, refused_op, largest_free, refused_store_shared,
         refused_store_idle) = _ops.capuchin_allocator_stats()
    return {
        "bytes_in_use": int(in_use),
        "peak_bytes_in_use": int(peak),
        "bytes_limit": int(limit),
        "wrapped": bool(wrapped),
        "small_pool_bytes_in_use": int(small_in_use),
        "small_pool_peak_bytes_in_use": int(small_peak),
        "small_pool_bytes_limit": int(small_limit),
        "budget_bytes": int(budget),
        "refusals": int(refusals),
        "refused_bytes": int(refused_bytes),
        "refused_in_use": int(refused_in_use),
        "refused_largest_free": int(refused_largest_free),
        "refused_op": refused_op.numpy().decode(),
        "largest_free": int(largest_free),
        "refused_store_shared": int(refused_store_shared),
        "refused_store_idle": int(refused_store_idle),
    }
