// Kernel of Capuchin>AllocatorStats: the device allocator's statistics, read from the kernel side.

#include "device_allocator.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace capuchin {
namespace {

class AllocatorStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    Allocator* allocator = ctx->device()->GetAllocator(AllocatorAttributes());
    int64_t in_use = -1, peak = -1, limit = -1;
    std::optional<AllocatorStats> stats = allocator->GetStats();
    if (stats.has_value()) {
      in_use = stats->bytes_in_use;
      peak = stats->peak_bytes_in_use;
      limit = stats->bytes_limit.value_or(-1);
    }
    const bool wrapped = dynamic_cast<CapuchinAllocator*>(allocator) != nullptr;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = in_use;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &out));
    out->scalar<int64_t>()() = peak;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &out));
    out->scalar<int64_t>()() = limit;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &out));
    out->scalar<bool>()() = wrapped;
  }
};

REGISTER_KERNEL_BUILDER(Name("Capuchin>AllocatorStats").Device(DEVICE_CPU), AllocatorStatsOp);

}  // namespace
}  // namespace capuchin
}  // namespace tensorflow
