// Kernel of Capuchin>AssignInPlace: a variable's value written into the buffer it already has.
//
// capuchin_tf restores variables after a failed attempt of a step (capuchin_tf/runtime/recovery.py). TensorFlow's ways
// to write a whole variable do not fit: AssignVariableOp takes over its value's buffer (in eager execution also when
// the value is held elsewhere), so the variable moves to wherever that buffer is (host memory, for a value made from a
// numpy array), and ResourceStridedSliceAssign writes in place but puts the variable in copy-on-read mode for good
// (EnsureSparseVariableAccess): every later read of it copies it, and every update copies it to a new buffer.
// The managed step's assignments use it too (capuchin_tf/tf/rewrite.py, assignments_in_place): AssignVariableOp's
// takeover of the value's buffer moves the variable to wherever the value was computed, every step.

#include <cstring>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/types.h"

namespace tensorflow {
namespace capuchin {
namespace {

class AssignInPlaceOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& value = ctx->input(1);
    core::RefCountPtr<Var> variable;
    // As AssignVariableOp: a variable whose handle has never been assigned has no Var yet (one made inside a step
    // while it was traced, initialized at the step's first call).
    OP_REQUIRES_OK(ctx, LookupOrCreateResource<Var>(ctx, HandleFromInput(ctx, 0), &variable, [&value](Var** ptr) {
                     *ptr = new Var(value.dtype());
                     return absl::OkStatus();
                   }));
    OP_REQUIRES(ctx, DataTypeCanUseMemcpy(value.dtype()),
                errors::InvalidArgument("Capuchin>AssignInPlace: cannot copy a ", DataTypeString(value.dtype()),
                                        " tensor byte for byte"));
    mutex_lock lock(*variable->mu());
    Tensor* tensor = variable->tensor();
    OP_REQUIRES(ctx, !tensor->IsInitialized() || tensor->dtype() == value.dtype(),
                errors::InvalidArgument("Capuchin>AssignInPlace: the variable holds ", DataTypeString(tensor->dtype()),
                                        ", the value is ", DataTypeString(value.dtype())));
    if (!(tensor->IsInitialized() && tensor->RefCountIsOne() && tensor->shape() == value.shape())) {
      // Shared (a read of it is still alive) or of another shape: a buffer of its own, as AssignVariableOp's copy.
      Tensor fresh;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(value.dtype(), value.shape(), &fresh));
      *tensor = fresh;
    }
    if (value.TotalBytes() > 0) {
      std::memcpy(const_cast<char*>(tensor->tensor_data().data()), value.tensor_data().data(), value.TotalBytes());
    }
    variable->is_initialized = true;
  }
};

REGISTER_KERNEL_BUILDER(Name("Capuchin>AssignInPlace").Device(DEVICE_CPU), AssignInPlaceOp);

}  // namespace
}  // namespace capuchin
}  // namespace tensorflow
