#include "host_store.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_set>
#include <utility>

#include "config.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/mem.h"

namespace tensorflow {
namespace capuchin {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

constexpr size_t kHostAlignment = 64;

}  // namespace

struct HostStore::Entry {
  int64_t handle = 0;
  std::string name;
  DataType dtype = DT_INVALID;
  TensorShape shape;
  int64_t bytes = 0;
  Residency state = Residency::kSwappingOut;
  Tensor device;                      // the device tensor while IN, or the copy's source while SWAPPING_OUT
  void* host = nullptr;               // the host copy while OUT or SWAPPING_IN
  bool released = false;              // dropped while a copy was in flight: the worker frees what is left
  bool prefetch_requested = false;    // a swap-in is wanted as soon as the swap-out finishes
  Allocator* in_allocator = nullptr;  // the device allocator the swap-in allocates from
  SwapInCallback waiter;              // the SwapIn that claimed this handle and waits for it
  int64_t wait_start_ns = 0;
  bool pooled = false;  // made by Hold: read by Get, evictable by passive mode
};

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

HostStore::HostStore() : trace_(Config::Get().trace_evict) {
  pool_cap_bytes_ = Config::Get().host_pool_bytes;
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
            NoteHanded(ready, e->name, "swap_in");
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
  hold_order_.push_back(e->handle);
  return e->handle;
}

absl::Status HostStore::Get(int64_t handle, const AllocateFn& allocate, DataType expected_dtype, bool last,
                            Tensor* out) {
  std::shared_ptr<Entry> e;
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
        NoteHanded(*out, e->name, "get");
        Erase(handle);
      } else {
        *out = e->device;
      }
      return absl::OkStatus();
    }
    e->state = Residency::kSwappingIn;  // claimed: eviction skips it, a concurrent Get waits above
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
  std::lock_guard<std::mutex> lock(mu_);
  FreeHostBuffer(e.get());
  if (last) {
    NoteHanded(tensor, e->name, "get");
    Erase(handle);  // as above: the reader owns the only reference
  } else {
    e->device = tensor;
  }
  e->state = Residency::kIn;
  get_cv_.notify_all();
  counters_.passive_swap_ins++;
  counters_.swap_ins++;
  counters_.bytes_in += e->bytes;
  stalls_.push_back(Stall{start, NowNs(), e->bytes, 1, e->name});
  *out = std::move(tensor);
  return absl::OkStatus();
}

void HostStore::LogWait(const Entry& e) {
  const int64_t now = NowNs();
  counters_.wait_ns += now - e.wait_start_ns;
  stalls_.push_back(Stall{e.wait_start_ns, now, e.bytes, 2, e.name});
}

namespace {

// The cheapest window of `chunks` (address order) made only of free chunks and chunks at an `evictable` address,
// contiguous in memory, whose sizes add up to `need`: its evictable addresses. Empty when there is none, or
// when the cheapest needs no eviction (a free chunk that large exists: another thread freed it meanwhile). Windows
// ending at each chunk are shrunk from the left while still large enough; costs are non-negative, so that is the
// cheapest window ending there.
std::vector<uint64_t> CheapestWindow(const std::vector<HostStore::ChunkSpan>& chunks,
                                     const std::function<bool(uint64_t)>& evictable, int64_t need) {
  std::vector<uint64_t> best;
  int64_t best_cost = -1;
  size_t i = 0;
  int64_t sum = 0, cost = 0;
  auto cost_of = [&](const HostStore::ChunkSpan& c) -> int64_t {
    if (!c.in_use) return 0;
    return evictable(c.address) ? c.size : -1;
  };
  for (size_t j = 0; j < chunks.size(); j++) {
    const int64_t cj = cost_of(chunks[j]);
    const bool contiguous =
        j > 0 && i < j && chunks[j - 1].address + static_cast<uint64_t>(chunks[j - 1].size) == chunks[j].address;
    if (cj < 0 || !contiguous) {  // an in-use chunk nobody can evict, or a region boundary: start afresh
      i = cj < 0 ? j + 1 : j;
      sum = cj < 0 ? 0 : chunks[j].size;
      cost = cj < 0 ? 0 : cj;
    } else {
      sum += chunks[j].size;
      cost += cj;
    }
    if (cj < 0) continue;
    while (i < j && sum - chunks[i].size >= need) {
      sum -= chunks[i].size;
      cost -= cost_of(chunks[i]);
      i++;
    }
    if (sum >= need && (best_cost < 0 || cost < best_cost)) {
      best_cost = cost;
      best.clear();
      for (size_t k = i; k <= j; k++) {
        if (chunks[k].in_use) best.push_back(chunks[k].address);
      }
    }
  }
  if (best_cost <= 0) best.clear();
  return best;
}

}  // namespace

