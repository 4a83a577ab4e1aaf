// Op definitions of capuchin_tf (interfaces and shape functions only; kernels live in cc/kernels/).
//
// Every op is namespaced "Capuchin>" and stateful: Grappler never prunes, merges, folds or moves a stateful op, which
// is what the swap, prefetch and pool nodes inserted into a training step need.

#include <string>

#include "cc/kernels/host_store_stats.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace capuchin {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// Ops that return a tensor from a scalar handle: the output's static shape is the `shape` attr.
absl::Status ShapeFromAttr(InferenceContext* c) {
  ShapeHandle unused;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
  PartialTensorShape shape;
  TF_RETURN_IF_ERROR(c->GetAttr("shape", &shape));
  ShapeHandle out;
  TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shape, &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

// Ops that take scalar settings and return nothing. A known non-scalar input is refused when the graph is built;
// the kernels check again, for eager calls (no shape function runs) and shapes unknown until run time.
absl::Status ScalarInputsNoOutputs(InferenceContext* c) {
  ShapeHandle unused;
  for (int i = 0; i < c->num_inputs(); ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
  return absl::OkStatus();
}

// Ops that take a scalar (a handle, a size) and return a scalar.
absl::Status ScalarHandleToScalar(InferenceContext* c) {
  ShapeHandle unused;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
  c->set_output(0, c->Scalar());
  return absl::OkStatus();
}

// Ops that drain a log: every output is a vector of the number of records.
absl::Status VectorOutputs(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->Vector(InferenceContext::kUnknownDim));
  return absl::OkStatus();
}

// Types whose bytes can be copied to host memory and back unchanged.
#define CAPUCHIN_SWAPPABLE_TYPES                                                                                \
  "{half, bfloat16, float, double, int8, uint8, int16, uint16, int32, uint32, int64, uint64, bool, complex64, " \
  "complex128}"

REGISTER_OP("Capuchin>SwapOut")
    .Input("tensor: T")
    .Output("handle: variant")
    .Attr("T: " CAPUCHIN_SWAPPABLE_TYPES)
    .Attr("tensor_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
Starts copying `tensor` to capuchin_tf's host store and returns a handle to it.

The copy runs asynchronously on the store's device-to-host worker (one per direction, like a GPU's copy engines).
Once it has finished the store drops its reference to the device buffer, so the device memory is freed as soon as
no other consumer holds the tensor. The handle's status goes SWAPPING_OUT -> OUT.

The handle is a reference-counted scalar variant: when the last tensor holding it is gone (the step ended,
successfully or not, or the Python object was dropped) a handle that was never consumed is released with its
buffers.

tensor: the device tensor to evict.
handle: a scalar variant handle for Capuchin>Prefetch, Capuchin>SwapIn and Capuchin>HandleStatus.
tensor_name: name of the tensor being swapped, for diagnostics.
)doc");

REGISTER_OP("Capuchin>Prefetch")
    .Input("handle: variant")
    .Output("handle_out: variant")
    .SetIsStateful()
    .SetShapeFn(ScalarHandleToScalar)
    .Doc(R"doc(
Starts bringing a swapped-out tensor back to the device, asynchronously (status OUT -> SWAPPING_IN -> IN).

Returns immediately. If the swap-out is still in flight, the swap-in is queued behind it. Prefetching a tensor that
is already coming back or back is a no-op.

handle: a handle from Capuchin>SwapOut.
handle_out: the same handle, so that a consumer can be ordered after the prefetch started.
)doc");

REGISTER_OP("Capuchin>SwapIn")
    .Input("handle: variant")
    .Output("tensor: dtype")
    .Attr("dtype: " CAPUCHIN_SWAPPABLE_TYPES)
    .Attr("shape: shape = { unknown_rank: true }")
    .SetIsStateful()
    .SetShapeFn(ShapeFromAttr)
    .Doc(R"doc(
Returns the swapped-out tensor behind `handle` as a device tensor and consumes the handle.

If a prefetch has finished, this costs nothing. If it is still running, the op waits for it (asynchronously, without
holding a compute thread) and records a late prefetch. If no prefetch was started, the swap-in runs on demand.
An already consumed handle, or a variant that is not a capuchin_tf handle, is an InvalidArgument error.

handle: a handle from Capuchin>SwapOut.
tensor: the tensor, bit for bit as it was swapped out.
dtype: the type of the swapped tensor (checked against the stored one).
shape: the static shape of the tensor, for shape inference only (checked against the stored one when fully defined).
)doc");

