// The host store: swapped-out tensors kept in host memory, outside TensorFlow's device allocator.
//
// A handle names one swapped tensor. Its residency follows the paper's states:
//
//   SwapOut:   (device tensor) --SWAPPING_OUT--> OUT            (device buffer dropped when the copy is done)
//   Prefetch:  OUT --SWAPPING_IN--> IN                          (device buffer allocated by the device allocator)
//   SwapIn:    IN -> consumed (the tensor is handed to the op's consumers and the handle is erased)
//
// Copies run on two worker threads, one per direction, so that they overlap compute and serialize per direction the
// way a GPU's two copy engines do. An optional link emulation makes each copy of N bytes take N / bandwidth seconds.
// The store keeps the handles, their statuses, the copies and the statistics; it delegates the host buffers to a
// HostBufferPool (host_buffer_pool.h), the choice of what passive mode evicts to a TensorPool (tensor_pool.h) and its
// debug output to a StoreTrace (store_trace.h).
//
// Every buffer is released on every path: when consumed, when the step that created the handle ends with the handle
// unused (the last copy of its handle is gone: see HandleGuard in swap_kernels.cc), or on ReleaseHandle /
// ReleaseAll.

#ifndef CAPUCHIN_TF_CC_KERNELS_HOST_STORE_H_
#define CAPUCHIN_TF_CC_KERNELS_HOST_STORE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "host_buffer_pool.h"
#include "host_store_stats.h"
#include "store_entry.h"
#include "store_trace.h"
#include "tensor_pool.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tensorflow {
namespace capuchin {

// What a stall waited for. The numbers are those the DrainStalls op returns; Python reads them as
// capuchin_tf.core.stalls.StallKind (tests/pure/test_stalls.py checks that the two lists agree).
enum StallKind : int32_t {
  kPassiveEviction = 0,  // passive mode evicted pooled tensors to make room for an allocation
  kEvictedGet = 1,       // a Get brought back a tensor passive mode had evicted
  kLatePrefetch = 2,     // a SwapIn waited for its prefetch's copy
  kEarlyPrefetch = 3,    // a prefetched tensor was evicted again before its SwapIn (guided execution's safety net)
  kCopyWait = 4,         // an allocation waited for a copy in flight to free device memory (passive mode)
  kDeviceMove = 5,       // passive mode moved pooled tensors inside the device to make a free run (MoveFor)
};

// A time interval the step spent waiting on the host store (removed from the ideal timeline).
struct Stall {
  int64_t start_ns = 0;  // CLOCK_MONOTONIC
  int64_t end_ns = 0;
  int64_t bytes = 0;
  int32_t kind = kPassiveEviction;  // a StallKind
  std::string name;                 // the tensor (every kind but kPassiveEviction, kCopyWait and kDeviceMove)
};

// Where passive mode can move a tensor inside the device instead of evicting it over the link: the allocator
// wrapper, which knows the device's memory. Reserve keeps the free chunks of [begin, end) in `chunks` that are at
// least `min_bytes` large from being allocated; AllocateMoved makes a device tensor that lies outside [begin, end) (an
// uninitialized one when there is no room for it there, or the memory budget has none); Release frees what Reserve
// took. Called by one thread at a time (the one allocation that evicts).
class DeviceMover {
 public:
  virtual ~DeviceMover() = default;
  virtual void Reserve(uint64_t begin, uint64_t end, const std::vector<ChunkSpan>& chunks, int64_t min_bytes) = 0;
  virtual Tensor AllocateMoved(DataType dtype, const TensorShape& shape) = 0;
  virtual void Release() = 0;
};

class HostStore {
 public:
  using SwapInCallback = capuchin::SwapInCallback;
  using ChunkSpan = capuchin::ChunkSpan;

  // The process-wide store (never destroyed: its worker threads live as long as the process).
  static HostStore* Global();

  // Registers `tensor` and queues its copy to host memory. Returns the new handle.
  absl::StatusOr<int64_t> SwapOut(const Tensor& tensor, const std::string& name);

  // Queues the swap-in of `handle` into memory from `device_allocator`. No-op when already coming back or back.
  absl::Status Prefetch(int64_t handle, Allocator* device_allocator);

  // Delivers the tensor of `handle` to `done` (at once when it is back, otherwise from the copy worker when it
  // arrives, starting an on-demand swap-in when no prefetch was started) and consumes the handle.
  // `expected_dtype` and `expected_shape` (if fully defined) are checked against what was stored.
  void SwapIn(int64_t handle, Allocator* device_allocator, DataType expected_dtype,
              const PartialTensorShape& expected_shape, SwapInCallback done);

