// qlinear_q8act and quantize_q8, CUDA backend (definition: csrc/include/specdec/cpu_q8act.h).
//
// quantize: one warp per (row, block of 32): amax by a shuffle max, d and id by __fdiv_rn (correctly
// rounded, never the fast reciprocal), codes by rintf(__fmul_rn(x, id)) (round half to even), and
// Q4_1's s = float(R) * d with R the codes' sum (an exact integer shuffle sum).
// dot: one warp per output (row m, weight row n), four blocks per step: thread t takes word t % 8 of block
// 4 i + t / 8 (one __dp4a: 4 weight codes x 4 activation codes; Q8_0 a signed word, Q4 a word of nibbles
// masked from the usual packed bytes, Q4_0's offset as 8 x the word's code sum), the 8 threads of a block
// sum their words by xor shuffles (exact integers), and every thread then runs the definition's chain
// over the four blocks in ascending order: acc = __fmaf_rn(float(P), __fmul_rn(dw, d), acc) and, for Q4_1,
// acc = __fmaf_rn(mw, s, acc) -- explicitly rounded steps, the definition's fused ones and no others. So the
// outputs equal the CPU tiers' and the torch reference's bit for bit. (The CPU's packed layout is not
// read here: CUDA takes the usual [N, K] / [N, K / 2] weight.)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "checks.h"
#include "common.cuh"
#include "q8act.h"