REGISTER_OP("Capuchin>HandleStatus")
    .Input("handle: variant")
    .Output("status: int32")
    .SetIsStateful()
    .SetShapeFn(ScalarHandleToScalar)
    .Doc(R"doc(
The residency of a handle: 0 IN, 1 SWAPPING_OUT, 2 OUT, 3 SWAPPING_IN, -1 unknown or consumed.
)doc");

REGISTER_OP("Capuchin>ReleaseHandle")
    .Input("handle: variant")
    .Output("released: bool")
    .SetIsStateful()
    .SetShapeFn(ScalarHandleToScalar)
    .Doc(R"doc(
Drops a handle without consuming it, freeing its host (or device) buffer. False if the handle was unknown.
)doc");

REGISTER_OP("Capuchin>ReleaseAllHandles")
    .Output("released: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
Drops every live handle of the host store (for example after eager use) and frees the host buffers it keeps for
reuse. Returns how many handles were dropped.
)doc");

// The HostStoreStats op's `fields` attr: its default lists the names of the output's entries, in order.
std::string HostStoreStatFieldsAttr() {
  std::string spec = "fields: list(string) = [";
  for (const std::string& name : HostStoreCounters::Names()) {
    spec += (spec.back() == '[' ? "'" : ", '") + name + "'";
  }
  return spec + "]";
}

REGISTER_OP("Capuchin>HostStoreStats")
    .Output("stats: int64")
    .Attr(HostStoreStatFieldsAttr())
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Statistics of the host store as a vector, one entry per name in `fields`.

fields: the names of the entries, in order (cc/kernels/host_store_stats.h). Leave it at its default: the kernel
  refuses any other value. capuchin_tf.tf.ops.host_store_stats() reads it from this definition to name the values.
)doc");

REGISTER_OP("Capuchin>ResetHostStoreStats").SetIsStateful().SetShapeFn(shape_inference::NoOutputs).Doc(R"doc(
Resets the host store's counters; the peak restarts from the bytes held now.
)doc");

REGISTER_OP("Capuchin>SetLinkBandwidth")
    .Input("device_to_host_bytes_per_sec: double")
    .Input("host_to_device_bytes_per_sec: double")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsNoOutputs)
    .Doc(R"doc(
Sets the emulated link: each copy of N bytes in a direction takes at least N / bandwidth seconds, one copy at a time
per direction, overlapping compute. 0 turns emulation off for that direction (the default).

device_to_host_bytes_per_sec: a scalar, >= 0.
host_to_device_bytes_per_sec: a scalar, >= 0.
)doc");