  // The tensor pool (passive mode). Hold registers a device tensor (status IN) that Get returns without consuming
  // the handle; EvictFor, called by the allocator wrapper when an allocation fails, copies pooled tensors that
  // nobody else references to host memory (synchronously) and drops their device buffers.
  int64_t Hold(const Tensor& tensor, const std::string& name);
  // `allocate` makes the device tensor an evicted entry comes back into (the Get kernel's own allocate_temp, so
  // that the allocation is attributed to the Get op in the profiler's memory events).
  using AllocateFn = std::function<absl::Status(DataType, const TensorShape&, Tensor*)>;
  // `last`: no other Get of this handle is left (the caller holds the only reference to the handle): the tensor is
  // handed over and the entry erased, so the pool no longer shares its buffer.
  absl::Status Get(int64_t handle, const AllocateFn& allocate, DataType expected_dtype, bool last, Tensor* out);
  // Traces only: a process-wide sequence number ordering allocations and hand-overs.
  static int64_t TraceSeq() { return capuchin::TraceSeq(); }
  // The device bytes of the tensors the store holds, by whether another holder shares them: `shared`, an op that
  // runs or waits to run (not evictable), `idle`, only the store (evictable).
  struct DeviceBytes {
    int64_t shared = 0;
    int64_t idle = 0;
  };
  DeviceBytes ResidentDeviceBytes();
  // `chunks`: the device's memory map in address order, when the allocator can tell (the simulated device's BFC);
  // `contiguous` false: any `bytes_needed` bytes will do. TensorPool::Choose (tensor_pool.h) says what is evicted.
  int64_t EvictFor(int64_t bytes_needed, const std::vector<ChunkSpan>* chunks = nullptr, bool contiguous = true);
  // Before EvictFor, when the allocation failed for want of one free run (not of bytes): the tensors of the window
  // EvictFor would choose for `bytes_needed` are moved to device memory outside it (`mover`), copied at memory speed
  // instead of over the link, and stay on the device. A tensor is moved only when nobody but the store holds it and it
  // is not on its way to or from host memory; one the mover finds no room for stays (EvictFor then takes it). Returns
  // the bytes moved: 0 without a map or a window, or when nothing in it could be moved.
  int64_t MoveFor(int64_t bytes_needed, const std::vector<ChunkSpan>* chunks, DeviceMover* mover);
  // Copies in flight free device memory when they finish (a swap-out) or make an evictable tensor (a prefetch).
  // CopyGeneration: -1 when no copy is pending, else a number that changes each time one finishes; WaitForCopy
  // waits until it changed or the deadline (CLOCK_MONOTONIC ns) passed, and says whether it changed.
  int64_t CopyGeneration();
  bool WaitForCopy(int64_t generation, int64_t deadline_ns);
  void SetPassive(bool enabled) { passive_.store(enabled); }
  bool passive() const { return passive_.load(); }
  std::vector<Stall> DrainStalls();

  // -1 when the handle is unknown or consumed.
  int32_t Status(int64_t handle);

  // Drops a handle without consuming it. False if unknown or already consumed.
  bool Release(int64_t handle);
  // Drops every handle and frees the host buffers kept for reuse.
  int64_t ReleaseAll();

  void SetLinkBandwidth(double device_to_host_bps, double host_to_device_bps);
  HostStoreCounters Counters();
  void ResetCounters();

 private:
  using Entry = StoreEntry;

  HostStore();
  static std::shared_ptr<Entry> NewEntry(const Tensor& tensor, const std::string& name, Residency state, bool pooled);
  void Register(const std::shared_ptr<Entry>& e);  // mu_ held: gives the entry its handle
  void RunOutWorker();
  void RunInWorker();
  void EnqueueSwapIn(const std::shared_ptr<Entry>& e, Allocator* device_allocator);  // mu_ held
  void FreeHostBuffer(Entry* e);                                                     // mu_ held
  // mu_ held: copies an entry EvictFor chose to host memory and moves its device buffer to `drop` (`queued`: a
  // swap-out still waiting for the copy worker). False when host memory ran out (the entry stays as it was).
  bool Evict(const std::shared_ptr<Entry>& e, bool queued, int64_t start_ns, std::vector<Tensor>* drop);
  void SleepForLink(double bps, int64_t bytes, int64_t start_ns);
  void Erase(int64_t handle);    // mu_ held
  void CopyDone();               // mu_ held: a copy finished
  void LogWait(const Entry& e);  // mu_ held: a SwapIn waited from e.wait_start_ns until now

  std::mutex mu_;
  std::condition_variable out_cv_, in_cv_;
  std::condition_variable copy_cv_;  // a copy finished (copies_done_ changed)
  int64_t copies_done_ = 0;
  std::condition_variable get_cv_;  // a Get that found its entry being brought back by another Get waits here
  EntryMap entries_;
  std::deque<std::shared_ptr<Entry>> out_queue_, in_queue_;
  int64_t next_handle_ = 1;
  double out_bps_ = 0.0, in_bps_ = 0.0;
  HostStoreCounters counters_;
  std::thread out_thread_, in_thread_;
  std::atomic<bool> passive_{false};
  std::vector<Stall> stalls_;
  HostBufferPool host_buffers_;
  TensorPool pool_;                          // mu_ held
  const std::unique_ptr<StoreTrace> trace_;  // mu_ held
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_HOST_STORE_H_
