// Kernels of Capuchin>AllocatorStats (the device allocator's statistics, its small-tensor pool's and its memory
// budget, read from the kernel side) and of the wrapper's switches, Capuchin>SetSmallPool, Capuchin>SizeSmallPool and
// Capuchin>SetMemoryBudget.

#include "device_allocator.h"
#include "kernel_inputs.h"
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
    CapuchinAllocator* capuchin = dynamic_cast<CapuchinAllocator*>(allocator);
    const bool wrapped = capuchin != nullptr;
    int64_t small_in_use = -1, small_peak = -1, small_limit = -1, budget = 0;
    if (capuchin != nullptr) {
      budget = capuchin->memory_budget();
      std::optional<AllocatorStats> small = capuchin->SmallPoolStats();
      if (small.has_value()) {
        small_in_use = small->bytes_in_use;
        small_peak = small->peak_bytes_in_use;
        small_limit = small->bytes_limit.value_or(-1);
      }
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = in_use;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &out));
    out->scalar<int64_t>()() = peak;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &out));
    out->scalar<int64_t>()() = limit;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &out));
    out->scalar<bool>()() = wrapped;
    CapuchinAllocator::Refusal refusal;
    if (capuchin != nullptr) refusal = capuchin->LastRefusal();
    const int64_t more_values[] = {small_in_use,  small_peak,    small_limit,    budget,
                                   refusal.count, refusal.bytes, refusal.in_use, refusal.largest_free};
    for (int i = 0; i < 8; ++i) {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(4 + i, TensorShape({}), &out));
      out->scalar<int64_t>()() = more_values[i];
    }
    OP_REQUIRES_OK(ctx, ctx->allocate_output(12, TensorShape({}), &out));
    out->scalar<tstring>()() = refusal.op;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(13, TensorShape({}), &out));
    out->scalar<int64_t>()() = capuchin != nullptr ? capuchin->LargestFreeChunk() : -1;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(14, TensorShape({}), &out));
    out->scalar<int64_t>()() = refusal.store_shared;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(15, TensorShape({}), &out));
    out->scalar<int64_t>()() = refusal.store_idle;
  }
};

class SetSmallPoolOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, CheckScalarInput(ctx, 0, "enabled"));
    CapuchinAllocator* allocator = CapuchinAllocator::Installed();
    if (allocator != nullptr) allocator->SetSmallPool(ctx->input(0).scalar<bool>()());
  }
};

class SizeSmallPoolOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, CheckScalarInput(ctx, 0, "bytes"));
    const int64_t bytes = ctx->input(0).scalar<int64_t>()();
    OP_REQUIRES(ctx, bytes > 0, errors::InvalidArgument("Capuchin>SizeSmallPool: bytes must be > 0, got ", bytes));
    CapuchinAllocator* allocator = CapuchinAllocator::Installed();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = allocator == nullptr ? 0 : allocator->SizeSmallPool(bytes);
  }
};

class SetMemoryBudgetOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, CheckScalarInput(ctx, 0, "bytes"));
    const int64_t bytes = ctx->input(0).scalar<int64_t>()();
    OP_REQUIRES(ctx, bytes >= 0,
                errors::InvalidArgument("Capuchin>SetMemoryBudget: bytes must be >= 0 (0: no budget), got ", bytes));
    CapuchinAllocator* allocator = CapuchinAllocator::Installed();
    if (allocator == nullptr) {
      OP_REQUIRES(ctx, bytes == 0,
                  errors::FailedPrecondition("Capuchin>SetMemoryBudget: capuchin_tf's allocator wrapper is not "
                                             "installed (capuchin_tf was imported after TensorFlow created its "
                                             "devices), so no budget can be enforced"));
      return;
    }
    OP_REQUIRES_OK(ctx, allocator->SetMemoryBudget(bytes));
  }
};

class LayoutStepOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, CheckScalarInput(ctx, 0, "phase"));
    OP_REQUIRES_OK(ctx, CheckScalarInput(ctx, 1, "id"));
    const int64_t phase = ctx->input(0).scalar<int64_t>()();
    const int64_t id = ctx->input(1).scalar<int64_t>()();
    OP_REQUIRES(ctx, phase >= 0 && phase <= 4,
                errors::InvalidArgument("Capuchin>LayoutStep: phase is 0 (begin), 1 (end), 2 (end after a failure), "
                                        "3 (begin, recording only) or 4 (the next new function starts from function "
                                        "`id`'s layout), got ",
                                        phase));
    CapuchinAllocator* allocator = CapuchinAllocator::Installed();
    if (allocator == nullptr) return;
    if (phase == 4) {
      allocator->InheritLayout(id);
    } else if (phase == 0 || phase == 3) {
      allocator->BeginLayoutStep(id, /*record_only=*/phase == 3);
    } else {
      allocator->EndLayoutStep(phase == 1);
    }
  }
};

class LayoutStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    StepLayout::Stats s;
    CapuchinAllocator* allocator = CapuchinAllocator::Installed();
    if (allocator != nullptr) s = allocator->LayoutStats();
    const int64_t values[] = {s.steps,        s.region_steps, s.layouts,     s.placed,         s.misses,  s.fallbacks,
                              s.region_bytes, s.planned,      s.step_misses, s.attached_bytes, s.previous};
    Tensor* out = nullptr;
    constexpr int64_t n = sizeof(values) / sizeof(values[0]);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    for (int64_t i = 0; i < n; ++i) out->vec<int64_t>()(i) = values[i];
  }
};

class LayoutRecordOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    std::vector<StepLayout::RecordedAllocation> record;
    CapuchinAllocator* allocator = CapuchinAllocator::Installed();
    if (allocator != nullptr) record = allocator->LayoutRecord();
    const int64_t n = static_cast<int64_t>(record.size());
    Tensor* keys = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &keys));
    Tensor* values[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
    for (int i = 0; i < 5; ++i) OP_REQUIRES_OK(ctx, ctx->allocate_output(1 + i, TensorShape({n}), &values[i]));
    for (int64_t j = 0; j < n; ++j) {
      keys->vec<tstring>()(j) = record[j].key;
      values[0]->vec<int64_t>()(j) = record[j].bytes;
      values[1]->vec<int64_t>()(j) = record[j].alloc_t;
      values[2]->vec<int64_t>()(j) = record[j].free_t;
      values[3]->vec<int64_t>()(j) = record[j].alloc_ns;
      values[4]->vec<int64_t>()(j) = record[j].free_ns;
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("Capuchin>LayoutRecord").Device(DEVICE_CPU), LayoutRecordOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>LayoutStep").Device(DEVICE_CPU), LayoutStepOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>LayoutStats").Device(DEVICE_CPU), LayoutStatsOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>AllocatorStats").Device(DEVICE_CPU), AllocatorStatsOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>SetMemoryBudget").Device(DEVICE_CPU), SetMemoryBudgetOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>SetSmallPool").Device(DEVICE_CPU), SetSmallPoolOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>SizeSmallPool").Device(DEVICE_CPU), SizeSmallPoolOp);

}  // namespace
}  // namespace capuchin
}  // namespace tensorflow
