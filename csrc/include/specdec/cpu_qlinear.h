// qlinear on the CPU: y = x W^T + bias for few-row activations, W in a group-quantized
// format with groups of 32 consecutive inputs (the GGUF block formats, stored as separate
// arrays so that a GGUF tensor converts without re-rounding):
//   bits 8 (Q8_0): qweight int8 [N, K], value = d * q
//   bits 4 (Q4_1): qweight uint8 [N, K/2], mins present, value = d * q + m, q in 0..15
//   bits 4 (Q4_0): qweight uint8 [N, K/2], no mins,     value = d * (q - 8)
// d = scales[n, g], m = mins[n, g] (float16). 4-bit byte j of group g holds element
// g*32 + j in its low nibble and g*32 + j + 16 in its high nibble (GGUF order).
//
// AVX2 (q_tile_avx2): per group and weight row the 32 codes become the float weights
// d * q (+ m) once and feed up to 4 x rows with 4 FMAs each (up to 8 rows at M = 5-8, see
// q_rows_wide). Baseline build (q_micro_tile):
// the codes feed kQMr x rows, the group's partial dot is scaled by d, and the min term
// m * sum(x[group]) uses per-group sums of x computed once per call (xsum[M, K/32]).
// Both compute each output with one sequence of operations for any M (batch invariance).
// The weight rows two blocks ahead are prefetched in software (as in cpu_linear.h).
// Napkin math (SmolLM2-135M as its GGUF ships it, Q4_1 layers + Q8_0 head): 98 MB per
// forward instead of 538 MB of fp32 weights; at M = 1 the AVX2 tile is bound by the code
// widening (~12 vector ops per 32 weights), not by DRAM.
//
// This header is compiled once per ISA (SPECDEC_CPU_ISA names the namespace).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "specdec/cpu_vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef SPECDEC_CPU_ISA
#error "define SPECDEC_CPU_ISA before including cpu_qlinear.h"
#endif

