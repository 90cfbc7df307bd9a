// The ymm tiers of qlinear_q8act (definition: csrc/include/specdec/cpu_q8act.h), included by
// qlinear_q8act_avx2.cpp (Q8ACT_VNNI 0: vpmaddubsw + vpmaddwd) and qlinear_q8act_avxvnni.cpp
// (Q8ACT_VNNI 1: vpdpbusd, VEX). Per weight row and block the 32 codes are loaded once (Q4: the 16
// bytes split into low / high nibbles = elements 0-15 / 16-31) and feed MR rows of activation codes;
// the 8 int32 lanes of a block's dot are the definition's lanes, and the even / odd blocks go to two
// ymm accumulators (the 16 canonical ones).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "specdec/cpu_q8act.h"

#ifndef Q8ACT_NS
#error "define Q8ACT_NS and Q8ACT_VNNI before including qlinear_q8act_ymm.h"
#endif

namespace specdec {
namespace cpu {
namespace Q8ACT_NS {

// 8 int32 lanes: lane l = sum over bytes 4l..4l+3 of u (unsigned) * s (signed).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if Q8ACT_VNNI
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The 32 codes of block g of weight row n: int8 (Q8_0) or 0..15 (Q4) in element order.
template <int BITS>
inline __m256i load_codes(const Q8ActParams& P, int64_t n, int64_t g) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(P.qw) + n * P.K + g * 32));
  } else {
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(P.qw) + n * (P.K / 2) + g * 16));
    const __m128i low4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
  }
}

// One block g of weight rows n0.. (NR) against MR activation rows from m0, into acc[.][.] (the
// accumulators of g's parity). ds: the weight rows' scales of blocks [g - g % 8, + 8) as float32.
template <int BITS, bool MINS, int NR, int MR>
inline void block(const Q8ActParams& P, int64_t n0, int64_t m0, int64_t g, const float (&ds)[NR][8],
                  __m256 (&acc)[NR][MR]) {
  const int64_t G = P.K / kQ8Block;
  for (int r = 0; r < NR; ++r) {
    const int64_t n = n0 + r;
    const __m256i w = load_codes<BITS>(P, n, g);
    const __m256i wu = BITS == 8 ? _mm256_abs_epi8(w) : w;
    const __m256 dw = _mm256_broadcast_ss(&ds[r][g & 7]);
    for (int m = 0; m < MR; ++m) {
      const int64_t o = ((m0 + m) * G + g) * 8;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.a + (m0 + m) * P.K + g * 32));
      __m256i p;
      if constexpr (BITS == 8) {
        p = dot_u8s8(wu, _mm256_sign_epi8(a, w));
      } else {
        p = dot_u8s8(w, a);
        if constexpr (!MINS)
          p = _mm256_sub_epi32(p, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.r + o)), 3));
      }
      acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_broadcast_ss(P.d + (m0 + m) * G + g)), acc[r][m]);
    }
  }
}

// The scales (mins) of blocks [g, g + 8) of weight rows n0.. (fewer at the row's end: the rest 0),
// widened exactly.
template <bool MINS, int NR>
inline void load_scales(const Q8ActParams& P, int64_t n0, int64_t g, float (&ds)[NR][8], float (&ms)[NR][8]) {
  const int64_t G = P.K / kQ8Block, cnt = std::min<int64_t>(8, G - g);
  for (int r = 0; r < NR; ++r) {
    const int64_t base = (n0 + r) * G + g;
    if (cnt == 8) {
      _mm256_store_ps(ds[r], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P.scales + base))));
      if constexpr (MINS)
        _mm256_store_ps(ms[r], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P.mins + base))));
    } else {
      for (int64_t j = 0; j < 8; ++j) {
        ds[r][j] = j < cnt ? _cvtsh_ss(P.scales[base + j]) : 0.0f;
        if constexpr (MINS) ms[r][j] = j < cnt ? _cvtsh_ss(P.mins[base + j]) : 0.0f;
      }
    }
  }
}