int64_t HostStore::EvictFor(int64_t bytes_needed, const std::vector<ChunkSpan>* chunks, bool contiguous) {
  const int64_t start = NowNs();
  std::vector<std::shared_ptr<Entry>> chosen;
  std::vector<Tensor> drop;
  int64_t freed = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The paper scans the access list from its start for tensors of about the needed size: first the oldest
    // evictable tensor at least as large as the need (and at most twice it), else the oldest ones until enough.
    std::vector<std::shared_ptr<Entry>> evictable;
    std::deque<int64_t> kept;
    for (int64_t h : hold_order_) {
      auto it = entries_.find(h);
      if (it == entries_.end()) continue;  // released: forget it
      kept.push_back(h);
      Entry* e = it->second.get();
      if (e->state == Residency::kIn && e->bytes > 0 && e->device.RefCountIsOne()) evictable.push_back(it->second);
    }
    hold_order_.swap(kept);
    // Guided execution: tensors a prefetch brought back that their SwapIn has not claimed yet (prefetched too early
    // for the memory there is). Evicted, their SwapIn swaps them in on demand. Most recently prefetched first: the
    // one needed last.
    std::vector<std::shared_ptr<Entry>> prefetched;
    for (const auto& kv : entries_) {
      Entry* e = kv.second.get();
      if (!e->pooled && e->state == Residency::kIn && !e->waiter && !e->released && e->bytes > 0 &&
          e->device.IsInitialized() && e->device.RefCountIsOne()) {
        prefetched.push_back(kv.second);
      }
    }
    std::sort(prefetched.begin(), prefetched.end(),
              [](const std::shared_ptr<Entry>& a, const std::shared_ptr<Entry>& b) { return a->handle > b->handle; });
    evictable.insert(evictable.end(), prefetched.begin(), prefetched.end());
    // Guided execution: swap-outs still queued behind the copy worker. Their device buffers stay until their turn
    // on the emulated link comes (28.7 MiB of the transformer's swap-only plan take 160 ms on a p100 link, most of
    // its forward pass), so the memory the plan freed on paper is still in use when the head allocates, and nothing
    // else near it may be evictable (seen: 20 MiB refused with 30 MiB in queued 1 MiB and 256 KiB swap-outs).
    // Evicted here, they are copied at once, like a pooled tensor, and leave the queue.
    std::unordered_set<const Entry*> queued;
    for (const auto& e : out_queue_) {
      if (!e->released && e->state == Residency::kSwappingOut && e->bytes > 0 && e->device.IsInitialized() &&
          e->device.RefCountIsOne()) {
        evictable.push_back(e);
        queued.insert(e.get());
      }
    }
    if (chunks != nullptr) {
      // A tensor whose buffer is not one of the map's chunks lives in the allocator wrapper's small-tensor pool:
      // evicting it frees nothing the failed allocation could use.
      std::unordered_set<uint64_t> starts;
      for (const auto& c : *chunks) starts.insert(c.address);
      evictable.erase(
          std::remove_if(evictable.begin(), evictable.end(),
                         [&starts](const std::shared_ptr<Entry>& e) {
                           return starts.count(reinterpret_cast<uint64_t>(e->device.tensor_data().data())) == 0;
                         }),
          evictable.end());
    }
    // Where each evictable tensor's buffer starts (taken before anything is evicted; the trace below names them).
    std::unordered_map<uint64_t, std::shared_ptr<Entry>> entry_at;
    for (const auto& e : evictable) entry_at[reinterpret_cast<uint64_t>(e->device.tensor_data().data())] = e;
    if (chunks != nullptr && contiguous) {
      // BFC rounds every request up to a multiple of 256 bytes.
      const int64_t need = (bytes_needed + 255) / 256 * 256;
      const auto is_evictable = [&entry_at](uint64_t a) { return entry_at.count(a) > 0; };
      for (uint64_t a : CheapestWindow(*chunks, is_evictable, need)) {
        chosen.push_back(entry_at[a]);
        freed += entry_at[a]->bytes;
      }
    }
    for (const auto& e : evictable) {
      if (!chosen.empty() || !contiguous) break;  // the window is chosen, or any bytes will do
      if (e->bytes >= bytes_needed && e->bytes <= 2 * bytes_needed) {
        chosen.push_back(e);
        freed = e->bytes;
      }
    }
    if (chosen.empty()) {  // no map, no window, or any bytes will do: the oldest ones until enough bytes
      for (const auto& e : evictable) {
        if (freed >= bytes_needed) break;
        chosen.push_back(e);
        freed += e->bytes;
      }
    }
    for (const auto& e : chosen) {
      void* buffer = AllocateHost(e->bytes);
      if (buffer == nullptr) {
        freed -= e->bytes;
        continue;
      }
      std::memcpy(buffer, e->device.tensor_data().data(), e->bytes);
      e->host = buffer;
      counters_.host_bytes += e->bytes;
      counters_.peak_host_bytes = std::max(counters_.peak_host_bytes, counters_.host_bytes);
      counters_.swap_outs++;
      counters_.bytes_out += e->bytes;
      counters_.passive_evictions++;
      counters_.passive_evicted_bytes += e->bytes;
      drop.push_back(std::move(e->device));
      e->device = Tensor();
      e->state = Residency::kOut;
      if (queued.count(e.get()) > 0) {
        // Out of the copy worker's queue. A prefetch already asked for stays asked: the swap-in is queued now and
        // waits for its turn on the link (its allocation may evict again).
        out_queue_.erase(std::find(out_queue_.begin(), out_queue_.end(), e));
        CopyDone();
        counters_.expedited_swap_outs++;
        if (e->prefetch_requested) EnqueueSwapIn(e, e->in_allocator);
        continue;
      }
      e->prefetch_requested = false;
      if (!e->pooled) {
        counters_.guided_evictions++;
        stalls_.push_back(Stall{start, NowNs(), e->bytes, 3, e->name});
      }
    }
    if (freed > 0) stalls_.push_back(Stall{start, NowNs(), freed, 0, ""});
    if (trace_) {
      std::string names;
      for (const auto& e : chosen) names += " " + e->name + "(" + std::to_string(e->bytes) + ")";
      std::string map;
      if (chunks != nullptr && !chunks->empty()) {
        // Every entry still on the device, evictable or not, named with its state (the ones not evictable show why).
        std::unordered_map<uint64_t, std::string> any_at;
        for (const auto& kv : entries_) {
          const Entry* e = kv.second.get();
          if (!e->device.IsInitialized() || e->bytes == 0) continue;
          any_at[reinterpret_cast<uint64_t>(e->device.tensor_data().data())] =
              "{" + std::string(e->pooled ? "pool" : "swap") + std::to_string(static_cast<int>(e->state)) +
              (e->device.RefCountIsOne() ? "" : ",shared") + (e->waiter ? ",claimed" : "") + "}" + e->name;
        }
        for (const auto& c : *chunks) {
          auto it = entry_at.find(c.address);
          auto any = any_at.find(c.address);
          map += " [" + std::to_string(c.address - chunks->front().address) + "+" + std::to_string(c.size) +
                 (c.in_use ? (it != entry_at.end()
                                  ? " " + it->second->name
                                  : (any != any_at.end() ? " used" + any->second
                                                         : " used(" + c.op + ")" + HandedAt(c.address, c.seq)))
                           : " free") +
                 "]";
        }
      }
      // Straight to stderr: a log line is cut at about 15,000 characters, and a map is often longer.
      const std::string line = "capuchin: EvictFor(" + std::to_string(bytes_needed) + ") evictable " +
                               std::to_string(evictable.size()) + " freed " + std::to_string(freed) + ":" + names +
                               (map.empty() ? "" : "; chunks:" + map) + "\n";
      std::fwrite(line.data(), 1, line.size(), stderr);
    }
    if (freed == 0 && Config::Get().debug_evict) {
      int64_t in = 0, in_shared = 0;
      for (const auto& kv : entries_) {
        const Entry* e = kv.second.get();
        if (!e->pooled || e->state != Residency::kIn) continue;
        in += e->bytes;
        if (!e->device.RefCountIsOne()) {
          in_shared += e->bytes;
          LOG(WARNING) << "capuchin: pooled in use " << e->name << " " << e->bytes;
        }
      }
      int64_t swapped_device = 0;  // device bytes of swap entries (not pooled) still on the device
      for (const auto& kv : entries_) {
        const Entry* e = kv.second.get();
        if (!e->pooled && e->device.IsInitialized()) swapped_device += e->bytes;
      }
      LOG(WARNING) << "capuchin: EvictFor(" << bytes_needed << ") freed nothing; pooled resident " << in
                   << " of which in use " << in_shared << "; swap entries on the device " << swapped_device
                   << "; copies pending " << counters_.pending_copies;
    }
  }
  drop.clear();  // frees the device buffers, outside the lock
  return freed;
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
  TrimPool();
  return n;
}

