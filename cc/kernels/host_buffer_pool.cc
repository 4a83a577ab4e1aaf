#include "host_buffer_pool.h"

#include "tensorflow/core/platform/mem.h"

namespace tensorflow {
namespace capuchin {
namespace {

constexpr size_t kHostAlignment = 64;

}  // namespace

void* HostBufferPool::Allocate(int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = buffers_.find(bytes);
    if (it != buffers_.end()) {
      void* buffer = it->second;
      buffers_.erase(it);
      bytes_ -= bytes;
      return buffer;
    }
  }
  return port::AlignedMalloc(bytes, kHostAlignment);
}

void HostBufferPool::Recycle(void* buffer, int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes_ + bytes <= cap_bytes_) {
      buffers_.emplace(bytes, buffer);
      bytes_ += bytes;
      return;
    }
  }
  port::AlignedFree(buffer);
}

void HostBufferPool::Trim() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& kv : buffers_) port::AlignedFree(kv.second);
  buffers_.clear();
  bytes_ = 0;
}

int64_t HostBufferPool::bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

}  // namespace capuchin
}  // namespace tensorflow
