// The ymm tiers of qlinear_q8act (definition and packed layout: csrc/include/specdec/cpu_q8act.h),
// included by qlinear_q8act_avx2.cpp (Q8ACT_VNNI 0: vpmaddubsw + vpmaddwd) and qlinear_q8act_avxvnni.cpp
// (Q8ACT_VNNI 1: vpdpbusd, VEX). A packed group of 16 weight rows is two 8-row halves (the low / high 32
// bytes of every 64-byte code vector); lane j of an accumulator is output row 8 h + j, so each lane runs
// the definition's sequence of multiply-adds over the blocks in order.
//   avx_vnni (half_tile): per half and block the codes are decoded once and feed up to 4 activation rows.
//   avx2 (group_tile): per block both halves at once, up to 4 activation rows: each broadcast
//   activation word serves the group's 16 rows, and each decoded code vector up to 4 rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "specdec/cpu_q8act.h"

#ifndef Q8ACT_NS
#error "define Q8ACT_NS and Q8ACT_VNNI before including qlinear_q8act_ymm.h"
#endif

namespace specdec {
namespace cpu {
namespace Q8ACT_NS {

inline __m256i bcast_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

#if Q8ACT_VNNI
// acc + the 4-byte dots of the packed codes u with the broadcast activation word s (int32 lanes).
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }

// Rows 16 t + 8 h .. + 8 of the weight against activation rows m0.. (MR).
template <int BITS, bool MINS, int MR>
inline void half_tile(const Q8ActParams& P, int64_t t, int h, int64_t m0) {
  constexpr int64_t blk = kQ8PackBytes(BITS, MINS), code = kQ8CodeBytes(BITS);
  constexpr int W = 8;  // activation words per block
  constexpr int shift = BITS == 8 ? 7 : (MINS ? -1 : 3);
  const int64_t G = P.K / kQ8Block;
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = P.packed + (t * G + g) * blk;
    __m256i w[W];  // w[e]: the codes multiplying activation word e (elements 4e..4e+3)
    if constexpr (BITS == 8) {
      for (int k = 0; k < 8; ++k) w[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k + 32 * h));
    } else {
      const __m256i low4 = _mm256_set1_epi8(15);
      for (int k = 0; k < 4; ++k) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k + 32 * h));
        w[k] = _mm256_and_si256(v, low4);
        w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + code + 16 * h)));
    __m256 mw = _mm256_setzero_ps();
    if constexpr (MINS) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + code + 32 + 16 * h)));
    for (int m = 0; m < MR; ++m) {
      const int64_t mg = (m0 + m) * G + g;
      const int8_t* a = P.a + (m0 + m) * P.K + g * kQ8Block;
      __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
      for (int e = 0; e < W; e += 2) {
        p0 = dot4(p0, w[e], bcast_word(a + 4 * e));
        p1 = dot4(p1, w[e + 1], bcast_word(a + 4 * e + 4));
      }
      __m256i p = _mm256_add_epi32(p0, p1);
      if constexpr (shift >= 0) p = _mm256_sub_epi32(p, _mm256_set1_epi32(P.R[mg] << shift));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_set1_ps(P.d[mg])), acc[m]);
      if constexpr (MINS) acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(P.s[mg]), acc[m]);
    }
  }
  const int64_t n0 = t * kQ8Rows + 8 * h, cnt = std::min<int64_t>(8, P.N - n0);
  for (int m = 0; m < MR; ++m) {
    float out[8];
    _mm256_storeu_ps(out, acc[m]);
    for (int64_t j = 0; j < cnt; ++j) P.y[(m0 + m) * P.y_stride + n0 + j] = out[j] + (P.bias ? P.bias[n0 + j] : 0.0f);
  }
}

#else
// The packed weight is read front to back (groups, then blocks), so the block P.prefetch blocks ahead is
// requested while this one is computed (set_q8act_prefetch; kQ8PrefetchBlocks by default): one core's hardware prefetch
// alone leaves a weight read from DRAM below the read bandwidth. Into L1 by default (P.prefetch_l1;
// set_q8act_prefetch_level 1 / 2 for A/Bs): into L2 a decode step was slower on an AMD family-25 CPU with the
// tier forced (benchmarks/results/q8act_level_prefetch_*.json), unlike the AVX-512 VNNI tier's stream prefetch
// at two blocks. Prefetches past the weight's end are harmless (the address formed in integers, never read).
template <int64_t BLK>
inline void prefetch_ahead(const uint8_t* b, int64_t blocks, bool l1) {
  if (blocks > 0) prefetch_lines_ahead(b, blocks * BLK, BLK, l1);
}

// y[m0.., 16 t..] = the accumulators (+ bias), rows past N left out.
template <int MR>
inline void store_group(const Q8ActParams& P, int64_t t, int64_t m0, const __m256 (&acc)[2][MR]) {
  for (int h = 0; h < 2; ++h) {
    const int64_t n0 = t * kQ8Rows + 8 * h, cnt = std::min<int64_t>(8, P.N - n0);
    for (int m = 0; m < MR; ++m) {
      float out[8];
      _mm256_storeu_ps(out, acc[h][m]);
      for (int64_t j = 0; j < cnt; ++j) P.y[(m0 + m) * P.y_stride + n0 + j] = out[j] + (P.bias ? P.bias[n0 + j] : 0.0f);
    }
  }
}

