// linear, CUDA backend: y = x W^T (* weight_scale) (+ bias) for few-row activations.
//
// What it computes (specdec/reference.py linear): x [M, K] (any leading shape), W [N, K]
// float32 / float16 / bfloat16 (x's dtype) or int8 with a float32 scale per output row,
// float32 accumulation, one rounding to x's dtype.
//
// Design (decode / tree verification, M <= kMaxM = 64): a weight-streaming GEMV. One warp
// owns one output row n at a time and reads W[n, :] once with 16-byte loads (4 fp32, 8
// half / bf16, 16 int8 values per lane per step), multiplying each loaded value into the
// M accumulators of its lane (x rows, converted to fp32 once on the host side, are small
// and stay in L1/L2); a shuffle reduction per row of x finishes the dot products. The
// weight is read exactly once for all M rows: at M <= 16 the kernel is bound by HBM
// bandwidth, not by FMA throughput (16 FMAs per 2-byte weight).
// Rows whose base is not 16-byte aligned (K * es % 16 != 0) take a scalar loop.
// Batch invariance (docs/gpu.md): up to kMaxM rows, y[m, n] is formed by the same operations in
// the same order whatever M is -- lane l's explicit fmaf chain over its k positions (l * kVec + 32
// * kVec * j, then the scalar tail), the fixed butterfly warp sum, one fmaf for scale and bias. M
// only picks how many accumulators a lane holds (1, 4, 16 or 64: specdec/cuda_plan.h), and the
// vector / scalar choice depends on the weight alone (x is copied to an aligned buffer when it is
// not 16-byte aligned). So a verify pass over N nodes of B requests gives each row the bits of a
// one-row decode step. Past 16 rows a lane's 64 accumulators make the kernel FMA-bound (64 FMAs
// per weight): slower than cuBLAS's tensor cores at M = 17..64, the price of the invariance.
// Larger M (prefill, M > 64) is compute-bound: cuBLAS, always through gemm_f32acc (NOT batch-
// invariant: cuBLAS picks its tiling and split-K by shape): cublasGemmEx with a
// float32 compute type and a float32 output -- float32 sums whatever torch's matmul settings say
// (float32 operands: CUBLAS_COMPUTE_32F_PEDANTIC, so no TF32 or emulated arithmetic; 16-bit
// operands: CUBLAS_COMPUTE_32F, tensor cores with float32 accumulators; and never a reduction in
// a 16-bit type: torch's allow_fp16 / allow_bf16_reduced_precision_reduction and
// allow_fp16_accumulation do not reach it) -- then y * scale + bias in float32 and ONE rounding
// to x's dtype. Float16 / bfloat16 weights are multiplied as they are (A and B in x's 16-bit
// dtype, exact products in float32); float32 and int8 weights (and qlinear's dequantized weights)
// as float32 operands (int8 codes convert to float32 exactly; the scale multiplies the float32
// dot product, as in the small-M kernel). (Dequantizing int8 to a 16-bit x dtype first would
// round every weight, then the output again.)
//
// Napkin math: Llama-3-8B bf16 decode, 15 GB of linear weights per forward, 4.8 TB/s
// (H200): ~3.1 ms at M = 1..16.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <limits>

#include "checks.h"
#include "common.cuh"
#include "cpu/head_argmax.h"
#include "ops.h"
#include "q8act.h"
#include "specdec/cuda_plan.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int kMaxM = int(plan::kLinearInvariantRows);
constexpr int kWarps = 8;  // output rows in flight per block

// 16 bytes of weights -> fp32 values (kVec of them).
template <typename W>
struct WVec {
  static constexpr int kVec = 16 / sizeof(W);
  __device__ __forceinline__ static void unpack(const uint4& v, float* out) { unpack16<W>(v, out); }
  __device__ __forceinline__ static float one(const W& w) { return to_float(w); }
};
template <>
struct WVec<int8_t> {
  static constexpr int kVec = 16;
  __device__ __forceinline__ static void unpack(const uint4& v, float* out) {
    const int8_t* b = reinterpret_cast<const int8_t*>(&v);
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(b[i]);
  }
  __device__ __forceinline__ static float one(const int8_t& w) { return static_cast<float>(w); }
};

