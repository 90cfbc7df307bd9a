// linear, CPU backend: y = x W^T (* weight_scale) (+ bias) for few-row activations
// (decode and tree verification). The kernel lives in csrc/include/specdec/cpu_linear.h;
// this file validates, converts half/bf16 activations to float32 once, splits the output
// columns over threads and converts the result back.
//
// Rows: the kernel takes kSmallM rows of x per pass over the weight. Float weights use it up
// to kBlasM rows (2 passes; measured faster than torch's BLAS sgemm up to ~64 rows on the
// Llama shapes here: 40 rows 1.24x, 64 rows 1.04x, 2 threads); larger M (prefill) is
// compute-bound and, on an AVX2 CPU with K % 8 == 0, takes the GEMM tiles of cpu_gemm.h: float32
// weights and x up to kLinearGemmRows rows (more: at::linear, the BLAS GEMM, faster from ~256 rows),
// float16 / bfloat16 and int8 weights at any M. Otherwise float weights go to at::linear and int8
// weights to the kernel, kSmallM rows at a time. cpu::set_gemm(false) turns the tiles off (A/Bs).
// Prompt prefill (cpu::set_prefill, thread-local; specdec.ops.prefill_rows) takes the tiles at every
// row count: a prompt's rows then do not depend on its length or batch, and the group-quantized
// prefill of a ~40-token prompt runs 1.35-1.38x the few-row kernel's speed (float32: parity).
// On an AVX-512 CPU the few-row kernel's 4/5-32-row passes take csrc/cpu/linear_avx512.cpp (the same
// bits: see rows_of).
#include <ATen/Parallel.h>

#include <atomic>

#include "checks.h"
#include "cpu/head_argmax.h"
#include "ops.h"
#include "specdec/cpu_isa.h"

#define SPECDEC_CPU_ISA base
#include "cpu/raw.h"

namespace specdec {
namespace cpu {
void linear_rows_avx2(const LinearParams& P, int64_t n_begin, int64_t n_end);    // linear_avx2.cpp
void qlinear_rows_avx2(const QLinearParams& P, int64_t n_begin, int64_t n_end);  // linear_avx2.cpp
void gemm_linear_rows_avx2(const LinearParams& P, int64_t n_begin, int64_t n_end, float* scratch);  // cpu_gemm.h
void gemm_q_rows_avx2(const QLinearParams& P, int64_t n_begin, int64_t n_end, float* scratch);       // cpu_gemm.h
void linear_rows_avx512(const LinearParams& P, int64_t n_begin, int64_t n_end);    // linear_avx512.cpp
void qlinear_rows_avx512(const QLinearParams& P, int64_t n_begin, int64_t n_end);  // linear_avx512.cpp

namespace {

constexpr int64_t kSmallM = kLinearRowsPerPass;
constexpr int64_t kBlasM = kLinearBlasRows;
constexpr int64_t kNr = base::kNr;  // same tile in both ISAs

WType to_wtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return WType::kFloat32;
    case at::kHalf: return WType::kFloat16;
    case at::kBFloat16: return WType::kBFloat16;
    default: return WType::kInt8;
  }
}

// Rows [n0, n1) of P by the best kernel this CPU runs. With K % 8 == 0 the AVX-512 tile takes float32
// weights from 4 rows of x and the narrow types from 5 (the AVX2 kernel's bits either way; a K with a
// scalar tail keeps AVX2, whose tail the compiler schedules its own way). Fewer rows keep the AVX2
// schedules: benchmarks/bench_rows.py (results/rows_cpu_2026-12-03*.json) has the tile at 0.95x / 1.04x /
// 1.18-1.55x the AVX2 float32 stream at 2 / 3 / 4 rows and 0.80-0.98x for int8, Q8_0 and Q4_1 at 2-4 rows.
constexpr int64_t kAvx512RowsF32 = 4, kAvx512Rows = 5;
inline void rows_of(const LinearParams& P, int64_t n0, int64_t n1, bool avx2, bool avx512) {
  if (avx512 && P.M >= (P.wtype == WType::kFloat32 ? kAvx512RowsF32 : kAvx512Rows) && P.K % 8 == 0)
    linear_rows_avx512(P, n0, n1);
  else if (avx2) linear_rows_avx2(P, n0, n1);
  else base::linear_rows(P, n0, n1);
}

// y[:, :] for all M rows of P (M <= kSmallM), output columns split over threads.
void run(const LinearParams& P) {
  const bool avx2 = has_avx2_fma_f16c(), avx512 = avx512_active();
  const int64_t blocks = (P.N + kNr - 1) / kNr;
  // At least ~256 KiB of weight per task so that small layers do not pay the fork.
  const int64_t es = wtype_size(P.wtype);
  const int64_t grain = std::max<int64_t>(1, (int64_t(256) << 10) / std::max<int64_t>(1, kNr * P.K * es));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kNr, n1 = std::min(end * kNr, P.N);
    rows_of(P, n0, n1, avx2, avx512);
  });
}

