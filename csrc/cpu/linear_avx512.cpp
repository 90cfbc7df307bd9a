// The few-row CPU linear and qlinear at 4..32 rows of x (float32 weights; other types from 5: tree
// verification, lookup verify passes, batched verify), compiled
// with AVX-512 (see CMakeLists.txt) and chosen at run time by csrc/cpu/linear.cpp when the CPU has it.
//
// Bits: every output is the AVX2 kernel's (csrc/include/specdec/cpu_linear.h, cpu_qlinear.h), bit for
// bit. A zmm register here holds TWO of the AVX2 kernel's 8-lane accumulators side by side (weight rows
// n and n + 1 against the same x row, the x vector broadcast to both halves): each lane does the same
// fused multiply-adds on the same widened weights in the same k order, and the horizontal sums add the
// lanes in the AVX2 kernel's order (v8_hsum for linear, the q tile's pairwise sum for qlinear), then the
// same scale and bias. So a verify row still equals a decode step (fewer rows keep the AVX2 kernels), and
// a CPU without AVX-512 gives the same outputs.
//
// Why: at 8 rows the AVX2 float32 tile (2 weight rows x 4 x rows, 8 ymm accumulators) ran at ~56 % of
// the FMA peak with the weights in cache, and a scalar horizontal sum per output cost ~17 % more, so a
// verify pass was compute-bound where a decode step is memory-bound. Here a tile is 4 weight rows x up
// to 8 x rows = 16 zmm accumulators (32 of the AVX2 kernel's): per 8 values of k, 2 weight loads (two
// rows each, widened once) and one broadcast per x row feed 2 * M zmm FMAs; the 32 registers hold the
// tile, and the sums are vector adds over transposed accumulators. Weights: float32, float16, bfloat16,
// int8 (per-row scale) and the group-quantized Q8_0 / Q4_1 / Q4_0 blocks.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "specdec/cpu_vec.h"

#define SPECDEC_CPU_ISA avx512
#include "specdec/cpu_linear.h"
#include "specdec/cpu_qlinear.h"

