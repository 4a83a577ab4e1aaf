#include "host_store.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <unordered_set>
#include <utility>

#include "config.h"
#include "tensorflow/core/framework/types.h"

namespace tensorflow {
namespace capuchin {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::shared_ptr<HostStore::Entry> HostStore::NewEntry(const Tensor& tensor, const std::string& name, Residency state,
                                                      bool pooled) {
  auto e = std::make_shared<Entry>();
  e->name = name;
  e->dtype = tensor.dtype();
  e->shape = tensor.shape();
  e->bytes = static_cast<int64_t>(tensor.TotalBytes());
  e->device = tensor;
  e->state = state;
  e->pooled = pooled;
  return e;
}

void HostStore::Register(const std::shared_ptr<Entry>& e) {
  e->handle = next_handle_++;
  entries_.emplace(e->handle, e);
  counters_.live_handles++;
}

HostStore* HostStore::Global() {
  // Leaked on purpose: the copy workers run for the life of the process, and a static destructor racing with them
  // at exit would be worse than the OS reclaiming the memory.
  static HostStore* store = new HostStore();
  return store;
}

HostStore::HostStore() : host_buffers_(Config::Get().host_pool_bytes), trace_(StoreTrace::FromConfig(Config::Get())) {
  out_thread_ = std::thread([this] { RunOutWorker(); });
  in_thread_ = std::thread([this] { RunInWorker(); });
}

absl::StatusOr<int64_t> HostStore::SwapOut(const Tensor& tensor, const std::string& name) {
  if (!DataTypeCanUseMemcpy(tensor.dtype())) {
    return errors::InvalidArgument("Capuchin>SwapOut cannot swap tensor '", name, "' of type ",
                                   DataTypeString(tensor.dtype()), ": only plain numeric and bool types can be copied");
  }
  std::shared_ptr<Entry> e = NewEntry(tensor, name, Residency::kSwappingOut, /*pooled=*/false);
  std::lock_guard<std::mutex> lock(mu_);
  Register(e);
  out_queue_.push_back(e);
  counters_.pending_copies++;
  out_cv_.notify_one();
  return e->handle;
}

void HostStore::EnqueueSwapIn(const std::shared_ptr<Entry>& e, Allocator* device_allocator) {
  e->state = Residency::kSwappingIn;
  e->in_allocator = device_allocator;
  e->prefetch_requested = false;
  in_queue_.push_back(e);
  counters_.pending_copies++;
  in_cv_.notify_one();
}

absl::Status HostStore::Prefetch(int64_t handle, Allocator* device_allocator) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(handle);
  if (it == entries_.end()) {
    return errors::InvalidArgument("Capuchin>Prefetch: unknown or already consumed handle ", handle);
  }
  Entry* e = it->second.get();
  if (e->state == Residency::kOut) {
    EnqueueSwapIn(it->second, device_allocator);
  } else if (e->state == Residency::kSwappingOut) {
    e->prefetch_requested = true;
    e->in_allocator = device_allocator;
  }
  return absl::OkStatus();
}

void HostStore::SwapIn(int64_t handle, Allocator* device_allocator, DataType expected_dtype,
                       const PartialTensorShape& expected_shape, SwapInCallback done) {
  Tensor ready;
  absl::Status error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(handle);
    if (it == entries_.end()) {
      error = errors::InvalidArgument("Capuchin>SwapIn: unknown or already consumed handle ", handle);
    } else {
      Entry* e = it->second.get();
      if (e->pooled) {
        error = errors::InvalidArgument("Capuchin>SwapIn: handle ", handle, " ('", e->name,
                                        "') is a pool handle (Capuchin>Hold): read it with Capuchin>Get");
      } else if (e->waiter) {
        error = errors::InvalidArgument("Capuchin>SwapIn: handle ", handle, " ('", e->name,
                                        "') is already being consumed by another SwapIn");
      } else if (e->dtype != expected_dtype) {
        error = errors::InvalidArgument("Capuchin>SwapIn: handle ", handle, " ('", e->name, "') holds ",
                                        DataTypeString(e->dtype), ", not ", DataTypeString(expected_dtype));
      } else if (expected_shape.IsFullyDefined() && !expected_shape.IsIdenticalTo(e->shape)) {
        error = errors::InvalidArgument("Capuchin>SwapIn: handle ", handle, " ('", e->name, "') holds shape ",
                                        e->shape.DebugString(), ", not ", expected_shape.DebugString());
      } else {
        bool deliver_now = false;
        switch (e->state) {
          case Residency::kIn:  // prefetched in time (or never left because host memory ran out)
            ready = std::move(e->device);
            trace_->Handed(ready, e->name, "swap_in");
            deliver_now = true;
            break;
          case Residency::kSwappingIn:
            counters_.late_prefetches++;
            break;
          case Residency::kSwappingOut:
            if (e->prefetch_requested) {
              counters_.late_prefetches++;
            } else {
              counters_.demand_swap_ins++;
              e->prefetch_requested = true;
              e->in_allocator = device_allocator;
            }
            break;
          case Residency::kOut:
            counters_.demand_swap_ins++;
            EnqueueSwapIn(it->second, device_allocator);
            break;
        }
        if (deliver_now) {
          Erase(handle);  // may destroy the entry: `e` is not used after this
        } else {
          // Not back yet: the copy worker delivers it to `done`.
          e->waiter = std::move(done);
          e->wait_start_ns = NowNs();
          return;
        }
      }
    }
  }
  done(error, ready);
}

