// qlinear_q8act on Intel AMX (AMX-TILE + AMX-INT8), the AVX-512 VNNI tier's path for verify passes of several
// activation rows (set_q8act_amx_rows; definition and packed layout: csrc/include/specdec/cpu_q8act.h). Compiled
// with -mamx-tile -mamx-int8 -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c -ffp-contract=off.
//
// The packed layout is already an AMX B tile: a block's code vectors hold, per 64 bytes, 4 consecutive inputs of
// each of the group's 16 weight rows (Q8_0: 8 vectors = the 32 inputs; Q4: 4 vectors of nibbles, the low ones
// inputs 0-15, the high ones 16-31, split into 8). One TDPBSUD multiplies up to 16 activation rows' codes of the
// block (the A tile, signed) by those (unsigned: Q8_0's codes + 128, Q4's nibbles), giving every row's 16 exact
// block dots; the codes' offset is subtracted as an integer (Q8_0: 128 R, Q4_0: 8 R), then the epilogue is the
// VNNI tile's, operation for operation: one convert, one fused multiply-add by dw * d, Q4_1's min term by one
// more, the bias added at the end. So every output has the definition's bits, as in every tier.
#include <immintrin.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "specdec/cpu_q8act.h"

namespace specdec {
namespace cpu {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-2 the products of up to three groups of 16 weight rows (MR x 16 int32 each), 3 the activation codes
// (MR x 32 int8), 4-6 the three groups' weight codes (8 x 64 uint8): three independent tile products per block
// and activation load, so that the AMX unit's latency overlaps.
inline void configure(int MR) {
  TileConfig c;
  for (int i = 0; i < 3; ++i) {
    c.rows[i] = uint8_t(MR);
    c.colsb[i] = 64;
    c.rows[4 + i] = 8;
    c.colsb[4 + i] = 64;
  }
  c.rows[3] = uint8_t(MR);
  c.colsb[3] = 32;
  _tile_loadconfig(&c);
}

// The weight codes of block b as a B tile: Q8_0's vectors in place, Q4's nibbles split into nib (8 x 64).
template <int BITS>
inline const uint8_t* b_tile(const uint8_t* b, uint8_t* nib) {
  if constexpr (BITS == 8) {
    return b;
  } else {
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int k = 0; k < 4; ++k) {
      const __m512i v = _mm512_loadu_si512(b + 64 * k);
      _mm512_store_si512(nib + 64 * k, _mm512_and_si512(v, low4));
      _mm512_store_si512(nib + 256 + 64 * k, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
    }
    return nib;
  }
}

// Groups t0 .. t0 + NG - 1 of 16 weight rows against activation rows m0 .. m0 + MR - 1.
template <int BITS, bool MINS, int MR, int NG>
void amx_tile(const Q8ActParams& P, int64_t t0, int64_t m0) {
  constexpr int64_t blk = kQ8PackBytes(BITS, MINS), code = kQ8CodeBytes(BITS);
  constexpr int shift = BITS == 8 ? 7 : (MINS ? -1 : 3);
  const int64_t G = P.K / kQ8Block, ahead = P.block_prefetch * blk;
  alignas(64) int32_t prod[NG][MR * 16];
  alignas(64) uint8_t nib[NG][512];
  __m512 acc[NG][MR];
  for (int q = 0; q < NG; ++q)
    for (int m = 0; m < MR; ++m) acc[q][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b[NG];
    for (int q = 0; q < NG; ++q) {
      b[q] = P.packed + ((t0 + q) * G + g) * blk;
      if (ahead > 0) prefetch_lines_ahead(b[q], ahead, blk, true);
    }
    _tile_loadd(3, P.a + m0 * P.K + g * kQ8Block, P.K);
    _tile_zero(0);
    _tile_loadd(4, b_tile<BITS>(b[0], nib[0]), 64);
    _tile_dpbsud(0, 3, 4);
    if constexpr (NG > 1) {
      _tile_zero(1);
      _tile_loadd(5, b_tile<BITS>(b[1], nib[1]), 64);
      _tile_dpbsud(1, 3, 5);
    }
    if constexpr (NG > 2) {
      _tile_zero(2);
      _tile_loadd(6, b_tile<BITS>(b[2], nib[2]), 64);
      _tile_dpbsud(2, 3, 6);
    }
    _tile_stored(0, prod[0], 64);
    if constexpr (NG > 1) _tile_stored(1, prod[NG > 1 ? 1 : 0], 64);
    if constexpr (NG > 2) _tile_stored(2, prod[NG > 2 ? 2 : 0], 64);
    for (int q = 0; q < NG; ++q) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[q] + code)));
      __m512 mw = _mm512_setzero_ps();
      if constexpr (MINS) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[q] + code + 32)));
      for (int m = 0; m < MR; ++m) {
        const int64_t mg = (m0 + m) * G + g;
        __m512i p = _mm512_load_si512(prod[q] + 16 * m);
        if constexpr (shift >= 0) p = _mm512_sub_epi32(p, _mm512_set1_epi32(P.R[mg] << shift));
        acc[q][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, _mm512_set1_ps(P.d[mg])), acc[q][m]);
        if constexpr (MINS) acc[q][m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(P.s[mg]), acc[q][m]);
      }
    }
  }
  for (int q = 0; q < NG; ++q) {
    const int64_t n0 = (t0 + q) * kQ8Rows, cnt = std::min<int64_t>(kQ8Rows, P.N - n0);
    const __mmask16 k = cnt >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cnt) - 1);
    const __m512 bias = P.bias ? _mm512_maskz_loadu_ps(k, P.bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m)
      _mm512_mask_storeu_ps(P.y + (m0 + m) * P.y_stride + n0, k, _mm512_add_ps(acc[q][m], bias));
  }
}