template <typename W, int MB>
__global__ void __launch_bounds__(kWarps * 32)
linear_small_m_kernel(const float* __restrict__ x, const W* __restrict__ w, const float* __restrict__ scale,
                      const float* __restrict__ bias, float* __restrict__ y, int M, int64_t N, int64_t K,
                      bool vec_ok) {
  constexpr int kVec = WVec<W>::kVec;
  const int lane = threadIdx.x & 31;
  const int64_t warp_global = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t warps_total = int64_t(gridDim.x) * kWarps;
  for (int64_t n = warp_global; n < N; n += warps_total) {
    const W* wr = w + n * K;
    float acc[MB];
#pragma unroll
    for (int m = 0; m < MB; ++m) acc[m] = 0.f;
    int64_t k_done = 0;
    if (vec_ok) {
      const int64_t kv = (K / kVec) * kVec;
      for (int64_t k = int64_t(lane) * kVec; k < kv; k += 32 * kVec) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(wr + k));
        float wf[kVec];
        WVec<W>::unpack(raw, wf);
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          if (m < M) {
            const float* xr = x + int64_t(m) * K + k;
#pragma unroll
            for (int i = 0; i < kVec; i += 4) {
              const float4 xv = *reinterpret_cast<const float4*>(xr + i);
              // explicit fmaf chain: no contraction choice is left to the compiler (batch invariance)
              acc[m] = fmaf(wf[i], xv.x, acc[m]);
              acc[m] = fmaf(wf[i + 1], xv.y, acc[m]);
              acc[m] = fmaf(wf[i + 2], xv.z, acc[m]);
              acc[m] = fmaf(wf[i + 3], xv.w, acc[m]);
            }
          }
        }
      }
      k_done = kv;
    }
    for (int64_t k = k_done + lane; k < K; k += 32) {
      const float wv = WVec<W>::one(wr[k]);
#pragma unroll
      for (int m = 0; m < MB; ++m)
        if (m < M) acc[m] = fmaf(wv, x[int64_t(m) * K + k], acc[m]);
    }
    const float s = scale ? scale[n] : 1.f;
    const float b = bias ? bias[n] : 0.f;
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (m < M) {
        const float v = warp_sum(acc[m]);
        if (lane == 0) y[int64_t(m) * N + n] = fmaf(v, s, b);
      }
    }
  }
}