// Q4_1's min terms of blocks [g, g + 8) (g % 8 == 0) into macc, the accumulators g % 16 of those
// blocks: macc + mw * s per lane (fused); a block past the row's end adds 0 * 0 = +0, which leaves any
// accumulator unchanged (one started at +0 is never -0).
template <int NR, int MR>
inline void min_terms(const Q8ActParams& P, int64_t m0, int64_t g, const float (&ms)[NR][8], __m256 (&macc)[NR][MR]) {
  const int64_t G = P.K / kQ8Block, cnt = std::min<int64_t>(8, G - g);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(cnt)), lanes);
  for (int m = 0; m < MR; ++m) {
    const __m256 sv = _mm256_maskload_ps(P.s + (m0 + m) * G + g, keep);
    for (int r = 0; r < NR; ++r) macc[r][m] = _mm256_fmadd_ps(_mm256_load_ps(ms[r]), sv, macc[r][m]);
  }
}

inline float fold(__m256 even, __m256 odd) {
  const __m256 h = _mm256_add_ps(even, odd);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

template <int BITS, bool MINS, int NR, int MR>
inline void tile(const Q8ActParams& P, int64_t n0, int64_t m0) {
  const int64_t G = P.K / kQ8Block;
  __m256 even[NR][MR], odd[NR][MR], mlo[NR][MR], mhi[NR][MR];  // mlo / mhi: Q4_1's macc 0-7 / 8-15
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) even[r][m] = odd[r][m] = mlo[r][m] = mhi[r][m] = _mm256_setzero_ps();
  alignas(32) float ds[NR][8], ms[NR][8];
  Q8Prefetch prefetch(P, n0, NR, m0, (G + 1) / 2);
  int64_t g = 0;
  for (; g < G; g += 2) {
    prefetch.step();
    if ((g & 7) == 0) {
      load_scales<MINS, NR>(P, n0, g, ds, ms);
      if constexpr (MINS) min_terms<NR, MR>(P, m0, g, ms, (g & 8) ? mhi : mlo);
    }
    block<BITS, MINS, NR, MR>(P, n0, m0, g, ds, even);
    if (g + 1 < G) block<BITS, MINS, NR, MR>(P, n0, m0, g + 1, ds, odd);
  }
  for (int r = 0; r < NR; ++r) {
    const float b = P.bias ? P.bias[n0 + r] : 0.0f;
    for (int m = 0; m < MR; ++m) {
      float y = fold(even[r][m], odd[r][m]);
      if constexpr (MINS) y = y + fold(mlo[r][m], mhi[r][m]);
      P.y[(m0 + m) * P.y_stride + n0 + r] = y + b;
    }
  }
}

// Weight row n against all M rows, 4 activation rows per tile (the row's codes stay in L1).
template <int BITS, bool MINS>
inline void row_all_m(const Q8ActParams& P, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= P.M; m += 4) tile<BITS, MINS, 1, 4>(P, n, m);
  switch (P.M - m) {
    case 3: tile<BITS, MINS, 1, 3>(P, n, m); break;
    case 2: tile<BITS, MINS, 1, 2>(P, n, m); break;
    case 1: tile<BITS, MINS, 1, 1>(P, n, m); break;
    default: break;
  }
}

template <int BITS, bool MINS>
inline void rows_t(const Q8ActParams& P, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (P.M == 1)  // a decode step: 4 weight rows in flight
    for (; n + 4 <= n_end; n += 4) tile<BITS, MINS, 4, 1>(P, n, 0);
  for (; n < n_end; ++n) row_all_m<BITS, MINS>(P, n);
}

inline void rows(const Q8ActParams& P, int64_t n_begin, int64_t n_end) {
  if (P.bits == 8) rows_t<8, false>(P, n_begin, n_end);
  else if (P.mins) rows_t<4, true>(P, n_begin, n_end);
  else rows_t<4, false>(P, n_begin, n_end);
}

}  // namespace Q8ACT_NS
}  // namespace cpu
}  // namespace specdec
