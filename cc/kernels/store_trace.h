// The host store's traces, behind one small interface: the store reports what it does, and a StoreTrace decides
// what to write. The configuration (config.h) picks the implementation: CAPUCHIN_TF_TRACE_EVICT writes each
// eviction and the device's memory map to stderr, CAPUCHIN_TF_DEBUG_EVICT logs what the store held when an
// eviction freed nothing; without either, nothing is recorded. Every method runs with the store's mutex held.

#ifndef CAPUCHIN_TF_CC_KERNELS_STORE_TRACE_H_
#define CAPUCHIN_TF_CC_KERNELS_STORE_TRACE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "store_entry.h"
#include "tensor_pool.h"

namespace tensorflow {
namespace capuchin {

// A process-wide sequence number ordering allocations and hand-overs (traces only).
int64_t TraceSeq();

class StoreTrace {
 public:
  virtual ~StoreTrace() = default;

  // The trace `config` asks for (one that records nothing when it asks for none).
  static std::unique_ptr<StoreTrace> FromConfig(const Config& config);

  // `tensor` was handed to an op (`how`: "get", a Get's last reader, or "swap_in"): its address is named by the
  // hand-over in later memory maps.
  virtual void Handed(const Tensor& tensor, const std::string& name, const char* how) {}
  // An eviction for an allocation of `bytes_needed` bytes took `choice.chosen` and freed `freed` bytes; `chunks` is
  // the memory map it was chosen from (or nullptr), `entries` the store's entries after it.
  virtual void Evicted(int64_t bytes_needed, const EvictionChoice& choice, int64_t freed,
                       const std::vector<ChunkSpan>* chunks, const EntryMap& entries, int64_t pending_copies) {}
  // A MoveFor for an allocation of `bytes_needed` bytes moved `moved` bytes of `movable` tensors out of the window
  // of `size` bytes at `offset` from the device's first chunk.
  virtual void Moved(int64_t bytes_needed, uint64_t offset, uint64_t size, int64_t movable, int64_t moved) {}
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_STORE_TRACE_H_
