// The access recorder: a process-wide, append-only buffer of tensor accesses that Python drains.
//
// One record is (tensor id, access index, time, device bytes in use). Tensor ids are interned once, when a
// RecordAccess kernel is constructed, so that recording an access is a timestamp, one allocator-stats read and one
// push under a short lock.

#ifndef CAPUCHIN_TF_CC_KERNELS_ACCESS_RECORDER_H_
#define CAPUCHIN_TF_CC_KERNELS_ACCESS_RECORDER_H_

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace tensorflow {
namespace capuchin {

struct AccessRecord {
  int32_t tensor = 0;        // interned tensor id, see AccessRecorder::Name
  int64_t access_index = 0;  // which access of that tensor in the step
  int64_t time_ns = 0;       // CLOCK_MONOTONIC
  int64_t bytes_in_use = -1; // device allocator bytes in use at that time, -1 if unknown
};

// CLOCK_MONOTONIC in nanoseconds, the clock of every timestamp capuchin_tf records (Python: time.monotonic_ns()).
int64_t MonotonicNowNs();

class AccessRecorder {
 public:
  static AccessRecorder* Global();

  int32_t Intern(const std::string& tensor_id);
  void Record(int32_t tensor, int64_t access_index, int64_t bytes_in_use);
  // Moves every record out (in recording order) and gives the name of each interned id.
  void Drain(std::vector<AccessRecord>* records, std::vector<std::string>* names);

 private:
  std::mutex mu_;
  std::vector<AccessRecord> records_;
  std::unordered_map<std::string, int32_t> ids_;
  std::vector<std::string> names_;
};

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_ACCESS_RECORDER_H_
