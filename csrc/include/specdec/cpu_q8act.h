// qlinear_q8act on the CPU: qlinear with quantized activations (llama.cpp's Q8 activation scheme).
//
// The definition (every form computes exactly this: the torch reference specdec/reference_q8act.py,
// the CPU tiers here, the CUDA kernel csrc/cuda/qlinear_q8act.cu):
//
// 1. Activations, per row m and block g of 32 consecutive inputs (float32 x; half / bfloat16 x are
//    widened first):  amax = max |x_j|;  d = amax / 127;  id = 127 / amax, or 0 where that is not
//    finite (amax == 0, or amax < 127 / FLT_MAX: the block's codes are then 0);
//    a_j = clamp(round_half_even(x_j * id), -127, 127)  -- one correctly rounded float32 division
//    each for d and id, one float32 product per element, round half to even. d stays float32
//    (llama.cpp stores it as float16: the only intended difference). R_g = sum of the block's 32 a_j
//    (exact) and s_g = float(R_g) * d_g (one rounding), made once per activation row and block.
// 2. One integer dot per block g and weight row: P_g = sum_j c_j a_j over the block's 32 elements,
//    exact in int32 (weight codes c: Q8_0 q; Q4_0 q - 8; Q4_1 q in 0..15), so any order of the
//    integer sums gives the same P_g.
// 3. Floats, one accumulator per output from +0, blocks in ascending order (each step one float32
//    rounding; fma(a, b, c) = a * b + c rounded once; dw, mw: the weight's float16 scale / min):
//      acc = fma(float(P_g), dw_g * d_g, acc)
//      Q4_1 then: acc = fma(mw_g, s_g, acc)          (llama.cpp's q8_1 min term: one product per block)
//    y = acc + bias (bias 0 without one).
// So each output is one fixed sequence of operations whatever M, the tile and the instruction set:
// a row's result does not depend on the other rows (verify rows equal decode steps) nor on the tier.
// Non-finite activations give unspecified (but memory-safe) outputs.
//
// The CPU tiers read the weight in a packed layout (q8_pack; specdec.ops.pack_q8act makes it once
// for a model; qlinear_q8act with the usual [N, K] / [N, K / 2] weight packs per call). Per group of
// 16 weight rows t and block g, kQ8PackBytes(bits, mins) contiguous bytes, groups outer, blocks inner:
//   codes: 4 (Q4) or 8 (Q8_0) vectors of 64 bytes; vector k holds, at bytes 4j..4j+3, bytes 4k..4k+3
//          of row 16t + j's block in the usual layout (Q4: byte i = element i in the low nibble and
//          element i + 16 in the high one; Q8_0: the codes stored offset by 128, i.e. c ^ 0x80);
//   then the 16 rows' float16 scales dw (32 bytes), then Q4_1's 16 float16 mins (32 bytes).
// Rows past N (the last group) have code 0 and scale 0. So one vpdpbusd multiplies 16 weight rows'
// 4 codes by 4 broadcast activation codes: its lanes are 16 outputs' block dots, and the offsets come
// back as P = dot - 8 R (Q4_0) or dot - 128 R (Q8_0).
//
// Tiers (csrc/cpu/qlinear_q8act*.cpp, chosen at run time, forced by specdec._C.set_q8act_tier):
//   avx512_vnni: zmm vpdpbusd over the 16 rows; avx_vnni: ymm vpdpbusd (VEX) over each 8-row half;
//   avx2: vpmaddubsw + vpmaddwd (Q8_0 through the sign trick on the re-signed codes: no saturation);
//   scalar: plain loops over the packed bytes.
#pragma once