int64_t HostStore::TraceSeq() {
  static std::atomic<int64_t> seq{0};
  return ++seq;
}

std::string HostStore::HandedAt(uint64_t address, int64_t alloc_seq) const {
  auto it = handed_.find(address);
  // A hand-over before the chunk's allocation was of an earlier tensor at that address.
  return it == handed_.end() || it->second.second < alloc_seq ? "" : "<" + it->second.first + ">";
}

void HostStore::NoteHanded(const Tensor& tensor, const std::string& name, const char* how) {
  if (!trace_ || !tensor.IsInitialized() || tensor.TotalBytes() == 0) return;
  handed_[reinterpret_cast<uint64_t>(tensor.tensor_data().data())] = {std::string(how) + ":" + name, TraceSeq()};
}

void HostStore::Erase(int64_t handle) {
  if (entries_.erase(handle)) counters_.live_handles--;
}

void HostStore::FreeHostBuffer(Entry* e) {
  if (e->host != nullptr) {
    RecycleHost(e->host, e->bytes);
    e->host = nullptr;
    counters_.host_bytes -= e->bytes;
  }
}

void* HostStore::AllocateHost(int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    auto it = pool_.find(bytes);
    if (it != pool_.end()) {
      void* buffer = it->second;
      pool_.erase(it);
      pool_bytes_ -= bytes;
      return buffer;
    }
  }
  return port::AlignedMalloc(bytes, kHostAlignment);
}

void HostStore::RecycleHost(void* buffer, int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    if (pool_bytes_ + bytes <= pool_cap_bytes_) {
      pool_.emplace(bytes, buffer);
      pool_bytes_ += bytes;
      return;
    }
  }
  port::AlignedFree(buffer);
}

void HostStore::TrimPool() {
  std::lock_guard<std::mutex> lock(pool_mu_);
  for (auto& kv : pool_) port::AlignedFree(kv.second);
  pool_.clear();
  pool_bytes_ = 0;
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
      buffer = AllocateHost(e->bytes);
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
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::time_point(std::chrono::nanoseconds(deadline_ns));
  return copy_cv_.wait_until(lock, deadline, [&] { return copies_done_ != generation; });
}

void HostStore::SetLinkBandwidth(double device_to_host_bps, double host_to_device_bps) {
  std::lock_guard<std::mutex> lock(mu_);
  out_bps_ = device_to_host_bps;
  in_bps_ = host_to_device_bps;
}

HostStoreCounters HostStore::Counters() {
  std::lock_guard<std::mutex> lock(mu_);
  HostStoreCounters c = counters_;
  std::lock_guard<std::mutex> pool_lock(pool_mu_);
  c.pool_bytes = pool_bytes_;
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
