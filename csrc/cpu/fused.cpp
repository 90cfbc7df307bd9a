// The fused small ops of a Llama-style layer, CPU backend: rms_norm, add_rms_norm, rope,
// silu_mul (specdec/reference.py has the math). Each replaces 3-8 separate torch calls
// of a decode step; at decode sizes (one row of H = 576) the cost of a call is its
// dispatch, so fusing is what counts here, not the arithmetic.
//
// Rounding follows the unfused torch expressions step by step (transformers' modules):
//   rms_norm:  r = T(x * rsqrt(mean(x^2) + eps)) in float32, out = T(w * r)
//   add_rms_norm: s = T(x + residual), then rms_norm(s); returns (out, s)
//   rope:      out = T(T(x * cos) + T(rotate_half(x) * sin))
//   silu_mul:  out = T(T(silu(gate)) * up)
// (T = round to the tensor dtype; identity for float32). This file is compiled with
// -ffp-contract=off, so rope's products and sums round separately as torch's do and its
// output is bit-identical to the reference (and to the CUDA kernel, which uses __fmul_rn /
// __fadd_rn). rms_norm's sum of squares and silu's exp are float32 within rounding.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <type_traits>

#include "checks.h"
#include "cpu/raw.h"
#include "fused_host.h"
#include "specdec/cpu_isa.h"
#include "ops.h"

namespace specdec {
namespace cpu {
void silu_avx2(const float* g, const float* up, float* out, int64_t n);  // fused_avx2.cpp
}  // namespace cpu
namespace {

template <typename T>
inline float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));  // round to T (RNE), back to float
}

// Rows of H elements per task of rms_norm / add_rms_norm / rope: at least g_row_elems elements (a one-row decode
// step runs inline; set_fused_row_elems for A/Bs). The same bits for any split: rows never interact.
std::atomic<int64_t> g_row_elems{int64_t(1) << 15};
inline int64_t row_grain(int64_t H) {
  return std::max<int64_t>(1, g_row_elems.load(std::memory_order_relaxed) / std::max<int64_t>(1, H));
}

// silu * up per task: 4096 values (~3 us); a verify pass of 3+ nodes of a 1536-wide MLP uses both
// cores (measured, 2 threads: 8 nodes 11.2 -> 8.4 us, 32 nodes 37.1 -> 22.1 us; elementwise, so
// the same bits for any split).
constexpr int64_t kSiluGrain = 4096;

template <typename T>
void rms_rows(const T* x, const T* res, const T* w, T* out, T* sum, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, row_grain(H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      const T* rr = res ? res + r * H : nullptr;
      T* sr = sum ? sum + r * H : nullptr;
      // 8 partial sums (the compiler keeps them in one vector register)
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= H; i += 8) {
        for (int j = 0; j < 8; ++j) {
          float v = static_cast<float>(xr[i + j]);
          if (rr) {
            v = rnd<T>(v + static_cast<float>(rr[i + j]));
            sr[i + j] = static_cast<T>(v);
          }
          acc[j] += v * v;
        }
      }
      for (; i < H; ++i) {
        float v = static_cast<float>(xr[i]);
        if (rr) {
          v = rnd<T>(v + static_cast<float>(rr[i]));
          sr[i] = static_cast<T>(v);
        }
        acc[i & 7] += v * v;
      }
      const float ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      const T* src = rr ? sr : xr;
      T* o = out + r * H;
      for (int64_t k = 0; k < H; ++k)
        o[k] = static_cast<T>(static_cast<float>(w[k]) * rnd<T>(static_cast<float>(src[k]) * inv));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const at::Tensor& x_in, const at::Tensor* res_in,
                                                 const at::Tensor& w_in, double eps) {
  NormBuffers b = norm_buffers(x_in, res_in, w_in);
  if (b.rows == 0) return {b.out, b.sum};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(b.x.data_ptr<scalar_t>(), res_in ? b.res.data_ptr<scalar_t>() : nullptr,
                       b.w.data_ptr<scalar_t>(), b.out.data_ptr<scalar_t>(),
                       res_in ? b.sum.data_ptr<scalar_t>() : nullptr, b.rows, b.H, float(eps));
  });
  return {b.out, b.sum};
}

