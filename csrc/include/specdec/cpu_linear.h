// linear (y = x W^T * scale + bias) on the CPU for the few-row activations of decoding
// and tree verification: M = 1..32 rows of x against a weight that is far larger than
// any cache. The weight is streamed from memory exactly once per call; every weight
// vector loaded into a register feeds up to kMr rows of x.
//
// Layout: W is [N, K] row-major (torch's nn.Linear layout), so output y[m, n] is the dot
// product of two contiguous rows. A micro-tile is kNr = 4 weight rows x kMr = 3 x rows:
// 12 vector accumulators of 8 partial sums, reduced horizontally once per tile. The 4
// weight rows (<= 4 * K * 4 bytes) stay in L1/L2 while the x row-triples pass over them.
// Float32 weights take two other schedules of the same micro-tile arithmetic (chosen by M,
// bit-identical results): 1-4 x rows stream the weight rows one after the other
// (seq_rows_f32), 6-8 x rows run as 2 x 4 tiles (row_block_24); int8 weights take the 2 x 4 tiles at
// 4 x rows; see there for the measurements.
// Weight dtypes: float32, float16, bfloat16 (widened to fp32 on load) and int8 with a
// per-output-row float32 scale (weight-only quantisation; applied after the dot product).
// x is float32 here; the host converts half/bf16 activations once (M * K values).
//
// Napkin math (SmolLM2-135M, 2 cores, ~20 GB/s): fp32 weights 538 MB -> 27 ms per forward
// at any M while 2*M*N*K flops stay under the FMA roof (M <= ~8); torch's MKL sgemm
// reaches ~8 GB/s at M = 1 and ~3 GB/s at M = 8 on the same shapes.
//
// This header is compiled once per ISA (SPECDEC_CPU_ISA names the namespace).
#pragma once

#include <cstdint>
#include <algorithm>
#include <cstring>

#include "specdec/cpu_vec.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifndef SPECDEC_CPU_ISA
#error "define SPECDEC_CPU_ISA before including cpu_linear.h"
#endif

namespace specdec {
namespace cpu {

enum class WType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt8 = 3 };

constexpr int64_t wtype_size(WType t) { return t == WType::kFloat32 ? 4 : (t == WType::kInt8 ? 1 : 2); }

struct LinearParams {
  const float* x;       // [M, K] float32, row stride x_stride
  int64_t x_stride;
  const void* w;        // [N, K] contiguous, wtype
  const float* scale;   // [N] float32 (int8 weights) or nullptr
  const float* bias;    // [N] float32 or nullptr
  float* y;             // [M, N] float32, row stride y_stride
  int64_t y_stride;
  int64_t M, N, K;
  WType wtype;
};

namespace SPECDEC_CPU_ISA {

constexpr int kNr = 4;  // weight rows per micro-tile
constexpr int kMr = 3;  // x rows per micro-tile

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef int8_t v8i8 __attribute__((vector_size(8)));

// Reinterpret 32 bytes (an __m256 / __m256i / v8u32) as a v8f.
template <typename V>
inline v8f bits_as_v8f(const V& v) {
  static_assert(sizeof(V) == sizeof(v8f), "32-byte vectors only");
  v8f f;
  std::memcpy(&f, &v, sizeof(f));
  return f;
}

// 8 weights at w + k (element index) widened to float.
template <WType WT>
inline v8f load_w(const void* w, int64_t k) {
  if constexpr (WT == WType::kFloat32) {
    return v8_load(static_cast<const float*>(w) + k);
  } else if constexpr (WT == WType::kBFloat16) {
#if defined(__AVX2__)
    return bits_as_v8f(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(w) + k))), 16));
#else
    v8u16 h;
    std::memcpy(&h, static_cast<const uint16_t*>(w) + k, sizeof(h));
    return bits_as_v8f(__builtin_convertvector(h, v8u32) << 16);
#endif
  } else if constexpr (WT == WType::kFloat16) {
#if defined(__F16C__)
    return bits_as_v8f(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(w) + k))));
#else
    const uint16_t* p = static_cast<const uint16_t*>(w) + k;
    return v8f{half_to_float(p[0]), half_to_float(p[1]), half_to_float(p[2]), half_to_float(p[3]),
               half_to_float(p[4]), half_to_float(p[5]), half_to_float(p[6]), half_to_float(p[7])};
#endif
  } else {
#if defined(__AVX2__)
    return bits_as_v8f(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
        static_cast<const int8_t*>(w) + k)))));
