"""The TensorFlow-facing public API, re-exported by `capuchin_tf` (unless CAPUCHIN_TF_PURE=1).

Importing this module loads TensorFlow and the op library (which installs the allocator wrapper: it must happen
before TensorFlow's first op).
"""

from capuchin_tf.tf import loader

loader.load()

from capuchin_tf.frontend.decorator import function  # noqa: E402
from capuchin_tf.frontend.keras_callback import CapuchinCallback  # noqa: E402
from capuchin_tf.runtime.errors import BudgetError, CapuchinError  # noqa: E402
from capuchin_tf.runtime.managed_step import ManagedStep  # noqa: E402
from capuchin_tf.tf import ops  # noqa: E402  (needs the library loaded above)
from capuchin_tf.tf.ops import (  # noqa: E402
    HandleStatus,
    allocator_stats,
    handle_status,
    host_store_stats,
    layout_stats,
    prefetch,
    release_all_handles,
    release_handle,
    reset_host_store_stats,
    set_link_bandwidth,
    set_memory_budget,
    swap_in,
    swap_out,
)

__all__ = [
    "BudgetError",
    "CapuchinCallback",
    "CapuchinError",
    "ManagedStep",
    "function",
    "HandleStatus",
    "allocator_stats",
    "handle_status",
    "host_store_stats",
    "layout_stats",
    "ops",
    "prefetch",
    "release_all_handles",
    "release_handle",
    "reset_host_store_stats",
    "set_link_bandwidth",
    "set_memory_budget",
    "swap_in",
    "swap_out",
]