namespace specdec {
namespace cpu {
void linear_rows_avx2(const LinearParams& P, int64_t n_begin, int64_t n_end);    // linear_avx2.cpp
void qlinear_rows_avx2(const QLinearParams& P, int64_t n_begin, int64_t n_end);  // linear_avx2.cpp

namespace {

// Weight rows w0 and w1 (element pointers of type WT) at element k, widened to float32 as the AVX2
// kernel's load_w does (exactly): [w0[k..k+8) | w1[k..k+8)].
template <WType WT>
inline __m512 load_pair(const void* w0, const void* w1, int64_t k) {
  if constexpr (WT == WType::kFloat32) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(static_cast<const float*>(w0) + k)),
                              _mm256_loadu_ps(static_cast<const float*>(w1) + k), 1);
  } else if constexpr (WT == WType::kInt8) {
    const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w0) + k)),
                                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w1) + k)));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {
    const __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w0) + k))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w1) + k)), 1);
    if constexpr (WT == WType::kFloat16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
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

// [a x 8 | b x 8]
inline __m512 pair_of(float a, float b) {
  return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

// y[m0 + m, n] = lane m of v's low half, y[m0 + m, n + 1] = lane m of its high half (m < MR).
template <int MR>
inline void store_pair(float* y, int64_t y_stride, int64_t n, int64_t m0, __m512 v) {
  alignas(64) float out[16];
  _mm512_store_ps(out, v);
  for (int m = 0; m < MR; ++m) {
    y[(m0 + m) * y_stride + n] = out[m];
    y[(m0 + m) * y_stride + n + 1] = out[8 + m];
  }
}

// acc[m] (m < MR) = [weight row n against x row m0 + m | row n + 1 against it], 8 partial sums each:
// y[m0 + m, n + h] = the partial sums added in v8_hsum's order ((0 + v[0]) + v[1]) + ... + v[7], then
// dot * scale + bias as the AVX2 kernel rounds it (scale: int8 weights only; bias 0 when absent),
// 16 outputs at a time as vector adds over the transposed accumulators (a scalar v8_hsum per
// output cost ~17 % of the float32 tile).
template <int MR>
inline void reduce_store(const LinearParams& P, int64_t n, int64_t m0, const __m512 acc[MR]) {
  __m512 r[8];
  for (int m = 0; m < 8; ++m) r[m] = m < MR ? acc[m] : _mm512_setzero_ps();
  transpose8_halves(r);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < 8; ++j) sum = _mm512_add_ps(sum, r[j]);
  const __m512 b = P.bias ? pair_of(P.bias[n], P.bias[n + 1]) : _mm512_setzero_ps();
  if (P.scale) sum = _mm512_fmadd_ps(sum, pair_of(P.scale[n], P.scale[n + 1]), b);
  else sum = _mm512_add_ps(sum, b);
  store_pair<MR>(P.y, P.y_stride, n, m0, sum);
}

// Outputs of weight rows [n0, n0 + 4) x x rows [m0, m0 + MR) (K % 8 == 0: no scalar tail); the prefetch
// of pf_lines lines from pf is spread over the k loop (KPrefetch, as in cpu_linear.h's micro_tile).
template <WType WT, int MR>
inline void tile_4xm(const LinearParams& P, int64_t n0, int64_t m0, const char* pf, int64_t pf_lines) {
  const int64_t K = P.K;
  const int64_t K16 = K & ~int64_t(15);
  const void* w0 = avx512::w_row<WT>(P.w, n0, K);
  const void* w1 = avx512::w_row<WT>(P.w, n0 + 1, K);
  const void* w2 = avx512::w_row<WT>(P.w, n0 + 2, K);
  const void* w3 = avx512::w_row<WT>(P.w, n0 + 3, K);
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = P.x + (m0 + m) * P.x_stride;
  __m512 a01[MR], a23[MR];
  for (int m = 0; m < MR; ++m) a01[m] = a23[m] = _mm512_setzero_ps();
  avx512::KPrefetch prefetch(pf, pf_lines, K16 / 16);
  int64_t k = 0;
  for (; k < K16; k += 16) {
    prefetch.step();
#pragma GCC unroll 2
    for (int64_t u = 0; u < 16; u += 8) {
      const __m512 wa = load_pair<WT>(w0, w1, k + u), wb = load_pair<WT>(w2, w3, k + u);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[m] + k + u));
        a01[m] = _mm512_fmadd_ps(wa, xv, a01[m]);
        a23[m] = _mm512_fmadd_ps(wb, xv, a23[m]);
      }
    }
  }
  if (k < K) {  // one 8-wide half left
    const __m512 wa = load_pair<WT>(w0, w1, k), wb = load_pair<WT>(w2, w3, k);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[m] + k));
      a01[m] = _mm512_fmadd_ps(wa, xv, a01[m]);
      a23[m] = _mm512_fmadd_ps(wb, xv, a23[m]);
    }
  }
  reduce_store<MR>(P, n0, m0, a01);
  reduce_store<MR>(P, n0 + 2, m0, a23);
}

// F(std::integral_constant<int, R>) for R = min(8, rows) in 1..8.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (std::min<int64_t>(8, rows)) {
    case 8: f(std::integral_constant<int, 8>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    default: f(std::integral_constant<int, 1>()); break;
  }
}

// All P.M rows against weight rows [n0, n0 + 4): groups of 8 x rows (the last 1..8), sharing the
// prefetch of the next 4 weight rows.
template <WType WT>
inline void block_4(const LinearParams& P, int64_t n0, int64_t n_end) {
  int64_t lines = 0;
  const char* next = avx512::next_block<WT, 4>(P, n0, n_end, lines);
  const int64_t groups = (P.M + 7) / 8;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t a = lines * g / groups, b = lines * (g + 1) / groups;
    const char* pf = next ? next + a * 64 : nullptr;
    with_rows(P.M - g * 8, [&](auto mr) { tile_4xm<WT, decltype(mr)::value>(P, n0, g * 8, pf, b - a); });
  }
}

