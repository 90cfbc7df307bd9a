// Raw-pointer entry points of the CPU kernels, for host code that has already validated its
// arguments and owns its buffers (csrc/decoder_layer.cpp's float32 path). The torch-level
// functions (linear_cpu, verify_attention_cpu, add_rms_norm_cpu, rope_cpu, silu_mul_cpu) call
// these same functions, so both give the same results bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#ifndef SPECDEC_CPU_ISA
#define SPECDEC_CPU_ISA base
#endif
#include "specdec/cpu_attention.h"
#include "specdec/cpu_linear.h"
#include "specdec/cpu_qlinear.h"

namespace specdec {
namespace cpu {

constexpr int64_t kLinearRowsPerPass = 32;  // rows of x per pass over a weight
constexpr int64_t kLinearBlasRows = 64;     // float weights: more rows than this are prefill sizes:
constexpr int64_t kLinearGemmRows = 256;    // up to this many, float32 weights and x on AVX2 take
                                            // cpu_gemm.h's tiles, else (and larger) the BLAS GEMM

// y = x W^T (* scale) (+ bias) for P.M rows (kLinearRowsPerPass per pass over the weight).
void linear_raw(LinearParams P);
// Several linears of one x (same M <= kLinearRowsPerPass, same K, same weight type) in one
// parallel region; larger M runs them one by one.
void linear_multi_raw(const std::vector<LinearParams>& P);
// Group-quantized weights; P.x contiguous [M, K] (x_stride == K), P.xsum ignored (computed here
// when the ISA's kernel needs it).
void qlinear_raw(QLinearParams P);
// verify_attention over (request, KV head) tasks; P.mask packed by pack_tree_mask or null.
void verify_attention_raw(const AttentionParams& P);
std::vector<uint64_t> pack_tree_mask(const bool* mask, int64_t rows, int64_t Nkv);
// rms_norm (res == nullptr) / add_rms_norm (sum = x + res) of rows of H float32 values.
void rms_norm_f32(const float* x, const float* res, const float* w, float* out, float* sum, int64_t rows, int64_t H,
                  float eps);
// rotate-half RoPE of BN positions x Hh heads x D (x rows x_stride apart; out contiguous).
void rope_f32(const float* x, int64_t x_stride, const float* cos, const float* sin, float* out, int64_t BN,
              int64_t Hh, int64_t D);
// out = silu(g) * u, n float32 values.
void silu_mul_f32(const float* g, const float* u, float* out, int64_t n);
// Elements per task (rows of H: elems / H rows) of the CPU rms_norm / add_rms_norm / rope; returns the previous value.
int64_t set_fused_row_elems(int64_t elems);
// out[r, :n] = silu(g[r * stride :][:n]) * u[r * stride :][:n] for r < rows (rows split over threads).
void silu_mul_rows_f32(const float* g, const float* u, int64_t stride, float* out, int64_t rows, int64_t n);

}  // namespace cpu
}  // namespace specdec
