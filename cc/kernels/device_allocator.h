// capuchin_tf's device allocator: a wrapper around the allocator TensorFlow would give the CPU device, installed by
// a "CPU" device factory of higher priority than the stock one when the op library loads (docs/design/tf-notes.md). It
// has to be in place before TensorFlow creates its devices, which is why capuchin_tf loads the library at import.
//
// By default it forwards every call (plain TensorFlow runs through it unchanged). On top of
// that, each switched on by capuchin_tf's runtime:
//   - passive mode (HostStore::SetPassive): an allocation that fails evicts pooled tensors to host memory and
//     retries, waiting for copies in flight when nothing is left to evict;
//   - the small-tensor pool (SetSmallPool), see the constructor;
//   - a memory budget (SetMemoryBudget) below the simulated device's size: no allocation may take the device's
//     bytes in use (BFC's, hence its peak and get_memory_info()) above it. An allocation that might is refused
//     like one at the device's limit: it fails at once, or, in passive mode, evicts until it fits.

#ifndef CAPUCHIN_TF_CC_KERNELS_DEVICE_ALLOCATOR_H_
#define CAPUCHIN_TF_CC_KERNELS_DEVICE_ALLOCATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "host_store.h"
#include "step_layout.h"
#include "tensorflow/core/framework/allocator.h"
#include "xla/tsl/framework/bfc_allocator.h"

namespace tensorflow {
namespace capuchin {

class CapuchinAllocator : public Allocator, private DeviceMover {
 public:
  // `bfc`: the same allocator as `base` when it is the simulated device's BFC (its memory map guides passive
  // eviction), else nullptr.
  //
  // `small_pool_bytes` > 0: once SetSmallPool(true) was called (every capuchin_tf managed step calls it), the
  // allocations of at most kSmallPoolMaxAllocationBytes come from a pool of that size, one region taken from `bfc` at
  // the first such allocation (a BFC allocator of its own). The persistent state built before that stays where it was;
  // plain TensorFlow, which never calls it, runs on the device allocator alone. Small tensors that live long (LayerNorm
  // and BatchNorm statistics kept for the backward pass, shape vectors) otherwise settle in the holes between large
  // tensors, and when those large tensors are freed the holes stay split: the free memory is there, in pieces no
  // large tensor fits in (seen: the transformer at 88 MiB, 50 MiB free in runs of at most 16.2 MiB split by 8 KiB
  // and 256-byte chunks, and a 20 MiB allocation failed). Size-segregated pools are what GPU caching allocators do
  // against this (PyTorch's CUDA allocator: blocks of at most 1 MiB in 2 MiB segments). A small allocation the pool
  // cannot hold goes to `base` as before.
  //
  // `fragmentation_fraction`: the one `bfc` was built with (BFCAllocator::Options), which decides how much more than
  // the request an allocation can take from it (MaxBytesAdded).
  //
  // `small_pool_fixed`: the pool's size was set by the user (CAPUCHIN_TF_SMALL_POOL_MB); SizeSmallPool keeps it.
  CapuchinAllocator(Allocator* base, tsl::BFCAllocator* bfc = nullptr, size_t small_pool_bytes = 0,
                    double fragmentation_fraction = 0.0, bool small_pool_fixed = false);

  // The largest allocation the small-tensor pool takes (64 KiB). Not capuchin_tf.core.pool_plan's
  // GUIDED_MIN_POOLED_BYTES, the smallest tensor a guided step hands to the host store's tensor pool, also 64 KiB.
  static constexpr size_t kSmallPoolMaxAllocationBytes = 64 << 10;
  // Traces only: the smallest buffer whose allocating op the eviction trace names (64 KiB).
  static constexpr size_t kTracedOwnerMinBytes = 64 << 10;

  // The one wrapper shared by every CPU device the factory creates (nullptr until TensorFlow created its devices).
  static CapuchinAllocator* Installed();

  Allocator* base() const { return base_; }
  void SetSmallPool(bool on) { small_on_.store(on, std::memory_order_relaxed); }
  // Sizes the small-tensor pool to `bytes` (rounded up to 256, at least 256) if nothing has used it yet and its size
  // is not the user's; returns the pool's size in effect (0: no pool). capuchin_tf sizes it from the first managed
  // step's graph (the peak of its small tensors), before the step runs.
  int64_t SizeSmallPool(int64_t bytes);
  // The last allocation the wrapper could not satisfy (at the device's limit or the budget, after passive mode's
  // evictions): its size, the device's bytes in use then, the largest free chunk then (smaller than the request with
  // enough bytes free: the free memory was split), and the op that asked. `count` grows by one per failure.
  struct Refusal {
    int64_t count = 0;
    int64_t bytes = 0;
    int64_t in_use = 0;
    int64_t largest_free = 0;
    std::string op;
    // What the host store held on the device then: shared with an op that runs or waits to run, and evictable.
    int64_t store_shared = 0;
    int64_t store_idle = 0;
  };
  Refusal LastRefusal();
  // The simulated device's largest free chunk now, in bytes (-1 when the device is not the simulated one).
  int64_t LargestFreeChunk();

