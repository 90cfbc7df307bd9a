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
//    (llama.cpp stores it as float16: the only intended difference).
// 2. Integer dots: weight codes c_j (Q8_0: q; Q4_0: q - 8; Q4_1: q in 0..15). Lane l (0..7) of block
//    g covers elements 4l..4l+3:  p[g][l] = sum_j c_j a_j  (exact int32). Q4_1 also needs the block's
//    code sum R_g = sum of its 32 a_j (exact) and s_g = float(R_g) * d_g (one rounding, made once per
//    activation row and block, at quantization).
// 3. Floats (each step one float32 rounding; fma(a, b, c) = a * b + c rounded once):
//      acc[(g % 2) * 8 + l] = fma(float(p), dw_g * d_g, acc[(g % 2) * 8 + l])
//                       (dw, mw: the weight's float16 scale / min; 16 accumulators from +0, g ascending)
//      Q4_1: macc[g % 16] = fma(mw_g, s_g, macc[g % 16])   (16 more, from +0, g ascending)
//    fold16 sums 16 accumulators in halves: h_i = acc_i + acc_{i+8} (8), h_i + h_{i+4} (4),
//    h_i + h_{i+2} (2), h_0 + h_1.  y = fold16(acc) + bias; Q4_1: y = (fold16(acc) + fold16(macc)) + bias
//    (bias 0 without one). The min term costs one product per block and weight row (llama.cpp's
//    q8_1 scheme: its s is d * sum a), not 8 lanes per block and activation row.
// So each output is one fixed sequence of operations whatever M, the tile and the instruction set:
// a row's result does not depend on the other rows (verify rows equal decode steps) nor on the tier.
// Non-finite activations give unspecified (but memory-safe) outputs.
//
// Tiers (csrc/cpu/qlinear_q8act*.cpp, chosen at run time, forced by specdec._C.set_q8act_tier):
//   avx512_vnni: two blocks per zmm (lanes 0-7 block g, 8-15 block g + 1: the canonical accumulators),
//                vpdpbusd; avx_vnni: ymm vpdpbusd (VEX); avx2: vpmaddubsw + vpmaddwd (no saturation: a
//                pair sum is at most 2 * 128 * 127); scalar: plain loops.
// Signed Q8_0 codes use the sign trick (|c| as unsigned, a * sign(c) as signed).
#pragma once

#include <cstdint>

namespace specdec {
namespace cpu {

constexpr int64_t kQ8Block = 32;

// The quantized activations of M rows (filled by q8_quantize_*), then the product with one weight.
struct Q8ActParams {
  const int8_t* a;         // [M, K] activation codes
  const float* d;          // [M, G] each block's scale d
  const int32_t* r;        // [M, G, 8] lane sums of the codes (int32; Q4_0's p - 8 r)
  const float* s;          // [M, G] float(R_g) * d_g (Q4_1's min term)
  const void* qw;          // [N, K] int8 (Q8_0) or [N, K / 2] uint8 (Q4), contiguous (cpu_qlinear.h's layout)
  const uint16_t* scales;  // [N, G] float16 bits
  const uint16_t* mins;    // [N, G] float16 bits (Q4_1) or nullptr
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N], row stride y_stride
  int64_t y_stride;
  int64_t M, N, K;
  int bits;
};

// Tiers, best first; kQ8TierAuto: the best this CPU runs.
enum Q8Tier : int { kQ8Avx512Vnni = 0, kQ8AvxVnni = 1, kQ8Avx2 = 2, kQ8Scalar = 3, kQ8TierAuto = -1 };

// Quantizes x [M, K] (row stride x_stride) into a / d / r / s (step 1 and the sums of step 2).
void q8_quantize_scalar(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* a, float* d, int32_t* r,
                        float* s);
void q8_quantize_avx2(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* a, float* d, int32_t* r,
                      float* s);
// Outputs y[:, n_begin:n_end] of one tier.
void q8act_rows_scalar(const Q8ActParams& P, int64_t n_begin, int64_t n_end);
void q8act_rows_avx2(const Q8ActParams& P, int64_t n_begin, int64_t n_end);
void q8act_rows_avxvnni(const Q8ActParams& P, int64_t n_begin, int64_t n_end);
void q8act_rows_avx512vnni(const Q8ActParams& P, int64_t n_begin, int64_t n_end);
// The AVX-512 tier's Q4 layout: for every full pair of blocks of every row, the codes a and lane sums
// r (nullptr: Q4_1, which reads no lane sums) in the 128-bit quarter order 0, 2, 1, 3 (the order a pair of
// packed Q4 blocks decodes into).
void q8_interleave_pairs_avx512(int8_t* a, int32_t* r, int64_t M, int64_t K);

// Software prefetch for a tile of weight rows [n0, n0 + nr): the codes of the rows max(8, 2 nr) ahead
// (DRAM latency is longer than one tile's compute), spread evenly over the tile's `steps` loop steps;
// only the first activation tile of a row block issues them (m0 == 0). No effect on the results.
struct Q8Prefetch {
  const char* p = nullptr;
  int64_t lines = 0, per_step = 0, issued = 0;
  Q8Prefetch(const Q8ActParams& P, int64_t n0, int64_t nr, int64_t m0, int64_t steps) {
    const int64_t row_bytes = P.bits == 8 ? P.K : P.K / 2, ahead = n0 + (nr * 2 > 8 ? nr * 2 : 8);
    const int64_t rows = m0 == 0 && ahead < P.N ? (P.N - ahead < nr ? P.N - ahead : nr) : 0;
    if (rows <= 0) return;
    p = static_cast<const char*>(P.qw) + ahead * row_bytes;
    lines = (rows * row_bytes + 63) / 64;
    per_step = steps > 0 ? (lines + steps - 1) / steps : 0;
  }
  inline void step() {
    for (int64_t j = 0; j < per_step && issued < lines; ++j, ++issued) __builtin_prefetch(p + issued * 64, 0, 2);
  }
};

// The 16 canonical accumulators summed in the definition's order (step 3).
inline float q8_fold16(const float* acc) {
  float h[8];
  for (int i = 0; i < 8; ++i) h[i] = acc[i] + acc[i + 8];
  for (int i = 0; i < 4; ++i) h[i] = h[i] + h[i + 4];
  for (int i = 0; i < 2; ++i) h[i] = h[i] + h[i + 2];
  return h[0] + h[1];
}

}  // namespace cpu
}  // namespace specdec
