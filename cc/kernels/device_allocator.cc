#include "device_allocator.h"

#include "host_store.h"

#include <memory>
#include <mutex>

#include "tensorflow/core/common_runtime/device_factory.h"
#include "tensorflow/core/common_runtime/process_state.h"
#include "tensorflow/core/common_runtime/threadpool_device.h"
#include "tensorflow/core/platform/numa.h"
#include "tensorflow/core/public/session_options.h"

namespace tensorflow {
namespace capuchin {
namespace {

std::atomic<CapuchinAllocator*> g_installed{nullptr};

// Wraps the allocator the stock factory would use. CreateDevices runs several times per process (eager context,
// temporary devices of function instantiation), so one wrapper is made and shared.
CapuchinAllocator* SharedWrapper() {
  static std::once_flag once;
  std::call_once(once, [] {
    Allocator* base = ProcessState::singleton()->GetCPUAllocator(port::kNUMANoAffinity);
    g_installed.store(new CapuchinAllocator(base));  // lives as long as the devices: the whole process
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
    for (int i = 0; i < n; i++) {
      const std::string name = strings::StrCat(name_prefix, "/device:CPU:", i);
      devices->push_back(
          std::make_unique<ThreadPoolDevice>(options, name, Bytes(256 << 20), DeviceLocality(), allocator));
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

void* CapuchinAllocator::AllocateRaw(size_t alignment, size_t num_bytes) {
  return AllocateRaw(alignment, num_bytes, AllocationAttributes());
}

void* CapuchinAllocator::AllocateRaw(size_t alignment, size_t num_bytes, const AllocationAttributes& attr) {
  void* ptr = nullptr;
  if (HostStore::Global()->passive()) {
    // Passive mode (the paper's on-demand eviction): try without the allocator's own wait-and-retry; on failure
    // evict pooled tensors that nobody else holds, and try again while eviction frees something.
    AllocationAttributes no_retry(false, attr.allocation_will_be_logged, attr.freed_by_func);
    ptr = base_->AllocateRaw(alignment, num_bytes, no_retry);
    while (ptr == nullptr && HostStore::Global()->EvictFor(static_cast<int64_t>(num_bytes)) > 0) {
      ptr = base_->AllocateRaw(alignment, num_bytes, no_retry);
    }
  }
  if (ptr == nullptr) ptr = base_->AllocateRaw(alignment, num_bytes, attr);
  if (ptr != nullptr) allocations_.fetch_add(1, std::memory_order_relaxed);
  return ptr;
}

void CapuchinAllocator::DeallocateRaw(void* ptr) {
  deallocations_.fetch_add(1, std::memory_order_relaxed);
  base_->DeallocateRaw(ptr);
}

}  // namespace capuchin
}  // namespace tensorflow