#else
    v8i8 b;
    std::memcpy(&b, static_cast<const int8_t*>(w) + k, sizeof(b));
    return __builtin_convertvector(b, v8f);
#endif
  }
}

template <WType WT>
inline float load_w1(const void* w, int64_t k) {
  if constexpr (WT == WType::kFloat32) return static_cast<const float*>(w)[k];
  else if constexpr (WT == WType::kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(w)[k]);
  else if constexpr (WT == WType::kFloat16) return half_to_float(static_cast<const uint16_t*>(w)[k]);
  else return float(static_cast<const int8_t*>(w)[k]);
}

template <WType WT>
inline const void* w_row(const void* w, int64_t n, int64_t K) {
  return static_cast<const char*>(w) + n * K * wtype_size(WT);
}

// The prefetch target of the weight block at n0 (NR rows): the next block of NR rows, clipped to n_end,
// as a pointer and a count of 64-byte lines (nullptr / 0 past the end). Shared by every few-row tile.
template <WType WT, int NR>
inline const char* next_block(const LinearParams& P, int64_t n0, int64_t n_end, int64_t& lines) {
  const int64_t rows = std::min<int64_t>(NR, n_end - (n0 + NR));
  lines = rows > 0 ? (rows * P.K * wtype_size(WT) + 63) / 64 : 0;
  return lines ? static_cast<const char*>(w_row<WT>(P.w, n0 + NR, P.K)) : nullptr;
}

// A tile's share of that prefetch (pf_lines lines from pf) spread evenly over its `steps` k steps:
// step() issues the next step's lines (see micro_tile).
struct KPrefetch {
  const char* p;
  int64_t per_step;
  KPrefetch(const char* pf, int64_t pf_lines, int64_t steps)
      : p(pf), per_step((pf != nullptr && steps > 0) ? (pf_lines + steps - 1) / steps : 0) {}
  inline void step() {
    for (int64_t j = 0; j < per_step; ++j, p += 64) __builtin_prefetch(p, 0, 2);
  }
};

// Dot products of NR weight rows (starting at n0) with MR x rows (starting at m0);
// writes the finished outputs (scale, bias applied).
template <WType WT, int NR, int MR>
inline void micro_tile(const LinearParams& P, int64_t n0, int64_t m0, const char* pf, int64_t pf_lines) {
  const int64_t K = P.K;
  const int64_t K8 = K & ~int64_t(7);
  const void* wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = w_row<WT>(P.w, n0 + r, K);
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = P.x + (m0 + m) * P.x_stride;
  v8f acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = v8_set1(0.0f);
  // Prefetch about pf_lines lines from pf on (a share of the next weight block), spread evenly
  // over the k loop, so that DRAM streams while this tile computes: the rows are too short
  // (K * es bytes) for the hardware prefetchers, which stop at page boundaries, alone. The
  // last step may run past the share: harmless (a prefetch never faults) and it lands on
  // the block after. The k loop takes 16 inputs per step (two 8-wide halves into the same
  // accumulators, so the summation order is the plain k order whatever the tile): fewer
  // loop branches and prefetch checks per FMA (exploratory, one core, weights in L2:
  // 1.24x at M = 3, 1.10x at M = 8 over one half per step).
  const int64_t K16 = K & ~int64_t(15);
  KPrefetch prefetch(pf, pf_lines, K16 / 16);
  int64_t k = 0;
  for (; k < K16; k += 16) {
    prefetch.step();
#pragma GCC unroll 2
    for (int64_t u = 0; u < 16; u += 8) {
      v8f xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = v8_load(xr[m] + k + u);
      for (int r = 0; r < NR; ++r) {
        const v8f wv = load_w<WT>(wr[r], k + u);
        for (int m = 0; m < MR; ++m) acc[r][m] += wv * xv[m];
      }
    }
  }
  if (k < K8) {  // one 8-wide half left
    v8f xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = v8_load(xr[m] + k);
    for (int r = 0; r < NR; ++r) {
      const v8f wv = load_w<WT>(wr[r], k);
      for (int m = 0; m < MR; ++m) acc[r][m] += wv * xv[m];
    }
  }
  for (int r = 0; r < NR; ++r) {
    const int64_t n = n0 + r;
    const float s = P.scale ? P.scale[n] : 1.0f;
    const float b = P.bias ? P.bias[n] : 0.0f;
    for (int m = 0; m < MR; ++m) {
      float dot = v8_hsum(acc[r][m]);
      for (int64_t k = K8; k < K; ++k) dot += load_w1<WT>(wr[r], k) * xr[m][k];
      P.y[(m0 + m) * P.y_stride + n] = dot * s + b;
    }
  }
}

