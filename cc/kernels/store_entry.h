// What the host store keeps per handle (StoreEntry), and the memory map an eviction is chosen from (ChunkSpan): the
// types the store (host_store.h), its tensor pool's eviction choice (tensor_pool.h) and its trace (store_trace.h)
// share. Entries are read and written with the store's mutex held.

#ifndef CAPUCHIN_TF_CC_KERNELS_STORE_ENTRY_H_
#define CAPUCHIN_TF_CC_KERNELS_STORE_ENTRY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "absl/status/status.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tensorflow {
namespace capuchin {

enum class Residency : int32_t { kIn = 0, kSwappingOut = 1, kOut = 2, kSwappingIn = 3 };

using SwapInCallback = std::function<void(const absl::Status&, const Tensor&)>;

struct StoreEntry {
  int64_t handle = 0;
  std::string name;
  DataType dtype = DT_INVALID;
  TensorShape shape;
  int64_t bytes = 0;
  Residency state = Residency::kSwappingOut;
  Tensor device;                      // the device tensor while IN, or the copy's source while SWAPPING_OUT
  void* host = nullptr;               // the host copy while OUT or SWAPPING_IN
  bool released = false;              // dropped while a copy was in flight: the worker frees what is left
  bool prefetch_requested = false;    // a swap-in is wanted as soon as the swap-out finishes
  Allocator* in_allocator = nullptr;  // the device allocator the swap-in allocates from
  SwapInCallback waiter;              // the SwapIn that claimed this handle and waits for it
  int64_t wait_start_ns = 0;
  bool pooled = false;  // made by Hold: read by Get, evictable by passive mode

  // Where the device buffer starts (entries are matched to the memory map's chunks by it).
  uint64_t device_address() const { return reinterpret_cast<uint64_t>(device.tensor_data().data()); }
};

using EntryMap = std::unordered_map<int64_t, std::shared_ptr<StoreEntry>>;

// One chunk of the device allocator's memory map.
struct ChunkSpan {
  uint64_t address;
  int64_t size;
  bool in_use;
  std::string op;   // the op that allocated it, where the allocator recorded one (traces only)
  int64_t seq = 0;  // when it was allocated, in TraceSeq order (traces only)
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_STORE_ENTRY_H_