namespace specdec {
namespace cpu {

constexpr int64_t kQGroup = 32;

struct QLinearParams {
  const float* x;          // [M, K] float32, row stride x_stride
  int64_t x_stride;
  const float* xsum;       // [M, K / 32] sums of x over each group (Q4_1 only), row stride K / 32
  const void* qw;          // [N, K] int8 or [N, K / 2] uint8, contiguous
  const uint16_t* scales;  // [N, K / 32] float16 bits
  const uint16_t* mins;    // [N, K / 32] float16 bits or nullptr
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N], row stride y_stride
  int64_t y_stride;
  int64_t M, N, K;
  int bits;
  // qlinear_q8act only: the weight in the CPU tiers' packed layout (cpu_q8act.h, q8_pack), or nullptr
  // (then qw / scales / mins are packed per call)
  const uint8_t* q8packed = nullptr;
};

namespace SPECDEC_CPU_ISA {

constexpr int kQNr = 4;  // weight rows per micro-tile (baseline build)
constexpr int kQMr = 3;  // x rows per micro-tile (baseline build)

// Software prefetch of [pf, pf + lines * 64) spread evenly over a tile's G groups (see
// cpu_linear.h: the rows are too short for the hardware prefetchers alone).
struct QPrefetch {
  const char* pf;
  int64_t lines, per_group, issued = 0;
  QPrefetch(const char* p, int64_t n, int64_t G) : pf(p), lines(n), per_group(G > 0 ? (n + G - 1) / G : 0) {}
  inline void step() {
    for (int64_t j = 0; j < per_group && issued < lines; ++j, ++issued) __builtin_prefetch(pf + issued * 64, 0, 2);
  }
};

typedef int8_t qv8i8 __attribute__((vector_size(8)));
typedef uint8_t qv8u8 __attribute__((vector_size(8)));

#if !defined(__AVX2__)
// The baseline tile (the AVX2 build has q_tile_avx2 below).
// The 32 weights of group g of row n as 4 vectors of 8 floats (codes only: d, m applied by
// the caller; Q4_0 codes are already shifted by -8).
template <int BITS, bool MINS>
inline void decode_group(const QLinearParams& P, int64_t n, int64_t g, v8f (&w)[4]) {
  if constexpr (BITS == 8) {
    const int8_t* q = static_cast<const int8_t*>(P.qw) + n * P.K + g * kQGroup;
    for (int c = 0; c < 4; ++c) {
      qv8i8 b;
      std::memcpy(&b, q + 8 * c, sizeof(b));
      w[c] = __builtin_convertvector(b, v8f);
    }
  } else {
    const uint8_t* q = static_cast<const uint8_t*>(P.qw) + n * (P.K / 2) + g * (kQGroup / 2);
    for (int c = 0; c < 2; ++c) {
      qv8u8 b;
      std::memcpy(&b, q + 8 * c, sizeof(b));
      const qv8u8 lo = b & uint8_t(15), hi = b >> 4;
      w[c] = __builtin_convertvector(lo, v8f);
      w[c + 2] = __builtin_convertvector(hi, v8f);
    }
    if constexpr (!MINS) {
      for (int c = 0; c < 4; ++c) w[c] -= v8_set1(8.0f);
    }
  }
}

inline float scale_of(uint16_t h) { return half_to_float(h); }

template <int BITS, bool MINS, int NR, int MR>
inline void q_micro_tile(const QLinearParams& P, int64_t n0, int64_t m0, const char* pf, int64_t pf_lines) {
  const int64_t G = P.K / kQGroup;
  QPrefetch prefetch(pf, pf_lines, G);
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = P.x + (m0 + m) * P.x_stride;
  v8f acc[NR][MR];
  float macc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      acc[r][m] = v8_set1(0.0f);
      macc[r][m] = 0.0f;
    }
  for (int64_t g = 0; g < G; ++g) {
    prefetch.step();
    v8f xv[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < 4; ++c) xv[m][c] = v8_load(xr[m] + g * kQGroup + 8 * c);
    for (int r = 0; r < NR; ++r) {
      const int64_t n = n0 + r;
      v8f w[4];
      decode_group<BITS, MINS>(P, n, g, w);
      const v8f d = v8_set1(scale_of(P.scales[n * G + g]));
      for (int m = 0; m < MR; ++m) {
        v8f part = w[0] * xv[m][0];
        part += w[1] * xv[m][1];
        part += w[2] * xv[m][2];
        part += w[3] * xv[m][3];
        acc[r][m] += d * part;
      }
      if constexpr (MINS) {
        const float mn = scale_of(P.mins[n * G + g]);
        for (int m = 0; m < MR; ++m) macc[r][m] += mn * P.xsum[(m0 + m) * G + g];
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const int64_t n = n0 + r;
    const float b = P.bias ? P.bias[n] : 0.0f;
    for (int m = 0; m < MR; ++m) P.y[(m0 + m) * P.y_stride + n] = v8_hsum(acc[r][m]) + macc[r][m] + b;
  }
}
#endif  // !__AVX2__

// Prefetch target of the block at n0: the codes of the block two blocks ahead (at least 8
// rows: DRAM latency is longer than one block's compute at M = 1), rows [n0 + ahead, + NR),
// as a pointer and a count of 64-byte lines (0 past the end). The scales / mins, 16x
// smaller, ride the hardware prefetcher.
template <int BITS, int NR>
inline const char* q_prefetch_target(const QLinearParams& P, int64_t n0, int64_t n_end, int64_t& lines) {
  const int64_t row_bytes = BITS == 8 ? P.K : P.K / 2;
  const int64_t ahead = n0 + std::max(8, 2 * NR);
  const int64_t rows = std::min<int64_t>(NR, n_end - ahead);
  lines = rows > 0 ? (rows * row_bytes + 63) / 64 : 0;
  return static_cast<const char*>(P.qw) + (rows > 0 ? ahead * row_bytes : 0);
}

#if defined(__AVX2__)
// The 32 weights of group g of weight row n as 4 vectors of 8 floats, w = d * q (+ m): the codes
// widened to int32 (a 4-bit group's 16 bytes by two vpmovzxbd loads: each 32-bit lane's low nibble is
// element j, its high nibble element j + 16), converted, then one mul (fma for Q4_1) per 8. Shared by
// the few-row tile below and the prefill GEMM's decode (cpu_gemm.h); d, mn: the group's scale and min
// (Q4_1) as float32, widened by the caller.
template <int BITS, bool MINS>
inline void q_group_weights_avx2(const QLinearParams& P, int64_t n, int64_t g, float d, float mn, __m256 (&w)[4]) {
  __m256i c[4];
  if constexpr (BITS == 8) {
    const int8_t* q = static_cast<const int8_t*>(P.qw) + n * P.K + g * kQGroup;
    for (int k = 0; k < 4; ++k)
      c[k] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k)));
  } else {
    const __m256i low4 = _mm256_set1_epi32(15);
    const uint8_t* q = static_cast<const uint8_t*>(P.qw) + n * (P.K / 2) + g * (kQGroup / 2);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
    c[0] = _mm256_and_si256(a, low4);
    c[1] = _mm256_and_si256(b, low4);
    c[2] = _mm256_srli_epi32(a, 4);
    c[3] = _mm256_srli_epi32(b, 4);
    if constexpr (!MINS) {
      const __m256i eight = _mm256_set1_epi32(8);
      for (int k = 0; k < 4; ++k) c[k] = _mm256_sub_epi32(c[k], eight);
    }
  }
  const __m256 dv = _mm256_set1_ps(d);
  if constexpr (BITS == 4 && MINS) {
    const __m256 mv = _mm256_set1_ps(mn);
    for (int k = 0; k < 4; ++k) w[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[k]), dv, mv);
  } else {
    for (int k = 0; k < 4; ++k) w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(c[k]), dv);
  }
}

