// The host store's tensor pool (passive mode): the pooled handles in hold order, and the choice of what an
// allocation that failed evicts. The store (host_store.h) owns the entries and carries the evictions out; every
// method here runs with the store's mutex held.

#ifndef CAPUCHIN_TF_CC_KERNELS_TENSOR_POOL_H_
#define CAPUCHIN_TF_CC_KERNELS_TENSOR_POOL_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "store_entry.h"

namespace tensorflow {
namespace capuchin {

// What an eviction takes, and what it could have taken.
struct EvictionChoice {
  std::vector<std::shared_ptr<StoreEntry>> evictable;  // in preference order
  std::vector<std::shared_ptr<StoreEntry>> chosen;     // to evict, in order
  int64_t freed = 0;                                   // the bytes of `chosen`
  // The contiguous run of memory `chosen` lies in, [window_begin, window_end), when a window was chosen (else 0, 0).
  uint64_t window_begin = 0;
  uint64_t window_end = 0;
  std::unordered_set<const StoreEntry*> queued;  // swap-outs still queued behind the copy worker
  // Where each evictable tensor's buffer starts (taken before anything is evicted; traces name them).
  std::unordered_map<uint64_t, std::shared_ptr<StoreEntry>> entry_at;
};

class TensorPool {
 public:
  // A handle Hold made (evictable once the pool holds the only reference to its tensor).
  void Add(int64_t handle) { hold_order_.push_back(handle); }

  // The tensors to evict so that an allocation of `bytes_needed` succeeds, among the pooled tensors of `entries`
  // nobody else references, the prefetched tensors no SwapIn has claimed yet and the swap-outs still in
  // `out_queue`. `chunks`, when the allocator can tell (the simulated device's BFC), is its memory map in address
  // order: then the tensors chosen are those of the contiguous run of free and evictable chunks that is large enough
  // and holds the fewest evictable bytes (an allocation needs one free chunk, not free bytes in total).
  // `contiguous` false: any `bytes_needed` bytes will do (a memory budget below the device's size refused the
  // allocation), the oldest evictable tensors first; `chunks` then only tells which tensors live in the device's
  // memory (not in the small-tensor pool, where evicting frees nothing the device counts).
  // Forgets the released handles of the hold order.
  EvictionChoice Choose(const EntryMap& entries, const std::deque<std::shared_ptr<StoreEntry>>& out_queue,
                        int64_t bytes_needed, const std::vector<ChunkSpan>* chunks, bool contiguous);

 private:
  std::deque<int64_t> hold_order_;  // pooled handles in hold order (may name released ones: skipped)
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_TENSOR_POOL_H_
