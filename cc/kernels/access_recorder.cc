#include "access_recorder.h"

#include <time.h>

namespace tensorflow {
namespace capuchin {

int64_t MonotonicNowNs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

AccessRecorder* AccessRecorder::Global() {
  static AccessRecorder* recorder = new AccessRecorder();  // leaked: kernels may record until the process exits
  return recorder;
}

int32_t AccessRecorder::Intern(const std::string& tensor_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ids_.find(tensor_id);
  if (it != ids_.end()) return it->second;
  const int32_t id = static_cast<int32_t>(names_.size());
  names_.push_back(tensor_id);
  ids_.emplace(tensor_id, id);
  return id;
}

void AccessRecorder::Record(int32_t tensor, int64_t access_index, int64_t bytes_in_use) {
  AccessRecord r;
  r.tensor = tensor;
  r.access_index = access_index;
  r.bytes_in_use = bytes_in_use;
  r.time_ns = MonotonicNowNs();
  std::lock_guard<std::mutex> lock(mu_);
  records_.push_back(r);
}

void AccessRecorder::Drain(std::vector<AccessRecord>* records, std::vector<std::string>* names) {
  std::lock_guard<std::mutex> lock(mu_);
  records->swap(records_);
  records_.clear();
  *names = names_;
}

}  // namespace capuchin
}  // namespace tensorflow