// The float16 scales (and mins) of groups [g, g + 8) of weight row n (fewer at the row's end) as
// float32 into ds / ms: one vcvtph2ps per 8 (exact either way). Shared with the AVX-512 tile.
template <bool MINS>
inline void q_group_scales(const QLinearParams& P, int64_t n, int64_t g, float* ds, float* ms) {
  const int64_t G = P.K / kQGroup, cnt = std::min<int64_t>(8, G - g), base = n * G + g;
  if (cnt == 8) {
    _mm256_storeu_ps(ds, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P.scales + base))));
    if constexpr (MINS)
      _mm256_storeu_ps(ms, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P.mins + base))));
  } else {
    for (int64_t j = 0; j < cnt; ++j) {
      ds[j] = _cvtsh_ss(P.scales[base + j]);
      if constexpr (MINS) ms[j] = _cvtsh_ss(P.mins[base + j]);
    }
  }
}

// The AVX2 tile. Per weight row and group the 32 codes are widened once and turned into the
// weights themselves (q_group_weights_avx2), which then feed MR rows of x with 4 FMAs each into
// one accumulator per (row, x row). Every output is the same sequence of operations whatever
// M and the tile shape are (batch invariance: a verify pass of N nodes computes the logits a
// decode step would, bit for bit, so greedy speculation stays token-exact); NR only sets how
// many independent chains are in flight (4 at M = 1, 2 x 4 otherwise).
template <int BITS, bool MINS, int NR, int MR>
inline void q_tile_avx2(const QLinearParams& P, int64_t n0, int64_t m0, const char* pf, int64_t pf_lines) {
  const int64_t G = P.K / kQGroup;
  QPrefetch prefetch(pf, pf_lines, G);
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = P.x + (m0 + m) * P.x_stride;
  __m256 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  // The float16 scales (and mins) of 8 groups at a time, widened with one vcvtph2ps per row and
  // broadcast from L1, instead of a scalar load, a move to a vector register and a conversion per
  // group (exact either way: the same values; ~1.07x for a Q4_1 decode step, exploratory A/B).
  alignas(32) float ds[NR][8], ms[NR][8];
  for (int64_t g = 0; g < G; ++g) {
    prefetch.step();
    if (g % 8 == 0)
      for (int r = 0; r < NR; ++r) q_group_scales<MINS>(P, n0 + r, g, ds[r], ms[r]);
    for (int r = 0; r < NR; ++r) {
      const int64_t n = n0 + r;
      __m256 w[4];
      q_group_weights_avx2<BITS, MINS>(P, n, g, ds[r][g % 8], MINS ? ms[r][g % 8] : 0.0f, w);
      for (int m = 0; m < MR; ++m) {
        const float* xg = xr[m] + g * kQGroup;
        __m256 s = acc[r][m];
        for (int k = 0; k < 4; ++k) s = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xg + 8 * k), s);
        acc[r][m] = s;
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const int64_t n = n0 + r;
    const float b = P.bias ? P.bias[n] : 0.0f;
    for (int m = 0; m < MR; ++m) {
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[r][m]), _mm256_extractf128_ps(acc[r][m], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      P.y[(m0 + m) * P.y_stride + n] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1))) + b;
    }
  }
}

