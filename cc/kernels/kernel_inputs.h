// Checks of kernel inputs shared by capuchin_tf's kernels.

#ifndef CAPUCHIN_TF_CC_KERNELS_KERNEL_INPUTS_H_
#define CAPUCHIN_TF_CC_KERNELS_KERNEL_INPUTS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tensorflow {
namespace capuchin {

// InvalidArgument, naming the op and the input, unless input `index` (called `name` in the op's definition) is a
// scalar. A kernel must check before it reads `.scalar<T>()`: on a tensor of another shape that is a CHECK failure,
// which aborts the whole process. The shape functions refuse a known non-scalar shape, but an eager call runs no
// shape function, and a graph may not know the shape when it is built.
inline absl::Status CheckScalarInput(OpKernelContext* ctx, int index, absl::string_view name) {
  const TensorShape& shape = ctx->input(index).shape();
  if (TensorShapeUtils::IsScalar(shape)) return absl::OkStatus();
  return errors::InvalidArgument(ctx->op_kernel().type_string(), ": input '", name, "' must be a scalar, got shape ",
                                 shape.DebugString());
}

}  // namespace capuchin
}  // namespace tensorflow

#endif  // CAPUCHIN_TF_CC_KERNELS_KERNEL_INPUTS_H_
