// qlinear_q8act, CPU backend: group-quantized weights (Q8_0 / Q4_0 / Q4_1) times activations
// quantized per row and block of 32 to int8 (the definition: csrc/include/specdec/cpu_q8act.h).
// This file: validation, the activation quantization (once per call, on the calling thread: M * K
// values), the scalar tier, the tier choice and the parallel split over output rows. The vector
// tiers live in qlinear_q8act_avx2.cpp / _avxvnni.cpp / _avx512.cpp; all give the same bits.
//
// Compiled with -ffp-contract=off (CMakeLists.txt): the definition's fused multiply-adds are explicit
// (std::fma here, fma intrinsics in the vector tiers); every other product and sum rounds on its own.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/raw.h"
#include "q8act.h"
#include "specdec/cpu_isa.h"
#include "specdec/cpu_q8act.h"
#include "specdec/cpu_vec.h"

namespace specdec {
namespace cpu {

void q8_quantize_scalar(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* a, float* dq, int32_t* r,
                        float* s) {
  const int64_t G = K / kQ8Block;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xb = x + m * x_stride + g * kQ8Block;
      int8_t* ab = a + m * K + g * kQ8Block;
      float amax = 0.0f;
      for (int64_t j = 0; j < kQ8Block; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f, inv = 127.0f / amax, id = std::isfinite(inv) ? inv : 0.0f;
      for (int64_t j = 0; j < kQ8Block; ++j) {
        const float q = std::nearbyint(xb[j] * id);  // the default rounding mode: half to even
        ab[j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
      }
      const int64_t o = (m * G + g) * 8;
      int32_t sum = 0;
      for (int l = 0; l < 8; ++l) {
        r[o + l] = ab[4 * l] + ab[4 * l + 1] + ab[4 * l + 2] + ab[4 * l + 3];
        sum += r[o + l];
      }
      dq[m * G + g] = d;
      s[m * G + g] = static_cast<float>(sum) * d;
    }
  }
}

namespace {

// Weight code j of block g of row n (Q8_0: q; Q4_0: q - 8; Q4_1: q).
inline int32_t weight_code(const Q8ActParams& P, int64_t n, int64_t g, int j) {
  if (P.bits == 8) return static_cast<const int8_t*>(P.qw)[n * P.K + g * kQ8Block + j];
  const uint8_t b = static_cast<const uint8_t*>(P.qw)[n * (P.K / 2) + g * 16 + (j & 15)];
  const int32_t q = j < 16 ? (b & 15) : (b >> 4);
  return P.mins ? q : q - 8;
}

}  // namespace

void q8act_rows_scalar(const Q8ActParams& P, int64_t n_begin, int64_t n_end) {
  const int64_t G = P.K / kQ8Block;
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m = 0; m < P.M; ++m) {
      float acc[16] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f,
                       0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      float macc[16] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f,
                        0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      const int8_t* am = P.a + m * P.K;
      for (int64_t g = 0; g < G; ++g) {
        const float dd = half_to_float(P.scales[n * G + g]) * P.d[m * G + g];
        for (int l = 0; l < 8; ++l) {
          int32_t p = 0;
          for (int j = 4 * l; j < 4 * l + 4; ++j) p += weight_code(P, n, g, j) * am[g * kQ8Block + j];
          float& a = acc[(g & 1) * 8 + l];
          a = std::fma(static_cast<float>(p), dd, a);
        }
        if (P.mins) {
          macc[g & 15] = std::fma(half_to_float(P.mins[n * G + g]), P.s[m * G + g], macc[g & 15]);
        }
      }
      float y = q8_fold16(acc);
      if (P.mins) y = y + q8_fold16(macc);
      P.y[m * P.y_stride + n] = y + (P.bias ? P.bias[n] : 0.0f);
    }
  }
}

namespace {

std::atomic<int> g_tier{kQ8TierAuto};

bool tier_supported(int t) {
#if defined(__x86_64__) || defined(__i386__)
  switch (t) {
    case kQ8Avx512Vnni: {
      static const bool ok = has_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512vnni");
      return ok;
    }
    case kQ8AvxVnni: {
      static const bool ok = has_avx2_fma_f16c() && __builtin_cpu_supports("avxvnni");
      return ok;
    }
    case kQ8Avx2: return has_avx2_fma_f16c();
    default: return t == kQ8Scalar;
  }
#else
  return t == kQ8Scalar;
#endif
}

constexpr const char* kTierNames[] = {"avx512_vnni", "avx_vnni", "avx2", "scalar"};

int active_tier() {
  const int forced = g_tier.load(std::memory_order_relaxed);
  if (forced != kQ8TierAuto) return forced;
  for (int t = kQ8Avx512Vnni; t <= kQ8Scalar; ++t)
    if (tier_supported(t)) return t;
  return kQ8Scalar;
}

}  // namespace

std::string set_q8act_tier(const std::string& name) {
  const std::string previous = g_tier.load() == kQ8TierAuto ? "auto" : kTierNames[g_tier.load()];
  if (name == "auto") {
    g_tier.store(kQ8TierAuto);
    return previous;
  }
  for (int t = kQ8Avx512Vnni; t <= kQ8Scalar; ++t) {
    if (name != kTierNames[t]) continue;
    TORCH_CHECK(tier_supported(t), "set_q8act_tier: this CPU does not run the ", name, " tier; it runs ",
                q8act_tiers());
    g_tier.store(t);
    return previous;
  }
  TORCH_CHECK(false, "set_q8act_tier: tier must be one of auto, avx512_vnni, avx_vnni, avx2, scalar; got '", name,
              "'");
  return previous;
}

