// A planned layout of a guided step's large allocations: where in one region of the device each of them goes, worked
// out from the allocations and frees of an earlier step of the same function (docs/decisions.md, "Planned layout").
//
// Why: a guided step runs the same function in the same pinned order every time, so its allocations repeat, with the
// same sizes from the same ops in the same order. Left to BFC's best fit, they split the free memory between
// long-lived activations, and at a device of the budget's size an allocation can find enough bytes free but no run
// large enough (seen: the transformer's 20 MiB logits gradient with more than 20 MiB free in runs of at most 14-17
// MiB); passive mode then evicts tensors over the link and brings them back on demand, most of a guided step's overhead
// on the p100 link. Knowing every allocation's lifetime beforehand, the placement can be solved offline, as XLA's and
// TensorFlow Lite's memory planners solve theirs: no two allocations that are live at once share bytes, and the region
// holds no more than the most the step keeps live at once plus what the packing leaves.
//
// How:
//   - Begin(id) starts a step of function `id`; every allocation of more than `min_bytes` until End() is recorded
//     under a key (the op that asks, its size, and how many allocations of that op and size came before in the step)
//     with its lifetime in allocation and free events.
//   - After a step that ran without a layout for `id`, or where the layout fell short (an allocation it lays out went
//     to the device allocator, or passive mode evicted: LayoutWanting), End(ok=true) lays out the allocations the step
//     freed before it ended (what lives on, an output or a new variable buffer, stays with the device allocator): one
//     at a time, each at the smallest gap (best fit) or the lowest (first fit) left by those already placed that are
//     live at the same time, in up to five orders (largest first as TensorFlow Lite's greedy by size, longest-lived,
//     broadest: most bytes live beside it, ...); the smallest packing is the layout (docs/decisions.md, "Planned
//     layout: the smallest of several packings"). A step whose allocations all stayed in the region keeps the layout,
//     misses included: a miss found another gap, and a layout made from that step's lifetimes can be larger than the
//     device can give (docs/decisions.md, "Planned layout: a layout that holds stays").
//   - A later step of `id` asks Begin for a region of the layout's size, which the allocator wrapper allocates from
//     the device and gives to Attach. An allocation whose key has an offset goes there when nothing live in the region
//     overlaps it; else into the smallest free gap of the region that holds it (a miss); else the wrapper's usual path.
//   - The region is given back when the step has ended and nothing in it is live any more.
//   - A step of another function sets the layout aside (up to kKeptLayouts of them) and takes that function's own:
//     two functions that take turns (two input signatures, two managed steps) keep a layout each. A function with no
//     layout yet may start from a copy of another's (InheritNext: the plan it replaces).
//
// Nothing is ever placed over a live allocation: a layout only chooses among free places. Every method is thread-safe.

#ifndef CAPUCHIN_TF_CC_KERNELS_STEP_LAYOUT_H_
#define CAPUCHIN_TF_CC_KERNELS_STEP_LAYOUT_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "store_entry.h"

namespace tensorflow {
namespace capuchin {

class StepLayout {
 public:
  // Every allocation of more than `min_bytes` is recorded and may be placed.
  explicit StepLayout(int64_t min_bytes) : min_bytes_(min_bytes) {}

  // Counters since the process started (LayoutStats reads them; the order is that op's output order).
  struct Stats {
    int64_t steps = 0;           // steps begun
    int64_t region_steps = 0;    // steps that ran with a region
    int64_t layouts = 0;         // layouts worked out
    int64_t placed = 0;          // allocations placed where the layout said
    int64_t misses = 0;          // allocations with an offset that went into another gap of the region
    int64_t fallbacks = 0;       // recorded allocations the region did not take (the device allocator's usual path)
    int64_t region_bytes = 0;    // the current layout's region size (0: none)
    int64_t planned = 0;         // allocations the current layout places
    int64_t step_misses = 0;     // misses + fallbacks of allocations with an offset, in the last step
    int64_t attached_bytes = 0;  // the region the last step ran with (0: none)
    int64_t previous = 0;        // steps that ran with the function's previous layout (Previous)
  };

  int64_t min_bytes() const { return min_bytes_; }
  // Allocations are recorded (between Begin and End).
  bool active() const { return active_.load(std::memory_order_acquire); }
  // `ptr` lies in the region (lock-free).
  bool InRegion(const void* ptr) const {
    const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    return p >= region_begin_.load(std::memory_order_acquire) && p < region_end_.load(std::memory_order_acquire);
  }

  // Starts a step of function `id` (a different id than the layout's drops the layout). Returns the size of the
  // region the step's layout needs, 0 when there is none or the region of an earlier step, still in use, holds it.
  // `record_only`: the step's allocations are recorded and none is placed (no region; the layout stays as it is).
  int64_t Begin(int64_t id, bool record_only = false);
  // The next Begin of a function that has no layout of its own starts from a copy of function `from`'s (a plan that
  // replaces another: mostly the same allocations, so its first step is placed rather than recorded on the device
  // allocator's placement; where it falls short, its own layout is made at its end).
  void InheritNext(int64_t from);
  // When the device had no room for the region Begin asked for: the size of this function's last layout that had its
  // region, now the layout again, if it is smaller than the one that found no room (0: none; nothing changes). A
  // layout made again from a step that fell short can need more than the device has in one run, where the layout it
  // replaces had its region in every step but that one.
  int64_t Previous();
  // The region Begin (or Previous) asked for (nullptr: the device had no room; the step then runs on the device
  // allocator alone).
  void Attach(void* region, int64_t bytes);
  // An allocation of `bytes` by `op`: its place in the region, or nullptr. `*ticket` >= 0 when the allocation is
  // recorded; pass it to Bind with the pointer the device allocator gave instead. `*planned`: the layout has an
  // offset for it (a miss or a fallback then counts).
  void* Allocate(std::string_view op, int64_t bytes, int64_t* ticket, bool* planned);
  // Tries again after the wrapper evicted tensors from the region: the smallest gap that holds the allocation.
  void* Retry(int64_t ticket);
  void Bind(int64_t ticket, void* ptr);
  // A deallocation: true when `ptr` was in the region (the device allocator must not see it); `*release` is then the
  // region itself when it is no longer needed (the wrapper gives it back to the device).
  // `evicted`: passive mode evicted the tensor to host memory (HostStore::EvictFor). Its record then stays open, and
  // the allocation that brings it back (a Capuchin>Get's of the same size, the earliest evicted first) continues it:
  // the layout gives the tensor one lifetime, as if it had stayed, so that a step that fits keeps it where it is.
  bool Free(void* ptr, void** release, bool evicted = false);
  // The requested size of an allocation in the region (0 if none).
  size_t SizeOf(const void* ptr);
  // Ends the step (`ok`: it completed). Returns the region to give back to the device, or nullptr.
  void* End(bool ok);
  // The region's map in address order (free gaps and live allocations), as HostStore::EvictFor reads BFC's.
  std::vector<ChunkSpan> ChunkMap();
  Stats stats();