  // The planned layout of guided steps (step_layout.h), on the simulated device only: the runtime begins and ends
  // each guided step of a function `id`; the step's allocations of more than 64 KiB are recorded, and from the
  // second step of the same function on they go where the layout says in one region of the device, allocated at
  // the step's beginning (within the budget) and given back when the step's allocations in it are gone.
  void BeginLayoutStep(int64_t id, bool record_only = false);
  void EndLayoutStep(bool ok);
  void InheritLayout(int64_t from) { layout_.InheritNext(from); }
  StepLayout::Stats LayoutStats() { return layout_.stats(); }
  std::vector<StepLayout::RecordedAllocation> LayoutRecord() { return layout_.LastRecord(); }

  // The small-tensor pool's statistics (nullopt without a pool).
  std::optional<AllocatorStats> SmallPoolStats() const;

  // The memory budget, in bytes (0: none). While it is set and below the device's limit, every allocation first
  // checks that the most it can add to the device's bytes in use (MaxBytesAdded, counting the allocations other
  // threads have checked and not finished) keeps them at or under the budget. One that might not is refused like
  // an allocation at the device's limit, except that it never waits: without passive mode it fails at once
  // (TensorFlow raises its "OOM when allocating tensor" ResourceExhaustedError); in passive mode it first evicts
  // the oldest evictable tensors, anywhere on the device (the device is larger than the budget, so the bytes need
  // not be contiguous), and waits for copies in flight, failing only when nothing more can be freed. A budget at or
  // above the limit changes nothing: the device enforces its own. Allocations already under way when it is set are
  // not checked, and bytes already in use stay: set it between steps. FailedPrecondition (and no budget) unless the
  // device is the simulated one, whose bytes in use the wrapper can read.
  absl::Status SetMemoryBudget(int64_t bytes);
  int64_t memory_budget() const { return budget_.load(std::memory_order_relaxed); }
  // The most an allocation of `num_bytes` can add to the simulated device's bytes in use (see the definition).
  int64_t MaxBytesAdded(size_t num_bytes) const;

  // Forwarded unchanged, so that error messages and get_memory_info() stay those of the allocator underneath.
  std::string Name() override { return base_->Name(); }
  void* AllocateRaw(size_t alignment, size_t num_bytes) override;
  void* AllocateRaw(size_t alignment, size_t num_bytes, const AllocationAttributes& attr) override;
  void DeallocateRaw(void* ptr) override;
  bool TracksAllocationSizes() const override { return base_->TracksAllocationSizes(); }
  bool AllocatesOpaqueHandle() const override { return base_->AllocatesOpaqueHandle(); }
  size_t RequestedSize(const void* ptr) const override {
    return layout_.InRegion(ptr) ? layout_.SizeOf(ptr) : Owner(ptr)->RequestedSize(ptr);
  }
  size_t AllocatedSize(const void* ptr) const override {
    return layout_.InRegion(ptr) ? layout_.SizeOf(ptr) : Owner(ptr)->AllocatedSize(ptr);
  }
  int64_t AllocationId(const void* ptr) const override {
    return layout_.InRegion(ptr) ? 0 : Owner(ptr)->AllocationId(ptr);
  }
  size_t AllocatedSizeSlow(const void* ptr) const override {
    return layout_.InRegion(ptr) ? layout_.SizeOf(ptr) : Owner(ptr)->AllocatedSizeSlow(ptr);
  }
  std::optional<AllocatorStats> GetStats() override { return base_->GetStats(); }
  bool ClearStats() override { return base_->ClearStats(); }
  void SetSafeFrontier(uint64_t count) override { base_->SetSafeFrontier(count); }
  AllocatorMemoryType GetMemoryType() const override { return base_->GetMemoryType(); }

 private:
  // The simulated device's memory map in address order (a buffer reused per thread), or nullptr.
  const std::vector<HostStore::ChunkSpan>* ChunkMap();

  // The allocator a pointer came from: the small pool if it lies in the pool's region, else `base`.
  Allocator* Owner(const void* ptr) const;

