// Kernels of the access recorder ops: RecordAccess (a pass-through that timestamps an access) and
// DrainAccessRecords.

#include "access_recorder.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tensorflow {
namespace capuchin {
namespace {

class RecordAccessOp : public OpKernel {
 public:
  explicit RecordAccessOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string tensor_id;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_id", &tensor_id));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("access_index", &access_index_));
    tensor_ = AccessRecorder::Global()->Intern(tensor_id);
  }

  void Compute(OpKernelContext* ctx) override {
    int64_t in_use = -1;
    std::optional<AllocatorStats> stats = ctx->device()->GetAllocator(AllocatorAttributes())->GetStats();
    if (stats.has_value()) in_use = stats->bytes_in_use;
    AccessRecorder::Global()->Record(tensor_, access_index_, in_use);
    ctx->set_output(0, ctx->input(0));  // forwards the buffer: no copy, no allocation
  }

 private:
  int32_t tensor_ = 0;
  int64_t access_index_ = 0;
};

class DrainAccessRecordsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    std::vector<AccessRecord> records;
    std::vector<std::string> names;
    AccessRecorder::Global()->Drain(&records, &names);
    const int64_t n = static_cast<int64_t>(records.size());
    Tensor *ids, *accesses, *times, *bytes;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &ids));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &accesses));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &times));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &bytes));
    auto ids_flat = ids->flat<tstring>();
    auto access_flat = accesses->flat<int64_t>();
    auto time_flat = times->flat<int64_t>();
    auto bytes_flat = bytes->flat<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      ids_flat(i) = names[records[i].tensor];
      access_flat(i) = records[i].access_index;
      time_flat(i) = records[i].time_ns;
      bytes_flat(i) = records[i].bytes_in_use;
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("Capuchin>RecordAccess").Device(DEVICE_CPU), RecordAccessOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>DrainAccessRecords").Device(DEVICE_CPU), DrainAccessRecordsOp);

}  // namespace
}  // namespace capuchin
}  // namespace tensorflow