template <typename W>
void launch(const at::Tensor& x32, const at::Tensor& w, const float* scale, const float* bias, at::Tensor& y,
            int M, int64_t N, int64_t K) {
  const bool vec_ok = (K * int64_t(sizeof(W))) % 16 == 0 && aligned16(w.data_ptr()) && K % 4 == 0 &&
                      aligned16(x32.data_ptr());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>(ceil_div(N, kWarps), int64_t(sms) * 16);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* xp = x32.data_ptr<float>();
  const W* wp = static_cast<const W*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  auto go = [&](auto mb) {
    constexpr int MB = decltype(mb)::value;
    linear_small_m_kernel<W, MB><<<blocks, kWarps * 32, 0, stream>>>(xp, wp, scale, bias, yp, M, N, K, vec_ok);
  };
  switch (plan::linear_row_block(M)) {
    case 1: go(std::integral_constant<int, 1>{}); break;
    case 4: go(std::integral_constant<int, 4>{}); break;
    case 16: go(std::integral_constant<int, 16>{}); break;
    case 64: go(std::integral_constant<int, 64>{}); break;
    default: TORCH_CHECK(false, "linear: internal error: ", M, " rows for the small-M kernel");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- large M: float32 cuBLAS GEMM
// y[m, n] = y[m, n] * scale[n] + bias[n] in float32 (one fused rounding, as the small-M kernel's
// v * s + b); scale / bias may be null (1 / 0).
__global__ void scale_bias_kernel(float* __restrict__ y, const float* __restrict__ scale,
                                  const float* __restrict__ bias, int64_t M, int64_t N) {
  const int64_t total = M * N;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i % N;
    y[i] = fmaf(y[i], scale ? scale[n] : 1.f, bias ? bias[n] : 0.f);
  }
}

// y [M, N] float32 = x2 [M, K] @ w2 [N, K]^T (* scale[N]) (+ bias[N]); x2, w2 contiguous, both float32,
// both float16 or both bfloat16. Float32 operands: CUBLAS_COMPUTE_32F_PEDANTIC, float32 products
// and accumulation, never down-converted to TF32 / BF16x9 (torch.backends.cuda.matmul.allow_tf32,
// set_float32_matmul_precision and the handle's math mode do not apply to an explicit pedantic
// compute type). 16-bit operands: CUBLAS_COMPUTE_32F (pedantic would forbid the tensor cores and
// make prefill many times slower): each product is exact in float32 and the tensor cores
// accumulate in float32 (their adds need not round like IEEE float32 adds, a bound the tests allow).
// The output (C) is float32, so no partial sum is ever stored in a 16-bit type: a split-K
// reduction, if cuBLAS picks one, runs in float32 -- the reduced-precision reductions torch allows
// by default for float16 / bfloat16 outputs cannot happen, whatever its flags say.
at::Tensor gemm_f32acc(const at::Tensor& x2, const at::Tensor& w2, const float* scale, const float* bias) {
  const int64_t M = x2.size(0), K = x2.size(1), N = w2.size(0);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(M <= kIntMax && N <= kIntMax && K <= kIntMax, "linear: sizes too large for cuBLAS (M = ", M,
              ", N = ", N, ", K = ", K, ")");
  TORCH_CHECK(x2.scalar_type() == w2.scalar_type() && x2.is_contiguous() && w2.is_contiguous(),
              "linear: internal error: GEMM operands must be contiguous and of one dtype, got ", x2.scalar_type(),
              " and ", w2.scalar_type());
  cudaDataType_t ab_type = CUDA_R_32F;
  switch (x2.scalar_type()) {
    case at::kFloat: ab_type = CUDA_R_32F; break;
    case at::kHalf: ab_type = CUDA_R_16F; break;
    case at::kBFloat16: ab_type = CUDA_R_16BF; break;
    default: TORCH_CHECK(false, "linear: internal error: no float32-accumulated GEMM for ", x2.scalar_type());
  }
  at::Tensor y = at::empty({M, N}, x2.options().dtype(at::kFloat));
  // cuBLAS is column-major: the row-major y [M, N] is the column-major y^T [N, M] = w2 x2^T, with
  // w2 (row-major [N, K] = column-major [K, N]) transposed and x2 (column-major [K, M]) as is.
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // on the current stream
  const float one = 1.f, zero = 0.f;
  TORCH_CUDABLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &one, w2.data_ptr(),
                                    ab_type, int(K), x2.data_ptr(), ab_type, int(K), &zero, y.data_ptr<float>(),
                                    CUDA_R_32F, int(N),
                                    ab_type == CUDA_R_32F ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
  if (scale != nullptr || bias != nullptr) {
    const int threads = 256;
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(M * N, threads), int64_t(sms) * 8));
    scale_bias_kernel<<<unsigned(blocks), threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        y.data_ptr<float>(), scale, bias, M, N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return y;
}

