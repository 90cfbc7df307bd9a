// The few-row CPU linear for float32 weights at 5..32 rows of x (tree verification), compiled with
// AVX-512 (see CMakeLists.txt) and chosen at run time by csrc/cpu/linear.cpp when the CPU has it.
//
// Bits: every output is the AVX2 kernel's (csrc/include/specdec/cpu_linear.h), bit for bit. A zmm
// register here holds TWO of the AVX2 kernel's 8-lane accumulators side by side (weight rows n and
// n + 1 against the same x row): each lane does the same fused multiply-adds in the same k order,
// and each half is reduced by the same v8_hsum, tail, scale and bias. So a verify row still equals
// a decode step (which keeps the AVX2 kernels), and a machine without AVX-512 gives the same output.
//
// Why: at 8 rows the AVX2 tile (two weight rows x four x rows, 8 ymm accumulators) runs at ~56 % of
// the FMA peak with the weights in cache, so its verify pass is compute-bound where a decode step is
// memory-bound. Here a tile is 4 weight rows x up to 8 x rows = 16 zmm accumulators (32 of the AVX2
// kernel's): per 8 values of k, 2 weight loads (two rows each) and one broadcast load per x row feed
// 2 * M zmm FMAs, and the 32 registers hold the whole tile.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "specdec/cpu_vec.h"

#define SPECDEC_CPU_ISA avx512
#include "specdec/cpu_linear.h"

namespace specdec {
namespace cpu {
void linear_rows_avx2(const LinearParams& P, int64_t n_begin, int64_t n_end);  // linear_avx2.cpp

namespace {

// Weight rows w0 and w1 at k: [w0[k..k+8) | w1[k..k+8)].
inline __m512 load_pair(const float* w0, const float* w1, int64_t k) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w0 + k)), _mm256_loadu_ps(w1 + k), 1);
}

inline v8f half_as_v8f(__m512 v, int h) {
  const __m256 y = h == 0 ? _mm512_castps512_ps256(v) : _mm512_extractf32x8_ps(v, 1);
  v8f f;
  __builtin_memcpy(&f, &y, sizeof(f));
  return f;
}

// Transposes 8 registers within each 256-bit half: on return, lane m of half h of r[j] is lane j of
// half h of the input r[m] (the classic 8 x 8 float transpose, on both halves at once).
inline void transpose8_halves(__m512 r[8]) {
  __m512 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // per 256-bit half: the low 128 bits of (a, b) and the high 128 bits of (a, b)
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_permutex2var_ps(u[i], lo, u[i + 4]);
    r[i + 4] = _mm512_permutex2var_ps(u[i], hi, u[i + 4]);
  }
}

// acc[m] (m < MR) = [weight row n against x row m0 + m | row n + 1 against it], 8 partial sums each:
// y[m0 + m, n] and y[m0 + m, n + 1] = the partial sums added in lane order from 0.0f (v8_hsum), + bias.
// Float32 weights have no scale (the op refuses one), so dot * 1 + bias == dot + bias.
template <int MR>
inline void reduce_store(const LinearParams& P, int64_t n, int64_t m0, const __m512 acc[MR]) {
  __m512 r[8];
  for (int m = 0; m < 8; ++m) r[m] = m < MR ? acc[m] : _mm512_setzero_ps();
  transpose8_halves(r);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < 8; ++j) sum = _mm512_add_ps(sum, r[j]);
  if (P.bias) {
    sum = _mm512_add_ps(sum, _mm512_insertf32x8(_mm512_set1_ps(P.bias[n]), _mm256_set1_ps(P.bias[n + 1]), 1));
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, sum);
  for (int m = 0; m < MR; ++m) {
    P.y[(m0 + m) * P.y_stride + n] = out[m];
    P.y[(m0 + m) * P.y_stride + n + 1] = out[8 + m];
  }
}