// ---- group-quantized weights (Q8_0, Q4_1, Q4_0; cpu_qlinear.h's format)

// The 32 weights of one group of two weight rows (codes at q0, q1), as the AVX2 kernel's
// q_group_weights_avx2 makes them (w = d * q (+ m), the same roundings), in pairs: w[k] =
// [row 0's elements 8k..8k+8 | row 1's].
template <int BITS, bool MINS>
inline void q_pair_weights(const void* q0, const void* q1, __m512 d, __m512 mn, __m512 (&w)[4]) {
  const char* a0 = static_cast<const char*>(q0);
  const char* a1 = static_cast<const char*>(q1);
  auto two8 = [](const char* p0, const char* p1) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)));
  };
  __m512i c[4];
  if constexpr (BITS == 8) {
    for (int k = 0; k < 4; ++k) c[k] = _mm512_cvtepi8_epi32(two8(a0 + 8 * k, a1 + 8 * k));
  } else {
    const __m512i low4 = _mm512_set1_epi32(15);
    const __m512i a = _mm512_cvtepu8_epi32(two8(a0, a1));
    const __m512i b = _mm512_cvtepu8_epi32(two8(a0 + 8, a1 + 8));
    c[0] = _mm512_and_si512(a, low4);
    c[1] = _mm512_and_si512(b, low4);
    c[2] = _mm512_srli_epi32(a, 4);
    c[3] = _mm512_srli_epi32(b, 4);
    if constexpr (!MINS) {
      const __m512i eight = _mm512_set1_epi32(8);
      for (int k = 0; k < 4; ++k) c[k] = _mm512_sub_epi32(c[k], eight);
    }
  }
  if constexpr (BITS == 4 && MINS) {
    for (int k = 0; k < 4; ++k) w[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[k]), d, mn);
  } else {
    for (int k = 0; k < 4; ++k) w[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(c[k]), d);
  }
}

// acc[m] = [row n | row n + 1] against x row m0 + m: the AVX2 q tile's horizontal sum, ((v0 + v4) +
// (v2 + v6)) + ((v1 + v5) + (v3 + v7)), then + bias (0 when absent), 16 outputs at a time.
template <int MR>
inline void q_reduce_store(const QLinearParams& P, int64_t n, int64_t m0, const __m512 acc[MR]) {
  __m512 r[8];
  for (int m = 0; m < 8; ++m) r[m] = m < MR ? acc[m] : _mm512_setzero_ps();
  transpose8_halves(r);
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(r[0], r[4]), _mm512_add_ps(r[2], r[6])),
                                   _mm512_add_ps(_mm512_add_ps(r[1], r[5]), _mm512_add_ps(r[3], r[7])));
  const __m512 b = P.bias ? pair_of(P.bias[n], P.bias[n + 1]) : _mm512_setzero_ps();
  store_pair<MR>(P.y, P.y_stride, n, m0, _mm512_add_ps(sum, b));
}