int64_t HostStore::Hold(const Tensor& tensor, const std::string& name) {
  std::shared_ptr<Entry> e = NewEntry(tensor, name, Residency::kIn, /*pooled=*/true);
  std::lock_guard<std::mutex> lock(mu_);
  Register(e);
  pool_.Add(e->handle);
  return e->handle;
}

absl::Status HostStore::Get(int64_t handle, const AllocateFn& allocate, DataType expected_dtype, bool last,
                            Tensor* out) {
  std::shared_ptr<Entry> e;
  double in_bps = 0.0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = entries_.find(handle);
    if (it == entries_.end() || !it->second->pooled) {
      return errors::InvalidArgument("Capuchin>Get: unknown or released pool handle ", handle);
    }
    e = it->second;
    if (e->dtype != expected_dtype) {
      return errors::InvalidArgument("Capuchin>Get: handle ", handle, " ('", e->name, "') holds ",
                                     DataTypeString(e->dtype), ", not ", DataTypeString(expected_dtype));
    }
    // Another Get (another reader of the same tensor, on another inter-op thread) is bringing it back: wait for it.
    // Going on would copy from the host buffer that Get frees when it is done.
    get_cv_.wait(lock, [&e] { return e->state != Residency::kSwappingIn; });
    if (e->state == Residency::kIn) {
      if (last) {
        // The last reader takes the buffer: with no reference left in the pool, the reader can reuse it for its
        // output (TensorFlow's in-place forwarding), as it would have without the pool.
        *out = std::move(e->device);
        trace_->Handed(*out, e->name, "get");
        Erase(handle);
      } else {
        *out = e->device;
      }
      return absl::OkStatus();
    }
    e->state = Residency::kSwappingIn;  // claimed: eviction skips it, a concurrent Get waits above
    in_bps = in_bps_;
  }
  // Evicted: bring it back synchronously (the paper's access failure). Allocate outside the lock: the allocation
  // may itself evict other pooled tensors.
  const int64_t start = NowNs();
  Tensor tensor;
  const absl::Status allocated = allocate(e->dtype, e->shape, &tensor);
  if (!allocated.ok() || (e->bytes > 0 && !tensor.IsInitialized())) {
    std::lock_guard<std::mutex> lock(mu_);
    e->state = Residency::kOut;
    counters_.failed_swap_ins++;
    get_cv_.notify_all();
    return errors::ResourceExhausted("Capuchin>Get: OOM when allocating ", e->bytes, " bytes to bring back '", e->name,
                                     "': ", allocated.message());
  }
  if (e->bytes > 0) std::memcpy(const_cast<char*>(tensor.tensor_data().data()), e->host, e->bytes);
  SleepForLink(in_bps, e->bytes, start);  // on an emulated link, the on-demand copy takes its time as a prefetch's does
  std::lock_guard<std::mutex> lock(mu_);
  FreeHostBuffer(e.get());
  if (last) {
    trace_->Handed(tensor, e->name, "get");
    Erase(handle);  // as above: the reader owns the only reference
  } else {
    e->device = tensor;
  }
  e->state = Residency::kIn;
  get_cv_.notify_all();
  counters_.passive_swap_ins++;
  counters_.swap_ins++;
  counters_.bytes_in += e->bytes;
  stalls_.push_back(Stall{start, NowNs(), e->bytes, kEvictedGet, e->name});
  *out = std::move(tensor);
  return absl::OkStatus();
}

