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
#include <string>
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
  explicit CapuchinAllocator(Allocator* base, tsl::BFCAllocator* bfc = nullptr) : base_(base), bfc_(bfc) {}

  // The one wrapper shared by every CPU device the factory creates (nullptr until TensorFlow created its devices).
  static CapuchinAllocator* Installed();

  Allocator* base() const { return base_; }
  int64_t allocations() const { return allocations_.load(std::memory_order_relaxed); }
  int64_t deallocations() const { return deallocations_.load(std::memory_order_relaxed); }

  // Forwarded unchanged, so that error messages and get_memory_info() stay those of the allocator underneath.
  std::string Name() override { return base_->Name(); }
  void* AllocateRaw(size_t alignment, size_t num_bytes) override;
  void* AllocateRaw(size_t alignment, size_t num_bytes, const AllocationAttributes& attr) override;
  void DeallocateRaw(void* ptr) override;
  bool TracksAllocationSizes() const override { return base_->TracksAllocationSizes(); }
  bool AllocatesOpaqueHandle() const override { return base_->AllocatesOpaqueHandle(); }
  size_t RequestedSize(const void* ptr) const override { return base_->RequestedSize(ptr); }
  size_t AllocatedSize(const void* ptr) const override { return base_->AllocatedSize(ptr); }
  int64_t AllocationId(const void* ptr) const override { return base_->AllocationId(ptr); }
  size_t AllocatedSizeSlow(const void* ptr) const override { return base_->AllocatedSizeSlow(ptr); }
  std::optional<AllocatorStats> GetStats() override { return base_->GetStats(); }
  bool ClearStats() override { return base_->ClearStats(); }
  void SetSafeFrontier(uint64_t count) override { base_->SetSafeFrontier(count); }
  AllocatorMemoryType GetMemoryType() const override { return base_->GetMemoryType(); }

 private:
  // The simulated device's memory map in address order (a buffer reused per thread), or nullptr.
  const std::vector<HostStore::ChunkSpan>* ChunkMap();

  Allocator* const base_;
  tsl::BFCAllocator* const bfc_;
  std::atomic<int64_t> allocations_{0};
  std::atomic<int64_t> deallocations_{0};
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_DEVICE_ALLOCATOR_H_