  // DeviceMover (HostStore::MoveFor), on the simulated device: Reserve allocates the window's free chunks (the
  // same size again, which BFC's best fit gives the lowest free chunk of exactly that size, until it is the window's),
  // AllocateMoved makes a tensor of this allocator that BFC places outside the window, within the budget, and Release
  // frees the reserved chunks. Run with `evict_mu_` held alone.
  void Reserve(uint64_t begin, uint64_t end, const std::vector<ChunkSpan>& chunks, int64_t min_bytes) override;
  Tensor AllocateMoved(DataType dtype, const TensorShape& shape) override;
  void Release() override;
  // AllocateRaw while AllocateMoved runs: from the device, never waiting or evicting, nullptr inside the window.
  void* AllocateOutsideWindow(size_t alignment, size_t num_bytes);
  // HostStore::EvictFor, marking the device buffers it frees on this thread as evicted (the planned layout keeps
  // such a tensor's record open until a Get brings it back).
  int64_t Evict(int64_t bytes, const std::vector<ChunkSpan>* chunks, bool contiguous = true);
  // MoveFor with this wrapper as the mover, when moves are on and the device is the simulated one.
  int64_t MoveFor(size_t num_bytes);
  std::vector<void*> reserved_;
  uint64_t window_begin_ = 0, window_end_ = 0;

  // AllocateRaw once the planned layout had no place for the allocation: the device, as without a layout.
  void* AllocateOnDevice(size_t alignment, size_t num_bytes, const AllocationAttributes& attr);
  // A planned allocation whose place in the region is taken and which no gap of the region holds, in passive mode:
  // first the device without evicting anything, then the cheapest run of the region evicted, as passive mode
  // evicts on the device. nullptr when neither works (the device's usual path follows).
  void* PlannedElsewhere(size_t alignment, size_t num_bytes, int64_t ticket);
  // The smallest gap of the region for the recorded allocation `ticket`, evicting the cheapest run of the region
  // (HostStore::EvictFor on the region's map) while none holds it; nullptr if that fails. `held`: `evict_mu_` is
  // already held exclusively (else it is taken).
  void* InRegionEvicting(size_t num_bytes, int64_t ticket, std::unique_lock<std::shared_mutex>* held = nullptr);
  // AllocateRaw while a budget (`budget` bytes, below the device's limit) is set.
  void* AllocateWithinBudget(size_t alignment, size_t num_bytes, const AllocationAttributes& attr, int64_t budget);
  // Calls `allocate` if `bytes_added` more bytes in use keep the device within `budget`, counting what the
  // allocations other threads have admitted and not finished may still add; else returns nullptr without calling
  // it and sets `*excess` to the bytes that would be over.
  template <typename AllocateFn>
  void* Admit(int64_t budget, int64_t bytes_added, int64_t* excess, AllocateFn allocate);

  Allocator* const base_;
  tsl::BFCAllocator* const bfc_;
  // The small-tensor pool, made at its first use (SmallPool) and never replaced: its size can change until then.
  tsl::BFCAllocator* SmallPool();
  std::atomic<tsl::BFCAllocator*> small_{nullptr};
  std::unique_ptr<tsl::BFCAllocator> small_owned_;
  std::mutex small_mu_;                   // making the pool, sizing it
  std::atomic<size_t> small_pool_bytes_;  // 0: no pool
  const bool small_pool_fixed_;
  std::atomic<bool> small_on_{false};
  // The small pool's region, [begin, end), 0 until it is taken.
  std::shared_ptr<std::atomic<uintptr_t>[]> small_region_;
  // Passive mode: allocations share it; an allocation that evicts holds it alone from its eviction to its retry.
  std::shared_mutex evict_mu_;
  // The memory budget. `enforced_budget_` is the budget when it is below the device's limit, else 0 (the only
  // state the allocation path reads when no budget is set). `bfc_limit_` and `max_fragmentation_bytes_` are the
  // device BFC's bytes_limit and max_internal_fragmentation_bytes.
  std::atomic<int64_t> budget_{0};
  std::atomic<int64_t> enforced_budget_{0};
  int64_t bfc_limit_ = 0;
  int64_t max_fragmentation_bytes_ = 0;
  // Admission to the budget: checked and counted under `budget_mu_`, which is never held while allocating.
  std::mutex budget_mu_;
  int64_t admitted_bytes_ = 0;  // the most the admitted allocations not yet finished can still add
  // MakeResident (device_allocator.cc): the end of the device region's pages made resident so far.
  void MakeResident(int64_t bytes);
  std::mutex resident_mu_;
  uintptr_t resident_end_ = 0;
  // CAPUCHIN_TF_TRACE_EVICT: the op that allocated each buffer of at least kTracedOwnerMinBytes, named in the
  // eviction trace's map.
  void RecordOwner(const void* ptr, size_t num_bytes);
  void RecordRefusal(size_t num_bytes);
  std::mutex refusal_mu_;
  Refusal last_refusal_;
  const bool trace_owners_;
  mutable StepLayout layout_{kSmallPoolMaxAllocationBytes};
  std::mutex owners_mu_;
  std::unordered_map<uint64_t, std::pair<std::string, int64_t>> owners_;  // op, HostStore::TraceSeq()
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_DEVICE_ALLOCATOR_H_