void HostStore::LogWait(const Entry& e) {
  const int64_t now = NowNs();
  counters_.wait_ns += now - e.wait_start_ns;
  stalls_.push_back(Stall{e.wait_start_ns, now, e.bytes, kLatePrefetch, e.name});
}

int64_t HostStore::EvictFor(int64_t bytes_needed, const std::vector<ChunkSpan>* chunks, bool contiguous) {
  const int64_t start = NowNs();
  std::vector<Tensor> drop;
  int64_t freed = 0;
  double out_bps = 0.0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const EvictionChoice choice = pool_.Choose(entries_, out_queue_, bytes_needed, chunks, contiguous);
    freed = choice.freed;
    for (const auto& e : choice.chosen) {
      if (!Evict(e, choice.queued.count(e.get()) > 0, start, &drop)) freed -= e->bytes;
    }
    out_bps = out_bps_;
    trace_->Evicted(bytes_needed, choice, freed, chunks, entries_, counters_.pending_copies);
  }
  if (freed > 0) {
    // On an emulated link the on-demand copies take their time, as a planned swap-out's does (out of the lock: the
    // copy workers go on meanwhile); the device buffers are freed when the copies are done.
    SleepForLink(out_bps, freed, start);
    std::lock_guard<std::mutex> lock(mu_);
    stalls_.push_back(Stall{start, NowNs(), freed, kPassiveEviction, ""});
  }
  drop.clear();  // frees the device buffers, outside the lock
  return freed;
}