// A whole group of 16 weight rows against activation rows m0.. (MR) without VNNI. Per block, the integer
// dots into s[h][m] (lane j: row 16 t + 8 h + j), one code vector at a time (unroll 1: fully unrolled, the
// compiler kept every product of the block on the stack):
//   Q4: vpmaddubsw's int16 pair sums (codes 0..15 times |a| <= 127: at most 3,810) added in int16 over the
//   block (16 products a lane: at most 30,480, no wrap), widened by one vpmaddwd;
//   Q8_0: the codes re-signed (c = u ^ 0x80, so no offset to take back) and |c| made once per code vector
//   for every activation row, then the sign trick per row: |c| (unsigned) times a * sign(c) (signed); a
//   pair sum is at most 2 * 128 * 127 (no saturation), so each vpmaddubsw is widened by its own vpmaddwd.
// Then the definition's float steps per output.
template <int BITS, bool MINS, int MR>
inline void group_tile(const Q8ActParams& P, int64_t t, int64_t m0) {
  constexpr int64_t blk = kQ8PackBytes(BITS, MINS), code = kQ8CodeBytes(BITS);
  const int64_t G = P.K / kQ8Block;
  const __m256i low4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[2][MR];
  for (int m = 0; m < MR; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = P.packed + (t * G + g) * blk;
    const int8_t* a0 = P.a + m0 * P.K + g * kQ8Block;
    prefetch_ahead<blk>(b, P.prefetch, P.prefetch_l1);
    __m256i s[2][MR];
    for (int m = 0; m < MR; ++m) s[0][m] = s[1][m] = _mm256_setzero_si256();
    if constexpr (BITS == 4) {
#pragma GCC unroll 1
      for (int k = 0; k < 4; ++k) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k + 32));
        for (int nib = 0; nib < 2; ++nib) {  // the low nibbles (elements 4k..), then the high ones (16 + 4k..)
          const __m256i w0 = _mm256_and_si256(nib ? _mm256_srli_epi16(v0, 4) : v0, low4);
          const __m256i w1 = _mm256_and_si256(nib ? _mm256_srli_epi16(v1, 4) : v1, low4);
          for (int m = 0; m < MR; ++m) {
            const __m256i x = bcast_word(a0 + m * P.K + 4 * k + 16 * nib);
            s[0][m] = _mm256_add_epi16(s[0][m], _mm256_maddubs_epi16(w0, x));
            s[1][m] = _mm256_add_epi16(s[1][m], _mm256_maddubs_epi16(w1, x));
          }
        }
      }
    } else {
#pragma GCC unroll 1
      for (int k = 0; k < 8; ++k) {
        const __m256i c0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k)), flip);
        const __m256i c1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k + 32)), flip);
        const __m256i u0 = _mm256_abs_epi8(c0), u1 = _mm256_abs_epi8(c1);
        for (int m = 0; m < MR; ++m) {
          const __m256i x = bcast_word(a0 + m * P.K + 4 * k);
          s[0][m] = _mm256_add_epi32(s[0][m], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(x, c0)), ones));
          s[1][m] = _mm256_add_epi32(s[1][m], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(x, c1)), ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + code + 16 * h)));
      __m256 mw = _mm256_setzero_ps();
      if constexpr (MINS) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + code + 32 + 16 * h)));
      for (int m = 0; m < MR; ++m) {
        const int64_t mg = (m0 + m) * G + g;
        __m256i p = s[h][m];
        if constexpr (BITS == 4) p = _mm256_madd_epi16(p, ones);
        if constexpr (BITS == 4 && !MINS) p = _mm256_sub_epi32(p, _mm256_set1_epi32(P.R[mg] << 3));
        acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_set1_ps(P.d[mg])), acc[h][m]);
        if constexpr (MINS) acc[h][m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(P.s[mg]), acc[h][m]);
      }
    }
  }
  store_group<MR>(P, t, m0, acc);
}
#endif

template <int BITS, bool MINS>
inline void rows_t(const Q8ActParams& P, int64_t t_begin, int64_t t_end) {
#if Q8ACT_VNNI
  for (int64_t t = t_begin; t < t_end; ++t)
    for (int h = 0; h < 2 && t * kQ8Rows + 8 * h < P.N; ++h) {
      int64_t m = 0;
      for (; m + 4 <= P.M; m += 4) half_tile<BITS, MINS, 4>(P, t, h, m);
      switch (P.M - m) {
        case 3: half_tile<BITS, MINS, 3>(P, t, h, m); break;
        case 2: half_tile<BITS, MINS, 2>(P, t, h, m); break;
        case 1: half_tile<BITS, MINS, 1>(P, t, h, m); break;
        default: break;
      }
    }
#else
  // tile(mr, t, m): activation rows m.. (mr of them) against weight group t
  auto tile = [&](auto mr, int64_t t, int64_t m) { group_tile<BITS, MINS, decltype(mr)::value>(P, t, m); };
  for (int64_t t = t_begin; t < t_end; ++t) {
    int64_t m = 0;
    for (; m + 4 <= P.M; m += 4) tile(std::integral_constant<int, 4>{}, t, m);
    switch (P.M - m) {
      case 3: tile(std::integral_constant<int, 3>{}, t, m); break;
      case 2: tile(std::integral_constant<int, 2>{}, t, m); break;
      case 1: tile(std::integral_constant<int, 1>{}, t, m); break;
      default: break;
    }
  }
#endif
}

inline void rows(const Q8ActParams& P, int64_t t_begin, int64_t t_end) {
  if (P.bits == 8) rows_t<8, false>(P, t_begin, t_end);
  else if (P.mins) rows_t<4, true>(P, t_begin, t_end);
  else rows_t<4, false>(P, t_begin, t_end);
}

}  // namespace Q8ACT_NS
}  // namespace cpu
}  // namespace specdec
