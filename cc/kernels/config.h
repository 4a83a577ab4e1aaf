// capuchin_tf's settings from the environment: every environment variable the op library reads, read once, here.
//
//   TF_CPU_ALLOCATOR_USE_BFC, TF_CPU_BFC_MEM_LIMIT_IN_MB
//       "true" and N: the simulated device, a BFC allocator of N MiB built by capuchin_tf's device factory
//       (device_allocator.cc). Default: unset, no simulated device (the allocator TensorFlow would use, wrapped).
//   CAPUCHIN_TF_BFC_FRAGMENTATION_FRACTION
//       the simulated device BFC's fragmentation_fraction, 0 to 1 (1/128: a GPU's default proportion). Default: 256.5
//       bytes' worth of the device, so that BFC splits every chunk larger than the request (device_allocator.cc).
//   CAPUCHIN_TF_SMALL_POOL_MB
//       the size of the allocator wrapper's small-tensor pool in MiB, 0 (no pool) to a quarter of the device.
//       Default: sized by capuchin_tf from the first managed step's graph before the pool is used (the peak of its
//       small tensors, runtime/managed_step.py); 1/128 of the simulated device, between 1 and 8 MiB, until then.
//   CAPUCHIN_TF_HOST_POOL_MB
//       the most bytes of freed host buffers the host store keeps for reuse, in MiB. Default: 2048.
//   CAPUCHIN_TF_TRACE_EVICT
//       set (any value): every passive eviction writes a line to stderr, with the device's memory map, each chunk
//       named by the tensor or op it holds. Default: unset, no trace.
//   CAPUCHIN_TF_DEVICE_MOVES
//       set (any value): passive mode moves the pooled tensors in the way of an allocation that lacks one free run
//       inside the device instead of evicting them to host memory (HostStore::MoveFor). Default: unset, evicted (the
//       moves are not yet a measured win: docs/decisions.md, "Moved inside the device").
//   CAPUCHIN_TF_DEBUG_EVICT
//       set (any value): an eviction that frees nothing logs what the store holds on the device, and a passive-mode
//       allocation that cannot be satisfied fails the allocator's own way (which logs its chunks) instead of at once.
//       Default: unset.
//
// An invalid value is ignored with a warning, and the default applies.

#ifndef CAPUCHIN_TF_CC_KERNELS_CONFIG_H_
#define CAPUCHIN_TF_CC_KERNELS_CONFIG_H_

#include <cstddef>
#include <cstdint>

namespace tensorflow {
namespace capuchin {

struct Config {
  int64_t simulated_device_bytes = 0;  // 0: no simulated device
  double bfc_fragmentation_fraction = 1.0 / 128;
  size_t small_pool_bytes = 0;    // a multiple of 256; 0 without a simulated device
  bool small_pool_fixed = false;  // set by CAPUCHIN_TF_SMALL_POOL_MB: capuchin_tf does not size it
  int64_t host_pool_bytes = int64_t{2048} << 20;
  bool trace_evict = false;
  bool debug_evict = false;
  bool device_moves = false;

  // The process's settings, read from the environment at the first call (when TensorFlow creates its devices).
  static const Config& Get();
  // Reads the environment now.
  static Config FromEnvironment();
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_CONFIG_H_
