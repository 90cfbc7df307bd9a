// qlinear_q8act and quantize_q8: host entry points per backend, their argument checks, the CPU tier
// switch and the raw CPU entry (csrc/decoder_layer.cpp). The definition of the op:
// csrc/include/specdec/cpu_q8act.h.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "checks.h"
#include "specdec/cpu_q8act.h"

namespace specdec {

at::Tensor qlinear_q8act_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                             int64_t bits);
// (codes int8 [..., K], d float32 [..., K / 32]): step 1 of the definition, for the exactness tests.
std::tuple<at::Tensor, at::Tensor> quantize_q8_cpu(const at::Tensor& x);
// The CPU tiers' packed layout of a weight (csrc/include/specdec/cpu_q8act.h): uint8 [ceil(N / 16), K / 32,
// bytes per group and block]. qlinear_q8act's CPU form takes it in place of qweight (scales / mins still
// give N, K and the format).
at::Tensor pack_q8act_cpu(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                          int64_t bits);
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
// How many packed blocks ahead the AVX2 tier prefetches its weight (0: none; default 16); process-wide,
// for A/Bs; returns the previous value. The bits do not depend on it.
int64_t set_q8act_prefetch(int64_t blocks);
// Whether the AVX-512 VNNI tier runs one- and two-row passes over Q4 weights on two groups of 16 weight
// rows at once (true) or one (false); the same bits either way. Returns the previous value.
bool set_q8act_group_pairs(bool on);
// Whether the CPU quantizes 5 activation rows or more on all threads inside the products' parallel region (true)
// or on the calling thread first (false); the same bits either way. Returns the previous value.
bool set_q8act_parallel_quantize(bool on);
// From how many activation rows the AVX-512 VNNI tiles take the many-row prefetch, for Q8_0 and Q4 weights (1-9;
// 9: never); the same bits either way. Returns the previous pair.
std::tuple<int64_t, int64_t> set_q8act_many_rows(int64_t q8_rows, int64_t q4_rows);
// How many blocks ahead the AVX-512 VNNI tier's many-row tiles prefetch every line of a packed weight block
// (0: the one-line hint the other tiles take); the same bits at any distance. Returns the previous value.
int64_t set_q8act_block_prefetch(int64_t blocks);
// How many blocks ahead the AVX-512 VNNI tier's tiles of few activation rows prefetch every line of a packed
// weight block into L2 (0: the one-line hint two blocks ahead); the same bits at any distance. Returns the
// previous value.
int64_t set_q8act_stream_prefetch(int64_t blocks);
// The cache level the AVX2 / AVX-VNNI tiers' prefetch (set_q8act_prefetch) fills: 1 (L1, the default) or 2 (L2);
// the same bits either way. Returns the previous value.
int64_t set_q8act_prefetch_level(int64_t level);
// From how many activation rows the AVX-512 VNNI tier takes AMX where the CPU has it (0: never); the same bits
// either way. Returns the previous value. q8act_amx(): whether this CPU and OS run the AMX path.
int64_t set_q8act_amx_rows(int64_t rows);
bool q8act_amx();
}  // namespace cpu

namespace checks {

// qlinear's argument rules with the errors renamed to `op`.
inline void qlinear_as(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits) {
  try {
    qlinear(x, qweight, scales, mins, bias, bits);
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    if (msg.rfind("qlinear:", 0) == 0) msg = msg.substr(8);
    TORCH_CHECK(false, op, ":", msg);
  }
}

// The packed layout's shape for scales [N, G] (N rows, G blocks).
inline std::vector<int64_t> q8_packed_shape(const at::Tensor& scales, int64_t bits, bool mins) {
  const int64_t N = scales.dim() == 2 ? scales.size(0) : 0, G = scales.dim() == 2 ? scales.size(1) : 0;
  return {(N + cpu::kQ8Rows - 1) / cpu::kQ8Rows, G, cpu::kQ8PackBytes(int(bits), mins)};
}

// qlinear's argument rules, the errors naming this op; qweight may also be the CPU's packed layout
// (3-D uint8, pack_q8act's output for these scales / mins / bits).
inline void qlinear_q8act(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                          int64_t bits) {
  if (qweight.dim() != 3) return qlinear_as("qlinear_q8act", x, qweight, scales, mins, bias, bits);
  const char* op = "qlinear_q8act";
  TORCH_CHECK(qweight.device().is_cpu(), op, ": a packed (3-D) qweight is the CPU tiers' layout; on ",
              qweight.device(), " pass the [N, K] / [N, K / 2] weight");
  TORCH_CHECK(scales.dim() == 2, op, ": scales must be float16 [N, K / 32], got ", scales.sizes());
  TORCH_CHECK(bits == 8 || bits == 4, op, ": bits must be 8 (Q8_0) or 4 (Q4_0 / Q4_1), got ", bits);
  const auto want = q8_packed_shape(scales, bits, mins.has_value());
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.sizes() == at::IntArrayRef(want) && qweight.is_contiguous(),
              op, ": a packed qweight must be contiguous uint8 ", at::IntArrayRef(want),
              " (pack_q8act of these scales / mins / bits), got ", qweight.scalar_type(), " ", qweight.sizes());
  // the remaining rules are qlinear's (with the weight's usual [N, K] shape)
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., K], got a 0-d tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32, float16 or bfloat16, got ", x.scalar_type());
  const int64_t N = scales.size(0), G = scales.size(1);
  TORCH_CHECK(x.size(-1) == G * 32, op, ": x's K = ", x.size(-1), " must be 32 x the ", G,
              " blocks of scales [N, K / 32]");
  TORCH_CHECK(bits == 4 || !mins.has_value(), op, ": mins are only for 4-bit weights (Q4_1), got mins with bits = 8");
  auto group_tensor = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == G && t.scalar_type() == at::kHalf, op, ": ", name,
                " must be float16 [N, K / 32] = [", N, ", ", G, "], got ", t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
    TORCH_CHECK(t.device() == x.device(), op, ": ", name, " must be on x's device ", x.device(), ", got ", t.device());
  };
  group_tensor("scales", scales);
  if (mins.has_value()) group_tensor("mins", *mins);
  TORCH_CHECK(x.device() == qweight.device(), op, ": qweight must be on x's device ", x.device(), ", got ",
              qweight.device());
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N && b.scalar_type() == x.scalar_type(), op, ": bias must be ",
                x.scalar_type(), " [", N, "], got ", b.scalar_type(), " ", b.sizes());
    TORCH_CHECK(b.device() == x.device(), op, ": bias must be on x's device ", x.device(), ", got ", b.device());
  }
}

// pack_q8act's arguments: qlinear's rules for the weight (x stands in as a zero-row probe of width K).
inline void pack_q8act(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                       int64_t bits) {
  TORCH_CHECK(scales.dim() == 2, "pack_q8act: scales must be float16 [N, K / 32], got ", scales.sizes());
  TORCH_CHECK(qweight.device().is_cpu(), "pack_q8act: the packed layout is the CPU tiers'; qweight is on ",
              qweight.device());
  const at::Tensor probe = at::empty({0, scales.size(1) * 32}, scales.options().dtype(at::kFloat));
  qlinear_as("pack_q8act", probe, qweight, scales, mins, std::nullopt, bits);
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