// Outputs of weight rows [n0, n0 + 4) x x rows [m0, m0 + MR) (K % 8 == 0: no scalar tail); the prefetch of pf_lines lines from pf
// is spread over the k loop as in cpu_linear.h's micro_tile.
template <int MR>
inline void tile_4xm(const LinearParams& P, int64_t n0, int64_t m0, const char* pf, int64_t pf_lines) {
  const int64_t K = P.K;
  const int64_t K16 = K & ~int64_t(15);
  const float* w = static_cast<const float*>(P.w) + n0 * K;
  const float* w0 = w;
  const float* w1 = w + K;
  const float* w2 = w + 2 * K;
  const float* w3 = w + 3 * K;
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = P.x + (m0 + m) * P.x_stride;
  __m512 a01[MR], a23[MR];
  for (int m = 0; m < MR; ++m) a01[m] = a23[m] = _mm512_setzero_ps();
  const int64_t steps = K16 / 16;
  const int64_t per_step = (pf != nullptr && steps > 0) ? (pf_lines + steps - 1) / steps : 0;
  const char* pfp = pf;
  int64_t k = 0;
  for (; k < K16; k += 16) {
    for (int64_t j = 0; j < per_step; ++j, pfp += 64) __builtin_prefetch(pfp, 0, 2);
#pragma GCC unroll 2
    for (int64_t u = 0; u < 16; u += 8) {
      const __m512 wa = load_pair(w0, w1, k + u), wb = load_pair(w2, w3, k + u);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[m] + k + u));
        a01[m] = _mm512_fmadd_ps(wa, xv, a01[m]);
        a23[m] = _mm512_fmadd_ps(wb, xv, a23[m]);
      }
    }
  }
  if (k < K) {  // one 8-wide half left
    const __m512 wa = load_pair(w0, w1, k), wb = load_pair(w2, w3, k);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[m] + k));
      a01[m] = _mm512_fmadd_ps(wa, xv, a01[m]);
      a23[m] = _mm512_fmadd_ps(wb, xv, a23[m]);
    }
  }
  // The horizontal sums, 16 outputs at a time: v8_hsum's ((0 + v[0]) + v[1]) + ... + v[7] per output,
  // as vector adds over the transposed accumulators (a scalar v8_hsum per output costs ~17 % here).
  reduce_store<MR>(P, n0, m0, a01);
  reduce_store<MR>(P, n0 + 2, m0, a23);
}

// All P.M rows against weight rows [n0, n0 + 4): groups of 8 x rows (the last 1..8), sharing the
// prefetch of the next 4 weight rows.
inline void block_4(const LinearParams& P, int64_t n0, int64_t n_end) {
  const int64_t next_rows = std::min<int64_t>(4, n_end - (n0 + 4));
  const int64_t lines = next_rows > 0 ? (next_rows * P.K * 4 + 63) / 64 : 0;
  const char* next = lines ? reinterpret_cast<const char*>(static_cast<const float*>(P.w) + (n0 + 4) * P.K) : nullptr;
  const int64_t groups = (P.M + 7) / 8;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t a = lines * g / groups, b = lines * (g + 1) / groups;
    const char* pf = next ? next + a * 64 : nullptr;
    const int64_t m0 = g * 8;
    switch (std::min<int64_t>(8, P.M - m0)) {
      case 8: tile_4xm<8>(P, n0, m0, pf, b - a); break;
      case 7: tile_4xm<7>(P, n0, m0, pf, b - a); break;
      case 6: tile_4xm<6>(P, n0, m0, pf, b - a); break;
      case 5: tile_4xm<5>(P, n0, m0, pf, b - a); break;
      case 4: tile_4xm<4>(P, n0, m0, pf, b - a); break;
      case 3: tile_4xm<3>(P, n0, m0, pf, b - a); break;
      case 2: tile_4xm<2>(P, n0, m0, pf, b - a); break;
      default: tile_4xm<1>(P, n0, m0, pf, b - a); break;
    }
  }
}

}  // namespace

// Outputs y[:, n_begin:n_end) of a float32 weight (any P.M <= kLinearRowsPerPass, K % 8 == 0): blocks of 4 weight
// rows here, the last 1-3 rows by the AVX2 kernel.
void linear_rows_f32_avx512(const LinearParams& P, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) block_4(P, n, n_end);
  if (n < n_end) linear_rows_avx2(P, n, n_end);
}

}  // namespace cpu
}  // namespace specdec
