// qlinear_q8act's AVX-512 VNNI tier (definition and packed layout: csrc/include/specdec/cpu_q8act.h),
// compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c -ffp-contract=off
// (CMakeLists.txt).
//
// A zmm lane is one of a packed group's 16 weight rows: per block, the group's 4 (Q4) or 8 (Q8_0)
// 64-byte code vectors are read once (Q4: split into low / high nibbles, 8 vectors) and every
// activation row takes 8 vpdpbusd against its 8 broadcast 4-code words, in two chains the first of which starts
// from the codes' offset (Q8_0 / Q4_0), giving the 16 rows' exact block dots in one register; then one convert
// and one fused multiply-add by
// dw * d (16 scales widened at once), and Q4_1's min term by one more. Up to 8 activation rows share
// the decoded codes; with Q4 weights a decode step (one activation row) and a pass of two rows run two
// groups at once for independent chains.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "specdec/cpu_q8act.h"

namespace specdec {
namespace cpu {
namespace {

inline __m512i bcast_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Groups t0.. (NG) of 16 weight rows against activation rows m0.. (MR).
template <int BITS, bool MINS, int NG, int MR>
inline void tile(const Q8ActParams& P, int64_t t0, int64_t m0) {
  constexpr int64_t blk = kQ8PackBytes(BITS, MINS), code = kQ8CodeBytes(BITS);
  constexpr int shift = BITS == 8 ? 7 : (MINS ? -1 : 3);
  const int64_t G = P.K / kQ8Block;
  __m512 acc[NG][MR];
  for (int q = 0; q < NG; ++q)
    for (int m = 0; m < MR; ++m) acc[q][m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15);
  // Many rows (from 4 with Q8_0, 6 with Q4: set_q8act_many_rows): the products outlast the stream, so every
  // line of a block block_prefetch blocks ahead into L1 (the hardware prefetcher alone fell behind), past the
  // group's end into the next group's blocks as the few-row tiles do (a layer of K = 576 has 18 blocks a group:
  // stopping at the group's end left each group's first blocks unrequested).
  // Few rows: the stream outruns the products; every line of the block stream_prefetch blocks ahead into L2,
  // past the group's end into the next group's blocks (a thread's groups lie one after another). Into L1 it
  // evicted the blocks in use; the one-line hint alone left a decode step waiting on DRAM (AMD family 25:
  // benchmarks/results/q8act_stream_prefetch_*.json). Either distance 0: the one-line hint two blocks ahead.
  const bool many = MR >= (BITS == 8 ? P.many_rows_q8 : P.many_rows_q4);
  const int64_t ahead = (many ? P.block_prefetch : P.stream_prefetch) * blk;
  for (int64_t g = 0; g < G; ++g) {
    for (int q = 0; q < NG; ++q) {
      const uint8_t* b = P.packed + ((t0 + q) * G + g) * blk;
      if (ahead > 0) {
        prefetch_lines_ahead(b, ahead, blk, many);
      } else if (g + 2 < G) {
        _mm_prefetch(reinterpret_cast<const char*>(b + 2 * blk), _MM_HINT_T0);
      }
      __m512i w[8];  // w[e]: the codes multiplying activation word e (elements 4e..4e+3)
      if constexpr (BITS == 8) {
        for (int k = 0; k < 8; ++k) w[k] = _mm512_loadu_si512(b + 64 * k);
      } else {
        for (int k = 0; k < 4; ++k) {
          const __m512i v = _mm512_loadu_si512(b + 64 * k);
          w[k] = _mm512_and_si512(v, low4);
          w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
      }
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + code)));
      __m512 mw = _mm512_setzero_ps();
      if constexpr (MINS) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + code + 32)));
      for (int m = 0; m < MR; ++m) {
        const int64_t mg = (m0 + m) * G + g;
        const int8_t* a = P.a + (m0 + m) * P.K + g * kQ8Block;
        // the codes' offset (Q8_0: 128, Q4_0: 8, times the block's activation sum) starts the chain
        __m512i p = _mm512_setzero_si512();
        if constexpr (shift >= 0) p = _mm512_set1_epi32(-(P.R[mg] << shift));
        // two chains: one dpbusd chain per row was slower at 4-16 rows (AMD family 25, whole forwards)
        __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast_word(a + 4));
        p = _mm512_dpbusd_epi32(p, w[0], bcast_word(a));
        p = _mm512_dpbusd_epi32(p, w[2], bcast_word(a + 8));
        p1 = _mm512_dpbusd_epi32(p1, w[3], bcast_word(a + 12));
        p = _mm512_dpbusd_epi32(p, w[4], bcast_word(a + 16));
        p1 = _mm512_dpbusd_epi32(p1, w[5], bcast_word(a + 20));
        p = _mm512_dpbusd_epi32(p, w[6], bcast_word(a + 24));
        p1 = _mm512_dpbusd_epi32(p1, w[7], bcast_word(a + 28));
        p = _mm512_add_epi32(p, p1);
        acc[q][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, _mm512_set1_ps(P.d[mg])), acc[q][m]);
        if constexpr (MINS) acc[q][m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(P.s[mg]), acc[q][m]);
      }
    }
  }
  for (int q = 0; q < NG; ++q) {
    const int64_t n0 = (t0 + q) * kQ8Rows, cnt = std::min<int64_t>(kQ8Rows, P.N - n0);
    const __mmask16 k = cnt >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cnt) - 1);
    const __m512 b = P.bias ? _mm512_maskz_loadu_ps(k, P.bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(P.y + (m0 + m) * P.y_stride + n0, k, _mm512_add_ps(acc[q][m], b));
  }
}

