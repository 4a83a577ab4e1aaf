// The host store's statistics: the one list of their fields.
//
// CAPUCHIN_HOST_STORE_STATS(X) calls X(name, meaning) once per field, in order. It defines the fields of
// HostStoreCounters, the order of the Capuchin>HostStoreStats op's output vector and the default of that op's
// `fields` attr, which the Python wrapper (capuchin_tf.tf.ops.host_store_stats) reads from the op's definition to
// name the values. To add a field, add it here: nothing else lists them.

#ifndef CAPUCHIN_TF_CC_KERNELS_HOST_STORE_STATS_H_
#define CAPUCHIN_TF_CC_KERNELS_HOST_STORE_STATS_H_

#include <cstdint>
#include <string>
#include <vector>

#define CAPUCHIN_HOST_STORE_STATS(X)                                                                        \
  X(host_bytes, "bytes held in host buffers now")                                                           \
  X(peak_host_bytes, "peak of host_bytes since the last reset")                                             \
  X(live_handles, "handles not yet consumed or released")                                                   \
  X(swap_outs, "device-to-host copies finished")                                                            \
  X(swap_ins, "host-to-device copies finished")                                                             \
  X(bytes_out, "bytes copied device-to-host")                                                               \
  X(bytes_in, "bytes copied host-to-device")                                                                \
  X(late_prefetches, "SwapIn found its prefetch still running and waited")                                  \
  X(demand_swap_ins, "SwapIn found no prefetch started and swapped in on demand")                           \
  X(wait_ns, "total time SwapIn ops waited for their tensor")                                               \
  X(released_unconsumed, "handles dropped without being consumed (step ended, explicit release)")           \
  X(failed_swap_ins, "swap-ins whose device allocation failed")                                             \
  X(pool_bytes, "freed host buffers kept for reuse (not counted in host_bytes)")                            \
  X(pending_copies, "copies queued or running, including those of released handles")                        \
  X(passive_evictions, "tensors passive mode evicted")                                                      \
  X(passive_evicted_bytes, "their bytes")                                                                   \
  X(passive_swap_ins, "Gets that brought an evicted tensor back")                                           \
  X(guided_evictions, "prefetched tensors evicted again (an allocation failed before their SwapIn)")        \
  X(expedited_swap_outs, "queued swap-outs an allocation copied at once (EvictFor) instead of waiting")     \
  X(device_moves, "pooled tensors passive mode moved inside the device instead of evicting them (MoveFor)") \
  X(device_moved_bytes, "their bytes")

namespace tensorflow {
namespace capuchin {

// Counters of the store, one int64 per field of CAPUCHIN_HOST_STORE_STATS.
struct HostStoreCounters {
#define CAPUCHIN_COUNTER_FIELD(name, meaning) int64_t name = 0;
  CAPUCHIN_HOST_STORE_STATS(CAPUCHIN_COUNTER_FIELD)
#undef CAPUCHIN_COUNTER_FIELD

  // The values in field order.
  std::vector<int64_t> Values() const {
#define CAPUCHIN_COUNTER_VALUE(name, meaning) name,
    return {CAPUCHIN_HOST_STORE_STATS(CAPUCHIN_COUNTER_VALUE)};
#undef CAPUCHIN_COUNTER_VALUE
  }

  // The field names in order.
  static std::vector<std::string> Names() {
#define CAPUCHIN_COUNTER_NAME(name, meaning) #name,
    return {CAPUCHIN_HOST_STORE_STATS(CAPUCHIN_COUNTER_NAME)};
#undef CAPUCHIN_COUNTER_NAME
  }
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_HOST_STORE_STATS_H_