REGISTER_OP("Capuchin>Hold")
    .Input("tensor: T")
    .Output("handle: variant")
    .Attr("T: " CAPUCHIN_SWAPPABLE_TYPES)
    .Attr("tensor_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
Hands `tensor` to capuchin_tf's tensor pool (status IN) and returns a handle; later consumers read it through
Capuchin>Get. Once its other consumers have run, the pool holds the only reference, so that passive mode can evict
it to host memory when an allocation would fail (the paper's passive mode), freeing device memory for real.
The handle is released, with its buffers, when the last tensor holding it is gone.
)doc");

REGISTER_OP("Capuchin>Get")
    .Input("handle: variant")
    .Output("tensor: dtype")
    .Attr("dtype: " CAPUCHIN_SWAPPABLE_TYPES)
    .Attr("shape: shape = { unknown_rank: true }")
    .SetIsStateful()
    .SetShapeFn(ShapeFromAttr)
    .Doc(R"doc(
Returns the tensor of a Capuchin>Hold handle without consuming the handle. If passive mode evicted it, it is
brought back synchronously first (the paper's access failure), and the wait is recorded as a stall.
)doc");

REGISTER_OP("Capuchin>SetPassiveMode")
    .Input("enabled: bool")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsNoOutputs)
    .Doc(R"doc(
Turns passive mode on or off: when on, an allocation that would fail makes the device allocator wrapper evict
tensors that only the pool holds (oldest hold first, preferring one of about the needed size) to host memory, and
retry.

enabled: a scalar.
)doc");

REGISTER_OP("Capuchin>AssignInPlace")
    .Input("resource: resource")
    .Input("value: dtype")
    .Attr("dtype: type")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return absl::OkStatus(); })
    .Doc(R"doc(
Writes `value` into the variable's own buffer, byte for byte, when the variable holds a tensor of the same dtype and
shape that nothing else shares; otherwise into a buffer of its own (allocated on this device). Unlike
AssignVariableOp it never takes over the value's buffer, and unlike ResourceStridedSliceAssign it leaves the
variable's copy-on-read mode as it was. capuchin_tf restores variables with it after a failed attempt of a step.
)doc");

REGISTER_OP("Capuchin>SetSmallPool").Input("enabled: bool").SetIsStateful().SetShapeFn(ScalarInputsNoOutputs).Doc(R"doc(
Turns the device allocator wrapper's small-tensor pool on or off: when on (and the device has one, i.e. it is the
simulated device), allocations of at most 64 KiB come from a pool of their own while it has room.

enabled: a scalar.
)doc");