// Rows of x in tiles of kMr (remainder 1 or 2) against NR weight rows; the tiles share
// the prefetch of the next block of NR rows.
template <WType WT, int NR>
inline void row_block(const LinearParams& P, int64_t n0, int64_t n_end) {
  const int64_t tiles = (P.M + kMr - 1) / kMr;
  int64_t lines = 0;
  const char* next = next_block<WT, NR>(P, n0, n_end, lines);
  auto share = [&](int64_t t, int64_t& count) {
    const int64_t a = lines * t / tiles, b = lines * (t + 1) / tiles;
    count = b - a;
    return next ? next + a * 64 : nullptr;
  };
  int64_t m = 0, t = 0, count = 0;
  for (; m + kMr <= P.M; m += kMr, ++t) {
    const char* pf = share(t, count);
    micro_tile<WT, NR, kMr>(P, n0, m, pf, count);
  }
  const int64_t rest = P.M - m;
  const char* pf = share(t, count);
  if (rest == 2) micro_tile<WT, NR, 2>(P, n0, m, pf, count);
  else if (rest == 1) micro_tile<WT, NR, 1>(P, n0, m, pf, count);
}

// Up to kSeqMaxRows x rows against float32 weights (decode steps, small verify passes): the
// weight rows one after the other, each against all M x rows, so that each thread reads its share
// of W as ONE sequential stream, with a software prefetch a few lines ahead. The 4-row tile above
// reads 4 weight rows side by side (4 streams K * 4 bytes apart per thread), which the hardware
// prefetchers follow less well. Measured on the Llama shapes here (K = 576 / 1536, 2 threads, one
// process, interleaved): 1.09-1.22x the tile's GB/s at M = 1 (the lm_head [49152, 576]: 25 -> 30
// GB/s), 1.04-1.25x at M = 2..4; at M >= 5 the tile's weight-register reuse wins (0.82-0.99x), so
// it keeps those. Each output is the same single accumulator in the same k order as in
// micro_tile, then the same horizontal sum, tail, scale and bias: the results are the tile's,
// bit for bit, so a row's output never depends on M (decode step == verify row). Narrow weights
// keep the tile: widening each vector makes the loop latency-bound (int8: 0.55-0.66x at one
// row in back-to-back runs, 0.40-0.85x at 2-4 rows in an interleaved A/B).
constexpr int64_t kSeqMaxRows = 4;

template <int MR>
inline void seq_row_f32(const LinearParams& P, int64_t n) {
  const int64_t K = P.K;
  const int64_t K8 = K & ~int64_t(7), K16 = K & ~int64_t(15);
  constexpr int64_t kAhead = 256;  // prefetch distance in bytes: 4 lines past the current load
  const float* w = static_cast<const float*>(P.w) + n * K;
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = P.x + m * P.x_stride;
  v8f acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = v8_set1(0.0f);
  int64_t k = 0;
  for (; k < K16; k += 16) {
    __builtin_prefetch(reinterpret_cast<const char*>(w + k) + kAhead, 0, 3);
    const v8f w0 = v8_load(w + k), w1 = v8_load(w + k + 8);
    for (int m = 0; m < MR; ++m) acc[m] += w0 * v8_load(xr[m] + k);
    for (int m = 0; m < MR; ++m) acc[m] += w1 * v8_load(xr[m] + k + 8);
  }
  if (k < K8) {
    const v8f w0 = v8_load(w + k);
    for (int m = 0; m < MR; ++m) acc[m] += w0 * v8_load(xr[m] + k);
  }
  const float s = P.scale ? P.scale[n] : 1.0f;
  const float b = P.bias ? P.bias[n] : 0.0f;
  for (int m = 0; m < MR; ++m) {
    float dot = v8_hsum(acc[m]);
    for (int64_t j = K8; j < K; ++j) dot += w[j] * xr[m][j];
    P.y[m * P.y_stride + n] = dot * s + b;
  }
}

template <int MR>
inline void seq_rows_f32(const LinearParams& P, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) seq_row_f32<MR>(P, n);
}