  // The last ended step's recorded allocations, in allocation order: key (op, size and count: "op#bytes#n"), rounded
  // bytes, and when they were allocated and freed in the step's allocation and free events (free -1: live at the
  // step's end, -2: the allocation failed).
  struct RecordedAllocation {
    std::string key;
    int64_t bytes, alloc_t, free_t;
    int64_t alloc_ns, free_ns;  // since the step began (free -1: not freed in the step)
  };
  std::vector<RecordedAllocation> LastRecord();

 private:
  struct Record {
    std::string key;
    int64_t bytes = 0;      // rounded to BFC's 256 bytes
    int64_t requested = 0;  // as asked for
    int64_t alloc_t = 0;
    int64_t free_t = -1;                 // -1: live at the step's end; kFailed: the allocation failed
    int64_t evict_t = -1;                // when passive mode evicted it (-1: never)
    int64_t alloc_ns = 0, free_ns = -1;  // since the step began (steady clock)
    bool in_region = false;              // placed in the region (where the layout said or in another gap)
  };
  static constexpr int64_t kFailed = -2;
  // mu_ held.
  std::string KeyOf(std::string_view op, int64_t bytes);
  void* PlaceAt(int64_t offset, int64_t bytes);  // nullptr if anything live overlaps
  int64_t BestGap(int64_t bytes) const;          // -1 if none
  void* Take(int64_t offset, int64_t bytes, int64_t requested, int64_t index);
  void Layout();
  // One greedy packing of `items` in `order` into `*offsets` (indexed as `items`; `(*beside)[i]`: the items live at
  // the same time as item i; null: each is checked against every one placed before it); returns its size.
  static int64_t Pack(const std::vector<const Record*>& items, const std::vector<std::vector<size_t>>* beside,
                      const std::vector<size_t>& order, bool best_fit, std::vector<int64_t>* offsets);
  void* MaybeRelease();

  const int64_t min_bytes_;
  std::atomic<bool> active_{false};
  std::atomic<uintptr_t> region_begin_{0}, region_end_{0};
  std::mutex mu_;
  // The layout: for one function, the offset of each key, the region's size.
  int64_t layout_id_ = -1;
  std::unordered_map<std::string, int64_t> offsets_;
  int64_t layout_bytes_ = 0;
  // The last layout of the function that had its region (Previous).
  struct HeldLayout {
    std::unordered_map<std::string, int64_t> offsets;
    int64_t bytes = 0;
  };
  bool layout_held_ = false;  // the layout had its region in a step (held_ is a copy of it)
  HeldLayout held_;
  // The layouts of other functions, set aside when a step of another function began (steps of two functions that
  // take turns, two input signatures or two managed steps, each keep theirs), at most kKeptLayouts, oldest out.
  struct KeptLayout {
    int64_t id;
    std::unordered_map<std::string, int64_t> offsets;
    int64_t bytes;
    bool held;
    HeldLayout previous;
  };
  static constexpr size_t kKeptLayouts = 8;
  std::deque<KeptLayout> kept_;
  void SwitchTo(int64_t id);
  int64_t inherit_from_ = -1;  // InheritNext
  // The step being recorded.
  int64_t step_id_ = -1;
  int64_t generation_ = 0;  // steps begun: a ticket of an earlier step is stale
  bool record_only_ = false;
  int64_t begin_ns_ = 0;  // when the step began (steady clock)
  int64_t SinceBegin() const;
  int64_t clock_ = 0;
  std::unordered_map<std::string, int64_t> seen_;             // op and size -> allocations so far this step
  std::vector<Record> records_;                               // this step's recorded allocations
  std::vector<Record> last_records_;                          // the last ended step's
  std::unordered_map<uintptr_t, int64_t> recorded_ptr_;       // live recorded allocation -> its record
  std::vector<bool> ticket_planned_;                          // per record: the layout had an offset for it
  std::unordered_map<int64_t, std::deque<int64_t>> evicted_;  // bytes -> evicted records not brought back yet
  int64_t step_evictions_ = 0;                                // tensors passive mode evicted in this step
  // The step showed the layout wanting: an allocation it lays out went to the device allocator, or passive mode
  // evicted (mu_ held, at End).
  bool LayoutWanting() const;
  // The region: its live allocations, offset -> (bytes, requested bytes).
  void* region_ = nullptr;
  int64_t region_bytes_ = 0;
  std::map<int64_t, std::pair<int64_t, int64_t>> live_;
  Stats stats_;
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_STEP_LAYOUT_H_
