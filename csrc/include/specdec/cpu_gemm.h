// linear and qlinear on the CPU for MANY rows of x (prefill): y = x W^T + bias, compute-bound; AVX2 +
// FMA only. linear: float32 weights and activations at kLinearBlasRows < M <= kLinearGemmRows, K a
// multiple of 8 (the baseline build and the other cases keep torch's BLAS GEMM); float16 / bfloat16
// weights and int8 weights (per-row scale) at M > kLinearBlasRows, K a multiple of 8, widened like the
// quantized ones below (else: the BLAS GEMM for half weights, ~10-12 G mul-add/s here without native
// bf16 / fp16 FMAs, against ~80 for the tiles; the few-row kernel for int8). qlinear: any
// group-quantized weight at M > kLinearBlasRows, its weight rows decoded to float32 four at a time
// into a scratch once per chunk of x rows (instead of the few-row kernel, 32 rows per pass, which
// widens every group again for every pass and tile).
//
// Dot-product micro-tiles of 4 weight rows x 3 x rows: 12 accumulators of 8 partial sums, 3 x
// vectors and 1 weight vector in flight (16 registers, no spills); per 8 inputs 7 loads feed 12
// FMAs, so the FMA ports, not the loads, set the pace. Each tile runs over the whole K and is
// reduced horizontally once (4 consecutive outputs of an x row in one reduction and one store).
// No packing: W is [N, K] row-major as nn.Linear keeps it, x is [M, K].
// Cache blocking: a task owns a range of weight rows; x goes in chunks of kGemmChunkRows rows
// (L2-resident), and each weight row quad, L1-resident after its first use, meets every x row
// triple of the chunk (the x rows stream from L2 at 3 loads per 12 FMAs; the other order, a block
// of 48 weight rows in L2 met by L1-resident x triples, streams 4 loads per 12 FMAs from L2 and
// measured 0.96-1.0x of this one in an interleaved A/B).
//
// Exploratory interleaved A/B on the bundled SmolLM2 target's layer shapes (qkv 960 x 576, o
// 576 x 576, gate_up 3072 x 576, down 576 x 1536), 2 threads, against torch's MKL sgemm
// (torch.nn.functional.linear): ~82-84 G mul-add/s at any M from 65 to 512 (the FMA peak of the two
// cores measures ~97) against MKL's 63-77 at 65-144 rows (1.08-1.30x) and 83-86 at 256-512
// (0.97-1.01x), hence kLinearGemmRows. The numbers of record, whole prefills included:
// benchmarks/bench_prefill.py (results/prefill_cpu_2026-12-03*.json).
//
// Every output is one sequence of operations (the K loop of its accumulator, then the same
// 4-lane reduction, whatever the tile's shape): a row's result does not depend on M, on the other
// rows or on the thread count. It differs in rounding from the few-row kernel (cpu_linear.h),
// which sums in another order.
#pragma once

#include <algorithm>
#include <cstdint>

