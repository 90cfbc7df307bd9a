// Device helpers shared by the CUDA kernels of specdec (csrc/cuda/*.cu): dtype
// dispatch, element conversions, 16-byte vector moves, cp.async, warp reductions.
//
// Compiled with torch's flags (-D__CUDA_NO_HALF_OPERATORS__ etc.): every half / bfloat16
// conversion below is an explicit intrinsic, never an implicit operator.
#pragma once

#include <cstdint>
#include <type_traits>

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace specdec {
namespace cuda {

constexpr float kNegInf = -__builtin_huge_valf();
constexpr unsigned kFullMask = 0xffffffffu;

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// True when a pointer may be used for 16-byte vector accesses.
inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// ---------------------------------------------------------------- dtype dispatch
// SPECDEC_DISPATCH_FLOAT(scalar_type, "op", T, [&] { ... T ... }): float / half / bfloat16.
#define SPECDEC_DISPATCH_FLOAT(STYPE, OPNAME, T, ...)                                   \
  [&] {                                                                                 \
    switch (STYPE) {                                                                    \
      case at::kFloat: {                                                                \
        using T = float;                                                                \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case at::kHalf: {                                                                 \
        using T = __half;                                                               \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case at::kBFloat16: {                                                             \
        using T = __nv_bfloat16;                                                        \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      default:                                                                          \
        TORCH_CHECK(false, OPNAME, ": unsupported dtype ", STYPE, " on CUDA");          \
    }                                                                                   \
  }()

// SPECDEC_DISPATCH_HEAD_DIM(d, "op", kD, [&] { ... kD ... }): 64 / 80 / 96 / 128 / 256.
#define SPECDEC_DISPATCH_HEAD_DIM(DIM, OPNAME, KD, ...)                                 \
  [&] {                                                                                 \
    switch (DIM) {                                                                      \
      case 64: {                                                                        \
        constexpr static int KD = 64;                                                   \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case 80: {                                                                        \
        constexpr static int KD = 80;                                                   \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case 96: {                                                                        \
        constexpr static int KD = 96;                                                   \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case 128: {                                                                       \
        constexpr static int KD = 128;                                                  \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case 256: {                                                                       \
        constexpr static int KD = 256;                                                  \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      default:                                                                          \
        TORCH_CHECK(false, OPNAME, ": head dim D must be one of 64, 80, 96, 128, 256 on CUDA, got ", DIM); \
    }                                                                                   \
  }()

// SPECDEC_BOOL_SWITCH(cond, kName, [&] { ... kName ... }).
#define SPECDEC_BOOL_SWITCH(COND, NAME, ...) \
  [&] {                                      \
    if (COND) {                              \
      constexpr static bool NAME = true;     \
      return __VA_ARGS__();                  \
    } else {                                 \
      constexpr static bool NAME = false;    \
      return __VA_ARGS__();                  \
    }                                        \
  }()

// ---------------------------------------------------------------- conversions
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Two floats -> one 32-bit word of two 16-bit values (lo in the low half), round to nearest.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Unpack the 16-byte vector of T at `v` into fp32 (4 floats or 8 halves).
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& v, float* out);
template <>
__device__ __forceinline__ void unpack16<float>(const uint4& v, float* out) {
  out[0] = __uint_as_float(v.x);
  out[1] = __uint_as_float(v.y);
  out[2] = __uint_as_float(v.z);
  out[3] = __uint_as_float(v.w);
}
template <>
__device__ __forceinline__ void unpack16<__half>(const uint4& v, float* out) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __half22float2(h[k]);
    out[2 * k] = f.x;
    out[2 * k + 1] = f.y;
  }
}
template <>
__device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4& v, float* out) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    out[2 * k] = f.x;
    out[2 * k + 1] = f.y;
  }
}

// Store 4 floats as 4 elements of T at dst (16 bytes for float, 8 for 16-bit types; dst aligned to that).
__device__ __forceinline__ void store4(float* dst, float4 v) { *reinterpret_cast<float4*>(dst) = v; }
__device__ __forceinline__ void store4(__half* dst, float4 v) {
  *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<__half>(v.x, v.y), pack2<__half>(v.z, v.w));
}
__device__ __forceinline__ void store4(__nv_bfloat16* dst, float4 v) {
  *reinterpret_cast<uint2*>(dst) =
      make_uint2(pack2<__nv_bfloat16>(v.x, v.y), pack2<__nv_bfloat16>(v.z, v.w));
}

// ---------------------------------------------------------------- shared memory / cp.async (sm_80+)
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1 (K/V are streamed once per CTA).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem_dst)), "l"(gmem_src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void zero16(void* smem_dst) {
  *reinterpret_cast<uint4*>(smem_dst) = make_uint4(0u, 0u, 0u, 0u);
}

// ---------------------------------------------------------------- cache lengths
// kv_commit's length update cache_lens + num_accepted + 1, in int64 and saturated to the int32 range:
// with strict checks off the inputs may be any int32 values, and an int32 sum would overflow (undefined;
// in practice a wrap to a large negative length). Valid inputs (the checked contract) never saturate.
__device__ __forceinline__ int32_t advanced_len(int32_t len, int32_t num_accepted) {
  const int64_t next = int64_t(len) + int64_t(num_accepted) + 1;
  return int32_t(next > INT32_MAX ? int64_t(INT32_MAX) : next < INT32_MIN ? int64_t(INT32_MIN) : next);
}

// ---------------------------------------------------------------- warp reductions
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

}  // namespace cuda
}  // namespace specdec