REGISTER_OP("Capuchin>SizeSmallPool")
    .Input("bytes: int64")
    .Output("size: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarHandleToScalar)
    .Doc(R"doc(
Sizes the device allocator wrapper's small-tensor pool to `bytes` (rounded up to a multiple of 256) if no allocation
has used the pool yet and CAPUCHIN_TF_SMALL_POOL_MB did not set its size; the pool's size stays fixed from its first
use on. Returns the pool's size in effect (0: the device has no pool).

bytes: a scalar, the size asked for.
)doc");

REGISTER_OP("Capuchin>SetMemoryBudget")
    .Input("bytes: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsNoOutputs)
    .Doc(R"doc(
Sets the memory budget the device allocator wrapper enforces (0 turns it off, the default). While it is set and
below the device's limit, no allocation may take the device's bytes in use (and so its peak) above it: one that might
(counting the most the device's BFC allocator can hand out for it, rounding and unsplit chunks included) fails at
once like an allocation at the device's limit, or, in passive mode, first evicts pooled tensors, anywhere on the
device, and waits for copies in flight, failing only when nothing more can be freed. Allocations under way when it
is set are not checked and bytes already in use stay: set it between steps. A budget at or above the device's limit
changes nothing.

FailedPrecondition for a budget other than 0 unless capuchin_tf's allocator wrapper runs the simulated device (the
only device whose bytes in use the wrapper can read).

bytes: a scalar, >= 0.
)doc");

REGISTER_OP("Capuchin>LayoutStep")
    .Input("phase: int64")
    .Input("id: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsNoOutputs)
    .Doc(R"doc(
Begins or ends a step under the device allocator wrapper's planned layout (cc/kernels/step_layout.h), on the simulated
device; elsewhere it does nothing. Phase 0 begins a step of the function `id`: its allocations of more than 64 KiB are
recorded and, once a step of the same function was recorded, placed in one region of the device where the layout
says (the region is allocated now, within the memory budget). Phase 1 ends the step (laying out its allocations when
it ran without a layout or not as laid out), phase 2 ends a step that failed (the layout is dropped), phase 3 begins
a step whose allocations are recorded only (nothing is placed; Capuchin>LayoutRecord reads them after its end). A
step of another function sets the layout aside (a few are kept) and takes that function's own. Phase 4: the next
function to begin that has no layout of its own starts from a copy of function `id`'s (a plan replacing another).

phase: a scalar, 0 to 4.
id: a scalar naming the function the step runs.
)doc");

REGISTER_OP("Capuchin>LayoutStats")
    .Output("stats: int64")
    .Attr(
        "fields: list(string) = ['steps', 'region_steps', 'layouts', 'placed', 'misses', 'fallbacks', "
        "'region_bytes', 'planned', 'step_misses', 'attached_bytes', 'previous']")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The planned layout's counters since the process started, one entry per name in `fields`: steps begun, steps that ran
with a region, layouts worked out, allocations placed where the layout said, allocations placed elsewhere in the
region (misses), laid-out allocations the region did not take (fallbacks: the device's usual path), the current
layout's region size in bytes, how many allocations it places, and the last step's misses and fallbacks.

fields: the names of the entries, in order. Leave it at its default.
)doc");

REGISTER_OP("Capuchin>LayoutRecord")
    .Output("keys: string")
    .Output("bytes: int64")
    .Output("allocated: int64")
    .Output("freed: int64")
    .Output("allocated_ns: int64")
    .Output("freed_ns: int64")
    .SetIsStateful()
    .SetShapeFn(VectorOutputs)
    .Doc(R"doc(
The allocations of more than 64 KiB the last step under Capuchin>LayoutStep recorded, in allocation order: the key
("op#bytes#n": the op that asked, the size rounded to 256 bytes, how many allocations of that op and size came before
in the step), the rounded size, and when the allocation was made and freed counted in the step's allocation and free
events (freed -1: live at the step's end; -2: the allocation failed), and the same in nanoseconds since the step
began (freed_ns -1: not freed in the step). What the step really kept live, allocation by allocation.
)doc");

REGISTER_OP("Capuchin>DrainStalls")
    .Output("starts_ns: int64")
    .Output("ends_ns: int64")
    .Output("bytes: int64")
    .Output("kinds: int32")
    .Output("names: string")
    .SetIsStateful()
    .SetShapeFn(VectorOutputs)
    .Doc(R"doc(
Every stall recorded since the last drain (CLOCK_MONOTONIC ns): kind 0 a passive eviction (inside an allocation),
kind 1 a Get that brought an evicted tensor back, kind 2 a SwapIn that waited for its copy (a late prefetch or an
on-demand swap-in), kind 3 a prefetched tensor evicted again before its SwapIn (an allocation failed), with the
tensor's name for kinds 1 to 3. Empties the log.
)doc");

REGISTER_OP("Capuchin>AllocatorStats")
    .Output("bytes_in_use: int64")
    .Output("peak_bytes_in_use: int64")
    .Output("bytes_limit: int64")
    .Output("wrapped: bool")
    .Output("small_pool_bytes_in_use: int64")
    .Output("small_pool_peak_bytes_in_use: int64")
    .Output("small_pool_bytes_limit: int64")
    .Output("budget_bytes: int64")
    .Output("refusals: int64")
    .Output("refused_bytes: int64")
    .Output("refused_in_use: int64")
    .Output("refused_largest_free: int64")
    .Output("refused_op: string")
    .Output("largest_free: int64")
    .Output("refused_store_shared: int64")
    .Output("refused_store_idle: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Statistics of the allocator of the device this op runs on: bytes in use, peak and limit (-1 when the allocator keeps
none, as the CPU allocator does unless TF_CPU_ALLOCATOR_USE_BFC=true), and whether it is capuchin_tf's allocator
wrapper (false when capuchin_tf was loaded after TensorFlow had created its devices); the same three for the
wrapper's small-tensor pool (-1 without one); the memory budget set by Capuchin>SetMemoryBudget (0: none); and the
last allocation the wrapper could not satisfy: how many so far, its bytes, the device's bytes in use and its largest
free chunk at that moment, and the op that asked; then the device's largest free chunk now (-1 unless the device is
the simulated one, whose memory map the wrapper reads); and what capuchin_tf's host store held on the device at the
last refusal: bytes shared with ops that ran or waited to run, and bytes only the store held (evictable).
)doc");

}  // namespace capuchin
}  // namespace tensorflow