#include "specdec/cpu_linear.h"
#include "specdec/cpu_qlinear.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace specdec {
namespace cpu {
namespace avx2 {

constexpr int64_t kGemmChunkRows = 96;  // x rows per chunk (96 * K * 4 bytes, L2-resident)
constexpr int kGemmNr = 4;              // weight rows per tile
constexpr int kGemmMr = 3;              // x rows per tile

// 4 accumulators -> their 4 horizontal sums as one vector: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline __m128 gemm_hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// y[m0 .. m0 + MR, n0 .. n0 + NR) over the whole K: x rows from x (row stride xs), weight rows from w
// (row stride ldw), outputs to y (row stride ys), bias (at n0) or nullptr.
template <int NR, int MR>
inline void gemm_tile(const float* x, int64_t xs, const float* w, int64_t ldw, int64_t K, const float* bias,
                      float* y, int64_t ys) {
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = x + m * xs;
  const float* wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = w + r * ldw;
  __m256 acc[4][MR];
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(xr[m] + k);
    for (int r = 0; r < NR; ++r) {
      const __m256 wv = _mm256_loadu_ps(wr[r] + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  // the same reduction for every tile shape (unused accumulators are zero)
  for (int m = 0; m < MR; ++m) {
    const __m128 s = gemm_hsum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]);
    float* yr = y + m * ys;
    if constexpr (NR == 4) {
      _mm_storeu_ps(yr, bias ? _mm_add_ps(s, _mm_loadu_ps(bias)) : s);
    } else {
      alignas(16) float t[4];
      _mm_store_ps(t, s);
      for (int r = 0; r < NR; ++r) yr[r] = bias ? t[r] + bias[r] : t[r];
    }
  }
}

// x rows [m0, m1) against NR weight rows (w, row stride ldw) for outputs [n0, n0 + NR), kGemmMr x rows
// at a time.
template <int NR>
inline void gemm_rows_nr(const float* x, int64_t xs, const float* w, int64_t ldw, int64_t K, const float* bias,
                         float* y, int64_t ys, int64_t n0, int64_t m0, int64_t m1) {
  const float* b = bias ? bias + n0 : nullptr;
  int64_t m = m0;
  for (; m + kGemmMr <= m1; m += kGemmMr) gemm_tile<NR, kGemmMr>(x + m * xs, xs, w, ldw, K, b, y + m * ys + n0, ys);
  if (m1 - m == 2) gemm_tile<NR, 2>(x + m * xs, xs, w, ldw, K, b, y + m * ys + n0, ys);
  else if (m1 - m == 1) gemm_tile<NR, 1>(x + m * xs, xs, w, ldw, K, b, y + m * ys + n0, ys);
}

// Outputs [n, n + rows) (rows <= 4) of x rows [c0, c1): weight rows w (row stride ldw).
inline void gemm_rows(const float* x, int64_t xs, const float* w, int64_t ldw, int64_t K, const float* bias,
                      float* y, int64_t ys, int64_t n, int64_t rows, int64_t c0, int64_t c1) {
  switch (rows) {
    case 4: gemm_rows_nr<4>(x, xs, w, ldw, K, bias, y, ys, n, c0, c1); break;
    case 3: gemm_rows_nr<3>(x, xs, w, ldw, K, bias, y, ys, n, c0, c1); break;
    case 2: gemm_rows_nr<2>(x, xs, w, ldw, K, bias, y, ys, n, c0, c1); break;
    case 1: gemm_rows_nr<1>(x, xs, w, ldw, K, bias, y, ys, n, c0, c1); break;
    default: break;
  }
}

// The schedule of every weight format: x in chunks of kGemmChunkRows rows, and per chunk each quad of
// weight rows [n, n + rows) as float32 rows of stride K from quad(n, rows) (the weight itself, or its
// rows decoded into the caller's scratch), met by all the chunk's x rows.
template <typename Quad>
inline void gemm_drive(const float* x, int64_t xs, int64_t M, int64_t K, const float* bias, float* y, int64_t ys,
                       int64_t n_begin, int64_t n_end, Quad&& quad) {
  for (int64_t c0 = 0; c0 < M; c0 += kGemmChunkRows) {
    const int64_t c1 = std::min(M, c0 + kGemmChunkRows);
    for (int64_t n = n_begin; n < n_end; n += kGemmNr) {
      const int64_t rows = std::min<int64_t>(kGemmNr, n_end - n);
      gemm_rows(x, xs, quad(n, rows), K, K, bias, y, ys, n, rows, c0, c1);
    }
  }
}

// Outputs y[:, n_begin:n_end) of a linear weight (P.K % 8 == 0). Float32 weights are read in place;
// float16 / bfloat16 / int8 weights are widened (load_w, as the few-row kernel widens them; int8 as
// q * scale[n], one rounding per weight, where the few-row kernel scales the dot product instead) into
// the scratch (4 * K floats) once per quad and x chunk.
template <WType WT>
inline void gemm_linear_rows_t(const LinearParams& P, int64_t n_begin, int64_t n_end, float* scratch) {
  gemm_drive(P.x, P.x_stride, P.M, P.K, P.bias, P.y, P.y_stride, n_begin, n_end, [&](int64_t n, int64_t rows) {
    if constexpr (WT == WType::kFloat32) {
      return static_cast<const float*>(P.w) + n * P.K;
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        const void* w = w_row<WT>(P.w, n + r, P.K);
        float* o = scratch + r * P.K;
        const v8f sc = v8_set1(WT == WType::kInt8 && P.scale ? P.scale[n + r] : 1.0f);
        for (int64_t k = 0; k < P.K; k += 8) v8_store(o + k, WT == WType::kInt8 ? load_w<WT>(w, k) * sc : load_w<WT>(w, k));
      }
      return static_cast<const float*>(scratch);
    }
  });
}

inline void gemm_linear_rows(const LinearParams& P, int64_t n_begin, int64_t n_end, float* scratch) {
  switch (P.wtype) {
    case WType::kFloat32: return gemm_linear_rows_t<WType::kFloat32>(P, n_begin, n_end, scratch);
    case WType::kFloat16: return gemm_linear_rows_t<WType::kFloat16>(P, n_begin, n_end, scratch);
    case WType::kBFloat16: return gemm_linear_rows_t<WType::kBFloat16>(P, n_begin, n_end, scratch);
    case WType::kInt8: return gemm_linear_rows_t<WType::kInt8>(P, n_begin, n_end, scratch);
  }
}

// Outputs y[:, n_begin:n_end) of a group-quantized weight (P.x contiguous [M, K]): each weight quad is
// decoded into the scratch (4 * K floats, L1-resident) once per x chunk, w = d * q (+ m), the values the
// few-row kernel computes (q_group_weights_avx2), so the decode (~1/3 op per weight) is paid once per
// 96 rows.
template <int BITS, bool MINS>
inline void gemm_q_rows_t(const QLinearParams& P, int64_t n_begin, int64_t n_end, float* scratch) {
  const int64_t G = P.K / kQGroup;
  gemm_drive(P.x, P.x_stride, P.M, P.K, P.bias, P.y, P.y_stride, n_begin, n_end, [&](int64_t n, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = (n + r) * G + g;
        __m256 w[4];
        q_group_weights_avx2<BITS, MINS>(P, n + r, g, _cvtsh_ss(P.scales[i]), MINS ? _cvtsh_ss(P.mins[i]) : 0.0f, w);
        for (int k = 0; k < 4; ++k) _mm256_storeu_ps(scratch + r * P.K + g * kQGroup + 8 * k, w[k]);
      }
    return static_cast<const float*>(scratch);
  });
}

inline void gemm_q_rows(const QLinearParams& P, int64_t n_begin, int64_t n_end, float* scratch) {
  if (P.bits == 8) gemm_q_rows_t<8, false>(P, n_begin, n_end, scratch);
  else if (P.mins) gemm_q_rows_t<4, true>(P, n_begin, n_end, scratch);
  else gemm_q_rows_t<4, false>(P, n_begin, n_end, scratch);
}

}  // namespace avx2
}  // namespace cpu
}  // namespace specdec
#endif  // __AVX2__ && __FMA__
