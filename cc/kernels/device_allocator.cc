#include "device_allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "config.h"
#include "host_store.h"
#include "tensorflow/core/common_runtime/bfc_allocator.h"
#include "tensorflow/core/common_runtime/device_factory.h"
#include "tensorflow/core/common_runtime/pool_allocator.h"
#include "tensorflow/core/common_runtime/process_state.h"
#include "tensorflow/core/common_runtime/threadpool_device.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/platform/numa.h"
#include "tensorflow/core/public/session_options.h"
#include "tsl/profiler/lib/scoped_memory_debug_annotation.h"
#include "xla/tsl/protobuf/bfc_memory_map.pb.h"

namespace tensorflow {
namespace capuchin {
namespace {

std::atomic<CapuchinAllocator*> g_installed{nullptr};

// The simulated device's one region (allow_growth=false: BFC takes the whole limit at its first allocation), as its
// sub-allocator handed it out: see MakeResident.
std::atomic<uintptr_t> g_region_base{0};
std::atomic<size_t> g_region_bytes{0};

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it with EINVAL
#endif

// The simulated device (docs/design/design.md): with TF_CPU_ALLOCATOR_USE_BFC=true and TF_CPU_BFC_MEM_LIMIT_IN_MB=N, a
// BFC allocator of N MiB. capuchin_tf builds its own, with the whole limit reserved up front as on a GPU
// (allow_growth=false): the environment-variable BFC grows its regions and fragments before reaching the limit
// (seen: out of memory at well under the limit during model construction). Waiting for frees on failure is kept,
// so an allocation can wait for an in-flight swap-out to release its device buffer.
//
// Internal fragmentation: BFC hands out a whole free chunk unless it is at least twice the request or the surplus
// reaches `fragmentation_fraction` of the limit (0: a fixed 128 MiB). The simulated device splits every chunk larger
// than the request (a fraction worth 256 bytes, BFC's granule), so that an allocation takes exactly its rounded size:
// - a memory budget below the device's size can then be held exactly (CapuchinAllocator::MaxBytesAdded): with a
//   GPU's default (1/128 of the device, 128 MiB on 16 GiB) any request under that surplus could take up to twice its
//   size, and an exact budget would have to reserve twice every activation;
// - no tensor holds more than it needs (seen with the GPU default on an 82 MiB device: a 20 MiB tensor holding a
//   29.6 MiB chunk when the next 20 MiB request failed).
// CAPUCHIN_TF_BFC_FRAGMENTATION_FRACTION overrides it (1/128: the GPU default's proportion; see config.h). Plain
// TensorFlow runs on the same allocator, so no gain comes from it.
tsl::BFCAllocator* SimulatedDeviceAllocator(double fragmentation_fraction) {
  const int64_t bytes = Config::Get().simulated_device_bytes;
  if (bytes <= 0) return nullptr;
  tsl::BFCAllocator::Options opts;
  opts.allow_growth = false;
  opts.allow_retry_on_failure = true;
  opts.garbage_collection = false;
  opts.fragmentation_fraction = fragmentation_fraction;
  SubAllocator::Visitor record_region = [](void* ptr, int, size_t num_bytes) {
    g_region_base.store(reinterpret_cast<uintptr_t>(ptr));
    g_region_bytes.store(num_bytes);
  };
  return new tsl::BFCAllocator(
      std::make_unique<BasicCPUAllocator>(port::kNUMANoAffinity, std::vector<SubAllocator::Visitor>{record_region},
                                          std::vector<SubAllocator::Visitor>{}),
      static_cast<size_t>(bytes), "bfc_cpu_allocator_for_gpu", opts);
}

// The small pool's one region, taken from the device allocator (it counts in the device's bytes in use, like any
// allocation). Never given back while the process lives: BFC frees regions only with garbage collection, off here.
class RegionSubAllocator : public SubAllocator {
 public:
  RegionSubAllocator(Allocator* device, std::shared_ptr<std::atomic<uintptr_t>[]> region)
      : SubAllocator({}, {}), device_(device), region_(std::move(region)) {}

