// Host buffers of the host store, pooled by size: a training step swaps the same sizes every iteration, and reusing
// a buffer avoids the page faults of fresh memory, which otherwise halve the copy speed. The pool keeps at most
// `cap_bytes` of freed buffers ($CAPUCHIN_TF_HOST_POOL_MB, config.h). Thread-safe.

#ifndef CAPUCHIN_TF_CC_KERNELS_HOST_BUFFER_POOL_H_
#define CAPUCHIN_TF_CC_KERNELS_HOST_BUFFER_POOL_H_

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace tensorflow {
namespace capuchin {

class HostBufferPool {
 public:
  explicit HostBufferPool(int64_t cap_bytes) : cap_bytes_(cap_bytes) {}

  // A buffer of `bytes` (a pooled one of that size if there is one), or nullptr when host memory ran out.
  void* Allocate(int64_t bytes);
  // Gives back a buffer of `bytes` from Allocate: kept for reuse while the pool has room, else freed.
  void Recycle(void* buffer, int64_t bytes);
  // Frees every pooled buffer.
  void Trim();
  // The bytes of the pooled buffers.
  int64_t bytes();

 private:
  std::mutex mu_;
  std::unordered_multimap<int64_t, void*> buffers_;
  int64_t bytes_ = 0;
  const int64_t cap_bytes_;
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_HOST_BUFFER_POOL_H_
