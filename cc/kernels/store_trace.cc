#include "store_trace.h"

#include <atomic>
#include <cstdio>
#include <unordered_map>
#include <utility>

#include "tensorflow/core/platform/logging.h"

namespace tensorflow {
namespace capuchin {
namespace {

class EvictionTrace : public StoreTrace {
 public:
  EvictionTrace(bool trace, bool debug) : trace_(trace), debug_(debug) {}

  void Handed(const Tensor& tensor, const std::string& name, const char* how) override {
    if (!trace_ || !tensor.IsInitialized() || tensor.TotalBytes() == 0) return;
    handed_[reinterpret_cast<uint64_t>(tensor.tensor_data().data())] = {std::string(how) + ":" + name, TraceSeq()};
  }

  void Evicted(int64_t bytes_needed, const EvictionChoice& choice, int64_t freed, const std::vector<ChunkSpan>* chunks,
               const EntryMap& entries, int64_t pending_copies) override {
    if (trace_) WriteEviction(bytes_needed, choice, freed, chunks, entries);
    if (freed == 0 && debug_) LogNothingFreed(bytes_needed, entries, pending_copies);
  }

  void Moved(int64_t bytes_needed, uint64_t offset, uint64_t size, int64_t movable, int64_t moved) override {
    if (!trace_) return;
    const std::string line = "capuchin: MoveFor(" + std::to_string(bytes_needed) + ") window " +
                             std::to_string(offset) + "+" + std::to_string(size) + " movable " +
                             std::to_string(movable) + " moved " + std::to_string(moved) + "\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
  }

 private:
  // One line on stderr: what was evicted and, with a memory map, every chunk named by what holds it.
  void WriteEviction(int64_t bytes_needed, const EvictionChoice& choice, int64_t freed,
                     const std::vector<ChunkSpan>* chunks, const EntryMap& entries) {
    std::string names;
    for (const auto& e : choice.chosen) names += " " + e->name + "(" + std::to_string(e->bytes) + ")";
    std::string map;
    if (chunks != nullptr && !chunks->empty()) {
      // Every entry still on the device, evictable or not, named with its state (the ones not evictable show why).
      std::unordered_map<uint64_t, std::string> any_at;
      for (const auto& kv : entries) {
        const StoreEntry* e = kv.second.get();
        if (!e->device.IsInitialized() || e->bytes == 0) continue;
        any_at[e->device_address()] =
            "{" + std::string(e->pooled ? "pool" : "swap") + std::to_string(static_cast<int>(e->state)) +
            (e->device.RefCountIsOne() ? "" : ",shared") + (e->waiter ? ",claimed" : "") + "}" + e->name;
      }
      for (const auto& c : *chunks) {
        auto it = choice.entry_at.find(c.address);
        auto any = any_at.find(c.address);
        map += " [" + std::to_string(c.address - chunks->front().address) + "+" + std::to_string(c.size) +
               (c.in_use ? (it != choice.entry_at.end()
                                ? " " + it->second->name
                                : (any != any_at.end() ? " used" + any->second
                                                       : " used(" + c.op + ")" + HandedAt(c.address, c.seq)))
                         : " free") +
               "]";
      }
    }
    // Straight to stderr: a log line is cut at about 15,000 characters, and a map is often longer.
    const std::string line = "capuchin: EvictFor(" + std::to_string(bytes_needed) + ") evictable " +
                             std::to_string(choice.evictable.size()) + " freed " + std::to_string(freed) + ":" + names +
                             (map.empty() ? "" : "; chunks:" + map) + "\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
  }

  // What the store held on the device when an eviction freed nothing.
  void LogNothingFreed(int64_t bytes_needed, const EntryMap& entries, int64_t pending_copies) {
    int64_t in = 0, in_shared = 0;
    for (const auto& kv : entries) {
      const StoreEntry* e = kv.second.get();
      if (!e->pooled || e->state != Residency::kIn) continue;
      in += e->bytes;
      if (!e->device.RefCountIsOne()) {
        in_shared += e->bytes;
        LOG(WARNING) << "capuchin: pooled in use " << e->name << " " << e->bytes;
      }
    }
    int64_t swapped_device = 0;  // device bytes of swap entries (not pooled) still on the device
    for (const auto& kv : entries) {
      const StoreEntry* e = kv.second.get();
      if (!e->pooled && e->device.IsInitialized()) swapped_device += e->bytes;
    }
    LOG(WARNING) << "capuchin: EvictFor(" << bytes_needed << ") freed nothing; pooled resident " << in
                 << " of which in use " << in_shared << "; swap entries on the device " << swapped_device
                 << "; copies pending " << pending_copies;
  }

  // The last tensor handed to an op at `address`, unless that was before the chunk there was allocated (then it was
  // an earlier tensor at that address).
  std::string HandedAt(uint64_t address, int64_t alloc_seq) const {
    auto it = handed_.find(address);
    return it == handed_.end() || it->second.second < alloc_seq ? "" : "<" + it->second.first + ">";
  }

  const bool trace_;
  const bool debug_;
  std::unordered_map<uint64_t, std::pair<std::string, int64_t>> handed_;  // name, TraceSeq()
};

}  // namespace

int64_t TraceSeq() {
  static std::atomic<int64_t> seq{0};
  return ++seq;
}

std::unique_ptr<StoreTrace> StoreTrace::FromConfig(const Config& config) {
  if (!config.trace_evict && !config.debug_evict) return std::make_unique<StoreTrace>();
  return std::make_unique<EvictionTrace>(config.trace_evict, config.debug_evict);
}

}  // namespace capuchin
}  // namespace tensorflow