// ---------------------------------------------------------------- qlinear (group-quantized weights)
// Same plan as above: one warp per output row, the weight row read once for all M rows of x.
// Lane l owns groups g = l, l + 32, ... of 32 weights (Q8_0: 32 bytes, Q4: 16 bytes, plus a
// float16 scale and, for Q4_1, a float16 min), so a warp reads 32 consecutive groups: one
// contiguous kilobyte (Q8_0) or half of one (Q4). Codes are decoded to fp32 once and feed the
// M accumulators of the lane: acc += d * dot(codes, x_group) + m * sum(x_group).
// Napkin math: Llama-3-8B as Q4_1, 4.2 GB of linear weights, ~0.9 ms per decode step at 4.8 TB/s.
template <int BITS, bool MINS, int MB>
__global__ void __launch_bounds__(kWarps * 32)
qlinear_small_m_kernel(const float* __restrict__ x, const uint8_t* __restrict__ qw, const __half* __restrict__ scales,
                       const __half* __restrict__ mins, const float* __restrict__ bias, float* __restrict__ y, int M,
                       int64_t N, int64_t K, bool vec_ok) {
  constexpr int kRowBytesPerGroup = BITS == 8 ? 32 : 16;
  const int lane = threadIdx.x & 31;
  const int64_t warp_global = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t warps_total = int64_t(gridDim.x) * kWarps;
  const int64_t G = K / 32;
  for (int64_t n = warp_global; n < N; n += warps_total) {
    const uint8_t* wr = qw + n * G * kRowBytesPerGroup;
    float acc[MB];
#pragma unroll
    for (int m = 0; m < MB; ++m) acc[m] = 0.f;
    for (int64_t g = lane; g < G; g += 32) {
      const uint8_t* wg = wr + g * kRowBytesPerGroup;
      uint8_t raw[kRowBytesPerGroup];
      if (vec_ok) {
#pragma unroll
        for (int i = 0; i < kRowBytesPerGroup; i += 16)
          *reinterpret_cast<uint4*>(raw + i) = __ldg(reinterpret_cast<const uint4*>(wg + i));
      } else {
#pragma unroll
        for (int i = 0; i < kRowBytesPerGroup; ++i) raw[i] = __ldg(wg + i);
      }
      float w[32];
      if constexpr (BITS == 8) {
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = float(int8_t(raw[i]));
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          w[i] = float(raw[i] & 15) - (MINS ? 0.f : 8.f);
          w[i + 16] = float(raw[i] >> 4) - (MINS ? 0.f : 8.f);
        }
      }
      const float d = __half2float(scales[n * G + g]);
      const float mn = MINS ? __half2float(mins[n * G + g]) : 0.f;
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        if (m < M) {
          const float* xr = x + int64_t(m) * K + g * 32;
          float dot = 0.f, xs = 0.f;
#pragma unroll
          for (int i = 0; i < 32; i += 4) {
            const float4 xv = vec_ok ? *reinterpret_cast<const float4*>(xr + i) : make_float4(xr[i], xr[i + 1], xr[i + 2], xr[i + 3]);
            // explicit fmaf chain (batch invariance: no contraction choice left to the compiler)
            dot = fmaf(w[i], xv.x, dot);
            dot = fmaf(w[i + 1], xv.y, dot);
            dot = fmaf(w[i + 2], xv.z, dot);
            dot = fmaf(w[i + 3], xv.w, dot);
            if (MINS) xs += (xv.x + xv.y) + (xv.z + xv.w);
          }
          acc[m] += fmaf(d, dot, mn * xs);
        }
      }
    }
    const float b = bias ? bias[n] : 0.f;
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (m < M) {
        const float v = warp_sum(acc[m]);
        if (lane == 0) y[int64_t(m) * N + n] = v + b;
      }
    }
  }
}

template <int BITS, bool MINS>
void launch_q(const at::Tensor& x32, const at::Tensor& qw, const at::Tensor& scales, const __half* mins,
              const float* bias, at::Tensor& y, int M, int64_t N, int64_t K) {
  const bool vec_ok = aligned16(qw.data_ptr()) && aligned16(x32.data_ptr());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>(ceil_div(N, kWarps), int64_t(sms) * 16);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* xp = x32.data_ptr<float>();
  const uint8_t* wp = static_cast<const uint8_t*>(qw.data_ptr());
  const __half* sp = reinterpret_cast<const __half*>(scales.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  auto go = [&](auto mb) {
    constexpr int MB = decltype(mb)::value;
    qlinear_small_m_kernel<BITS, MINS, MB><<<blocks, kWarps * 32, 0, stream>>>(xp, wp, sp, mins, bias, yp, M, N, K,
                                                                               vec_ok);
  };
  switch (plan::linear_row_block(M)) {
    case 1: go(std::integral_constant<int, 1>{}); break;
    case 4: go(std::integral_constant<int, 4>{}); break;
    case 16: go(std::integral_constant<int, 16>{}); break;
    case 64: go(std::integral_constant<int, 64>{}); break;
    default: TORCH_CHECK(false, "qlinear: internal error: ", M, " rows for the small-M kernel");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// x as the small-M kernels read it: [M, K] float32, contiguous, 16-byte aligned (a copy when x is not:
// the vector / scalar choice, and with it the summation order, then depends on the weight alone).
at::Tensor rows_f32(const at::Tensor& x, int64_t M, int64_t K) {
  at::Tensor x32 = x.reshape({M, K}).to(at::kFloat).contiguous();
  if (!aligned16(x32.data_ptr())) x32 = x32.clone();
  return x32;
}

}  // namespace
}  // namespace cuda

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& weight_scale) {
  checks::linear(x, weight, bias, weight_scale);
  const c10::cuda::CUDAGuard guard(x.device());
  if (auto y = checks::linear_trivial(x, weight, bias)) return *y;
  const int64_t K = weight.size(1), N = weight.size(0);
  const int64_t M = checks::linear_rows(x);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  std::optional<at::Tensor> b32, s32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  if (weight_scale.has_value()) s32 = weight_scale->contiguous();
  const float* bp = b32.has_value() ? b32->data_ptr<float>() : nullptr;
  const float* sp = s32.has_value() ? s32->data_ptr<float>() : nullptr;
  if (M > cuda::kMaxM) {  // prefill: float32-accumulated cuBLAS GEMM, float32 output, one rounding below
    const bool f16_weight = weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16;
    at::Tensor y = f16_weight
                       // x's dtype (checked): float16 / bfloat16 A and B, exact products, float32 sums
                       ? cuda::gemm_f32acc(x.reshape({M, K}).contiguous(), weight.contiguous(), sp, bp)
                       // float32, or int8 -> float32 (exact); the scale multiplies the float32 result
                       : cuda::gemm_f32acc(x.reshape({M, K}).to(at::kFloat).contiguous(),
                                           weight.to(at::kFloat).contiguous(), sp, bp);
    if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());  // the one rounding
    return y.view(out_shape);
  }
  const at::Tensor x32 = cuda::rows_f32(x, M, K);
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  switch (w.scalar_type()) {
    case at::kFloat: cuda::launch<float>(x32, w, sp, bp, y, int(M), N, K); break;
    case at::kHalf: cuda::launch<__half>(x32, w, sp, bp, y, int(M), N, K); break;
    case at::kBFloat16: cuda::launch<__nv_bfloat16>(x32, w, sp, bp, y, int(M), N, K); break;
    default: cuda::launch<int8_t>(x32, w, sp, bp, y, int(M), N, K); break;
  }
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(out_shape);
}

