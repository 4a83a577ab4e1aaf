// Kernels of the swap ops: SwapOut, Prefetch, SwapIn, HandleStatus, ReleaseHandle(s), host store statistics and the
// link emulation switch. The state lives in HostStore (host_store.h); handles are ref-counted variants (SwapHandle).

#include <mutex>
#include <vector>

#include "host_store.h"
#include "kernel_inputs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/variant.h"
#include "tensorflow/core/framework/variant_encode_decode.h"
#include "tensorflow/core/framework/variant_tensor_data.h"

namespace tensorflow {
namespace capuchin {
namespace {

// The handle a SwapOut returns: a scalar variant sharing one guard. TensorFlow copies the variant along the edges
// it flows on (Prefetch forwards it); when the last copy is destroyed (its consumers have run, the step failed or was
// cancelled, or the Python object holding it was dropped) the guard releases the host store entry. Releasing a
// consumed handle is a no-op, so this frees exactly the handles nobody swapped in, on every path.
class HandleGuard {
 public:
  explicit HandleGuard(int64_t handle) : handle_(handle) {}
  ~HandleGuard() { HostStore::Global()->Release(handle_); }
  int64_t handle() const { return handle_; }

 private:
  const int64_t handle_;
};

struct SwapHandle {
  static constexpr const char kTypeName[] = "capuchin_tf.SwapHandle";
  std::shared_ptr<HandleGuard> guard;

  std::string TypeName() const { return kTypeName; }
  std::string DebugString() const { return absl::StrCat("SwapHandle(", guard ? guard->handle() : -1, ")"); }
  // Handles are process-local: they can be carried through a graph but not serialized.
  void Encode(VariantTensorData* data) const { data->set_type_name(TypeName()); }
  bool Decode(const VariantTensorData& data) { return false; }
};

absl::Status ScalarHandle(OpKernelContext* ctx, int64_t* handle) {
  TF_RETURN_IF_ERROR(CheckScalarInput(ctx, 0, "handle"));
  const Tensor& t = ctx->input(0);
  const SwapHandle* h = t.scalar<Variant>()().get<SwapHandle>();
  if (h == nullptr || h->guard == nullptr) {
    return errors::InvalidArgument(ctx->op_kernel().type_string(),
                                   ": not a capuchin_tf swap handle: ", t.scalar<Variant>()().DebugString());
  }
  *handle = h->guard->handle();
  return absl::OkStatus();
}

Allocator* DeviceAllocator(OpKernelContext* ctx) { return ctx->device()->GetAllocator(AllocatorAttributes()); }

// Kernels that only register a tensor or queue a copy (SwapOut, Hold, Prefetch) run inline: TensorFlow's executor runs
// an inexpensive kernel as soon as it is ready, and hands an "expensive" one (every kernel is, until the executor has
// timed it) to the inter-op pool, whose owner thread takes the newest work first. With one inter-op thread a Hold
// made ready in the forward pass ran only after the transformer's masked-LM head (seen in the eviction trace): until
// then its tensor was the executor's, not the pool's, and could not be evicted.
class InlineOpKernel : public OpKernel {
 public:
  using OpKernel::OpKernel;
  bool IsExpensive() override { return false; }
};

class SwapOutOp : public InlineOpKernel {
 public:
  explicit SwapOutOp(OpKernelConstruction* ctx) : InlineOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_name", &tensor_name_));
    if (tensor_name_.empty()) tensor_name_ = name();
  }

  void Compute(OpKernelContext* ctx) override {
    absl::StatusOr<int64_t> handle = HostStore::Global()->SwapOut(ctx->input(0), tensor_name_);
    OP_REQUIRES_OK(ctx, handle.status());
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    SwapHandle h;
    h.guard = std::make_shared<HandleGuard>(*handle);
    out->scalar<Variant>()() = std::move(h);
  }

 private:
  std::string tensor_name_;
};

class HoldOp : public InlineOpKernel {
 public:
  explicit HoldOp(OpKernelConstruction* ctx) : InlineOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_name", &tensor_name_));
    if (tensor_name_.empty()) tensor_name_ = name();
  }

  void Compute(OpKernelContext* ctx) override {
    const int64_t handle = HostStore::Global()->Hold(ctx->input(0), tensor_name_);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    SwapHandle h;
    h.guard = std::make_shared<HandleGuard>(handle);
    out->scalar<Variant>()() = std::move(h);
  }

 private:
  std::string tensor_name_;
};

class GetOp : public OpKernel {
 public:
  explicit GetOp(OpKernelConstruction* ctx) : OpKernel(ctx) { OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_)); }

  void Compute(OpKernelContext* ctx) override {
    int64_t handle;
    OP_REQUIRES_OK(ctx, ScalarHandle(ctx, &handle));
    Tensor tensor;
    auto allocate = [ctx](DataType dtype, const TensorShape& shape, Tensor* t) {
      return ctx->allocate_temp(dtype, shape, t);
    };
    // Every Get of a handle receives its own reference to the handle tensor when the Hold runs; a Get that finds
    // the only one left is the handle's last reader.
    const bool last = ctx->input(0).RefCountIsOne();
    OP_REQUIRES_OK(ctx, HostStore::Global()->Get(handle, allocate, dtype_, last, &tensor));
    ctx->set_output(0, tensor);
  }

 private:
  DataType dtype_;
};

class SetPassiveModeOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, CheckScalarInput(ctx, 0, "enabled"));
    HostStore::Global()->SetPassive(ctx->input(0).scalar<bool>()());
  }
};

class DrainStallsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const std::vector<Stall> stalls = HostStore::Global()->DrainStalls();
    const int64_t n = static_cast<int64_t>(stalls.size());
    Tensor *starts, *ends, *bytes, *kinds, *names;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &starts));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &ends));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &bytes));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &kinds));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({n}), &names));
    for (int64_t i = 0; i < n; ++i) {
      starts->flat<int64_t>()(i) = stalls[i].start_ns;
      ends->flat<int64_t>()(i) = stalls[i].end_ns;
      bytes->flat<int64_t>()(i) = stalls[i].bytes;
      kinds->flat<int32_t>()(i) = stalls[i].kind;
      names->flat<tstring>()(i) = stalls[i].name;
    }
  }
};

class PrefetchOp : public InlineOpKernel {
 public:
  using InlineOpKernel::InlineOpKernel;

  void Compute(OpKernelContext* ctx) override {
    int64_t handle;
    OP_REQUIRES_OK(ctx, ScalarHandle(ctx, &handle));
    OP_REQUIRES_OK(ctx, HostStore::Global()->Prefetch(handle, DeviceAllocator(ctx)));
    ctx->set_output(0, ctx->input(0));
  }
};

class SwapInOp : public AsyncOpKernel {
 public:
  explicit SwapInOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shape", &shape_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    int64_t handle;
    OP_REQUIRES_OK_ASYNC(ctx, ScalarHandle(ctx, &handle), done);
    HostStore::Global()->SwapIn(handle, DeviceAllocator(ctx), dtype_, shape_,
                                [ctx, done](const absl::Status& status, const Tensor& tensor) {
                                  if (status.ok()) {
                                    ctx->set_output(0, tensor);
                                  } else {
                                    ctx->SetStatus(status);
                                  }
                                  done();
                                });
  }

 private:
  DataType dtype_;
  PartialTensorShape shape_;
};

class HandleStatusOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    int64_t handle;
    OP_REQUIRES_OK(ctx, ScalarHandle(ctx, &handle));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int32_t>()() = HostStore::Global()->Status(handle);
  }
};

class ReleaseHandleOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    int64_t handle;
    OP_REQUIRES_OK(ctx, ScalarHandle(ctx, &handle));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<bool>()() = HostStore::Global()->Release(handle);
  }
};

class ReleaseAllHandlesOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = HostStore::Global()->ReleaseAll();
  }
};

class HostStoreStatsOp : public OpKernel {
 public:
  // The `fields` attr only names the output's entries for Python (see the op's definition): any other value than
  // its default, the list the kernel outputs, is a caller's mistake.
  explicit HostStoreStatsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::vector<std::string> fields;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("fields", &fields));
    OP_REQUIRES(
        ctx, fields == HostStoreCounters::Names(),
        errors::InvalidArgument("Capuchin>HostStoreStats: the fields attr is fixed (cc/kernels/host_store_stats.h); "
                                "leave it at its default"));
  }

  void Compute(OpKernelContext* ctx) override {
    const std::vector<int64_t> values = HostStore::Global()->Counters().Values();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({static_cast<int64_t>(values.size())}), &out));
    auto flat = out->flat<int64_t>();
    for (size_t i = 0; i < values.size(); ++i) flat(i) = values[i];
  }
};

class ResetHostStoreStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override { HostStore::Global()->ResetCounters(); }
};

class SetLinkBandwidthOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, CheckScalarInput(ctx, 0, "device_to_host_bytes_per_sec"));
    OP_REQUIRES_OK(ctx, CheckScalarInput(ctx, 1, "host_to_device_bytes_per_sec"));
    const double out_bps = ctx->input(0).scalar<double>()();
    const double in_bps = ctx->input(1).scalar<double>()();
    OP_REQUIRES(ctx, out_bps >= 0.0 && in_bps >= 0.0,
                errors::InvalidArgument("link bandwidths must be >= 0 bytes/s (0 = no emulation), got ", out_bps,
                                        " and ", in_bps));
    HostStore::Global()->SetLinkBandwidth(out_bps, in_bps);
  }
};

// All swap ops run on the device whose memory they manage. On a GPU build the same kernels would be registered for
// the GPU with host-memory handles; this project targets the simulated device (docs/design/design.md), i.e. CPU.
REGISTER_KERNEL_BUILDER(Name("Capuchin>SwapOut").Device(DEVICE_CPU), SwapOutOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>Prefetch").Device(DEVICE_CPU), PrefetchOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>Hold").Device(DEVICE_CPU), HoldOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>Get").Device(DEVICE_CPU), GetOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>SetPassiveMode").Device(DEVICE_CPU), SetPassiveModeOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>DrainStalls").Device(DEVICE_CPU), DrainStallsOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>SwapIn").Device(DEVICE_CPU), SwapInOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>HandleStatus").Device(DEVICE_CPU), HandleStatusOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>ReleaseHandle").Device(DEVICE_CPU), ReleaseHandleOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>ReleaseAllHandles").Device(DEVICE_CPU), ReleaseAllHandlesOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>HostStoreStats").Device(DEVICE_CPU), HostStoreStatsOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>ResetHostStoreStats").Device(DEVICE_CPU), ResetHostStoreStatsOp);
REGISTER_KERNEL_BUILDER(Name("Capuchin>SetLinkBandwidth").Device(DEVICE_CPU), SetLinkBandwidthOp);

}  // namespace
}  // namespace capuchin
}  // namespace tensorflow