int64_t HostStore::MoveFor(int64_t bytes_needed, const std::vector<ChunkSpan>* chunks, DeviceMover* mover) {
  if (chunks == nullptr || mover == nullptr) return 0;
  const int64_t start = NowNs();
  std::vector<Tensor> drop;
  int64_t moved = 0;
  bool reserved = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const EvictionChoice choice = pool_.Choose(entries_, out_queue_, bytes_needed, chunks, /*contiguous=*/true);
    if (choice.window_end == 0) return 0;
    std::vector<std::shared_ptr<Entry>> movable;
    int64_t min_bytes = std::numeric_limits<int64_t>::max();
    for (const auto& e : choice.chosen) {
      // Not a swap-out still queued (its copy worker reads the buffer) nor a swap-in under way.
      if (e->state != Residency::kIn || e->released || e->bytes <= 0 || !e->device.IsInitialized() ||
          !e->device.RefCountIsOne() || !DataTypeCanUseMemcpy(e->dtype)) {
        continue;
      }
      movable.push_back(e);
      min_bytes = std::min(min_bytes, e->bytes);
    }
    if (movable.empty()) return 0;
    // The largest first: they have the fewest places to go.
    std::stable_sort(
        movable.begin(), movable.end(),
        [](const std::shared_ptr<Entry>& a, const std::shared_ptr<Entry>& b) { return a->bytes > b->bytes; });
    mover->Reserve(choice.window_begin, choice.window_end, *chunks, min_bytes);
    reserved = true;
    for (const auto& e : movable) {
      Tensor target = mover->AllocateMoved(e->dtype, e->shape);
      if (!target.IsInitialized() || target.TotalBytes() != static_cast<size_t>(e->bytes)) continue;
      std::memcpy(const_cast<char*>(target.tensor_data().data()), e->device.tensor_data().data(), e->bytes);
      drop.push_back(std::move(e->device));
      e->device = std::move(target);
      moved += e->bytes;
      counters_.device_moves++;
      counters_.device_moved_bytes += e->bytes;
    }
    trace_->Moved(bytes_needed, choice.window_begin - chunks->front().address, choice.window_end - choice.window_begin,
                  static_cast<int64_t>(movable.size()), moved);
  }
  drop.clear();                    // frees the window's buffers, outside the lock
  if (reserved) mover->Release();  // then what Reserve took: the window's memory is one free chunk again
  if (moved > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    stalls_.push_back(Stall{start, NowNs(), moved, kDeviceMove, ""});
  }
  return moved;
}

bool HostStore::Evict(const std::shared_ptr<Entry>& e, bool queued, int64_t start_ns, std::vector<Tensor>* drop) {
  void* buffer = host_buffers_.Allocate(e->bytes);
  if (buffer == nullptr) return false;
  std::memcpy(buffer, e->device.tensor_data().data(), e->bytes);
  e->host = buffer;
  counters_.host_bytes += e->bytes;
  counters_.peak_host_bytes = std::max(counters_.peak_host_bytes, counters_.host_bytes);
  counters_.swap_outs++;
  counters_.bytes_out += e->bytes;
  counters_.passive_evictions++;
  counters_.passive_evicted_bytes += e->bytes;
  drop->push_back(std::move(e->device));
  e->device = Tensor();
  e->state = Residency::kOut;
  if (queued) {
    // Out of the copy worker's queue. A prefetch already asked for stays asked: the swap-in is queued now and
    // waits for its turn on the link (its allocation may evict again).
    out_queue_.erase(std::find(out_queue_.begin(), out_queue_.end(), e));
    CopyDone();
    counters_.expedited_swap_outs++;
    if (e->prefetch_requested) EnqueueSwapIn(e, e->in_allocator);
    return true;
  }
  e->prefetch_requested = false;
  if (!e->pooled) {
    counters_.guided_evictions++;
    stalls_.push_back(Stall{start_ns, NowNs(), e->bytes, kEarlyPrefetch, e->name});
  }
  return true;
}

HostStore::DeviceBytes HostStore::ResidentDeviceBytes() {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceBytes out;
  std::unordered_set<const void*> seen;  // a buffer two entries hold (a tensor and a view of it) counts once
  for (const auto& kv : entries_) {
    const Entry* e = kv.second.get();
    if (!e->device.IsInitialized() || e->bytes <= 0) continue;
    if (!seen.insert(e->device.tensor_data().data()).second) continue;
    (e->device.RefCountIsOne() ? out.idle : out.shared) += e->bytes;
  }
  return out;
}

std::vector<Stall> HostStore::DrainStalls() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Stall> out;
  out.swap(stalls_);
  return out;
}

int32_t HostStore::Status(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(handle);
  return it == entries_.end() ? -1 : static_cast<int32_t>(it->second->state);
}