namespace specdec {
namespace cuda {
namespace {

__global__ void q8_quantize_kernel(const float* __restrict__ x, int8_t* __restrict__ a, float* __restrict__ d,
                                   float* __restrict__ s, int64_t K) {
  // one block per (row, group), flattened: a [K / 32, M] grid would cap M at gridDim.y's 65,535
  const int64_t G = K / 32, m = int64_t(blockIdx.x) / G, g = int64_t(blockIdx.x) % G;
  const int j = threadIdx.x;
  const float xv = x[m * K + g * 32 + j];
  float amax = fabsf(xv);
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
  const float inv = __fdiv_rn(127.0f, amax), id = isfinite(inv) ? inv : 0.0f;
  const float q = fminf(127.0f, fmaxf(-127.0f, rintf(__fmul_rn(xv, id))));
  a[m * K + g * 32 + j] = static_cast<int8_t>(static_cast<int>(q));
  int sum = static_cast<int>(q);
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kFullMask, sum, off);
  const float dv = __fdiv_rn(amax, 127.0f);
  if (j == 0) {
    d[m * G + g] = dv;
    if (s != nullptr) s[m * G + g] = __fmul_rn(__int2float_rn(sum), dv);
  }
}

template <int BITS, bool MINS>
__global__ void q8act_dot_kernel(const int8_t* __restrict__ a, const float* __restrict__ d,
                                 const float* __restrict__ s, const uint8_t* __restrict__ qw, const __half* __restrict__ scales,
                                 const __half* __restrict__ mins, const float* __restrict__ bias,
                                 float* __restrict__ y, int64_t M, int64_t N, int64_t K) {
  const int64_t G = K / 32;
  const int lane = threadIdx.x & 31, l = lane & 7, q = lane >> 3;
  const int64_t out = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (out >= M * N) return;  // a whole warp: the shuffles below see all 32 threads
  const int64_t m = out / N, n = out % N;
  float acc = 0.0f;
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t g = g0 + q;
    int p = 0;
    if (g < G) {
      const int av = *reinterpret_cast<const int*>(a + m * K + g * 32 + 4 * l);
      int wv;
      if constexpr (BITS == 8) {
        wv = *reinterpret_cast<const int*>(qw + n * K + g * 32 + 4 * l);
      } else {
        const int raw = *reinterpret_cast<const int*>(qw + n * (K / 2) + g * 16 + 4 * (l & 3));
        wv = (l < 4 ? raw : (raw >> 4)) & 0x0F0F0F0F;
      }
      p = __dp4a(wv, av, 0);
      if constexpr (BITS == 4 && !MINS) p -= 8 * __dp4a(0x01010101, av, 0);
    }
    for (int off = 1; off < 8; off <<= 1) p += __shfl_xor_sync(kFullMask, p, off);
    for (int j = 0; j < 4 && g0 + j < G; ++j) {
      const int pj = __shfl_sync(kFullMask, p, 8 * j);
      const int64_t gj = g0 + j;
      acc = __fmaf_rn(__int2float_rn(pj), __fmul_rn(__half2float(scales[n * G + gj]), d[m * G + gj]), acc);
      if constexpr (MINS) acc = __fmaf_rn(__half2float(mins[n * G + gj]), s[m * G + gj], acc);
    }
  }
  if (lane == 0) y[m * N + n] = __fadd_rn(acc, bias != nullptr ? bias[n] : 0.0f);
}

// codes [M, K] int8, d [M, G] float32 and (s non-null) s [M, G] of x32 [M, K] (contiguous float32).
void quantize(const at::Tensor& x32, at::Tensor& a, at::Tensor& d, float* s) {
  const int64_t M = x32.size(0), K = x32.size(1);
  if (M == 0 || K == 0) return;
  const int64_t blocks = M * (K / 32);
  TORCH_CHECK(blocks <= int64_t(0x7fffffff), "specdec qlinear_q8act (CUDA): x holds ", M, " rows of ", K / 32,
              " blocks; at most 2^31 - 1 (row, block) pairs per call");
  q8_quantize_kernel<<<unsigned(blocks), 32, 0, at::cuda::getCurrentCUDAStream()>>>(
      x32.data_ptr<float>(), a.data_ptr<int8_t>(), d.data_ptr<float>(), s, K);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int BITS, bool MINS>
void launch_dot(const at::Tensor& a, const at::Tensor& d, const float* s, const at::Tensor& qw, const at::Tensor& scales,
                const __half* mins, const float* bias, at::Tensor& y, int64_t M, int64_t N, int64_t K) {
  constexpr int kThreads = 256;
  const int64_t blocks = ceil_div(M * N * 32, kThreads);
  TORCH_CHECK(blocks <= int64_t(0x7fffffff), "specdec qlinear_q8act (CUDA): ", M, " rows x ", N,
              " outputs need more than 2^31 - 1 blocks of one warp per output; split x's rows");
  q8act_dot_kernel<BITS, MINS><<<unsigned(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<int8_t>(), d.data_ptr<float>(), s, static_cast<const uint8_t*>(qw.data_ptr()),
      reinterpret_cast<const __half*>(scales.data_ptr<at::Half>()), mins, bias, y.data_ptr<float>(), M, N, K);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda

at::Tensor qlinear_q8act_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                              int64_t bits) {
  checks::qlinear_q8act(x, qweight, scales, mins, bias, bits);
  const c10::cuda::CUDAGuard guard(x.device());
  if (auto y = checks::linear_trivial(x, qweight, bias)) return *y;
  const int64_t K = x.size(-1), N = qweight.size(0), M = checks::linear_rows(x), G = K / 32;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x32 = x.reshape({M, K}).to(at::kFloat).contiguous();
  at::Tensor a = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, G}, x.options().dtype(at::kFloat));
  at::Tensor s = mins.has_value() ? at::empty({M, G}, x.options().dtype(at::kFloat)) : at::Tensor();
  cuda::quantize(x32, a, d, mins.has_value() ? s.data_ptr<float>() : nullptr);
  // the kernel reads the codes as 4-byte words: a view at an odd offset is copied to a fresh allocation
  const at::Tensor w = (reinterpret_cast<uintptr_t>(qweight.data_ptr()) & 3u) == 0 ? qweight : qweight.clone();
  std::optional<at::Tensor> b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  const float* bp = b32.has_value() ? b32->data_ptr<float>() : nullptr;
  const __half* mp = mins.has_value() ? reinterpret_cast<const __half*>(mins->data_ptr<at::Half>()) : nullptr;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* sp = mins.has_value() ? s.data_ptr<float>() : nullptr;
  if (bits == 8) cuda::launch_dot<8, false>(a, d, sp, w, scales, mp, bp, y, M, N, K);
  else if (mp != nullptr) cuda::launch_dot<4, true>(a, d, sp, w, scales, mp, bp, y, M, N, K);
  else cuda::launch_dot<4, false>(a, d, sp, w, scales, mp, bp, y, M, N, K);
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(out_shape);
}

std::tuple<at::Tensor, at::Tensor> quantize_q8_cuda(const at::Tensor& x) {
  checks::quantize_q8(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t K = x.size(-1), M = checks::linear_rows(x), G = K / 32;
  const at::Tensor x32 = x.reshape({M, K}).to(at::kFloat).contiguous();
  at::Tensor a = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, G}, x.options().dtype(at::kFloat));
  cuda::quantize(x32, a, d, nullptr);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  std::vector<int64_t> dshape = shape;
  dshape.back() = G;
  return {a.view(shape), d.view(dshape)};
}

}  // namespace specdec
