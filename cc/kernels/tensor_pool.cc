#include "tensor_pool.h"

#include <algorithm>
#include <functional>

namespace tensorflow {
namespace capuchin {
namespace {

// The cheapest window of `chunks` (address order) made only of free chunks and chunks at an `evictable` address,
// contiguous in memory, whose sizes add up to `need`: its evictable addresses. Empty when there is none, or
// when the cheapest needs no eviction (a free chunk that large exists: another thread freed it meanwhile). Windows
// ending at each chunk are shrunk from the left while still large enough; costs are non-negative, so that is the
// cheapest window ending there. `*begin` and `*end`: the window's address range, when one is returned.
std::vector<uint64_t> CheapestWindow(const std::vector<ChunkSpan>& chunks,
                                     const std::function<bool(uint64_t)>& evictable, int64_t need, uint64_t* begin,
                                     uint64_t* end) {
  std::vector<uint64_t> best;
  int64_t best_cost = -1;
  size_t i = 0;
  int64_t sum = 0, cost = 0;
  auto cost_of = [&](const ChunkSpan& c) -> int64_t {
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
      *begin = chunks[i].address;
      *end = chunks[j].address + static_cast<uint64_t>(chunks[j].size);
      for (size_t k = i; k <= j; k++) {
        if (chunks[k].in_use) best.push_back(chunks[k].address);
      }
    }
  }
  if (best_cost <= 0) {
    best.clear();
    *begin = *end = 0;
  }
  return best;
}

}  // namespace

EvictionChoice TensorPool::Choose(const EntryMap& entries, const std::deque<std::shared_ptr<StoreEntry>>& out_queue,
                                  int64_t bytes_needed, const std::vector<ChunkSpan>* chunks, bool contiguous) {
  EvictionChoice choice;
  std::vector<std::shared_ptr<StoreEntry>>& evictable = choice.evictable;
  std::vector<std::shared_ptr<StoreEntry>>& chosen = choice.chosen;
  int64_t& freed = choice.freed;
  std::unordered_set<const StoreEntry*>& queued = choice.queued;
  std::unordered_map<uint64_t, std::shared_ptr<StoreEntry>>& entry_at = choice.entry_at;
  // The paper scans the access list from its start for tensors of about the needed size: first the oldest
  // evictable tensor at least as large as the need (and at most twice it), else the oldest ones until enough.
  std::deque<int64_t> kept;
  for (int64_t h : hold_order_) {
    auto it = entries.find(h);
    if (it == entries.end()) continue;  // released: forget it
    kept.push_back(h);
    StoreEntry* e = it->second.get();
    if (e->state == Residency::kIn && e->bytes > 0 && e->device.RefCountIsOne()) evictable.push_back(it->second);
  }
  hold_order_.swap(kept);
  // Guided execution: tensors a prefetch brought back that their SwapIn has not claimed yet (prefetched too early
  // for the memory there is). Evicted, their SwapIn swaps them in on demand. Most recently prefetched first: the
  // one needed last.
  std::vector<std::shared_ptr<StoreEntry>> prefetched;
  for (const auto& kv : entries) {
    StoreEntry* e = kv.second.get();
    if (!e->pooled && e->state == Residency::kIn && !e->waiter && !e->released && e->bytes > 0 &&
        e->device.IsInitialized() && e->device.RefCountIsOne()) {
      prefetched.push_back(kv.second);
    }
  }
  std::sort(
      prefetched.begin(), prefetched.end(),
      [](const std::shared_ptr<StoreEntry>& a, const std::shared_ptr<StoreEntry>& b) { return a->handle > b->handle; });
  evictable.insert(evictable.end(), prefetched.begin(), prefetched.end());
  // Guided execution: swap-outs still queued behind the copy worker. Their device buffers stay until their turn
  // on the emulated link comes (28.7 MiB of the transformer's swap-only plan take 160 ms on a p100 link, most of
  // its forward pass), so the memory the plan freed on paper is still in use when the head allocates, and nothing
  // else near it may be evictable (seen: 20 MiB refused with 30 MiB in queued 1 MiB and 256 KiB swap-outs).
  // Evicted here, they are copied at once, like a pooled tensor, and leave the queue.
  for (const auto& e : out_queue) {
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
    evictable.erase(std::remove_if(evictable.begin(), evictable.end(),
                                   [&starts](const std::shared_ptr<StoreEntry>& e) {
                                     return starts.count(e->device_address()) == 0;
                                   }),
                    evictable.end());
  }
  // Where each evictable tensor's buffer starts (taken before anything is evicted).
  for (const auto& e : evictable) entry_at[e->device_address()] = e;
  if (chunks != nullptr && contiguous) {
    // BFC rounds every request up to a multiple of 256 bytes.
    const int64_t need = (bytes_needed + 255) / 256 * 256;
    const auto is_evictable = [&entry_at](uint64_t a) { return entry_at.count(a) > 0; };
    for (uint64_t a : CheapestWindow(*chunks, is_evictable, need, &choice.window_begin, &choice.window_end)) {
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
  return choice;
}

}  // namespace capuchin
}  // namespace tensorflow