#include <cstdint>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace specdec {
namespace cpu {

constexpr int64_t kQ8Block = 32;
constexpr int64_t kQ8Rows = 16;  // weight rows per packed group
// The AVX-512 VNNI tier's tiles of many activation rows (Q8_0 from 4 rows, Q4 from 6), whose products outlast
// the weight stream, prefetch every line of the block this many blocks ahead, past a group's end into the next
// group's (set_q8act_block_prefetch; 0: the one-line hint two blocks ahead that the other tiles take). 8: verify
// passes of 6-16 nodes 0.92-0.95x the distance of 2 (AMD family 25, benchmarks/results/q8act_block_prefetch_*).
// On other CPUs 16 (an Intel Xeon with AVX-512 VNNI and a 480 MiB L3: 6- / 8-node passes 0.92x / 0.95x the
// distance of 8, benchmarks/results/q8act_block_prefetch_2026-12-08.json).
constexpr int64_t kQ8BlockPrefetch = 8;
constexpr int64_t kQ8BlockPrefetchOther = 16;
// The first tile size (activation rows) that takes the many-row prefetch, per weight format
// (set_q8act_many_rows). From 3 / 4 rows instead, 4- and 5-node verify passes ran 0.98x / 1.05x and 0.90x / 0.95x
// in two runs (benchmarks/results/q8act_many_*_2026-12-07.json), within the host's noise then: these stay.
constexpr int64_t kQ8ManyRowsQ8 = 4;
constexpr int64_t kQ8ManyRowsQ4 = 6;
// set_q8act_stream_prefetch: 2 blocks on AMD CPUs (family 25: 8 blocks made a decode step 1.30x slower), 32
// elsewhere (the Intel Xeon above: a decode step 0.78x, a 3-node pass 0.62x the distance of 2;
// benchmarks/results/q8act_stream_prefetch_2026-12-08.json)
constexpr int64_t kQ8StreamPrefetch = 2;
constexpr int64_t kQ8StreamPrefetchOther = 32;
// set_q8act_amx_rows: the AVX-512 VNNI tier's AMX path from this many activation rows (0: never)
constexpr int64_t kQ8AmxRows = 0;
constexpr int64_t kQ8PrefetchBlocks = 16;  // the AVX2 tier's default prefetch distance (set_q8act_prefetch)

// Bytes per (group of 16 rows, block) of the packed layout, and the offset of its scales.
constexpr int64_t kQ8CodeBytes(int bits) { return bits == 8 ? 512 : 256; }
constexpr int64_t kQ8PackBytes(int bits, bool mins) { return kQ8CodeBytes(bits) + 32 + (mins ? 32 : 0); }

// The quantized activations of M rows (filled by q8_quantize_*), then the product with one packed weight.
struct Q8ActParams {
  const int8_t* a;         // [M, K] activation codes
  const float* d;          // [M, G] each block's scale d
  const int32_t* R;        // [M, G] each block's code sum
  const float* s;          // [M, G] float(R_g) * d_g (Q4_1's min term)
  const uint8_t* packed;   // [ceil(N / 16), G, kQ8PackBytes] (the layout above)
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N], row stride y_stride
  int64_t y_stride;
  int64_t M, N, K;
  int bits;
  bool mins;               // Q4_1
  int64_t prefetch = kQ8PrefetchBlocks;  // packed blocks the AVX2 tier prefetches ahead (0: none)
  bool prefetch_l1 = true;  // the AVX2 / AVX-VNNI tiers' prefetch into L1 (true, the default) or L2 (false)
  int64_t many_rows_q8 = kQ8ManyRowsQ8;  // AVX-512 VNNI: tiles of at least this many rows are "many" (Q8_0)
  int64_t many_rows_q4 = kQ8ManyRowsQ4;  // the same for Q4_0 / Q4_1 weights
  bool group_pairs = true;  // AVX-512 VNNI, Q4 weights, one or two rows: two groups of 16 rows per tile
  int64_t block_prefetch = kQ8BlockPrefetch;  // AVX-512 VNNI many-row tiles: every line this many blocks ahead
  int64_t stream_prefetch = kQ8StreamPrefetch;  // AVX-512 VNNI few-row tiles: every line into L2 this many ahead
  int64_t amx_rows = 0;  // AVX-512 VNNI tier: from this many activation rows, AMX where the CPU has it (0: never)
};

#if defined(__x86_64__) || defined(__i386__)
// A software prefetch of every 64-byte line of the `bytes` bytes that start `ahead` bytes past p, into L1 (l1) or
// L2: a packed weight block further down a tile's stream. The address is formed in integers: past the weight's
// end it is only requested, never read. asm statements: with _mm_prefetch, GCC (LTO) dropped the calls of this
// function from the ymm tiers, taking a function that only prefetches for one without effects.
inline void prefetch_lines_ahead(const uint8_t* p, int64_t ahead, int64_t bytes, bool l1) {
  const uintptr_t f = reinterpret_cast<uintptr_t>(p) + uintptr_t(ahead);
  for (int64_t o = 0; o < bytes; o += 64) {
    const char* line = reinterpret_cast<const char*>(f + uintptr_t(o));
#if defined(__GNUC__)
    if (l1) asm volatile("prefetcht0 %0" : : "m"(*line));
    else asm volatile("prefetcht1 %0" : : "m"(*line));
#else
    if (l1) _mm_prefetch(line, _MM_HINT_T0);
    else _mm_prefetch(line, _MM_HINT_T1);
#endif
  }
}
#endif

// Tiers, best first; kQ8TierAuto: the best this CPU runs.
enum Q8Tier : int { kQ8Avx512Vnni = 0, kQ8AvxVnni = 1, kQ8Avx2 = 2, kQ8Scalar = 3, kQ8TierAuto = -1 };

// Quantizes x [M, K] (row stride x_stride) into a / d / R / s (step 1).
void q8_quantize_scalar(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* a, float* d, int32_t* R,
                        float* s);
void q8_quantize_avx2(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* a, float* d, int32_t* R,
                      float* s);
// The packed layout of a [N, K] int8 (bits 8) or [N, K / 2] uint8 (bits 4) weight with float16 scales /
// mins [N, K / 32] (mins nullptr: Q8_0 / Q4_0) into out (ceil(N / 16) * G * kQ8PackBytes bytes).
void q8_pack(const void* qw, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K, int bits,
             uint8_t* out);
// Outputs y[:, 16 t_begin : min(N, 16 t_end)] of one tier (row groups t_begin..t_end).
void q8act_rows_scalar(const Q8ActParams& P, int64_t t_begin, int64_t t_end);
void q8act_rows_avx2(const Q8ActParams& P, int64_t t_begin, int64_t t_end);
void q8act_rows_avxvnni(const Q8ActParams& P, int64_t t_begin, int64_t t_end);
void q8act_rows_avx512vnni(const Q8ActParams& P, int64_t t_begin, int64_t t_end);
// AMX (csrc/cpu/qlinear_q8act_amx.cpp): the AVX-512 VNNI tier's path from P.amx_rows activation rows; the same
// bits. amx_available(): the CPU has AMX-TILE and AMX-INT8 and the OS grants the tile state (asked once).
void q8act_rows_amx(const Q8ActParams& P, int64_t t_begin, int64_t t_end);
bool amx_available();

// The offset folded into the codes of the packed layout: P = dot - (R << q8_offset_shift) (Q4_1: none).
inline int q8_offset_shift(const Q8ActParams& P) { return P.bits == 8 ? 7 : (P.mins ? -1 : 3); }

}  // namespace cpu
}  // namespace specdec