// 6-8 x rows against float32 weights (a verify pass of 6-8 nodes), and 4 x rows against int8 weights
// (1.07-1.12x over the 4 x 3 tile's 3 + 1 rows, which widen each weight vector twice; at 5-8 rows
// int8 keeps the 4 x 3 tile, 0.90-1.03x): the block's 4 weight rows as
// two pairs, each against the x rows in two groups (4, then M - 4): 2 x 4 tiles of 8
// accumulators instead of 3 + 3 + 2 rows of the 4 x 3 tile. Measured against it in one process,
// interleaved (exploratory, 2 threads, weights from DRAM): 1.05-1.20x at M = 6..8 on the Llama
// shapes, 1.055-1.072x for the whole 8-node float32 forward of the bundled target; mixed at M = 5
// (0.97-1.13x, left to the 4 x 3 tile) and slower for int8 weights at 6-8 rows (0.86-1.0x: each pair
// widens its codes twice), which keep the 4 x 3 tile there. The same micro_tile, so the same bits.
template <WType WT>
inline void row_block_24(const LinearParams& P, int64_t n0, int64_t n_end) {
  static_assert(kNr == 4, "two pairs of weight rows");
  int64_t lines = 0;
  const char* next = next_block<WT, 4>(P, n0, n_end, lines);
  const int64_t r = P.M - 4;
  const int64_t shares = r > 0 ? 4 : 2;
  int t = 0;
  auto share = [&](int64_t& count) {
    const int64_t a = lines * t / shares, b = lines * (t + 1) / shares;
    ++t;
    count = b - a;
    return next ? next + a * 64 : nullptr;
  };
  for (int h = 0; h < 4; h += 2) {
    int64_t c;
    const char* pf = share(c);
    micro_tile<WT, 2, 4>(P, n0 + h, 0, pf, c);
    if (r == 0) continue;
    pf = share(c);
    if (r == 4) micro_tile<WT, 2, 4>(P, n0 + h, 4, pf, c);
    else if (r == 3) micro_tile<WT, 2, 3>(P, n0 + h, 4, pf, c);
    else if (r == 2) micro_tile<WT, 2, 2>(P, n0 + h, 4, pf, c);
    else micro_tile<WT, 2, 1>(P, n0 + h, 4, pf, c);
  }
}

// Output rows [n_begin, n_end) in blocks of 4 by row_block_24 (the tail row by row).
template <WType WT>
inline void rows_24(const LinearParams& P, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + kNr <= n_end; n += kNr) row_block_24<WT>(P, n, n_end);
  for (; n < n_end; ++n) row_block<WT, 1>(P, n, n_end);
}

template <WType WT>
inline void linear_rows_t(const LinearParams& P, int64_t n_begin, int64_t n_end) {
  if constexpr (WT == WType::kFloat32) {
    switch (P.M) {
      case 1: return seq_rows_f32<1>(P, n_begin, n_end);
      case 2: return seq_rows_f32<2>(P, n_begin, n_end);
      case 3: return seq_rows_f32<3>(P, n_begin, n_end);
      case 4: return seq_rows_f32<4>(P, n_begin, n_end);
      case 6: case 7: case 8: return rows_24<WT>(P, n_begin, n_end);
      default: break;  // M = 5 or M > 8: the 4 x 3 tile
    }
  }
  if constexpr (WT == WType::kInt8) {
    if (P.M == 4) return rows_24<WT>(P, n_begin, n_end);  // 4 rows of x against int8: 2 x 4 tiles
  }
  int64_t n = n_begin;
  for (; n + kNr <= n_end; n += kNr) row_block<WT, kNr>(P, n, n_end);
  for (; n < n_end; ++n) row_block<WT, 1>(P, n, n_end);
}

// Outputs y[:, n_begin:n_end].
inline void linear_rows(const LinearParams& P, int64_t n_begin, int64_t n_end) {
  switch (P.wtype) {
    case WType::kFloat32: linear_rows_t<WType::kFloat32>(P, n_begin, n_end); break;
    case WType::kFloat16: linear_rows_t<WType::kFloat16>(P, n_begin, n_end); break;
    case WType::kBFloat16: linear_rows_t<WType::kBFloat16>(P, n_begin, n_end); break;
    case WType::kInt8: linear_rows_t<WType::kInt8>(P, n_begin, n_end); break;
  }
}

}  // namespace SPECDEC_CPU_ISA
}  // namespace cpu
}  // namespace specdec
