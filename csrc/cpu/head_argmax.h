// linear_argmax / qlinear_argmax on the CPU: the first index of each row's maximum of the op's output
// (torch.argmax's semantics on linear / qlinear / qlinear_q8act's result in x's dtype: the first NaN wins when a
// row has one, else the first index holding the maximum, +0 and -0 equal), without materialising the [M, N]
// logits. The vocabulary goes in slabs of kArgmaxSlab output columns, split over the threads; each slab's
// columns are computed into a small per-thread buffer by the op's own few-row kernel (so every value is the
// bit the op gives it: its tiles compute each output with one sequence of operations whatever the columns or
// rows that share the call), rounded to x's dtype, and only the slab's best survives. Greedy rows of a verify
// pass and plain decode steps need the argmax alone (docs/ops.md).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <ATen/ATen.h>

namespace specdec {
namespace cpu {

// Output columns per slab: a multiple of every kernel's column unit (linear 4, qlinear 8, qlinear_q8act 16).
constexpr int64_t kArgmaxSlab = 1024;
// qlinear_argmax with quantized activations takes the slabs up to this many rows (verify sizes).
constexpr int64_t kArgmaxQ8Rows = 64;

// slab(n0, n1, y, y_stride) writes y[m * y_stride + j] = the op's float32 value of column n0 + j of row m,
// for m < M and j < n1 - n0 (called from inside a parallel region: its own parallel loops run inline).
using ArgmaxSlab = std::function<void(int64_t n0, int64_t n1, float* y, int64_t y_stride)>;

// out[m] = the argmax of row m over N >= 1 columns, the values rounded to out_dtype (float32, float16 or
// bfloat16) first, as the op's result is.
void blocked_argmax(int64_t M, int64_t N, at::ScalarType out_dtype, const ArgmaxSlab& slab, int64_t* out);

// The argmax of each row of a materialised [M, N] result (float32 / float16 / bfloat16), int64 [M]: the path
// for the shapes the slabs do not take (prefill sizes, an unpacked q8 weight, nothing to stream).
at::Tensor argmax_rows_cpu(const at::Tensor& y);

// Runs the argument checks f of op `base` with their errors renamed to `op` ("qlinear: ..." -> "qlinear_argmax:
// ...").
template <typename F>
void checked_as(const char* op, const char* base, F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    const std::string prefix = std::string(base) + ":";
    if (msg.rfind(prefix, 0) == 0) msg = msg.substr(prefix.size());
    TORCH_CHECK(false, op, ":", msg);
  }
}

// The argmax ops need a column: N >= 1.
inline void check_argmax_columns(const char* op, int64_t N) {
  TORCH_CHECK(N >= 1, op, ": the weight must have at least one output row (N >= 1) to take an argmax over, got N = ",
              N);
}

}  // namespace cpu
}  // namespace specdec
