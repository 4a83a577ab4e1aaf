#include "step_layout.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace tensorflow {
namespace capuchin {
namespace {

constexpr int64_t kGranule = 256;  // BFC's rounding, and the region's alignment of every offset
// A step with more recorded allocations than this is not laid out (the packing is quadratic in them).
constexpr size_t kMaxLaidOut = 50000;
// A step with more than this, or whose allocations live beside each other in more than kMaxPairs pairs, is packed in
// one order only, each allocation checked against every one placed before (StepLayout::Layout packs up to ten ways,
// each allocation checked against its own neighbours, kept as lists: 16 bytes a pair).
constexpr size_t kMaxSearched = 20000;
constexpr size_t kMaxPairs = size_t{4} << 20;

int64_t Rounded(int64_t bytes) { return (bytes + kGranule - 1) / kGranule * kGranule; }

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int64_t StepLayout::Begin(int64_t id, bool record_only) {
  std::lock_guard<std::mutex> lock(mu_);
  record_only_ = record_only;
  stats_.steps++;
  stats_.step_misses = 0;
  stats_.attached_bytes = 0;
  step_evictions_ = 0;
  generation_++;
  if (id != layout_id_) SwitchTo(id);
  inherit_from_ = -1;  // (InheritNext is for the next function that begins, only)
  step_id_ = id;
  clock_ = 0;
  begin_ns_ = SteadyNs();
  seen_.clear();
  records_.clear();
  recorded_ptr_.clear();
  ticket_planned_.clear();
  evicted_.clear();
  active_.store(true, std::memory_order_release);
  if (layout_bytes_ <= 0 || record_only) return 0;
  if (region_ != nullptr) {
    // An earlier step's region, something in it still live: this step uses it if it is large enough.
    if (region_bytes_ >= layout_bytes_) {
      stats_.region_steps++;
      stats_.attached_bytes = region_bytes_;
    }
    return 0;
  }
  return layout_bytes_;
}

void StepLayout::InheritNext(int64_t from) {
  std::lock_guard<std::mutex> lock(mu_);
  inherit_from_ = from;
}

void StepLayout::SwitchTo(int64_t id) {
  if (layout_bytes_ > 0 || held_.bytes > 0) {
    if (kept_.size() >= kKeptLayouts) kept_.pop_front();
    kept_.push_back(KeptLayout{layout_id_, std::move(offsets_), layout_bytes_, layout_held_, std::move(held_)});
  }
  offsets_.clear();
  layout_bytes_ = 0;
  layout_held_ = false;
  held_ = HeldLayout();
  layout_id_ = id;
  const int64_t from = inherit_from_;
  inherit_from_ = -1;
  for (auto it = kept_.begin(); it != kept_.end(); ++it) {
    if (it->id != id) continue;
    offsets_ = std::move(it->offsets);
    layout_bytes_ = it->bytes;
    layout_held_ = it->held;
    held_ = std::move(it->previous);
    kept_.erase(it);
    break;
  }
  if (layout_bytes_ <= 0 && from >= 0) {
    for (const KeptLayout& kept : kept_) {
      if (kept.id != from) continue;
      offsets_ = kept.offsets;
      layout_bytes_ = kept.bytes;
      break;
    }
  }
  stats_.region_bytes = layout_bytes_;
  stats_.planned = static_cast<int64_t>(offsets_.size());
}

int64_t StepLayout::SinceBegin() const { return SteadyNs() - begin_ns_; }

int64_t StepLayout::Previous() {
  std::lock_guard<std::mutex> lock(mu_);
  if (layout_held_ || held_.bytes <= 0 || held_.bytes >= layout_bytes_ || !active() || record_only_) return 0;
  offsets_ = held_.offsets;
  layout_bytes_ = held_.bytes;
  layout_held_ = true;
  stats_.region_bytes = layout_bytes_;
  stats_.planned = static_cast<int64_t>(offsets_.size());
  stats_.previous++;
  return layout_bytes_;
}

void StepLayout::Attach(void* region, int64_t bytes) {
  if (region == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  region_ = region;
  region_bytes_ = bytes;
  live_.clear();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(region);
  region_end_.store(begin + static_cast<uintptr_t>(bytes), std::memory_order_release);
  region_begin_.store(begin, std::memory_order_release);
  stats_.region_steps++;
  stats_.attached_bytes = bytes;
  if (!layout_held_) {  // its first region: kept, for Previous
    held_.offsets = offsets_;
    held_.bytes = layout_bytes_;
    layout_held_ = true;
  }
}

std::string StepLayout::KeyOf(std::string_view op, int64_t bytes) {
  std::string key(op);
  key += '#';
  key += std::to_string(bytes);
  const int64_t nth = seen_[key]++;
  key += '#';
  key += std::to_string(nth);
  return key;
}

void* StepLayout::PlaceAt(int64_t offset, int64_t bytes) {
  if (region_ == nullptr || offset < 0 || offset + bytes > region_bytes_) return nullptr;
  // Live allocations are disjoint and ordered: the last one starting before our end is the only one that can reach
  // into [offset, offset + bytes).
  auto it = live_.lower_bound(offset + bytes);
  if (it != live_.begin()) {
    --it;
    if (it->first + it->second.first > offset) return nullptr;
  }
  return static_cast<char*>(region_) + offset;
}

int64_t StepLayout::BestGap(int64_t bytes) const {
  if (region_ == nullptr) return -1;
  int64_t best = -1, best_size = std::numeric_limits<int64_t>::max(), prev = 0;
  auto consider = [&](int64_t begin, int64_t end) {
    if (end - begin >= bytes && end - begin < best_size) {
      best = begin;
      best_size = end - begin;
    }
  };
  for (const auto& kv : live_) {
    consider(prev, kv.first);
    prev = kv.first + kv.second.first;
  }
  consider(prev, region_bytes_);
  return best;
}

void* StepLayout::Take(int64_t offset, int64_t bytes, int64_t requested, int64_t index) {
  void* p = PlaceAt(offset, bytes);
  if (p == nullptr) return nullptr;
  live_[offset] = {bytes, requested};
  if (index >= 0) {
    recorded_ptr_[reinterpret_cast<uintptr_t>(p)] = index;
    records_[index].in_region = true;
  }
  return p;
}

void* StepLayout::Allocate(std::string_view op, int64_t bytes, int64_t* ticket, bool* planned) {
  *ticket = -1;
  *planned = false;
  if (bytes <= min_bytes_ || !active()) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (!active()) return nullptr;
  const int64_t rounded = Rounded(bytes);
  static constexpr std::string_view kGet = "capuchin/get/";
  auto back = evicted_.find(rounded);
  if (op.substr(0, kGet.size()) == kGet && back != evicted_.end() && !back->second.empty()) {
    // A Get bringing back a tensor passive mode evicted: the evicted tensor's record goes on, and its place is its.
    const int64_t index = back->second.front();
    back->second.pop_front();
    *ticket = (generation_ << 32) | index;
    *planned = ticket_planned_[index];
    auto at = offsets_.find(records_[index].key);
    if (!*planned || region_ == nullptr || at == offsets_.end()) return nullptr;
    void* p = Take(at->second, rounded, bytes, index);
    if (p == nullptr) {
      const int64_t gap = BestGap(rounded);
      p = gap < 0 ? nullptr : Take(gap, rounded, bytes, index);
    }
    return p;
  }
  const int64_t index = static_cast<int64_t>(records_.size());
  Record r;
  r.key = KeyOf(op, rounded);
  r.bytes = rounded;
  r.requested = bytes;
  r.alloc_t = clock_++;
  r.alloc_ns = SinceBegin();
  auto it = offsets_.find(r.key);
  *planned = !record_only_ && it != offsets_.end();
  records_.push_back(std::move(r));
  ticket_planned_.push_back(*planned);
  *ticket = (generation_ << 32) | index;
  if (!*planned || region_ == nullptr) return nullptr;
  void* p = Take(it->second, rounded, bytes, index);
  if (p != nullptr) {
    stats_.placed++;
    return p;
  }
  // Its place is taken (an allocation lives longer or came earlier than in the step the layout was made from): the
  // smallest free gap of the region that holds it.
  const int64_t gap = BestGap(rounded);
  p = gap < 0 ? nullptr : Take(gap, rounded, bytes, index);
  if (p != nullptr) {
    stats_.misses++;
    stats_.step_misses++;
  }
  return p;
}

void* StepLayout::Retry(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t index = ticket & 0xffffffff;
  if (ticket < 0 || (ticket >> 32) != generation_ || index >= static_cast<int64_t>(records_.size())) return nullptr;
  const int64_t gap = BestGap(records_[index].bytes);
  void* p = gap < 0 ? nullptr : Take(gap, records_[index].bytes, records_[index].requested, index);
  if (p != nullptr) {
    stats_.misses++;
    stats_.step_misses++;
  }
  return p;
}

void StepLayout::Bind(int64_t ticket, void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t index = ticket & 0xffffffff;
  if (ticket < 0 || (ticket >> 32) != generation_ || index >= static_cast<int64_t>(records_.size())) return;
  if (ticket_planned_[index]) {
    stats_.fallbacks++;
    stats_.step_misses++;
  }
  if (ptr == nullptr) {
    records_[index].free_t = kFailed;  // never allocated: not laid out
    return;
  }
  // Its lifetime starts now, not when it was asked for: passive mode may have evicted tensors for it meanwhile, and
  // those must not count as live beside it. (A tensor brought back goes on with the lifetime it started with.)
  if (records_[index].evict_t < 0) {
    records_[index].alloc_t = clock_++;
    records_[index].alloc_ns = SinceBegin();
  }
  recorded_ptr_[reinterpret_cast<uintptr_t>(ptr)] = index;
}

bool StepLayout::Free(void* ptr, void** release, bool evicted) {
  *release = nullptr;
  const bool in_region = InRegion(ptr);
  if (!in_region && !active()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  auto r = recorded_ptr_.find(p);
  if (r != recorded_ptr_.end()) {
    Record& rec = records_[r->second];
    if (evicted) {
      step_evictions_++;
      rec.evict_t = clock_++;
      evicted_[rec.bytes].push_back(r->second);
    } else {
      rec.free_t = clock_++;
      rec.free_ns = SinceBegin();
    }
    recorded_ptr_.erase(r);
  }
  if (region_ == nullptr) return false;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(region_);
  if (p < begin || p >= begin + static_cast<uintptr_t>(region_bytes_)) return false;
  live_.erase(static_cast<int64_t>(p - begin));
  *release = MaybeRelease();
  return true;
}

size_t StepLayout::SizeOf(const void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  if (region_ == nullptr) return 0;
  auto it = live_.find(static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr) - reinterpret_cast<uintptr_t>(region_)));
  return it == live_.end() ? 0 : static_cast<size_t>(it->second.second);
}

void* StepLayout::MaybeRelease() {
  if (active() || region_ == nullptr || !live_.empty()) return nullptr;
  void* region = region_;
  region_begin_.store(0, std::memory_order_release);
  region_end_.store(0, std::memory_order_release);
  region_ = nullptr;
  region_bytes_ = 0;
  return region;
}

void* StepLayout::End(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  active_.store(false, std::memory_order_release);
  for (const auto& kv : evicted_) {
    for (int64_t i : kv.second) records_[i].free_t = records_[i].evict_t;  // evicted, not brought back in the step
  }
  if (!ok) {
    // A step that failed (out of memory) says nothing reliable of the lifetimes: the next step records afresh.
    offsets_.clear();
    layout_bytes_ = 0;
    stats_.region_bytes = 0;
    stats_.planned = 0;
  } else if (!record_only_ && step_id_ == layout_id_ && (layout_bytes_ == 0 || LayoutWanting())) {
    Layout();
  }
  recorded_ptr_.clear();
  last_records_ = std::move(records_);
  records_.clear();
  return MaybeRelease();
}

bool StepLayout::LayoutWanting() const {
  if (step_evictions_ > 0) return true;
  for (const Record& r : records_) {
    if (r.free_t >= 0 && !r.in_region) return true;  // laid out next time, and went to the device allocator
  }
  return false;
}

std::vector<StepLayout::RecordedAllocation> StepLayout::LastRecord() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RecordedAllocation> out;
  out.reserve(last_records_.size());
  for (const Record& r : last_records_) {
    out.push_back(RecordedAllocation{r.key, r.bytes, r.alloc_t, r.free_t, r.alloc_ns, r.free_ns});
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const RecordedAllocation& a, const RecordedAllocation& b) { return a.alloc_t < b.alloc_t; });
  return out;
}

