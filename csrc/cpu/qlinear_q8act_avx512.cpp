// qlinear_q8act's AVX-512 VNNI tier (definition: csrc/include/specdec/cpu_q8act.h), compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c -ffp-contract=off (CMakeLists.txt).
//
// A zmm holds two blocks g, g + 1: its 16 lanes are the 16 canonical accumulators, so one vpdpbusd
// computes both blocks' 8 lane dots and one fused multiply-add accumulates them. Q8_0 keeps the
// canonical order (lanes 0-7 block g, 8-15 block g + 1). Q4: the 32 packed bytes of a pair decode into
// [lo g | lo g+1 | hi g | hi g+1] (16 bytes each: a broadcast, a masked shift, a mask), i.e. the
// canonical 128-bit quarters in the order 0, 2, 1, 3; the activation codes (and Q4_0's lane sums)
// of every full pair are permuted the same way once per call (q8_interleave_pairs_avx512), and the
// accumulators are permuted back before the fold. Each pair's scale vector comes from dw * d of 16
// blocks multiplied at once (the same products as the definition's) by one permute. An odd last block
// adds to the canonical lanes 0-7; the sums fold in the definition's order, so the outputs are the
// ymm tiers' and the scalar tier's, bit for bit. Up to 8 activation rows share each decoded pair.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "specdec/cpu_q8act.h"

namespace specdec {
namespace cpu {
namespace {

// Codes of blocks g, g + 1 of weight row n (Q8_0: element order; Q4: [lo g | lo g+1 | hi g | hi g+1]).
template <int BITS>
inline __m512i load_pair(const Q8ActParams& P, int64_t n, int64_t g) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(static_cast<const int8_t*>(P.qw) + n * P.K + g * 32);
  } else {
    // [b | b], the upper copy shifted to its high nibbles, masked
    const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(P.qw) + n * (P.K / 2) + g * 16)));
    return _mm512_and_si512(_mm512_mask_srli_epi16(b, __mmask32(0xFFFF0000u), b, 4), _mm512_set1_epi8(15));
  }
}

// The 8-lane (one block) form for an odd last block, as the ymm tiers compute it.
template <int BITS>
inline __m256i load_one(const Q8ActParams& P, int64_t n, int64_t g) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(P.qw) + n * P.K + g * 32));
  } else {
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(P.qw) + n * (P.K / 2) + g * 16));
    const __m128i low4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
  }
}

// quarters 0, 2, 1, 3 of a zmm (self-inverse: Q4's pair order <-> the canonical order)
inline __m512i swap_quarters(__m512i z) { return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)); }

// acc + float(p) * (dw * d) (one fused multiply-add) over the pair's 16 lanes of activation row m, dd
// the pair's scale vector.
template <int BITS, bool MINS>
inline __m512 pair_fma(const Q8ActParams& P, __m512i w, __m512i wu, __m512 dd, __m512 acc, int64_t m, int64_t g) {
  const __m512i a = _mm512_loadu_si512(P.a + m * P.K + g * 32);
  __m512i p;
  if constexpr (BITS == 8) {
    const __m512i s = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a);
    p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, s);
  } else {
    p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
    if constexpr (!MINS)
      p = _mm512_sub_epi32(p, _mm512_slli_epi32(_mm512_loadu_si512(P.r + (m * (P.K / kQ8Block) + g) * 8), 3));
  }
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), dd, acc);
}

// The odd last block's float(p) and dw * d (8 lanes each), as the ymm tiers compute them.
template <int BITS, bool MINS>
inline void one_block(const Q8ActParams& P, int64_t n, int64_t m, int64_t g, __m256& pf, __m256& dd) {
  const int64_t G = P.K / kQ8Block, o = (m * G + g) * 8;
  const __m256i w = load_one<BITS>(P, n, g);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.a + m * P.K + g * 32));
  __m256i p;
  if constexpr (BITS == 8) {
    p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
  } else {
    p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
    if constexpr (!MINS)
      p = _mm256_sub_epi32(p, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.r + o)), 3));
  }
  pf = _mm256_cvtepi32_ps(p);
  dd = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(P.scales[n * G + g])), _mm256_broadcast_ss(P.d + m * G + g));
}

inline float fold(__m512 acc) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// Lanes of the 16 blocks from g that exist (a masked tail at the row's end).
inline __mmask16 chunk_mask(int64_t G, int64_t g) {
  const int64_t cnt = std::min<int64_t>(16, G - g);
  return cnt == 16 ? __mmask16(0xFFFF) : __mmask16((1u << cnt) - 1);
}

// Q4_1's min terms of weight rows n0.. (NR) and activation rows m0.. (MR): macc lane i = the blocks
// g = i (mod 16) in ascending order, 16 blocks per step (a masked tail).
template <int NR, int MR>
inline void min_terms(const Q8ActParams& P, int64_t n0, int64_t m0, __m512 (&macc)[NR][MR]) {
  const int64_t G = P.K / kQ8Block;
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 k = chunk_mask(G, g);
    __m512 sv[MR];
    for (int m = 0; m < MR; ++m) sv[m] = _mm512_maskz_loadu_ps(k, P.s + (m0 + m) * G + g);
    for (int r = 0; r < NR; ++r) {
      const __m512 mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, P.mins + (n0 + r) * G + g));
      for (int m = 0; m < MR; ++m)
        macc[r][m] = _mm512_mask3_fmadd_ps(mw, sv[m], macc[r][m], k);
    }
  }
}