// Weight rows [n0, n0 + NR) against all M rows of x, in x tiles of up to 4.
template <int BITS, bool MINS, int NR>
inline void q_row_block_avx2(const QLinearParams& P, int64_t n0, int64_t n_end) {
  int64_t lines = 0;
  const char* pf = q_prefetch_target<BITS, NR>(P, n0, n_end, lines);
  int64_t m = 0;
  for (; m + 4 <= P.M; m += 4, lines = 0) q_tile_avx2<BITS, MINS, NR, 4>(P, n0, m, pf, lines);
  const int64_t rest = P.M - m;
  if (rest == 3) q_tile_avx2<BITS, MINS, NR, 3>(P, n0, m, pf, lines);
  else if (rest == 2) q_tile_avx2<BITS, MINS, NR, 2>(P, n0, m, pf, lines);
  else if (rest == 1) q_tile_avx2<BITS, MINS, NR, 1>(P, n0, m, pf, lines);
}

// 5-8 rows of x (a verify pass of 5-8 nodes): each weight row's groups are widened ONCE and feed
// all M rows (M accumulators), instead of once per x tile of 4 (the remainder tile of 1-4 rows
// widening them again). The same per-output sequence of operations, so the same bits. Measured
// against the 2 x 4 tiles (exploratory, interleaved, 2 threads, the bundled target's shapes):
// Q4_1 1.27x / 1.24x / 1.16x / 1.06x at M = 5 / 6 / 7 / 8, Q8_0 1.17x / 1.12x / 1.06x at M = 5 /
// 6 / 7 and 0.94x at M = 8 (kept on the tiles); two such passes for M = 10-16 gave 0.90-1.04x.
template <int BITS, bool MINS, int MR>
inline void q_rows_wide(const QLinearParams& P, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    int64_t lines = 0;
    const char* pf = q_prefetch_target<BITS, 1>(P, n, n_end, lines);
    q_tile_avx2<BITS, MINS, 1, MR>(P, n, 0, pf, lines);
  }
}

template <int BITS, bool MINS>
inline void qlinear_rows_t(const QLinearParams& P, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  switch (P.M) {
    case 5: return q_rows_wide<BITS, MINS, 5>(P, n_begin, n_end);
    case 6: return q_rows_wide<BITS, MINS, 6>(P, n_begin, n_end);
    case 7: return q_rows_wide<BITS, MINS, 7>(P, n_begin, n_end);
    case 8:
      if constexpr (BITS == 4) return q_rows_wide<BITS, MINS, 8>(P, n_begin, n_end);
      break;
    default: break;
  }
  if (P.M == 1) {
    for (; n + 4 <= n_end; n += 4) q_row_block_avx2<BITS, MINS, 4>(P, n, n_end);
  } else {
    for (; n + 2 <= n_end; n += 2) q_row_block_avx2<BITS, MINS, 2>(P, n, n_end);
  }
  for (; n < n_end; ++n) q_row_block_avx2<BITS, MINS, 1>(P, n, n_end);
}
#else
// All M rows of x against weight rows [n0, n0 + NR).
template <int BITS, bool MINS, int NR>
inline void q_row_block(const QLinearParams& P, int64_t n0, int64_t n_end) {
  int64_t lines = 0;
  const char* pf = q_prefetch_target<BITS, NR>(P, n0, n_end, lines);
  int64_t m = 0;
  for (; m + kQMr <= P.M; m += kQMr, lines = 0) q_micro_tile<BITS, MINS, NR, kQMr>(P, n0, m, pf, lines);
  const int64_t rest = P.M - m;
  if (rest == 2) q_micro_tile<BITS, MINS, NR, 2>(P, n0, m, pf, lines);
  else if (rest == 1) q_micro_tile<BITS, MINS, NR, 1>(P, n0, m, pf, lines);
}

template <int BITS, bool MINS>
inline void qlinear_rows_t(const QLinearParams& P, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + kQNr <= n_end; n += kQNr) q_row_block<BITS, MINS, kQNr>(P, n, n_end);
  for (; n < n_end; ++n) q_row_block<BITS, MINS, 1>(P, n, n_end);
}
#endif

// Outputs y[:, n_begin:n_end].
inline void qlinear_rows(const QLinearParams& P, int64_t n_begin, int64_t n_end) {
  if (P.bits == 8) qlinear_rows_t<8, false>(P, n_begin, n_end);
  else if (P.mins) qlinear_rows_t<4, true>(P, n_begin, n_end);
  else qlinear_rows_t<4, false>(P, n_begin, n_end);
}


}  // namespace SPECDEC_CPU_ISA
}  // namespace cpu
}  // namespace specdec