void StepLayout::Layout() {
  std::vector<const Record*> items;
  for (const Record& r : records_) {
    if (r.free_t >= 0) items.push_back(&r);
  }
  offsets_.clear();
  layout_bytes_ = 0;
  stats_.layouts++;
  if (items.empty() || items.size() > kMaxLaidOut) {
    stats_.planned = 0;
    stats_.region_bytes = 0;
    return;
  }
  const size_t n = items.size();
  // The most the laid-out allocations hold at once (events are numbered 0 .. clock_ - 1): no packing is smaller.
  std::vector<int64_t> level(static_cast<size_t>(clock_) + 1, 0);
  for (const Record* r : items) {
    level[r->alloc_t] += r->bytes;
    level[r->free_t] -= r->bytes;
  }
  int64_t live_peak = 0;
  for (size_t t = 0; t < level.size(); t++) {
    if (t > 0) level[t] += level[t - 1];
    live_peak = std::max(live_peak, level[t]);
  }
  // Which allocations are live at the same time as which (a sweep in allocation order), so that each packing looks
  // at an allocation's own neighbours only; counted first, kept when there are not too many pairs.
  std::vector<size_t> by_alloc(n);
  for (size_t i = 0; i < n; i++) by_alloc[i] = i;
  std::sort(by_alloc.begin(), by_alloc.end(),
            [&](size_t a, size_t b) { return items[a]->alloc_t < items[b]->alloc_t; });
  auto sweep = [&](auto pair) {
    std::vector<size_t> live;
    for (const size_t i : by_alloc) {
      live.erase(
          std::remove_if(live.begin(), live.end(), [&](size_t j) { return items[j]->free_t <= items[i]->alloc_t; }),
          live.end());
      for (const size_t j : live) pair(i, j);
      live.push_back(i);
    }
  };
  size_t pairs = 0;
  sweep([&](size_t, size_t) { pairs++; });
  const bool search = n <= kMaxSearched && pairs <= kMaxPairs;
  std::vector<std::vector<size_t>> beside(search ? n : 0);
  if (search) {
    sweep([&](size_t i, size_t j) {
      beside[i].push_back(j);
      beside[j].push_back(i);
    });
  }
  // Orders the greedy packs in (the first is the layout's until one of the others packs smaller): greedy by size
  // (TensorFlow Lite's), by lifetime, by breadth (the most bytes live at once during the allocation's lifetime), by
  // breadth then lifetime, by area (size x lifetime). On the steps measured (docs/decisions.md, "Planned layout: the
  // smallest of several packings") no one order was the smallest on every step: by size packed the cnn's step into
  // 128 MiB where its allocations hold 107 MiB at once, by lifetime into 107.
  auto life = [&](size_t i) { return items[i]->free_t - items[i]->alloc_t; };
  auto bytes = [&](size_t i) { return items[i]->bytes; };
  auto by = [&](auto key) {
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; i++) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) > key(b); });
    return order;
  };
  using Key = std::tuple<int64_t, int64_t, int64_t>;
  std::vector<std::vector<size_t>> orders;
  orders.push_back(by([&](size_t i) { return Key{bytes(i), -items[i]->alloc_t, 0}; }));
  if (search) {
    // (the breadth: the level's most over [alloc_t, free_t), from a sparse table of its maxima over runs of 2^k)
    std::vector<std::vector<int64_t>> most{level};
    for (size_t k = 1; (size_t{1} << k) <= level.size(); k++) {
      const std::vector<int64_t>& half = most.back();
      std::vector<int64_t> row(level.size() - (size_t{1} << k) + 1);
      for (size_t t = 0; t < row.size(); t++) row[t] = std::max(half[t], half[t + (size_t{1} << (k - 1))]);
      most.push_back(std::move(row));
    }
    std::vector<int64_t> breadth(n, 0);
    for (size_t i = 0; i < n; i++) {
      const size_t a = static_cast<size_t>(items[i]->alloc_t), b = static_cast<size_t>(items[i]->free_t);
      if (b <= a) continue;
      size_t k = 0;
      while ((size_t{2} << k) <= b - a) k++;
      breadth[i] = std::max(most[k][a], most[k][b - (size_t{1} << k)]);
    }
    orders.push_back(by([&](size_t i) { return Key{life(i), bytes(i), -items[i]->alloc_t}; }));
    orders.push_back(by([&](size_t i) { return Key{breadth[i], bytes(i), -items[i]->alloc_t}; }));
    orders.push_back(by([&](size_t i) { return Key{breadth[i], life(i), bytes(i)}; }));
    orders.push_back(by([&](size_t i) { return Key{bytes(i) * life(i), -items[i]->alloc_t, 0}; }));
  }
  std::vector<int64_t> offsets(n), best;
  int64_t top = std::numeric_limits<int64_t>::max();
  for (const auto& order : orders) {
    for (const bool best_fit : {true, false}) {
      const int64_t packed = Pack(items, search ? &beside : nullptr, order, best_fit, &offsets);
      if (packed < top) {
        top = packed;
        best = offsets;
      }
      if (top <= live_peak) break;  // nothing packs smaller
    }
    if (top <= live_peak) break;
  }
  for (size_t i = 0; i < n; i++) offsets_[items[i]->key] = best[i];
  layout_bytes_ = top;
  layout_held_ = false;
  stats_.planned = static_cast<int64_t>(n);
  stats_.region_bytes = top;
}

