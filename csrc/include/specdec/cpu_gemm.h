// linear on the CPU for MANY rows of x (prefill: kLinearBlasRows < M <= kLinearGemmRows rows,
// float32 weights and activations, K a multiple of 8): y = x W^T + bias, compute-bound; AVX2 + FMA
// only (the baseline build and the other cases keep torch's BLAS GEMM).
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
// measured 0.97-1.0x of this one).
//
// Exploratory interleaved A/B on the bundled SmolLM2 target's layer shapes (qkv 960 x 576, o
// 576 x 576, gate_up 3072 x 576, down 576 x 1536), 2 threads, against torch's MKL sgemm
// (torch.nn.functional.linear): ~82-84 G mul-add/s at any M from 65 to 512 (the FMA peak of the two
// cores measures ~97) against MKL's 63-77 at 65-144 rows (1.08-1.30x) and 83-86 at 256-512
// (0.97-1.01x), hence kLinearGemmRows. The number of record: benchmarks/bench_prefill.py.
//
// Every output is one sequence of operations (the K loop of its accumulator, then the same
// 4-lane reduction, whatever the tile's shape): a row's result does not depend on M, on the other
// rows or on the thread count. It differs in rounding from the few-row kernel (cpu_linear.h),
// which sums in another order.
#pragma once

#include <algorithm>
#include <cstdint>

#include "specdec/cpu_linear.h"

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

// y[m0 .. m0 + MR, n0 .. n0 + NR) over the whole K.
template <int NR, int MR>
inline void gemm_tile(const LinearParams& P, const float* W, int64_t n0, int64_t m0) {
  const int64_t K = P.K;
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = P.x + (m0 + m) * P.x_stride;
  const float* wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = W + (n0 + r) * K;
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
    float* y = P.y + (m0 + m) * P.y_stride + n0;
    if constexpr (NR == 4) {
      _mm_storeu_ps(y, P.bias ? _mm_add_ps(s, _mm_loadu_ps(P.bias + n0)) : s);
    } else {
      alignas(16) float t[4];
      _mm_store_ps(t, s);
      for (int r = 0; r < NR; ++r) y[r] = P.bias ? t[r] + P.bias[n0 + r] : t[r];
    }
  }
}

// x rows [m0, m1) against weight rows [n0, n0 + NR), kGemmMr x rows at a time.
template <int NR>
inline void gemm_rows_nr(const LinearParams& P, const float* W, int64_t n0, int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + kGemmMr <= m1; m += kGemmMr) gemm_tile<NR, kGemmMr>(P, W, n0, m);
  if (m1 - m == 2) gemm_tile<NR, 2>(P, W, n0, m);
  else if (m1 - m == 1) gemm_tile<NR, 1>(P, W, n0, m);
}

// Outputs y[:, n_begin:n_end) (float32 weights, P.K % 8 == 0).
inline void gemm_f32_rows(const LinearParams& P, int64_t n_begin, int64_t n_end) {
  const float* W = static_cast<const float*>(P.w);
  for (int64_t c0 = 0; c0 < P.M; c0 += kGemmChunkRows) {
    const int64_t c1 = std::min(P.M, c0 + kGemmChunkRows);
    int64_t n = n_begin;
    for (; n + kGemmNr <= n_end; n += kGemmNr) gemm_rows_nr<kGemmNr>(P, W, n, c0, c1);
    switch (n_end - n) {
      case 3: gemm_rows_nr<3>(P, W, n, c0, c1); break;
      case 2: gemm_rows_nr<2>(P, W, n, c0, c1); break;
      case 1: gemm_rows_nr<1>(P, W, n, c0, c1); break;
      default: break;
    }
  }
}

}  // namespace avx2
}  // namespace cpu
}  // namespace specdec
#endif  // __AVX2__ && __FMA__