template <int BITS, bool MINS, int MR>
void amx_rows(const Q8ActParams& P, int64_t t_begin, int64_t t_end, int64_t m0) {
  int64_t t = t_begin;
  for (; t + 3 <= t_end; t += 3) amx_tile<BITS, MINS, MR, 3>(P, t, m0);
  if (t_end - t == 2) amx_tile<BITS, MINS, MR, 2>(P, t, m0);
  else if (t_end - t == 1) amx_tile<BITS, MINS, MR, 1>(P, t, m0);
}

template <int BITS, bool MINS>
void amx_chunk(const Q8ActParams& P, int64_t t_begin, int64_t t_end, int64_t m0, int rows) {
  configure(rows);
  switch (rows) {
#define SPECDEC_AMX_CASE(R) \
  case R: amx_rows<BITS, MINS, R>(P, t_begin, t_end, m0); break;
    SPECDEC_AMX_CASE(1) SPECDEC_AMX_CASE(2) SPECDEC_AMX_CASE(3) SPECDEC_AMX_CASE(4) SPECDEC_AMX_CASE(5)
    SPECDEC_AMX_CASE(6) SPECDEC_AMX_CASE(7) SPECDEC_AMX_CASE(8) SPECDEC_AMX_CASE(9) SPECDEC_AMX_CASE(10)
    SPECDEC_AMX_CASE(11) SPECDEC_AMX_CASE(12) SPECDEC_AMX_CASE(13) SPECDEC_AMX_CASE(14) SPECDEC_AMX_CASE(15)
    SPECDEC_AMX_CASE(16)
#undef SPECDEC_AMX_CASE
    default: break;
  }
}

template <int BITS, bool MINS>
void amx_all(const Q8ActParams& P, int64_t t_begin, int64_t t_end) {
  for (int64_t m0 = 0; m0 < P.M; m0 += 16) amx_chunk<BITS, MINS>(P, t_begin, t_end, m0, int(std::min<int64_t>(16, P.M - m0)));
  _tile_release();
}

}  // namespace

bool amx_available() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // Linux: ask for the tile state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

void q8act_rows_amx(const Q8ActParams& P, int64_t t_begin, int64_t t_end) {
  if (P.bits == 8) amx_all<8, false>(P, t_begin, t_end);
  else if (P.mins) amx_all<4, true>(P, t_begin, t_end);
  else amx_all<4, false>(P, t_begin, t_end);
}

}  // namespace cpu
}  // namespace specdec