  void* Alloc(size_t alignment, size_t num_bytes, size_t* bytes_received) override {
    // One region only: Owner() knows one, and the memory budget counts the region's bytes at the pool's first
    // allocation only. (The pool's BFC asks again if the device gave it less than asked for, backing off 10% at a
    // time, when the device was nearly full at the first small allocation; the pool is then smaller.)
    if (region_[0].load() != 0) {
      *bytes_received = 0;
      return nullptr;
    }
    AllocationAttributes no_retry(false, true, nullptr);
    void* ptr = device_->AllocateRaw(std::max<size_t>(alignment, Allocator::kAllocatorAlignment), num_bytes, no_retry);
    *bytes_received = ptr == nullptr ? 0 : num_bytes;
    if (ptr != nullptr && region_[0].load() == 0) {
      region_[1].store(reinterpret_cast<uintptr_t>(ptr) + num_bytes);
      region_[0].store(reinterpret_cast<uintptr_t>(ptr));
    }
    return ptr;
  }
  void Free(void* ptr, size_t num_bytes) override { device_->DeallocateRaw(ptr); }
  bool SupportsCoalescing() const override { return false; }
  AllocatorMemoryType GetMemoryType() const override { return device_->GetMemoryType(); }

 private:
  Allocator* const device_;
  std::shared_ptr<std::atomic<uintptr_t>[]> region_;
};

// Wraps the simulated device's allocator, or else the allocator the stock factory would use. CreateDevices runs
// several times per process (eager context, temporary devices of function instantiation), so one wrapper is made
// and shared; it lives as long as the devices, i.e. the whole process.
CapuchinAllocator* SharedWrapper() {
  static std::once_flag once;
  std::call_once(once, [] {
    const Config& config = Config::Get();
    const double fragmentation_fraction = config.bfc_fragmentation_fraction;
    tsl::BFCAllocator* bfc = SimulatedDeviceAllocator(fragmentation_fraction);
    Allocator* base = bfc;
    if (base == nullptr) base = ProcessState::singleton()->GetCPUAllocator(port::kNUMANoAffinity);
    // The small-tensor pool's size (config.h): 0 without the simulated device.
    const size_t small = bfc == nullptr ? 0 : config.small_pool_bytes;
    g_installed.store(new CapuchinAllocator(base, bfc, small, fragmentation_fraction, config.small_pool_fixed));
  });
  return g_installed.load();
}

// The stock ThreadPoolDeviceFactory (priority 60), with the allocator wrapped. It must stay below a GPU factory's
// priority (210) on a GPU build, since priorities also order device placement.
class CapuchinCpuDeviceFactory : public DeviceFactory {
 public:
  absl::Status ListPhysicalDevices(std::vector<std::string>* devices) override {
    devices->push_back("/physical_device:CPU:0");
    return absl::OkStatus();
  }