std::string q8act_tier() { return kTierNames[active_tier()]; }

std::string q8act_tiers() {
  std::string out;
  for (int t = kQ8Avx512Vnni; t <= kQ8Scalar; ++t)
    if (tier_supported(t)) out += (out.empty() ? "" : ",") + std::string(kTierNames[t]);
  return out;
}

void qlinear_q8act_raw(const float* x, int64_t x_stride, const QLinearParams& Q) {
  const int64_t M = Q.M, K = Q.K, G = K / kQ8Block;
  const int tier = active_tier();
  // one scratch per calling thread, kept across calls (no allocation per decode step once it has grown):
  // codes [M, K], then r [M, G, 8], d / s [M, G] (4-byte aligned: K % 32 == 0)
  thread_local std::vector<int32_t> scratch;
  const size_t need = size_t(M * K / 4 + M * G * 8 + 2 * M * G);
  if (scratch.size() < need) scratch.resize(need);
  int8_t* a = reinterpret_cast<int8_t*>(scratch.data());
  int32_t* r = scratch.data() + M * K / 4;
  float* d = reinterpret_cast<float*>(r + M * G * 8);
  float* s = d + M * G;
  if (tier == kQ8Scalar) q8_quantize_scalar(x, x_stride, M, K, a, d, r, s);
  else q8_quantize_avx2(x, x_stride, M, K, a, d, r, s);
  if (tier == kQ8Avx512Vnni && Q.bits == 4) q8_interleave_pairs_avx512(a, Q.mins ? nullptr : r, M, K);
  Q8ActParams P;
  P.a = a;
  P.d = d;
  P.r = r;
  P.s = s;
  P.qw = Q.qw;
  P.scales = Q.scales;
  P.mins = Q.mins;
  P.bias = Q.bias;
  P.y = Q.y;
  P.y_stride = Q.y_stride;
  P.M = M;
  P.N = Q.N;
  P.K = K;
  P.bits = Q.bits;
  auto rows = tier == kQ8Avx512Vnni ? &q8act_rows_avx512vnni
              : tier == kQ8AvxVnni  ? &q8act_rows_avxvnni
              : tier == kQ8Avx2     ? &q8act_rows_avx2
                                    : &q8act_rows_scalar;
  constexpr int64_t nr = 8;  // output rows per task unit
  const int64_t blocks = (P.N + nr - 1) / nr;
  // tasks of >= ~128K integer multiply-adds: a 576 x 576 decode-step weight splits over 2 threads (at
  // 512K it ran on one thread)
  const int64_t grain = std::max<int64_t>(1, (int64_t(128) << 10) / std::max<int64_t>(1, nr * K * M));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    rows(P, begin * nr, std::min(end * nr, P.N));
  });
}

}  // namespace cpu

at::Tensor qlinear_q8act_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                             int64_t bits) {
  checks::qlinear_q8act(x, qweight, scales, mins, bias, bits);
  if (auto y = checks::linear_trivial(x, qweight, bias)) return *y;
  const int64_t K = x.size(-1), N = qweight.size(0);
  const int64_t M = checks::linear_rows(x);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat).contiguous();
  std::optional<at::Tensor> b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  cpu::QLinearParams Q;
  Q.x = nullptr;
  Q.x_stride = K;
  Q.xsum = nullptr;
  Q.qw = qweight.data_ptr();
  Q.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  Q.mins = mins.has_value() ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  Q.bias = b32.has_value() ? b32->data_ptr<float>() : nullptr;
  Q.y = y.data_ptr<float>();
  Q.y_stride = N;
  Q.M = M;
  Q.N = N;
  Q.K = K;
  Q.bits = int(bits);
  cpu::qlinear_q8act_raw(x2.data_ptr<float>(), K, Q);
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(out_shape);
}

std::tuple<at::Tensor, at::Tensor> quantize_q8_cpu(const at::Tensor& x) {
  checks::quantize_q8(x);
  const int64_t K = x.size(-1), M = checks::linear_rows(x), G = K / cpu::kQ8Block;
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat).contiguous();
  at::Tensor a = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, G}, x.options().dtype(at::kFloat));
  std::vector<float> s(M * G);
  std::vector<int32_t> r(M * G * 8);
  if (M > 0 && K > 0) {
    if (cpu::q8act_tier() == "scalar")
      cpu::q8_quantize_scalar(x2.data_ptr<float>(), K, M, K, a.data_ptr<int8_t>(), d.data_ptr<float>(), r.data(),
                              s.data());
    else
      cpu::q8_quantize_avx2(x2.data_ptr<float>(), K, M, K, a.data_ptr<int8_t>(), d.data_ptr<float>(), r.data(),
                            s.data());
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  std::vector<int64_t> dshape = shape;
  dshape.back() = G;
  return {a.view(shape), d.view(dshape)};
}

}  // namespace specdec