bool HostStore::Release(int64_t handle) {
  Tensor drop;
  SwapInCallback waiter;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(handle);
    if (it == entries_.end()) return false;
    Entry* e = it->second.get();
    switch (e->state) {
      case Residency::kIn:
        drop = std::move(e->device);
        break;
      case Residency::kOut:
        FreeHostBuffer(e);
        break;
      case Residency::kSwappingOut:
      case Residency::kSwappingIn:
        e->released = true;  // the worker owns the buffers until its copy is done
        break;
    }
    waiter = std::move(e->waiter);
    if (!e->pooled) counters_.released_unconsumed++;  // a pool handle ends this way normally
    Erase(handle);
  }
  if (waiter)
    waiter(errors::Cancelled("Capuchin: handle ", handle, " was released before it was swapped in"), Tensor());
  return true;
}

int64_t HostStore::ReleaseAll() {
  std::vector<int64_t> handles;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& kv : entries_) handles.push_back(kv.first);
  }
  int64_t n = 0;
  for (int64_t h : handles) n += Release(h) ? 1 : 0;
  host_buffers_.Trim();
  return n;
}

void HostStore::Erase(int64_t handle) {
  if (entries_.erase(handle)) counters_.live_handles--;
}

void HostStore::FreeHostBuffer(Entry* e) {
  if (e->host != nullptr) {
    host_buffers_.Recycle(e->host, e->bytes);
    e->host = nullptr;
    counters_.host_bytes -= e->bytes;
  }
}

void HostStore::SleepForLink(double bps, int64_t bytes, int64_t start_ns) {
  if (bps <= 0.0 || bytes <= 0) return;
  const int64_t target_ns = start_ns + static_cast<int64_t>(static_cast<double>(bytes) / bps * 1e9);
  std::this_thread::sleep_until(std::chrono::steady_clock::time_point(std::chrono::nanoseconds(target_ns)));
}

void HostStore::RunOutWorker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    out_cv_.wait(lock, [this] { return !out_queue_.empty(); });
    std::shared_ptr<Entry> e = std::move(out_queue_.front());
    out_queue_.pop_front();
    if (e->released) {  // dropped before its copy started
      Tensor drop = std::move(e->device);
      lock.unlock();
      drop = Tensor();
      lock.lock();
      CopyDone();
      continue;
    }
    Tensor source = e->device;
    const double bps = out_bps_;
    lock.unlock();

    const int64_t start = NowNs();
    void* buffer = nullptr;
    bool host_ok = true;
    if (e->bytes > 0) {
      buffer = host_buffers_.Allocate(e->bytes);
      host_ok = buffer != nullptr;
      if (host_ok) std::memcpy(buffer, source.tensor_data().data(), e->bytes);
    }
    if (host_ok) SleepForLink(bps, e->bytes, start);
    source = Tensor();

    lock.lock();
    Tensor drop;
    if (!host_ok) {
      // Host memory ran out: the tensor simply stays on the device (status IN); SwapIn hands it back unchanged.
      LOG(WARNING) << "capuchin_tf: host allocation of " << e->bytes << " bytes failed; tensor '" << e->name
                   << "' stays on the device";
      e->state = Residency::kIn;
      if (e->released) drop = std::move(e->device);
    } else {
      e->host = buffer;
      counters_.host_bytes += e->bytes;
      counters_.peak_host_bytes = std::max(counters_.peak_host_bytes, counters_.host_bytes);
      counters_.swap_outs++;
      counters_.bytes_out += e->bytes;
      drop = std::move(e->device);
      e->state = Residency::kOut;
      if (e->released) {
        FreeHostBuffer(e.get());
      } else if (e->prefetch_requested) {
        EnqueueSwapIn(e, e->in_allocator);
      }
    }
    SwapInCallback waiter;
    Tensor deliver;
    if (e->state == Residency::kIn && e->waiter) {  // a SwapIn was waiting and the tensor never left
      waiter = std::move(e->waiter);
      deliver = std::move(drop);
      LogWait(*e);
      Erase(e->handle);
    }
    lock.unlock();
    drop = Tensor();  // frees the device buffer outside the lock
    if (waiter) waiter(absl::OkStatus(), deliver);
    deliver = Tensor();
    lock.lock();
    CopyDone();
  }
}