int64_t StepLayout::Pack(const std::vector<const Record*>& items, const std::vector<std::vector<size_t>>* beside,
                         const std::vector<size_t>& order, bool best_fit, std::vector<int64_t>* offsets) {
  std::vector<bool> placed(items.size(), false);
  std::vector<size_t> done;  // without `beside`: every allocation placed so far is checked
  std::vector<std::pair<int64_t, int64_t>> overlapping;
  int64_t top = 0;
  for (const size_t i : order) {
    const Record& r = *items[i];
    overlapping.clear();
    if (beside != nullptr) {
      for (const size_t j : (*beside)[i]) {
        if (placed[j]) overlapping.push_back({(*offsets)[j], items[j]->bytes});
      }
    } else {
      for (const size_t j : done) {
        if (items[j]->alloc_t < r.free_t && r.alloc_t < items[j]->free_t) {
          overlapping.push_back({(*offsets)[j], items[j]->bytes});
        }
      }
      done.push_back(i);
    }
    std::sort(overlapping.begin(), overlapping.end());
    // The smallest gap between the allocations live at the same time that holds it (best fit), or the lowest (first
    // fit); else above them all.
    int64_t pick = -1, pick_size = std::numeric_limits<int64_t>::max(), prev = 0;
    for (const auto& o : overlapping) {
      const int64_t gap = o.first - prev;
      if (gap >= r.bytes && gap < pick_size) {
        pick = prev;
        pick_size = gap;
        if (!best_fit) break;
      }
      prev = std::max(prev, o.first + o.second);
    }
    (*offsets)[i] = pick >= 0 ? pick : prev;
    placed[i] = true;
    top = std::max(top, (*offsets)[i] + r.bytes);
  }
  return top;
}

std::vector<ChunkSpan> StepLayout::ChunkMap() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ChunkSpan> chunks;
  if (region_ == nullptr) return chunks;
  const uint64_t base = reinterpret_cast<uint64_t>(region_);
  int64_t prev = 0;
  for (const auto& kv : live_) {
    if (kv.first > prev) chunks.push_back(ChunkSpan{base + prev, kv.first - prev, false, "", 0});
    chunks.push_back(ChunkSpan{base + kv.first, kv.second.first, true, "", 0});
    prev = kv.first + kv.second.first;
  }
  if (region_bytes_ > prev) chunks.push_back(ChunkSpan{base + prev, region_bytes_ - prev, false, "", 0});
  return chunks;
}

StepLayout::Stats StepLayout::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace capuchin
}  // namespace tensorflow
