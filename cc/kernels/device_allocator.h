// capuchin_tf's device allocator: a wrapper around the allocator TensorFlow would give the CPU device, installed by
// a "CPU" device factory of higher priority than the stock one when the op library loads (tf-notes.md).
//
// In this version it forwards every call (pass-through mode) and counts allocations; the measured-execution layer
// adds recording of every allocation and free and, in passive mode, eviction on allocation failure. It has to be in
// place before TensorFlow creates its devices, which is why capuchin_tf loads the library at import.

#ifndef CAPUCHIN_TF_CC_KERNELS_DEVICE_ALLOCATOR_H_
#define CAPUCHIN_TF_CC_KERNELS_DEVICE_ALLOCATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "host_store.h"

#include "tensorflow/core/framework/allocator.h"
#include "xla/tsl/framework/bfc_allocator.h"

namespace tensorflow {
namespace capuchin {

class CapuchinAllocator : public Allocator {
 public:
  // `bfc`: the same allocator as `base` when it is the simulated device's BFC (its memory map guides passive
  // eviction), else nullptr.
  //
  // `small_pool_bytes` > 0: once SetSmallPool(true) was called (every capuchin_tf managed step calls it), the
  // allocations of at most kSmallMaxBytes come from a pool of that size, one region taken from `bfc` at the first
  // such allocation (a BFC allocator of its own). The persistent state built before that stays where it was; plain
  // TensorFlow, which never calls it, runs on the device allocator alone. Small tensors that live long (LayerNorm and
  // BatchNorm statistics kept for the backward pass, shape vectors) otherwise settle in the holes between large
  // tensors, and when those large tensors are freed the holes stay split: the free memory is there, in pieces no
  // large tensor fits in (seen: the transformer at 88 MiB, 50 MiB free in runs of at most 16.2 MiB split by 8 KiB
  // and 256-byte chunks, and a 20 MiB allocation failed). Size-segregated pools are what GPU caching allocators do
  // against this (PyTorch's CUDA allocator: blocks of at most 1 MiB in 2 MiB segments). A small allocation the pool
  // cannot hold goes to `base` as before.
  CapuchinAllocator(Allocator* base, tsl::BFCAllocator* bfc = nullptr, size_t small_pool_bytes = 0);

  static constexpr size_t kSmallMaxBytes = 64 << 10;

  // The one wrapper shared by every CPU device the factory creates (nullptr until TensorFlow created its devices).
  static CapuchinAllocator* Installed();

  Allocator* base() const { return base_; }
  int64_t allocations() const { return allocations_.load(std::memory_order_relaxed); }
  int64_t deallocations() const { return deallocations_.load(std::memory_order_relaxed); }
  void SetSmallPool(bool on) { small_on_.store(on, std::memory_order_relaxed); }
  // The small-tensor pool's statistics (nullopt without a pool).
  std::optional<AllocatorStats> SmallPoolStats() const;

  // Forwarded unchanged, so that error messages and get_memory_info() stay those of the allocator underneath.
  std::string Name() override { return base_->Name(); }
  void* AllocateRaw(size_t alignment, size_t num_bytes) override;
  void* AllocateRaw(size_t alignment, size_t num_bytes, const AllocationAttributes& attr) override;
  void DeallocateRaw(void* ptr) override;
  bool TracksAllocationSizes() const override { return base_->TracksAllocationSizes(); }
  bool AllocatesOpaqueHandle() const override { return base_->AllocatesOpaqueHandle(); }
  size_t RequestedSize(const void* ptr) const override { return Owner(ptr)->RequestedSize(ptr); }
  size_t AllocatedSize(const void* ptr) const override { return Owner(ptr)->AllocatedSize(ptr); }
  int64_t AllocationId(const void* ptr) const override { return Owner(ptr)->AllocationId(ptr); }
  size_t AllocatedSizeSlow(const void* ptr) const override { return Owner(ptr)->AllocatedSizeSlow(ptr); }
  std::optional<AllocatorStats> GetStats() override { return base_->GetStats(); }
  bool ClearStats() override { return base_->ClearStats(); }
  void SetSafeFrontier(uint64_t count) override { base_->SetSafeFrontier(count); }
  AllocatorMemoryType GetMemoryType() const override { return base_->GetMemoryType(); }

 private:
  // The simulated device's memory map in address order (a buffer reused per thread), or nullptr.
  const std::vector<HostStore::ChunkSpan>* ChunkMap();

  // The allocator a pointer came from: the small pool if it lies in the pool's region, else `base`.
  Allocator* Owner(const void* ptr) const;

  Allocator* const base_;
  tsl::BFCAllocator* const bfc_;
  std::unique_ptr<tsl::BFCAllocator> small_;
  std::atomic<bool> small_on_{false};
  // The small pool's region, [begin, end), 0 until it is taken.
  std::shared_ptr<std::atomic<uintptr_t>[]> small_region_;
  // Passive mode: allocations share it; an allocation that evicts holds it alone from its eviction to its retry.
  std::shared_mutex evict_mu_;
  // CAPUCHIN_TF_TRACE_EVICT: the op that allocated each buffer of at least 64 KiB, named in the eviction trace's map.
  void RecordOwner(const void* ptr, size_t num_bytes);
  const bool trace_owners_;
  std::mutex owners_mu_;
  std::unordered_map<uint64_t, std::pair<std::string, int64_t>> owners_;  // op, HostStore::TraceSeq()
  std::atomic<int64_t> allocations_{0};
  std::atomic<int64_t> deallocations_{0};
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_DEVICE_ALLOCATOR_H_