at::Tensor qlinear_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits) {
  checks::qlinear(x, qweight, scales, mins, bias, bits);
  const c10::cuda::CUDAGuard guard(x.device());
  if (auto y = checks::linear_trivial(x, qweight, bias)) return *y;
  const int64_t K = x.size(-1), N = qweight.size(0);
  const int64_t M = checks::linear_rows(x);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x32 = cuda::rows_f32(x, M, K);
  std::optional<at::Tensor> b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  const float* bp = b32.has_value() ? b32->data_ptr<float>() : nullptr;
  if (M > cuda::kMaxM) {  // prefill: cuBLAS on the dequantized weight
    // float32 operands and float32 (pedantic) GEMM: the contract's float32 accumulation, one rounding
    const at::Tensor w32 = checks::qlinear_dequantize(qweight, scales, mins, bits, at::kFloat).contiguous();
    at::Tensor y = cuda::gemm_f32acc(x32, w32, nullptr, bp);
    if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
    return y.view(out_shape);
  }
  const __half* mp = mins.has_value() ? reinterpret_cast<const __half*>(mins->data_ptr<at::Half>()) : nullptr;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (bits == 8) cuda::launch_q<8, false>(x32, qweight, scales, mp, bp, y, int(M), N, K);
  else if (mp != nullptr) cuda::launch_q<4, true>(x32, qweight, scales, mp, bp, y, int(M), N, K);
  else cuda::launch_q<4, false>(x32, qweight, scales, mp, bp, y, int(M), N, K);
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(out_shape);
}

// linear_argmax / qlinear_argmax on CUDA: the CUDA product (its kernel up to 64 rows, batch invariant; cuBLAS
// above), then one block per row takes its argmax (argmax_rows_cuda). The logits are materialised here: a GPU
// writes and rereads a [M, V] row block in microseconds; the slabs are the CPU's saving.
at::Tensor linear_argmax_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& weight_scale) {
  cpu::checked_as("linear_argmax", "linear", [&] { checks::linear(x, weight, bias, weight_scale); });
  cpu::check_argmax_columns("linear_argmax", weight.size(0));
  return argmax_rows_cuda(linear_cuda(x, weight, bias, weight_scale));
}

at::Tensor qlinear_argmax_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                               int64_t bits, bool q8act) {
  if (q8act) {
    cpu::checked_as("qlinear_argmax", "qlinear_q8act", [&] { checks::qlinear_q8act(x, qweight, scales, mins, bias, bits); });
    cpu::check_argmax_columns("qlinear_argmax", scales.size(0));
    return argmax_rows_cuda(qlinear_q8act_cuda(x, qweight, scales, mins, bias, bits));
  }
  cpu::checked_as("qlinear_argmax", "qlinear", [&] { checks::qlinear(x, qweight, scales, mins, bias, bits); });
  cpu::check_argmax_columns("qlinear_argmax", qweight.size(0));
  return argmax_rows_cuda(qlinear_cuda(x, qweight, scales, mins, bias, bits));
}

}  // namespace specdec
