// Portable 8-wide float vectors (GCC/Clang vector extensions) and dtype conversions
// for the CPU kernels. No torch here: usable from a plain C++ program.
//
// The same source is compiled twice (baseline x86-64 and AVX2+FMA, see
// csrc/cpu/attention_avx2.cpp); with AVX2 a v8f is one ymm register, otherwise the
// compiler splits it into two SSE registers.
#pragma once

#include <cstdint>
#include <cstring>

namespace specdec {
namespace cpu {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

static inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// IEEE half -> float, exact for every input (normals, subnormals, inf, NaN): the
// exponent is rebiased by a float multiply, subnormals by a magic-number subtraction.
static inline float half_to_float(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result = sign | (two_w < (1u << 27) ? float_to_bits(denormalized) : float_to_bits(normalized));
  return bits_to_float(result);
}

// float -> IEEE half, round to nearest even (same results as a hardware conversion).
static inline uint16_t float_to_half(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// float -> bfloat16, round to nearest even; NaN stays a (quiet) NaN.
static inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040u);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Convert n elements of `src` (dtype dt) to float.
static inline void load_row(const void* src, DType dt, int64_t n, float* dst) {
  switch (dt) {
    case DType::kFloat32:
      std::memcpy(dst, src, size_t(n) * 4);
      break;
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
      break;
    }
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      break;
    }
  }
}

static inline void store_row(const float* src, DType dt, int64_t n, void* dst) {
  switch (dt) {
    case DType::kFloat32:
      std::memcpy(dst, src, size_t(n) * 4);
      break;
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_half(src[i]);
      break;
    }
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      break;
    }
  }
}

static inline int64_t dtype_size(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

static inline v8f v8_load(const float* p) {
  v8f r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
static inline void v8_store(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
static inline v8f v8_set1(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// exp(x) for x <= 0 (softmax after max subtraction): Cody-Waite range reduction
// x = n ln2 + r, |r| <= ln2/2, degree-6 Taylor polynomial (truncation error
// r^7/7! < 1.2e-7 relative, about one float ulp), then scale by 2^n through the
// exponent bits. Inputs below -87 flush to 0 (their true value is below 2^-126).
static inline v8f v8_exp(v8f x) {
  const v8f lo = v8_set1(-87.0f);
  const v8i underflow = x < lo;
  x = underflow ? lo : x;
  const v8f magic = v8_set1(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  v8f n = x * v8_set1(1.44269504088896341f) + magic;
  n = n - magic;
  v8f r = x - n * v8_set1(0.693359375f);
  r = r - n * v8_set1(-2.12194440e-4f);
  v8f p = v8_set1(1.0f / 720.0f);
  p = p * r + v8_set1(1.0f / 120.0f);
  p = p * r + v8_set1(1.0f / 24.0f);
  p = p * r + v8_set1(1.0f / 6.0f);
  p = p * r + v8_set1(0.5f);
  p = p * r + v8_set1(1.0f);
  p = p * r + v8_set1(1.0f);
  v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &e, sizeof(scale));
  p = p * scale;
  return underflow ? v8_set1(0.0f) : p;
}

static inline float v8_hsum(v8f v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}
static inline float v8_hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

}  // namespace cpu
}  // namespace specdec