  absl::Status CreateDevices(const SessionOptions& options, const std::string& name_prefix,
                             std::vector<std::unique_ptr<Device>>* devices) override {
    int n = 1;
    auto iter = options.config.device_count().find("CPU");
    if (iter != options.config.device_count().end()) n = iter->second;
    CapuchinAllocator* allocator = SharedWrapper();
    // The stock factory declares 256 MiB. Grappler's memory optimizer compares its static peak estimate with that
    // figure and, above 80% of it, rewrites AddN nodes into in-place accumulations, which changes their summation
    // order; whether it does depends on the graph, so a rewritten step would not give plain TensorFlow's bits (seen
    // on ResNet50 at batch 32). capuchin_tf manages memory itself: the device declares the host's physical memory.
    const int64_t ram = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
    const Bytes memory_limit(ram > 0 ? ram : (int64_t{1} << 40));
    for (int i = 0; i < n; i++) {
      const std::string name = strings::StrCat(name_prefix, "/device:CPU:", i);
      devices->push_back(std::make_unique<ThreadPoolDevice>(options, name, memory_limit, DeviceLocality(), allocator));
    }
    return absl::OkStatus();
  }
};

constexpr int kFactoryPriority = 100;

struct RegisterFactory {
  RegisterFactory() {
    DeviceFactory::Register("CPU", std::make_unique<CapuchinCpuDeviceFactory>(), kFactoryPriority,
                            /*is_pluggable_device=*/false);
  }
} register_factory;

}  // namespace

CapuchinAllocator* CapuchinAllocator::Installed() { return g_installed.load(); }

CapuchinAllocator::CapuchinAllocator(Allocator* base, tsl::BFCAllocator* bfc, size_t small_pool_bytes,
                                     double fragmentation_fraction, bool small_pool_fixed)
    : base_(base),
      bfc_(bfc),
      small_pool_bytes_(bfc != nullptr && small_pool_bytes >= 256 ? small_pool_bytes : 0),
      small_pool_fixed_(small_pool_fixed),
      small_region_(new std::atomic<uintptr_t>[2]),
      trace_owners_(Config::Get().trace_evict) {
  small_region_[0].store(0);
  small_region_[1].store(0);
  if (bfc != nullptr) {
    bfc_limit_ = bfc->GetStats()->bytes_limit.value_or(0);
    // As BFCAllocator computes it from its options (a double truncated to int64).
    max_fragmentation_bytes_ = fragmentation_fraction > 0.0
                                   ? static_cast<int64_t>(fragmentation_fraction * static_cast<double>(bfc_limit_))
                                   : int64_t{128} << 20;
  }
}

tsl::BFCAllocator* CapuchinAllocator::SmallPool() {
  tsl::BFCAllocator* pool = small_.load(std::memory_order_acquire);
  if (pool != nullptr) return pool;
  std::lock_guard<std::mutex> lock(small_mu_);
  pool = small_.load(std::memory_order_relaxed);
  if (pool != nullptr) return pool;
  tsl::BFCAllocator::Options opts;
  opts.allow_growth = false;            // one region of the whole pool, taken at the first small allocation
  opts.allow_retry_on_failure = false;  // a full pool is not a failure: the allocation goes to `base`
  opts.garbage_collection = false;
  small_owned_ = std::make_unique<tsl::BFCAllocator>(std::make_unique<RegionSubAllocator>(bfc_, small_region_),
                                                     small_pool_bytes_.load(), "capuchin_small_pool", opts);
  small_.store(small_owned_.get(), std::memory_order_release);
  return small_owned_.get();
}

int64_t CapuchinAllocator::SizeSmallPool(int64_t bytes) {
  std::lock_guard<std::mutex> lock(small_mu_);
  const size_t current = small_pool_bytes_.load();
  if (current == 0 || small_pool_fixed_ || small_.load(std::memory_order_relaxed) != nullptr) {
    return static_cast<int64_t>(current);
  }
  const size_t size = (static_cast<size_t>(std::max<int64_t>(bytes, 256)) + 255) / 256 * 256;
  small_pool_bytes_.store(size);
  return static_cast<int64_t>(size);
}

Allocator* CapuchinAllocator::Owner(const void* ptr) const {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  tsl::BFCAllocator* pool = small_.load(std::memory_order_acquire);
  if (pool != nullptr && p >= small_region_[0].load() && p < small_region_[1].load()) return pool;
  return base_;
}

std::optional<AllocatorStats> CapuchinAllocator::SmallPoolStats() const {
  const size_t size = small_pool_bytes_.load();
  if (size == 0) return std::nullopt;
  tsl::BFCAllocator* pool = small_.load(std::memory_order_acquire);
  if (pool != nullptr) return pool->GetStats();
  AllocatorStats stats;  // not used yet
  stats.bytes_limit = static_cast<int64_t>(size);
  return stats;
}

void* CapuchinAllocator::AllocateRaw(size_t alignment, size_t num_bytes) {
  return AllocateRaw(alignment, num_bytes, AllocationAttributes());
}

namespace {
// Set while CapuchinAllocator::AllocateMoved (a DeviceMover's) makes a tensor on this thread.
thread_local bool t_moving = false;
// Set while passive mode evicts tensors on this thread (HostStore::EvictFor frees their device buffers here).
thread_local bool t_evicting = false;
}  // namespace

void* CapuchinAllocator::AllocateRaw(size_t alignment, size_t num_bytes, const AllocationAttributes& attr) {
  if (t_moving) return AllocateOutsideWindow(alignment, num_bytes);
  int64_t ticket = -1;
  bool planned = false;
  if (layout_.active() && static_cast<int64_t>(num_bytes) > layout_.min_bytes() && alignment <= 256) {
    const std::string_view op = tsl::profiler::ScopedMemoryDebugAnnotation::CurrentAnnotation().pending_op_name;
    void* ptr = layout_.Allocate(op, static_cast<int64_t>(num_bytes), &ticket, &planned);
    if (ptr != nullptr) return ptr;
    if (planned && HostStore::Global()->passive()) {
      ptr = PlannedElsewhere(alignment, num_bytes, ticket);
      if (ptr != nullptr) return ptr;
    }
  }
  void* ptr = AllocateOnDevice(alignment, num_bytes, attr);
  if (ptr == nullptr && ticket >= 0 && !planned && HostStore::Global()->passive()) {
    // The device outside the region had no room even after passive mode's evictions, which cannot free the region's
    // memory for it: the region, evicting from it (a planned allocation evicted from it already).
    ptr = InRegionEvicting(num_bytes, ticket);
    if (ptr != nullptr) return ptr;
  }
  if (ticket >= 0) layout_.Bind(ticket, ptr);
  return ptr;
}

void* CapuchinAllocator::PlannedElsewhere(size_t alignment, size_t num_bytes, int64_t ticket) {
  AllocationAttributes no_retry(false, true, nullptr);
  const int64_t budget = enforced_budget_.load(std::memory_order_relaxed);
  auto allocate = [&] { return base_->AllocateRaw(alignment, num_bytes, no_retry); };
  std::unique_lock<std::shared_mutex> exclusive(evict_mu_);
  int64_t excess = 0;
  void* ptr = budget > 0 ? Admit(budget, MaxBytesAdded(num_bytes), &excess, allocate) : allocate();
  if (ptr != nullptr) {
    layout_.Bind(ticket, ptr);
    return ptr;
  }
  return InRegionEvicting(num_bytes, ticket, &exclusive);
}

void* CapuchinAllocator::InRegionEvicting(size_t num_bytes, int64_t ticket, std::unique_lock<std::shared_mutex>* held) {
  std::unique_lock<std::shared_mutex> exclusive;
  if (held == nullptr) exclusive = std::unique_lock<std::shared_mutex>(evict_mu_);
  // A few rounds: when the region has no run of free and evictable memory that large, the store evicts tensors of
  // about the size asked for wherever they are, which may not make one.
  void* ptr = nullptr;
  for (int round = 0; round < 4; round++) {
    ptr = layout_.Retry(ticket);
    if (ptr != nullptr) return ptr;
    const std::vector<ChunkSpan> chunks = layout_.ChunkMap();
    if (chunks.empty() || Evict(static_cast<int64_t>(num_bytes), &chunks) == 0) return nullptr;
  }
  return layout_.Retry(ticket);
}

void CapuchinAllocator::BeginLayoutStep(int64_t id, bool record_only) {
  if (bfc_ == nullptr) return;
  const int64_t want = layout_.Begin(id, record_only);
  if (want <= 0) return;
  // The region, within the budget like any allocation; none when the device has no run that large (the step then
  // runs as without a layout, and is recorded).
  AllocationAttributes no_retry(false, true, nullptr);
  const int64_t budget = enforced_budget_.load(std::memory_order_relaxed);
  auto region_of = [&](int64_t bytes) -> void* {
    auto allocate = [&] { return base_->AllocateRaw(Allocator::kAllocatorAlignment, bytes, no_retry); };
    int64_t excess = 0;
    return budget > 0 ? Admit(budget, MaxBytesAdded(bytes), &excess, allocate) : allocate();
  };
  int64_t bytes = want;
  void* region = region_of(bytes);
  if (region == nullptr) {
    // No room for it: the function's last layout that had its region, if smaller (StepLayout::Previous).
    bytes = layout_.Previous();
    if (bytes > 0) region = region_of(bytes);
  }
  layout_.Attach(region, bytes);
}

void CapuchinAllocator::EndLayoutStep(bool ok) {
  void* region = layout_.End(ok);
  if (region != nullptr) base_->DeallocateRaw(region);
}

void* CapuchinAllocator::AllocateOnDevice(size_t alignment, size_t num_bytes, const AllocationAttributes& attr) {
  // No budget (or one the device's own limit already enforces): the path below, unchanged, at the cost of this load.
  const int64_t budget = enforced_budget_.load(std::memory_order_relaxed);
  if (budget > 0) return AllocateWithinBudget(alignment, num_bytes, attr, budget);
  void* ptr = nullptr;
  if (num_bytes > 0 && num_bytes <= kSmallPoolMaxAllocationBytes && small_on_.load(std::memory_order_relaxed) &&
      small_pool_bytes_.load(std::memory_order_relaxed) > 0) {
    AllocationAttributes no_retry(false, attr.allocation_will_be_logged, attr.freed_by_func);
    ptr = SmallPool()->AllocateRaw(alignment, num_bytes, no_retry);
    if (ptr != nullptr) return ptr;
  }
  if (HostStore::Global()->passive()) {
    // Passive mode (the paper's on-demand eviction): try without the allocator's own wait-and-retry; on failure
    // evict pooled tensors that nobody else holds, and try again while eviction frees something.
    AllocationAttributes no_retry(false, attr.allocation_will_be_logged, attr.freed_by_func);
    {
      std::shared_lock<std::shared_mutex> shared(evict_mu_);
      ptr = base_->AllocateRaw(alignment, num_bytes, no_retry);
    }
    // Evict and allocate with no other allocation in between: the run of memory EvictFor frees is chosen for this
    // request, and another thread's allocation (a prefetch's swap-in on the copy worker, a second inter-op thread)
    // could otherwise take part of it first. When nothing is left to evict, copies in flight may still help: a
    // swap-out frees its device buffer when its copy ends, and a prefetch that lands becomes evictable. So wait for
    // the next copy to finish (with the lock released: the copy worker allocates too) and try again, up to the
    // allocator's own 10 s. (Seen on the transformer's head: no contiguous 20 MiB while a 4 MiB swap-out was on
    // the link; BFC's own wait-and-retry then waited for frees only, never evicting the prefetches that landed.)
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    HostStore* store = HostStore::Global();
    while (ptr == nullptr) {
      int64_t generation = -1;
      {
        std::unique_lock<std::shared_mutex> exclusive(evict_mu_);
        ptr = base_->AllocateRaw(alignment, num_bytes, no_retry);
        if (ptr == nullptr && MoveFor(num_bytes) > 0) ptr = base_->AllocateRaw(alignment, num_bytes, no_retry);
        while (ptr == nullptr && Evict(static_cast<int64_t>(num_bytes), ChunkMap()) > 0) {
          ptr = base_->AllocateRaw(alignment, num_bytes, no_retry);
        }
        if (ptr == nullptr) generation = store->CopyGeneration();
      }
      if (ptr != nullptr || generation < 0) break;  // allocated, or no copy in flight that could change anything
      const int64_t deadline_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.time_since_epoch()).count();
      if (!store->WaitForCopy(generation, deadline_ns)) break;
    }
    // Nothing left to evict and no copy in flight (or 10 s of them did not help): fail now, the runtime retries the
    // step with a tighter plan. (CAPUCHIN_TF_DEBUG_EVICT set: let the allocator fail its own way, which logs its
    // chunks and their ops.)
    if (ptr == nullptr && !Config::Get().debug_evict) {
      RecordRefusal(num_bytes);
      return nullptr;
    }
  }
  if (ptr == nullptr) {
    // A budget the device's own limit enforces (a device of the budget's size): fail at once, as within a smaller
    // budget (AllocateWithinBudget). BFC's own wait for frees at its limit delayed the same out-of-memory error by
    // 10 s an attempt: a guided step whose plan does not fit took 30 s in its three attempts (docs/decisions.md,
    // "No wait at the budget"). Without a budget (plain TensorFlow's steps), BFC's behaviour is kept.
    AllocationAttributes no_retry(false, attr.allocation_will_be_logged, attr.freed_by_func);
    ptr = base_->AllocateRaw(alignment, num_bytes, budget_.load(std::memory_order_relaxed) > 0 ? no_retry : attr);
  }
  if (ptr == nullptr) RecordRefusal(num_bytes);
  if (ptr != nullptr && trace_owners_) RecordOwner(ptr, num_bytes);
  return ptr;
}

absl::Status CapuchinAllocator::SetMemoryBudget(int64_t bytes) {
  if (bytes < 0) return errors::InvalidArgument("capuchin_tf: a memory budget is >= 0 bytes (0: none), got ", bytes);
  if (bytes > 0 && bfc_ == nullptr) {
    return errors::FailedPrecondition(
        "capuchin_tf: a memory budget needs the simulated device (TF_CPU_ALLOCATOR_USE_BFC=true and "
        "TF_CPU_BFC_MEM_LIMIT_IN_MB set before TensorFlow starts): only there can the allocator wrapper read the "
        "device's bytes in use");
  }
  budget_.store(bytes, std::memory_order_relaxed);
  enforced_budget_.store(bytes > 0 && bytes < bfc_limit_ ? bytes : 0, std::memory_order_relaxed);
  if (bytes > 0) MakeResident(bytes + bytes / 2);
  return absl::OkStatus();
}

// A GPU's memory is resident from the start; the simulated device's is host memory the kernel maps on first write,
// page by page. Left so, the first step to reach memory no step used before pays a page fault per 4 KiB inside its
// kernels' times: measured on bert-4l b16, plain TensorFlow's first step ran its forward pass 1.95x slower than its
// third (1.13x with the memory written once before), and the measured step is such a first step, so the trace told
// the planner the forward pass was about twice as long as the guided steps' and the swap-outs it planned there lagged
// behind compute (docs/decisions.md, "A resident device"). The first `bytes` of the region (a budget and half
// of it again: what BFC's placement of a step under that budget reaches) are made resident without writing to them
// (tensors already live there keep their bytes); memory made resident once stays so. Best effort: nothing is done
// on a kernel without MADV_POPULATE_WRITE.
void CapuchinAllocator::MakeResident(int64_t bytes) {
  const uintptr_t base = g_region_base.load();
  const size_t region = g_region_bytes.load();
  if (base == 0 || region == 0 || bfc_ == nullptr) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (base + page - 1) / page * page;
  const uintptr_t end = (base + std::min<size_t>(region, static_cast<size_t>(bytes))) / page * page;
  std::lock_guard<std::mutex> lock(resident_mu_);
  const uintptr_t from = std::max(begin, resident_end_);
  if (end <= from) return;
  if (madvise(reinterpret_cast<void*>(from), end - from, MADV_POPULATE_WRITE) != 0) {
    VLOG(1) << "capuchin_tf: madvise(MADV_POPULATE_WRITE) failed (errno " << errno << "); device pages stay lazy";
    return;
  }
  resident_end_ = end;
}

// The most an allocation of `num_bytes` can add to the device BFC's bytes_in_use, from tsl's bfc_allocator.cc as
// TensorFlow 2.21 builds it (FindChunkPtr with a freed_before count, no alignment padding):
//   - AllocateRawInternal rounds the request up to a multiple of kMinAllocationSize, 256 (RoundedBytes);
//   - FindChunkPtr takes the smallest free chunk of at least that size (bins in size order, each ordered by size),
//     and splits it to exactly the rounded size only
//       if (chunk->size >= rounded_bytes * 2 ||
//           static_cast<int64_t>(chunk->size) - rounded_bytes >= max_internal_fragmentation_bytes)
//     with max_internal_fragmentation_bytes = fragmentation_fraction * memory_limit_ (128 MiB when the fraction is
//     0); then `stats_.bytes_in_use += chunk->size` and peak_bytes_in_use follows it.
// Chunk sizes are multiples of 256 (the region is, and every split is at a rounded size), so an unsplit chunk is
// larger than the rounded size by less than min(rounded, max_internal_fragmentation_bytes): by at most that, rounded
// up to 256, minus 256. The bound is exact in the worst case (BFC adds exactly that when such a chunk is the best
// fit) and conservative otherwise. The chunk BFC will actually pick cannot be relied on: a free on another thread,
// which is not serialized with allocations, can coalesce a new best fit at any time.
int64_t CapuchinAllocator::MaxBytesAdded(size_t num_bytes) const {
  constexpr int64_t kMinAllocationSize = 256;
  if (num_bytes == 0) return 0;  // BFC allocates nothing
  if (num_bytes > static_cast<size_t>(bfc_limit_)) return std::numeric_limits<int64_t>::max() / 4;  // never fits
  const int64_t rounded =
      (static_cast<int64_t>(num_bytes) + kMinAllocationSize - 1) / kMinAllocationSize * kMinAllocationSize;
  const int64_t unsplit_below = std::min(rounded, max_fragmentation_bytes_);
  const int64_t surplus =
      unsplit_below <= 0
          ? 0
          : (unsplit_below + kMinAllocationSize - 1) / kMinAllocationSize * kMinAllocationSize - kMinAllocationSize;
  return rounded + surplus;
}

// Admission keeps this invariant: bytes in use + what the admitted, unfinished allocations can still add <= budget.
// An admission reads bytes in use at one instant with the admitted bytes constant (both under `budget_mu_`); after
// that instant bytes in use grow only by admitted allocations finishing, each by at most what it was admitted for,
// which it keeps counted until it has finished. So BFC's bytes in use, and its peak, never pass the budget, while
// the allocations themselves run concurrently (BFC serializes them itself).
template <typename AllocateFn>
void* CapuchinAllocator::Admit(int64_t budget, int64_t bytes_added, int64_t* excess, AllocateFn allocate) {
  {
    std::lock_guard<std::mutex> lock(budget_mu_);
    const int64_t in_use = bfc_->GetStats()->bytes_in_use;
    const int64_t over = in_use + admitted_bytes_ + bytes_added - budget;
    if (over > 0) {
      *excess = over;
      return nullptr;
    }
    admitted_bytes_ += bytes_added;
  }
  *excess = 0;
  void* ptr = allocate();
  std::lock_guard<std::mutex> lock(budget_mu_);
  admitted_bytes_ -= bytes_added;
  return ptr;
}

void* CapuchinAllocator::AllocateWithinBudget(size_t alignment, size_t num_bytes, const AllocationAttributes& attr,
                                              int64_t budget) {
  AllocationAttributes no_retry(false, attr.allocation_will_be_logged, attr.freed_by_func);
  int64_t excess = 0;
  void* ptr = nullptr;
  if (num_bytes > 0 && num_bytes <= kSmallPoolMaxAllocationBytes && small_on_.load(std::memory_order_relaxed) &&
      small_pool_bytes_.load(std::memory_order_relaxed) > 0) {
    // Inside the pool's region the device's bytes in use do not change; the pool's first allocation takes the
    // region from the device. Refused, the allocation goes to the device as below.
    tsl::BFCAllocator* pool = SmallPool();
    auto small = [&] { return pool->AllocateRaw(alignment, num_bytes, no_retry); };
    ptr =
        small_region_[0].load() != 0 ? small() : Admit(budget, MaxBytesAdded(small_pool_bytes_.load()), &excess, small);
    if (ptr != nullptr) return ptr;
  }
  const int64_t bytes_added = MaxBytesAdded(num_bytes);
  HostStore* store = HostStore::Global();
  if (!store->passive()) {
    // Refused: fail at once, and the runtime retries the step with a tighter plan. BFC's own wait at its limit
    // would mostly delay the same error by 10 s. Admitted, the allocation runs as it would without a budget.
    ptr = Admit(budget, bytes_added, &excess, [&] { return base_->AllocateRaw(alignment, num_bytes, attr); });
  } else {
    // Passive mode, as in AllocateRaw with the budget in place of the device's limit: over the budget, evict the
    // oldest evictable tensors until `excess` bytes are freed, anywhere on the device (it is larger than the budget:
    // the bytes need not be contiguous); within the budget but without a free chunk large enough on the device,
    // evict one contiguous run as without a budget. Then wait for copies in flight, up to 10 s.
    {
      std::shared_lock<std::shared_mutex> shared(evict_mu_);
      ptr = Admit(budget, bytes_added, &excess, [&] { return base_->AllocateRaw(alignment, num_bytes, no_retry); });
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (ptr == nullptr) {
      int64_t generation = -1;
      {
        std::unique_lock<std::shared_mutex> exclusive(evict_mu_);
        bool moved = false;  // within the budget without a free run: tensors moved inside the device once
        for (;;) {
          ptr = Admit(budget, bytes_added, &excess, [&] { return base_->AllocateRaw(alignment, num_bytes, no_retry); });
          if (ptr != nullptr) break;
          if (excess == 0 && !moved) {
            moved = true;
            if (MoveFor(num_bytes) > 0) continue;
          }
          const int64_t freed = excess > 0 ? Evict(excess, ChunkMap(), /*contiguous=*/false)
                                           : Evict(static_cast<int64_t>(num_bytes), ChunkMap());
          if (freed == 0) break;
        }
        if (ptr == nullptr) generation = store->CopyGeneration();
      }
      if (ptr != nullptr || generation < 0) break;
      const int64_t deadline_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.time_since_epoch()).count();
      if (!store->WaitForCopy(generation, deadline_ns)) break;
    }
  }
  if (ptr == nullptr) RecordRefusal(num_bytes);
  if (ptr == nullptr && excess > 0) {
    // TensorFlow's error names the device's allocator, which is not full: say why.
    static std::atomic<int> logged{0};
    if (logged.fetch_add(1, std::memory_order_relaxed) < 10) {
      LOG(WARNING) << "capuchin: refused an allocation of " << num_bytes << " bytes (up to " << bytes_added
                   << " on the device): the device's bytes in use would pass the memory budget of " << budget
                   << " bytes by up to " << excess << (store->passive() ? " with nothing left to evict" : "");
    }
  }
  if (ptr != nullptr && trace_owners_) RecordOwner(ptr, num_bytes);
  return ptr;
}

int64_t CapuchinAllocator::Evict(int64_t bytes, const std::vector<ChunkSpan>* chunks, bool contiguous) {
  t_evicting = true;
  const int64_t freed = HostStore::Global()->EvictFor(bytes, chunks, contiguous);
  t_evicting = false;
  return freed;
}

int64_t CapuchinAllocator::MoveFor(size_t num_bytes) {
  if (bfc_ == nullptr || !Config::Get().device_moves) return 0;
  return HostStore::Global()->MoveFor(static_cast<int64_t>(num_bytes), ChunkMap(), this);
}

void CapuchinAllocator::Reserve(uint64_t begin, uint64_t end, const std::vector<ChunkSpan>& chunks, int64_t min_bytes) {
  window_begin_ = begin;
  window_end_ = end;
  const int64_t budget = enforced_budget_.load(std::memory_order_relaxed);
  AllocationAttributes no_retry(false, false, nullptr);
  for (const ChunkSpan& c : chunks) {
    if (c.in_use || c.address < begin || c.address + static_cast<uint64_t>(c.size) > end || c.size < min_bytes) {
      continue;
    }
    // BFC's best fit for exactly this size is the lowest free chunk of this size: reserve until it is this one
    // (the others reserved on the way are freed with it). A bounded number of tries: a chunk not reserved only makes
    // the move likelier to land in the window, which Allocate refuses.
    for (int tries = 0; tries < 8; tries++) {
      int64_t excess = 0;
      auto allocate = [&] { return base_->AllocateRaw(Allocator::kAllocatorAlignment, c.size, no_retry); };
      void* p = budget > 0 ? Admit(budget, MaxBytesAdded(c.size), &excess, allocate) : allocate();
      if (p == nullptr) break;
      reserved_.push_back(p);
      if (reinterpret_cast<uint64_t>(p) == c.address) break;
    }
  }
}

void* CapuchinAllocator::AllocateOutsideWindow(size_t alignment, size_t num_bytes) {
  AllocationAttributes no_retry(false, false, nullptr);
  const int64_t budget = enforced_budget_.load(std::memory_order_relaxed);
  int64_t excess = 0;
  auto allocate = [&] { return base_->AllocateRaw(alignment, num_bytes, no_retry); };
  void* p = budget > 0 ? Admit(budget, MaxBytesAdded(num_bytes), &excess, allocate) : allocate();
  const uint64_t a = reinterpret_cast<uint64_t>(p);
  if (p != nullptr && a + num_bytes > window_begin_ && a < window_end_) {
    base_->DeallocateRaw(p);
    return nullptr;
  }
  if (p != nullptr && trace_owners_) RecordOwner(p, num_bytes);
  return p;
}

Tensor CapuchinAllocator::AllocateMoved(DataType dtype, const TensorShape& shape) {
  t_moving = true;
  Tensor t(this, dtype, shape);
  t_moving = false;
  return t;
}

void CapuchinAllocator::Release() {
  for (void* p : reserved_) base_->DeallocateRaw(p);
  reserved_.clear();
  window_begin_ = window_end_ = 0;
}

void CapuchinAllocator::RecordRefusal(size_t num_bytes) {
  Refusal r;
  r.bytes = static_cast<int64_t>(num_bytes);
  if (bfc_ != nullptr) {
    r.in_use = bfc_->GetStats()->bytes_in_use;
    r.largest_free = LargestFreeChunk();
  }
  const HostStore::DeviceBytes held = HostStore::Global()->ResidentDeviceBytes();
  r.store_shared = held.shared;
  r.store_idle = held.idle;
  r.op = std::string(tsl::profiler::ScopedMemoryDebugAnnotation::CurrentAnnotation().pending_op_name);
  std::lock_guard<std::mutex> lock(refusal_mu_);
  r.count = last_refusal_.count + 1;
  last_refusal_ = std::move(r);
}

int64_t CapuchinAllocator::LargestFreeChunk() {
  if (bfc_ == nullptr) return -1;
  int64_t largest = 0;
  for (const HostStore::ChunkSpan& c : *ChunkMap()) {
    if (!c.in_use) largest = std::max(largest, c.size);
  }
  return largest;
}

CapuchinAllocator::Refusal CapuchinAllocator::LastRefusal() {
  std::lock_guard<std::mutex> lock(refusal_mu_);
  return last_refusal_;
}

void CapuchinAllocator::RecordOwner(const void* ptr, size_t num_bytes) {
  if (num_bytes < kTracedOwnerMinBytes) return;
  const auto& annotation = tsl::profiler::ScopedMemoryDebugAnnotation::CurrentAnnotation();
  std::lock_guard<std::mutex> lock(owners_mu_);
  owners_[reinterpret_cast<uint64_t>(ptr)] = {std::string(annotation.pending_op_name), HostStore::TraceSeq()};
}

const std::vector<HostStore::ChunkSpan>* CapuchinAllocator::ChunkMap() {
  if (bfc_ == nullptr) return nullptr;
  const MemoryDump dump = bfc_->RecordMemoryMap();
  thread_local std::vector<HostStore::ChunkSpan> chunks;
  chunks.clear();
  chunks.reserve(dump.chunk_size());
  for (const MemChunk& c : dump.chunk()) {
    chunks.push_back(HostStore::ChunkSpan{c.address(), static_cast<int64_t>(c.size()), c.in_use(), "", 0});
    if (trace_owners_ && c.in_use()) {
      std::lock_guard<std::mutex> lock(owners_mu_);
      auto it = owners_.find(c.address());
      if (it != owners_.end()) {
        chunks.back().op = it->second.first;
        chunks.back().seq = it->second.second;
      }
    }
  }
  std::sort(chunks.begin(), chunks.end(),
            [](const HostStore::ChunkSpan& a, const HostStore::ChunkSpan& b) { return a.address < b.address; });
  return &chunks;
}

void CapuchinAllocator::DeallocateRaw(void* ptr) {
  if (trace_owners_) {
    std::lock_guard<std::mutex> lock(owners_mu_);
    owners_.erase(reinterpret_cast<uint64_t>(ptr));
  }
  void* region = nullptr;
  if (layout_.Free(ptr, &region, t_evicting)) {
    if (region != nullptr) base_->DeallocateRaw(region);
    return;
  }
  Owner(ptr)->DeallocateRaw(ptr);
}

}  // namespace capuchin
}  // namespace tensorflow