void HostStore::RunInWorker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    in_cv_.wait(lock, [this] { return !in_queue_.empty(); });
    std::shared_ptr<Entry> e = std::move(in_queue_.front());
    in_queue_.pop_front();
    if (e->released) {
      FreeHostBuffer(e.get());
      CopyDone();
      continue;
    }
    Allocator* allocator = e->in_allocator;
    const double bps = in_bps_;
    const void* host = e->host;
    lock.unlock();

    const int64_t start = NowNs();
    absl::Status status;
    Tensor tensor;
    if (e->bytes > 0) {
      tensor = Tensor(allocator, e->dtype, e->shape);
      if (!tensor.IsInitialized()) {
        status = errors::ResourceExhausted("Capuchin>SwapIn: OOM when allocating ", e->bytes,
                                           " bytes to bring back tensor '", e->name, "' (shape ",
                                           e->shape.DebugString(), ") with allocator ", allocator->Name());
        tensor = Tensor();
      } else {
        std::memcpy(const_cast<char*>(tensor.tensor_data().data()), host, e->bytes);
        SleepForLink(bps, e->bytes, start);
      }
    } else {
      tensor = Tensor(e->dtype, e->shape);
    }

    lock.lock();
    Tensor drop;
    SwapInCallback waiter;
    Tensor deliver;
    if (status.ok()) {
      FreeHostBuffer(e.get());
      counters_.swap_ins++;
      counters_.bytes_in += e->bytes;
      e->state = Residency::kIn;
      if (e->released) {
        drop = std::move(tensor);
      } else if (e->waiter) {
        waiter = std::move(e->waiter);
        deliver = std::move(tensor);
        LogWait(*e);
        Erase(e->handle);
      } else {
        e->device = std::move(tensor);
      }
    } else {
      counters_.failed_swap_ins++;
      e->state = Residency::kOut;  // still on the host: a later SwapIn can try again
      if (e->released) FreeHostBuffer(e.get());
      if (e->waiter) {
        waiter = std::move(e->waiter);
        LogWait(*e);
      }
    }
    lock.unlock();
    drop = Tensor();
    if (waiter) waiter(status, deliver);
    deliver = Tensor();
    lock.lock();
    CopyDone();
  }
}

void HostStore::CopyDone() {
  counters_.pending_copies--;
  copies_done_++;
  copy_cv_.notify_all();
}

int64_t HostStore::CopyGeneration() {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_.pending_copies == 0 ? -1 : copies_done_;
}

bool HostStore::WaitForCopy(int64_t generation, int64_t deadline_ns) {
  const int64_t start = NowNs();
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::time_point(std::chrono::nanoseconds(deadline_ns));
  const bool done = copy_cv_.wait_until(lock, deadline, [&] { return copies_done_ != generation; });
  stalls_.push_back(Stall{start, NowNs(), 0, kCopyWait, ""});
  return done;
}

void HostStore::SetLinkBandwidth(double device_to_host_bps, double host_to_device_bps) {
  std::lock_guard<std::mutex> lock(mu_);
  out_bps_ = device_to_host_bps;
  in_bps_ = host_to_device_bps;
}

HostStoreCounters HostStore::Counters() {
  std::lock_guard<std::mutex> lock(mu_);
  HostStoreCounters c = counters_;
  c.pool_bytes = host_buffers_.bytes();
  return c;
}

void HostStore::ResetCounters() {
  std::lock_guard<std::mutex> lock(mu_);
  HostStoreCounters fresh;
  fresh.host_bytes = counters_.host_bytes;
  fresh.peak_host_bytes = counters_.host_bytes;
  fresh.live_handles = counters_.live_handles;
  fresh.pending_copies = counters_.pending_copies;
  counters_ = fresh;
}

}  // namespace capuchin
}  // namespace tensorflow
