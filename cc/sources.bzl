"""The one list of C++ sources of the op library `_capuchin_ops.so`.

Read by Bazel (`cc/BUILD` loads it) and by `setup.py` (which evaluates this file as Python: keep it to plain list
literals), so that both builds compile exactly the same files. Paths are relative to `cc/`.
"""

CAPUCHIN_OPS_SRCS = [
    "ops/capuchin_ops.cc",
    "kernels/config.cc",
    "kernels/host_buffer_pool.cc",
    "kernels/host_store.cc",
    "kernels/store_trace.cc",
    "kernels/tensor_pool.cc",
    "kernels/swap_kernels.cc",
    "kernels/stats_kernels.cc",
    "kernels/step_layout.cc",
    "kernels/device_allocator.cc",
    "kernels/variable_kernels.cc",
]

CAPUCHIN_OPS_HDRS = [
    "kernels/config.h",
    "kernels/host_buffer_pool.h",
    "kernels/host_store.h",
    "kernels/host_store_stats.h",
    "kernels/store_entry.h",
    "kernels/store_trace.h",
    "kernels/tensor_pool.h",
    "kernels/step_layout.h",
    "kernels/device_allocator.h",
    "kernels/kernel_inputs.h",
]