// Weight rows [n0, n0 + 2 NP) x x rows [m0, m0 + MR): per group the codes of the 2 NP rows are widened
// once, as NP pairs, and each x vector (broadcast to both halves) feeds NP zmm FMAs; every accumulator
// lane does the AVX2 tile's FMAs in its order (4 per group, k order). Used with NP = 2 at 5+ x rows: at
// 1-4 rows (NP = 4 at 1-2) it gave 0.72-1.09x the AVX2 tile (exploratory), whose widening the zmm
// form does not make cheaper on a CPU that splits 512-bit integer ops in two.
template <int BITS, bool MINS, int NP, int MR>
inline void q_tile(const QLinearParams& P, int64_t n0, int64_t m0, const char* pf, int64_t pf_lines) {
  constexpr int NR = 2 * NP;
  const int64_t G = P.K / kQGroup;
  const int64_t row_bytes = BITS == 8 ? P.K : P.K / 2, group_bytes = BITS == 8 ? kQGroup : kQGroup / 2;
  const char* q[NR];
  for (int r = 0; r < NR; ++r) q[r] = static_cast<const char*>(P.qw) + (n0 + r) * row_bytes;
  avx512::QPrefetch prefetch(pf, pf_lines, G);
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = P.x + (m0 + m) * P.x_stride;
  __m512 acc[NP][MR];
  for (int p = 0; p < NP; ++p)
    for (int m = 0; m < MR; ++m) acc[p][m] = _mm512_setzero_ps();
  alignas(32) float ds[NR][8], ms[NR][8];
  for (int64_t g = 0; g < G; ++g) {
    prefetch.step();
    if (g % 8 == 0)  // the float16 scales (and mins) of 8 groups, widened exactly
      for (int r = 0; r < NR; ++r) avx512::q_group_scales<MINS>(P, n0 + r, g, ds[r], ms[r]);
    const int j = int(g % 8);
    __m512 w[NP][4];
    for (int p = 0; p < NP; ++p)
      q_pair_weights<BITS, MINS>(q[2 * p] + g * group_bytes, q[2 * p + 1] + g * group_bytes,
                                 pair_of(ds[2 * p][j], ds[2 * p + 1][j]),
                                 MINS ? pair_of(ms[2 * p][j], ms[2 * p + 1][j]) : _mm512_setzero_ps(), w[p]);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const float* xg = xr[m] + g * kQGroup;
      for (int k = 0; k < 4; ++k) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xg + 8 * k));
        for (int p = 0; p < NP; ++p) acc[p][m] = _mm512_fmadd_ps(w[p][k], xv, acc[p][m]);
      }
    }
  }
  for (int p = 0; p < NP; ++p) q_reduce_store<MR>(P, n0 + 2 * p, m0, acc[p]);
}

// Blocks of 2 NP weight rows against all P.M rows of x (groups of 8); the rest by the AVX2 kernel.
template <int BITS, bool MINS, int NP>
inline void q_rows(const QLinearParams& P, int64_t n_begin, int64_t n_end) {
  constexpr int NR = 2 * NP;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) {
    int64_t lines = 0;
    const char* pf = avx512::q_prefetch_target<BITS, NR>(P, n, n_end, lines);
    for (int64_t m0 = 0; m0 < P.M; m0 += 8, lines = 0)  // the first x group carries the prefetch
      with_rows(P.M - m0, [&](auto mr) { q_tile<BITS, MINS, NP, decltype(mr)::value>(P, n, m0, pf, lines); });
  }
  if (n < n_end) qlinear_rows_avx2(P, n, n_end);
}

}  // namespace

// Outputs y[:, n_begin:n_end) of a float32 / float16 / bfloat16 / int8 weight (any P.M <=
// kLinearRowsPerPass, K % 8 == 0): blocks of 4 weight rows here, the last 1-3 rows by the AVX2 kernel.
void linear_rows_avx512(const LinearParams& P, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) {
    switch (P.wtype) {
      case WType::kFloat32: block_4<WType::kFloat32>(P, n, n_end); break;
      case WType::kFloat16: block_4<WType::kFloat16>(P, n, n_end); break;
      case WType::kBFloat16: block_4<WType::kBFloat16>(P, n, n_end); break;
      case WType::kInt8: block_4<WType::kInt8>(P, n, n_end); break;
    }
  }
  if (n < n_end) linear_rows_avx2(P, n, n_end);
}

// The same for a group-quantized weight (any P.M <= kLinearRowsPerPass).
void qlinear_rows_avx512(const QLinearParams& P, int64_t n_begin, int64_t n_end) {
  if (P.bits == 8) q_rows<8, false, 2>(P, n_begin, n_end);
  else if (P.mins) q_rows<4, true, 2>(P, n_begin, n_end);
  else q_rows<4, false, 2>(P, n_begin, n_end);
}

}  // namespace cpu
}  // namespace specdec