template <int BITS, bool MINS>
inline void rows_t(const Q8ActParams& P, int64_t t_begin, int64_t t_end) {
  int64_t t = t_begin;
  // Q4 weights, one or two activation rows: two groups in flight where group_pairs is on (the default except
  // on AMD CPUs; at 3 or 4 rows it measured no faster). Q8_0 weights (8 code vectors per group and block, the
  // LM head) take one group at a time: a second group's codes do not fit the registers beside the first's
  // (two-row pass 1.153 -> 1.089x a one-row pass in benchmarks/results/q8act_cpu_2026-12-06j.json against
  // archive/q8act_cpu_2026-12-06i.json)
  if constexpr (BITS == 4) {
    if (P.group_pairs && P.M == 1)
      for (; t + 2 <= t_end; t += 2) tile<BITS, MINS, 2, 1>(P, t, 0);
    else if (P.group_pairs && P.M == 2)
      for (; t + 2 <= t_end; t += 2) tile<BITS, MINS, 2, 2>(P, t, 0);
  }
  for (; t < t_end; ++t) {
    int64_t m = 0;
    for (; m + 8 <= P.M; m += 8) tile<BITS, MINS, 1, 8>(P, t, m);
    switch (P.M - m) {
      case 7: tile<BITS, MINS, 1, 7>(P, t, m); break;
      case 6: tile<BITS, MINS, 1, 6>(P, t, m); break;
      case 5: tile<BITS, MINS, 1, 5>(P, t, m); break;
      case 4: tile<BITS, MINS, 1, 4>(P, t, m); break;
      case 3: tile<BITS, MINS, 1, 3>(P, t, m); break;
      case 2: tile<BITS, MINS, 1, 2>(P, t, m); break;
      case 1: tile<BITS, MINS, 1, 1>(P, t, m); break;
      default: break;
    }
  }
}

}  // namespace

void q8act_rows_avx512vnni(const Q8ActParams& P, int64_t t_begin, int64_t t_end) {
  if (P.amx_rows > 0 && P.M >= P.amx_rows && amx_available()) return q8act_rows_amx(P, t_begin, t_end);
  if (P.bits == 8) rows_t<8, false>(P, t_begin, t_end);
  else if (P.mins) rows_t<4, true>(P, t_begin, t_end);
  else rows_t<4, false>(P, t_begin, t_end);
}

}  // namespace cpu
}  // namespace specdec