// Weight rows n0.. (NR) against activation rows m0.. (MR).
template <int BITS, bool MINS, int NR, int MR>
inline void tile(const Q8ActParams& P, int64_t n0, int64_t m0) {
  const int64_t G = P.K / kQ8Block;
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  // dw * d of 16 blocks (float16 scales widened exactly) per weight and activation row; a pair's
  // lanes take theirs by a permute
  __m512 dd[NR][MR];
  const __m512i idx0 = BITS == 8 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                 : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  Q8Prefetch prefetch(P, n0, NR, m0, (G + 1) / 2);
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    prefetch.step();
    if ((g & 15) == 0) {
      const __mmask16 k = chunk_mask(G, g);
      __m512 da[MR];
      for (int m = 0; m < MR; ++m) da[m] = _mm512_maskz_loadu_ps(k, P.d + (m0 + m) * G + g);
      for (int r = 0; r < NR; ++r) {
        const __m512 ds = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, P.scales + (n0 + r) * G + g));
        for (int m = 0; m < MR; ++m) dd[r][m] = _mm512_mul_ps(ds, da[m]);
      }
    }
    const __m512i idx = _mm512_add_epi32(idx0, _mm512_set1_epi32(int(g & 15)));
    for (int r = 0; r < NR; ++r) {
      const __m512i w = load_pair<BITS>(P, n0 + r, g);
      const __m512i wu = BITS == 8 ? _mm512_abs_epi8(w) : w;
      for (int m = 0; m < MR; ++m)
        acc[r][m] = pair_fma<BITS, MINS>(P, w, wu, _mm512_permutexvar_ps(idx, dd[r][m]), acc[r][m], m0 + m, g);
    }
  }
  if constexpr (BITS == 4)  // back to the canonical lanes
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_castsi512_ps(swap_quarters(_mm512_castps_si512(acc[r][m])));
  if (g < G)
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MR; ++m) {
        __m256 pf, dd1;
        one_block<BITS, MINS>(P, n0 + r, m0 + m, g, pf, dd1);
        acc[r][m] = _mm512_mask3_fmadd_ps(_mm512_zextps256_ps512(pf), _mm512_zextps256_ps512(dd1), acc[r][m], 0x00FF);
      }
  __m512 macc[NR][MR];
  if constexpr (MINS) {
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MR; ++m) macc[r][m] = _mm512_setzero_ps();
    min_terms<NR, MR>(P, n0, m0, macc);
  }
  for (int r = 0; r < NR; ++r) {
    const float b = P.bias ? P.bias[n0 + r] : 0.0f;
    for (int m = 0; m < MR; ++m) {
      float y = fold(acc[r][m]);
      if constexpr (MINS) y = y + fold(macc[r][m]);
      P.y[(m0 + m) * P.y_stride + n0 + r] = y + b;
    }
  }
}

// Weight row n against all M rows, 8 activation rows per tile (the row's codes stay in L1).
template <int BITS, bool MINS>
inline void row_all_m(const Q8ActParams& P, int64_t n) {
  int64_t m = 0;
  for (; m + 8 <= P.M; m += 8) tile<BITS, MINS, 1, 8>(P, n, m);
  switch (P.M - m) {
    case 7: tile<BITS, MINS, 1, 7>(P, n, m); break;
    case 6: tile<BITS, MINS, 1, 6>(P, n, m); break;
    case 5: tile<BITS, MINS, 1, 5>(P, n, m); break;
    case 4: tile<BITS, MINS, 1, 4>(P, n, m); break;
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
  else if (P.M <= 4)
    for (; n + 2 <= n_end; n += 2) {
      switch (P.M) {
        case 2: tile<BITS, MINS, 2, 2>(P, n, 0); break;
        case 3: tile<BITS, MINS, 2, 3>(P, n, 0); break;
        default: tile<BITS, MINS, 2, 4>(P, n, 0); break;
      }
    }
  for (; n < n_end; ++n) row_all_m<BITS, MINS>(P, n);
}

}  // namespace

void q8_interleave_pairs_avx512(int8_t* a, int32_t* r, int64_t M, int64_t K) {
  const int64_t G = K / kQ8Block;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g + 2 <= G; g += 2) {
      int8_t* ap = a + m * K + g * 32;
      _mm512_storeu_si512(ap, swap_quarters(_mm512_loadu_si512(ap)));
      if (r == nullptr) continue;
      int32_t* rp = r + (m * G + g) * 8;
      _mm512_storeu_si512(rp, swap_quarters(_mm512_loadu_si512(rp)));
    }
}

void q8act_rows_avx512vnni(const Q8ActParams& P, int64_t n_begin, int64_t n_end) {
  if (P.bits == 8) rows_t<8, false>(P, n_begin, n_end);
  else if (P.mins) rows_t<4, true>(P, n_begin, n_end);
  else rows_t<4, false>(P, n_begin, n_end);
}

}  // namespace cpu
}  // namespace specdec
