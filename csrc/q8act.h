// qlinear_q8act and quantize_q8: host entry points per backend, their argument checks, the CPU tier
// switch and the raw CPU entry (csrc/decoder_layer.cpp). The definition of the op:
// csrc/include/specdec/cpu_q8act.h.
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>

#include "checks.h"

namespace specdec {

at::Tensor qlinear_q8act_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                             int64_t bits);
// (codes int8 [..., K], d float32 [..., K / 32]): step 1 of the definition, for the exactness tests.
std::tuple<at::Tensor, at::Tensor> quantize_q8_cpu(const at::Tensor& x);
#ifdef SPECDEC_WITH_CUDA
at::Tensor qlinear_q8act_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                              int64_t bits);
std::tuple<at::Tensor, at::Tensor> quantize_q8_cuda(const at::Tensor& x);
#endif

namespace cpu {
struct QLinearParams;  // csrc/include/specdec/cpu_qlinear.h
// y [M, N] = the product of x [M, K] (row stride x_stride) quantized per block and the weight of Q (Q.x,
// Q.xsum unused), arguments already validated.
void qlinear_q8act_raw(const float* x, int64_t x_stride, const QLinearParams& Q);
// Forces a CPU tier ("avx512_vnni", "avx_vnni", "avx2", "scalar") or "auto" (the best the CPU runs);
// process-wide, for tests and A/Bs; returns the previous setting. Every tier gives the same bits.
std::string set_q8act_tier(const std::string& name);
std::string q8act_tier();   // the tier calls take now
std::string q8act_tiers();  // the tiers this CPU runs, comma-separated, best first
}  // namespace cpu

namespace checks {

// qlinear's argument rules, the errors naming this op.
inline void qlinear_q8act(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                          int64_t bits) {
  try {
    qlinear(x, qweight, scales, mins, bias, bits);
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    if (msg.rfind("qlinear:", 0) == 0) msg = msg.substr(8);
    TORCH_CHECK(false, "qlinear_q8act:", msg);
  }
}

inline void quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "quantize_q8: x must be [..., K], got a 0-d tensor");
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16,
              "quantize_q8: x must be float32, float16 or bfloat16, got ", t);
  TORCH_CHECK(x.size(-1) % 32 == 0, "quantize_q8: x's K = ", x.size(-1), " must be a multiple of the block size 32");
}

}  // namespace checks
}  // namespace specdec
