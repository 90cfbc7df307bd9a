// The fused small ops of a Llama-style layer, CUDA backend: rms_norm, add_rms_norm, rope,
// silu_mul. Same math and rounding steps as csrc/cpu/fused.cpp and specdec/reference.py:
//   rms_norm:  r = T(x * rsqrt(mean(x^2) + eps)) in float32, out = T(w * r)
//   add_rms_norm: s = T(x + residual), then rms_norm(s); returns (out, s)
//   rope:      out = T(T(x * cos) + T(rotate_half(x) * sin))   (__fmul_rn / __fadd_rn: no
//              contraction, bit-identical to the CPU kernel and the reference)
//   silu_mul:  out = T(T(silu(gate)) * up)
// At decode sizes each is one small launch (a step's launches are what a CUDA graph
// removes); the arithmetic is negligible next to the weights.
//
// Kernels: rms_norm = one CTA of 256 threads per row (strided loads, a warp-sum + shared
// reduction, a second pass over the row from L1/L2); rope = one thread per rotate-half
// pair of a (position, head) row; silu_mul = a grid-stride elementwise loop.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "checks.h"
#include "common.cuh"
#include "fused_host.h"
#include "ops.h"

namespace specdec {
namespace cuda {
namespace {

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__device__ __forceinline__ float rnd(float v) { return to_float(from_float<T>(v)); }

constexpr int kNormThreads = 256;

template <typename T, bool kAdd>
__global__ void rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w,
                                T* __restrict__ out, T* __restrict__ sum, int64_t H, float eps) {
  const int64_t r = blockIdx.x;
  const T* xr = x + r * H;
  const T* rr = kAdd ? res + r * H : nullptr;
  T* sr = kAdd ? sum + r * H : nullptr;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < H; i += kNormThreads) {
    float v = to_float(xr[i]);
    if constexpr (kAdd) {
      v = rnd<T>(__fadd_rn(v, to_float(rr[i])));
      sr[i] = from_float<T>(v);
    }
    ss = fmaf(v, v, ss);
  }
  __shared__ float part[kNormThreads / 32];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < kNormThreads / 32 ? part[threadIdx.x] : 0.0f;
    t = warp_sum(t);
    if (threadIdx.x == 0) part[0] = t;
  }
  __syncthreads();
  const float inv = rsqrtf(part[0] / static_cast<float>(H) + eps);
  T* o = out + r * H;
  for (int64_t i = threadIdx.x; i < H; i += kNormThreads) {
    // the row's own thread re-reads what it wrote (or x): no cross-thread dependency
    const float v = kAdd ? rnd<T>(__fadd_rn(to_float(xr[i]), to_float(rr[i]))) : to_float(xr[i]);
    o[i] = from_float<T>(__fmul_rn(to_float(w[i]), rnd<T>(__fmul_rn(v, inv))));
  }
}

template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                            T* __restrict__ out, int64_t rows, int Hh, int D) {
  const int half = D / 2;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * half) return;
  const int64_t row = idx / half;  // (position, head)
  const int i = int(idx - row * half);
  const int64_t p = row / Hh;
  const T* xr = x + row * D;
  const T* c = cos + p * D;
  const T* s = sin + p * D;
  const float x1 = to_float(xr[i]), x2 = to_float(xr[i + half]);
  T* o = out + row * D;
  o[i] = from_float<T>(__fadd_rn(rnd<T>(__fmul_rn(x1, to_float(c[i]))), rnd<T>(__fmul_rn(-x2, to_float(s[i])))));
  o[i + half] = from_float<T>(
      __fadd_rn(rnd<T>(__fmul_rn(x2, to_float(c[i + half]))), rnd<T>(__fmul_rn(x1, to_float(s[i + half])))));
}

template <typename T>
__global__ void silu_mul_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ o, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gv = to_float(g[i]);
    const float si = rnd<T>(__fdiv_rn(gv, __fadd_rn(1.0f, expf(-gv))));
    o[i] = from_float<T>(__fmul_rn(si, to_float(u[i])));
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const at::Tensor& x_in, const at::Tensor* res_in,
                                                 const at::Tensor& w_in, double eps) {
  NormBuffers b = norm_buffers(x_in, res_in, w_in);
  if (b.rows == 0) return {b.out, b.sum};
  TORCH_CHECK(b.rows <= int64_t(INT32_MAX), "rms_norm: at most 2^31 - 1 rows on CUDA, got ", b.rows);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  SPECDEC_DISPATCH_FLOAT(b.x.scalar_type(), "rms_norm", T, [&] {
    const T* xp = reinterpret_cast<const T*>(b.x.data_ptr());
    const T* wp = reinterpret_cast<const T*>(b.w.data_ptr());
    T* op = reinterpret_cast<T*>(b.out.data_ptr());
    if (res_in) {
      rms_norm_kernel<T, true><<<unsigned(b.rows), kNormThreads, 0, stream>>>(
          xp, reinterpret_cast<const T*>(b.res.data_ptr()), wp, op, reinterpret_cast<T*>(b.sum.data_ptr()), b.H,
          float(eps));
    } else {
      rms_norm_kernel<T, false><<<unsigned(b.rows), kNormThreads, 0, stream>>>(xp, nullptr, wp, op, nullptr, b.H,
                                                                                float(eps));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {b.out, b.sum};
}

at::Tensor rope_one(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, cudaStream_t stream) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const int64_t rows = x.size(0) * x.size(1) * x.size(2);
  const int Hh = int(x.size(2)), D = int(x.size(3));
  const int64_t work = rows * (D / 2);
  constexpr int kThreads = 256;
  SPECDEC_DISPATCH_FLOAT(x.scalar_type(), "rope", T, [&] {
    rope_kernel<T><<<unsigned(ceil_div(work, kThreads)), kThreads, 0, stream>>>(
        reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const T*>(cos.data_ptr()),
        reinterpret_cast<const T*>(sin.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), rows, Hh, D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace cuda

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  checks::rms_norm("rms_norm", x, nullptr, weight, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  return std::get<0>(cuda::rms_norm_impl(x, nullptr, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  checks::rms_norm("add_rms_norm", x, &residual, weight, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  return cuda::rms_norm_impl(x, &residual, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin) {
  checks::rope(q, k, cos, sin);
  const c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(q.numel() < (int64_t(1) << 31) && k.numel() < (int64_t(1) << 31), "rope: q and k must hold fewer than "
              "2^31 elements on CUDA, got ", q.numel(), " and ", k.numel());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  return {cuda::rope_one(q, c, s, stream), cuda::rope_one(k, c, s, stream)};
}

at::Tensor silu_mul_cuda(const at::Tensor& gate_in, const at::Tensor& up_in) {
  checks::silu_mul(gate_in, up_in);
  const c10::cuda::CUDAGuard guard(gate_in.device());
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  const int64_t n = gate.numel();
  if (n == 0) return out;
  constexpr int kThreads = 256;
  const unsigned blocks = unsigned(std::min<int64_t>(cuda::ceil_div(n, kThreads), 65535));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  SPECDEC_DISPATCH_FLOAT(gate.scalar_type(), "silu_mul", T, [&] {
    cuda::silu_mul_kernel<T><<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const T*>(gate.data_ptr()),
                                                             reinterpret_cast<const T*>(up.data_ptr()),
                                                             reinterpret_cast<T*>(out.data_ptr()), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace specdec
