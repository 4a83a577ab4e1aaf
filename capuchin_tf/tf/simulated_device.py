"""The simulated device (design.md): the environment of a fresh process whose CPU:0 is a BFC allocator with a hard
limit. Pure: imports no TensorFlow (the settings only work if they are in place before TensorFlow starts)."""

from __future__ import annotations

import os

# The device TensorFlow's memory stats are read from: CPU:0, the simulated device.
DEVICE = "CPU:0"


def simulated_device_env(limit_mb: int, inter_op_threads: int | None = 1, base: dict | None = None) -> dict:
    """`base` (default: this process's environment) with CPU:0 a BFC device of `limit_mb` MiB.

    oneDNN off: its kernels can crash on an allocation failure (docs/decisions.md). One inter-op thread by default:
    a single stream of kernels, like a GPU's compute stream, and a repeatable order (tf-notes.md); None leaves
    TensorFlow's default pool.
    """
    env = dict(os.environ if base is None else base)
    env.update(TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(int(limit_mb)),
               TF_ENABLE_ONEDNN_OPTS="0")
    if inter_op_threads is not None:
        env["TF_NUM_INTEROP_THREADS"] = str(int(inter_op_threads))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env
