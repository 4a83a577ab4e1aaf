#include "config.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "tensorflow/core/platform/logging.h"

namespace tensorflow {
namespace capuchin {
namespace {

// The simulated device's size in bytes, or 0 when it is not configured.
int64_t SimulatedDeviceBytes() {
  const char* use_bfc = std::getenv("TF_CPU_ALLOCATOR_USE_BFC");
  const char* limit_mb = std::getenv("TF_CPU_BFC_MEM_LIMIT_IN_MB");
  if (use_bfc == nullptr || std::string(use_bfc) != "true" || limit_mb == nullptr) return 0;
  return std::max<int64_t>(0, std::atoll(limit_mb)) << 20;
}

double FragmentationFraction(int64_t limit_bytes) {
  const char* env = std::getenv("CAPUCHIN_TF_BFC_FRAGMENTATION_FRACTION");
  if (env != nullptr) {
    char* end = nullptr;
    const double f = std::strtod(env, &end);
    if (end != env && f >= 0.0 && f <= 1.0) return f;
    LOG(WARNING) << "capuchin: ignoring CAPUCHIN_TF_BFC_FRAGMENTATION_FRACTION=" << env << " (expected 0..1)";
  }
  // BFC truncates fraction x limit to whole bytes: 256.5 bytes' worth gives 256 (0 would split off empty chunks).
  return limit_bytes > 0 ? 256.5 / static_cast<double>(limit_bytes) : 1.0 / 128;
}

// The small pool's size until capuchin_tf sizes it from a step's graph (CapuchinAllocator::SizeSmallPool), or the
// user's. What a step allocates in the small pool at most, measured: 0.1-0.4 MiB on the quick tier, 0.5 MiB on
// ResNet50 at batch 32, 1.5-3 MiB on MobileNets and EfficientNets at batch 32 (docs/decisions.md).
size_t SmallPoolBytes(int64_t device_bytes, bool* fixed) {
  const char* env = std::getenv("CAPUCHIN_TF_SMALL_POOL_MB");
  if (env != nullptr) {
    char* end = nullptr;
    const double mb = std::strtod(env, &end);
    if (end != env && mb >= 0.0 && mb * (1 << 20) <= static_cast<double>(device_bytes) / 4) {
      *fixed = true;
      return static_cast<size_t>(mb * (1 << 20)) / 256 * 256;
    }
    LOG(WARNING) << "capuchin: ignoring CAPUCHIN_TF_SMALL_POOL_MB=" << env
                 << " (expected 0 to a quarter of the device)";
  }
  return static_cast<size_t>(std::clamp<int64_t>(device_bytes / 128, int64_t{1} << 20, int64_t{8} << 20));
}

}  // namespace

Config Config::FromEnvironment() {
  Config c;
  c.simulated_device_bytes = SimulatedDeviceBytes();
  c.bfc_fragmentation_fraction = FragmentationFraction(c.simulated_device_bytes);
  c.small_pool_bytes = c.simulated_device_bytes > 0 ? SmallPoolBytes(c.simulated_device_bytes, &c.small_pool_fixed) : 0;
  if (const char* env = std::getenv("CAPUCHIN_TF_HOST_POOL_MB")) {
    c.host_pool_bytes = std::max<int64_t>(0, std::atoll(env)) << 20;
  }
  c.trace_evict = std::getenv("CAPUCHIN_TF_TRACE_EVICT") != nullptr;
  c.debug_evict = std::getenv("CAPUCHIN_TF_DEBUG_EVICT") != nullptr;
  c.device_moves = std::getenv("CAPUCHIN_TF_DEVICE_MOVES") != nullptr;
  return c;
}

const Config& Config::Get() {
  static const Config config = FromEnvironment();
  return config;
}

}  // namespace capuchin
}  // namespace tensorflow