// Prefill sizes on AVX2 (cpu_gemm.h): the weight rows split over the threads in whole quads (every
// output is one sequence of operations whatever the split); each task gets a scratch of 4 * K floats
// for the quads it decodes (unused for float32 weights, which are read in place).
template <typename F>
void run_gemm(int64_t N, int64_t K, F&& rows) {
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(4 * K);
    rows(begin * 4, std::min(end * 4, N), scratch.data());
  });
}

// y[:, :] for all M rows of a group-quantized weight, output rows split over threads.
// The kernel is compute-bound (codes widened to float32): tasks of >= ~256K multiply-adds
// (~25 us on one core), so that the 576-row layers of a small model still use both cores.
void run_q(const QLinearParams& P) {
  const bool avx2 = has_avx2_fma_f16c(), avx512 = avx512_active() && P.M >= kAvx512Rows;
  constexpr int64_t nr = 8;  // rows per task unit: the AVX2 tile's M = 1 block
  const int64_t blocks = (P.N + nr - 1) / nr;
  const int64_t grain = std::max<int64_t>(1, (int64_t(256) << 10) / std::max<int64_t>(1, nr * P.K * P.M));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * nr, n1 = std::min(end * nr, P.N);
    if (avx512) qlinear_rows_avx512(P, n0, n1);  // the AVX2 tile's bits, 4 weight rows x 8 x rows
    else if (avx2) qlinear_rows_avx2(P, n0, n1);
    else base::qlinear_rows(P, n0, n1);
  });
}

}  // namespace

// Whether M rows take cpu_gemm.h's tiles (AVX2, switched on): prefill sizes (more than kBlasM rows),
// or any M inside prefill rows (set_prefill).
static bool tiles_for(int64_t M) {
  return (M > kBlasM || prefill_enabled()) && has_avx2_fma_f16c() && gemm_enabled();
}

// The same for a linear of weight type wt (K % 8 == 0): float32 weights only with float32 x and up to
// kLinearGemmRows rows (more: the BLAS GEMM); half and int8 weights at any M.
static bool tiles_for(int64_t M, int64_t K, WType wt, bool x_float32) {
  return tiles_for(M) && K % 8 == 0 && (wt != WType::kFloat32 || (x_float32 && M <= kLinearGemmRows));
}

void linear_raw(LinearParams P) {
  if (tiles_for(P.M, P.K, P.wtype, true)) {
    run_gemm(P.N, P.K, [&](int64_t n0, int64_t n1, float* scratch) { gemm_linear_rows_avx2(P, n0, n1, scratch); });
    return;
  }
  const float* x = P.x;
  float* y = P.y;
  const int64_t M = P.M;
  for (int64_t m0 = 0; m0 < M; m0 += kSmallM) {
    P.M = std::min(kSmallM, M - m0);
    P.x = x + m0 * P.x_stride;
    P.y = y + m0 * P.y_stride;
    run(P);
  }
}

void linear_multi_raw(const std::vector<LinearParams>& P) {
  if (P.empty()) return;
  if (P[0].M > kSmallM || tiles_for(P[0].M, P[0].K, P[0].wtype, true)) {
    for (const LinearParams& p : P) linear_raw(p);
    return;
  }
  std::vector<int64_t> first_block(P.size() + 1, 0);  // weight j owns blocks [first_block[j], first_block[j + 1])
  for (size_t j = 0; j < P.size(); ++j) first_block[j + 1] = first_block[j] + (P[j].N + kNr - 1) / kNr;
  const bool avx2 = has_avx2_fma_f16c(), avx512 = avx512_active();
  const int64_t es = wtype_size(P[0].wtype);
  const int64_t grain = std::max<int64_t>(1, (int64_t(256) << 10) / std::max<int64_t>(1, kNr * P[0].K * es));
  at::parallel_for(0, first_block.back(), grain, [&](int64_t begin, int64_t end) {
    for (size_t j = 0; j < P.size(); ++j) {
      const int64_t b0 = std::max(begin, first_block[j]), b1 = std::min(end, first_block[j + 1]);
      if (b0 >= b1) continue;
      const int64_t n0 = (b0 - first_block[j]) * kNr, n1 = std::min((b1 - first_block[j]) * kNr, P[j].N);
      rows_of(P[j], n0, n1, avx2, avx512);
    }
  });
}

