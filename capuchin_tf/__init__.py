"""capuchin_tf: Capuchin (Peng et al., ASPLOS 2020) for TensorFlow 2.x.

Cuts the device memory a training step needs by evicting tensors to host memory and prefetching them back in time,
or by recomputing them, deciding per tensor from the access pattern measured at runtime.

Importing this package loads TensorFlow and capuchin_tf's op library, which installs capuchin_tf's device allocator
wrapper; import it before running any TensorFlow op. See README.md and docs/.
"""

from capuchin_tf._version import __version__
from capuchin_tf import _loader

_loader.load()

from capuchin_tf import ops  # noqa: E402  (needs the library loaded above)
from capuchin_tf.ops import (  # noqa: E402
    HandleStatus,
    allocator_stats,
    drain_access_records,
    handle_status,
    host_store_stats,
    prefetch,
    record_access,
    release_all_handles,
    release_handle,
    reset_host_store_stats,
    set_link_bandwidth,
    swap_in,
    swap_out,
)

__all__ = [
    "__version__",
    "HandleStatus",
    "allocator_stats",
    "drain_access_records",
    "handle_status",
    "host_store_stats",
    "ops",
    "prefetch",
    "record_access",
    "release_all_handles",
    "release_handle",
    "reset_host_store_stats",
    "set_link_bandwidth",
    "swap_in",
    "swap_out",
]