// x: BN positions x_stride elements apart, each Hh heads of D; out contiguous.
template <typename T>
void rope_rows(const T* x, int64_t x_stride, const T* cos, const T* sin, T* out, int64_t BN, int64_t Hh, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, BN, row_grain(Hh * D), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const T* c = cos + p * D;
      const T* s = sin + p * D;
      for (int64_t h = 0; h < Hh; ++h) {
        const T* xr = x + p * x_stride + h * D;
        T* o = out + (p * Hh + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(xr[i]), x2 = static_cast<float>(xr[i + half]);
          o[i] = static_cast<T>(rnd<T>(x1 * static_cast<float>(c[i])) + rnd<T>(-x2 * static_cast<float>(s[i])));
          o[i + half] = static_cast<T>(rnd<T>(x2 * static_cast<float>(c[i + half])) +
                                       rnd<T>(x1 * static_cast<float>(s[i + half])));
        }
      }
    }
  });
}

at::Tensor rope_one(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t BN = x.size(0) * x.size(1), Hh = x.size(2), D = x.size(3);
  if (x.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), Hh * D, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), BN, Hh, D);
  });
  return out;
}

}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  checks::rms_norm("rms_norm", x, nullptr, weight, eps);
  return std::get<0>(rms_norm_impl(x, nullptr, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps) {
  checks::rms_norm("add_rms_norm", x, &residual, weight, eps);
  return rms_norm_impl(x, &residual, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                            const at::Tensor& sin) {
  checks::rope(q, k, cos, sin);
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  return {rope_one(q, c, s), rope_one(k, c, s)};
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_in, const at::Tensor& up_in) {
  checks::silu_mul(gate_in, up_in);
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  const int64_t n = gate.numel();
  if (n == 0) return out;
  if (gate.scalar_type() == at::kFloat) {
    cpu::silu_mul_f32(gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "silu_mul", [&] {
    const scalar_t* g = gate.data_ptr<scalar_t>();
    const scalar_t* u = up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const bool avx2 = cpu::has_avx2_fma_f16c();
    at::parallel_for(0, n, kSiluGrain, [&](int64_t i0, int64_t i1) {
      if (!avx2) {
        for (int64_t i = i0; i < i1; ++i) {
          const float gv = static_cast<float>(g[i]);
          const float si = rnd<scalar_t>(gv / (1.0f + std::exp(-gv)));
          o[i] = static_cast<scalar_t>(si * static_cast<float>(u[i]));
        }
        return;
      }
      // the AVX2 kernel (csrc/cpu/fused_avx2.cpp) on float32 chunks of silu, then the roundings
      // and the product as above (float32 itself: cpu::silu_mul_f32, one pass)
      constexpr int64_t kChunk = 512;
      float gs[kChunk];
      for (int64_t c0 = i0; c0 < i1; c0 += kChunk) {
        const int64_t c = std::min(kChunk, i1 - c0);
        for (int64_t j = 0; j < c; ++j) gs[j] = static_cast<float>(g[c0 + j]);
        cpu::silu_avx2(gs, nullptr, gs, c);
        for (int64_t j = 0; j < c; ++j)
          o[c0 + j] = static_cast<scalar_t>(rnd<scalar_t>(gs[j]) * static_cast<float>(u[c0 + j]));
      }
    });
  });
  return out;
}

namespace cpu {

void rms_norm_f32(const float* x, const float* res, const float* w, float* out, float* sum, int64_t rows, int64_t H,
                  float eps) {
  rms_rows<float>(x, res, w, out, sum, rows, H, eps);
}

int64_t set_fused_row_elems(int64_t elems) {
  TORCH_CHECK(elems >= 1, "set_fused_row_elems: elems must be >= 1, got ", elems);
  return g_row_elems.exchange(elems);
}

void rope_f32(const float* x, int64_t x_stride, const float* cos, const float* sin, float* out, int64_t BN,
              int64_t Hh, int64_t D) {
  rope_rows<float>(x, x_stride, cos, sin, out, BN, Hh, D);
}

namespace {
// o[i] = silu(g[i]) * u[i] for i < n on the calling thread (the AVX2 kernel when the CPU has it).
inline void silu_mul_span(const float* g, const float* u, float* o, int64_t n, bool avx2) {
  if (avx2) {
    silu_avx2(g, u, o, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) o[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
}
}  // namespace

void silu_mul_rows_f32(const float* g, const float* u, int64_t stride, float* o, int64_t rows, int64_t n) {
  const bool avx2 = has_avx2_fma_f16c();
  at::parallel_for(0, rows, std::max<int64_t>(1, kSiluGrain / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_span(g + r * stride, u + r * stride, o + r * n, n, avx2);
  });
}

void silu_mul_f32(const float* g, const float* u, float* o, int64_t n) {
  const bool avx2 = has_avx2_fma_f16c();
  at::parallel_for(0, n, kSiluGrain, [&](int64_t i0, int64_t i1) { silu_mul_span(g + i0, u + i0, o + i0, i1 - i0, avx2); });
}

}  // namespace cpu
}  // namespace specdec