void qlinear_raw(QLinearParams P) {
  const int64_t M = P.M, K = P.K, G = K / kQGroup;
  // prefill sizes on AVX2: the GEMM tiles over decoded weight quads (cpu_gemm.h), not batch
  // invariant with the few-row kernel, which keeps every decode / verify size (<= kBlasM rows)
  if (tiles_for(M)) {
    run_gemm(P.N, K, [&](int64_t n0, int64_t n1, float* scratch) { gemm_q_rows_avx2(P, n0, n1, scratch); });
    return;
  }
  // The baseline kernel's Q4_1 min term needs the sum of x over each group (the AVX2 tile folds
  // the min into the weights): one pass here, not per weight row.
  std::vector<float> xsum;
  if (P.mins && !has_avx2_fma_f16c()) {
    xsum.resize(M * G);
    for (int64_t i = 0; i < M * G; ++i) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t j = 0; j < kQGroup; ++j) acc[j & 7] += P.x[i * kQGroup + j];
      xsum[i] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
  }
  // kSmallM rows at a time (prefill too): the packed weight streamed once per chunk costs
  // less than dequantizing it to float32 for a GEMM (4-8x the bytes, written and read).
  const float* x = P.x;
  float* y = P.y;
  for (int64_t m0 = 0; m0 < M; m0 += kSmallM) {
    P.M = std::min(kSmallM, M - m0);
    P.x = x + m0 * K;
    P.xsum = xsum.empty() ? nullptr : xsum.data() + m0 * G;
    P.y = y + m0 * P.y_stride;
    run_q(P);
  }
}

namespace {
std::atomic<bool> g_gemm{true};
std::atomic<bool> g_avx512{true};
thread_local bool t_prefill = false;
}  // namespace

void set_gemm(bool on) { g_gemm.store(on, std::memory_order_relaxed); }
bool gemm_enabled() { return g_gemm.load(std::memory_order_relaxed); }
bool set_prefill(bool on) {
  const bool was = t_prefill;
  t_prefill = on;
  return was;
}
bool prefill_enabled() { return t_prefill; }
bool set_avx512(bool on) { return g_avx512.exchange(on, std::memory_order_relaxed); }
bool avx512_active() { return has_avx512() && g_avx512.load(std::memory_order_relaxed); }

}  // namespace cpu

namespace {
// linear's operands as its kernels take them (x as float32 rows, bias float32, the weight contiguous), held
// alive with their LinearParams (x, weight, scale, bias, M, K and the weight type; N and the output are the
// caller's).
struct LinearCall {
  at::Tensor w, x2;
  std::optional<at::Tensor> b32, s32;
  cpu::LinearParams P{};
  LinearCall(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
             const std::optional<at::Tensor>& weight_scale, int64_t M) {
    const int64_t K = weight.size(1);
    w = weight.contiguous();
    x2 = x.reshape({M, K});
    if (x2.scalar_type() != at::kFloat) x2 = x2.to(at::kFloat);
    if (x2.stride(1) != 1) x2 = x2.contiguous();
    if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
    if (weight_scale.has_value()) s32 = weight_scale->contiguous();
    P.w = w.data_ptr();
    P.scale = s32.has_value() ? s32->data_ptr<float>() : nullptr;
    P.bias = b32.has_value() ? b32->data_ptr<float>() : nullptr;
    P.K = K;
    P.wtype = cpu::to_wtype(w.scalar_type());
    P.x_stride = x2.stride(0);
    P.M = M;
    P.x = x2.data_ptr<float>();
  }
};
}  // namespace

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& weight_scale) {
  checks::linear(x, weight, bias, weight_scale);
  if (auto y = checks::linear_trivial(x, weight, bias)) return *y;
  const int64_t K = weight.size(1), N = weight.size(0);
  const int64_t M = checks::linear_rows(x);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const bool quantized = weight.scalar_type() == at::kChar;
  // prefill sizes (see the file comment; results/prefill_cpu_2026-12-03*.json): the tiles against
  // MKL's sgemm 1.10-1.61x per layer at 65-72 rows and 0.92-1.31x at 100-256; the bf16 target's
  // prefill 5.1-6.3x its BLAS GEMM's, the w8 draft's 1.13-1.30x the few-row kernel's
  const bool gemm = cpu::tiles_for(M, K, cpu::to_wtype(weight.scalar_type()), x.scalar_type() == at::kFloat);
  if (!quantized && M > cpu::kBlasM && !gemm) {
    return at::linear(x, weight, bias);
  }

  const bool direct = x.scalar_type() == at::kFloat;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const LinearCall C(x, weight, bias, weight_scale, M);
  cpu::LinearParams P = C.P;
  P.N = N;
  P.y_stride = N;
  P.y = y.data_ptr<float>();
  if (gemm) cpu::run_gemm(N, K, [&](int64_t n0, int64_t n1, float* scratch) { cpu::gemm_linear_rows_avx2(P, n0, n1, scratch); });
  else cpu::linear_raw(P);
  if (!direct) y = y.to(x.scalar_type());
  return y.view(out_shape);
}

