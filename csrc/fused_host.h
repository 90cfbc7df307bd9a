// Host side shared by the CPU and CUDA backends of the fused ops (csrc/cpu/fused.cpp,
// csrc/cuda/fused.cu): contiguous operands and the outputs, allocated like the inputs.
#pragma once

#include <ATen/ATen.h>

namespace specdec {

// rms_norm / add_rms_norm: x [..., H] as rows of H; res (add_rms_norm only) and sum
// (x + residual) undefined for rms_norm. Call after checks::rms_norm.
struct NormBuffers {
  at::Tensor x, res, w, out, sum;
  int64_t H, rows;
};

inline NormBuffers norm_buffers(const at::Tensor& x_in, const at::Tensor* res_in, const at::Tensor& w_in) {
  NormBuffers b;
  b.x = x_in.contiguous();
  b.w = w_in.contiguous();
  if (res_in) b.res = res_in->contiguous();
  b.H = b.x.size(-1);
  b.rows = b.H == 0 ? 0 : b.x.numel() / b.H;
  b.out = at::empty(b.x.sizes(), b.x.options());
  if (res_in) b.sum = at::empty(b.x.sizes(), b.x.options());
  return b;
}

}  // namespace specdec