at::Tensor qlinear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits) {
  checks::qlinear(x, qweight, scales, mins, bias, bits);
  if (auto y = checks::linear_trivial(x, qweight, bias)) return *y;
  const int64_t K = x.size(-1), N = qweight.size(0);
  const int64_t M = checks::linear_rows(x);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat).contiguous();
  std::optional<at::Tensor> b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  cpu::QLinearParams P;
  P.x_stride = K;
  P.qw = qweight.data_ptr();
  P.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  P.mins = mins.has_value() ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  P.bias = b32.has_value() ? b32->data_ptr<float>() : nullptr;
  P.y_stride = N;
  P.N = N;
  P.K = K;
  P.bits = int(bits);
  P.M = M;
  P.x = x2.data_ptr<float>();
  P.y = y.data_ptr<float>();
  cpu::qlinear_raw(P);
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(out_shape);
}

// linear_argmax / qlinear_argmax (float activations): decode and verify sizes take the blocked argmax over the
// few-row kernel's slabs (csrc/cpu/head_argmax.h); the shapes linear_cpu / qlinear_cpu send elsewhere (prefill
// sizes: the GEMM tiles or BLAS; nothing to stream) take the argmax of their materialised result.
at::Tensor linear_argmax_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& weight_scale) {
  const char* op = "linear_argmax";
  cpu::checked_as(op, "linear", [&] { checks::linear(x, weight, bias, weight_scale); });
  cpu::check_argmax_columns(op, weight.size(0));
  const int64_t K = weight.size(1), N = weight.size(0), M = checks::linear_rows(x);
  const std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end() - 1);
  const bool quantized = weight.scalar_type() == at::kChar;
  const cpu::WType wt = cpu::to_wtype(weight.scalar_type());
  if (M == 0 || K == 0 || cpu::tiles_for(M, K, wt, x.scalar_type() == at::kFloat) || (!quantized && M > cpu::kBlasM))
    return cpu::argmax_rows_cpu(linear_cpu(x, weight, bias, weight_scale)).view(out_shape);
  const LinearCall C(x, weight, bias, weight_scale, M);
  const cpu::LinearParams& P = C.P;
  const char* w0 = static_cast<const char*>(P.w);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  cpu::blocked_argmax(M, N, x.scalar_type(), [&](int64_t n0, int64_t n1, float* y, int64_t y_stride) {
    cpu::LinearParams S = P;
    S.w = w0 + n0 * K * cpu::wtype_size(wt);
    S.scale = P.scale ? P.scale + n0 : nullptr;
    S.bias = P.bias ? P.bias + n0 : nullptr;
    S.N = n1 - n0;
    S.y = y;
    S.y_stride = y_stride;
    cpu::linear_raw(S);
  }, out.data_ptr<int64_t>());
  return out.view(out_shape);
}

at::Tensor qlinear_argmax_float_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                                    int64_t bits) {
  const char* op = "qlinear_argmax";
  cpu::checked_as(op, "qlinear", [&] { checks::qlinear(x, qweight, scales, mins, bias, bits); });
  cpu::check_argmax_columns(op, qweight.size(0));
  const int64_t K = x.size(-1), N = qweight.size(0), M = checks::linear_rows(x), G = K / cpu::kQGroup;
  const std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end() - 1);
  if (M == 0 || K == 0 || cpu::tiles_for(M))
    return cpu::argmax_rows_cpu(qlinear_cpu(x, qweight, scales, mins, bias, bits)).view(out_shape);
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat).contiguous();
  std::optional<at::Tensor> b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  cpu::QLinearParams P;
  P.x = x2.data_ptr<float>();
  P.x_stride = K;
  P.xsum = nullptr;
  P.M = M;
  P.K = K;
  P.bits = int(bits);
  const int64_t row_bytes = bits == 8 ? K : K / 2;
  const uint8_t* qw0 = static_cast<const uint8_t*>(qweight.data_ptr());
  const uint16_t* sc0 = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mn0 = mins.has_value() ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  const float* bias0 = b32.has_value() ? b32->data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  cpu::blocked_argmax(M, N, x.scalar_type(), [&](int64_t n0, int64_t n1, float* y, int64_t y_stride) {
    cpu::QLinearParams S = P;
    S.qw = qw0 + n0 * row_bytes;
    S.scales = sc0 + n0 * G;
    S.mins = mn0 ? mn0 + n0 * G : nullptr;
    S.bias = bias0 ? bias0 + n0 : nullptr;
    S.N = n1 - n0;
    S.y = y;
    S.y_stride = y_stride;
    cpu::qlinear_raw(S);
  }, out.data_ptr<int64_t>());
  return out.view(out_shape);
}

}  // namespace specdec
