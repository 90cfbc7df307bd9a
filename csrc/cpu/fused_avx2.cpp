// silu of float32 values, compiled with -mavx2 -mfma (see CMakeLists.txt; the exp polynomial
// may contract into FMAs: the same operations for every element);
// chosen at run time by csrc/cpu/fused.cpp (silu_mul) when the CPU supports AVX2 + FMA + F16C.
//
// silu(g) = g * sigmoid(g) with the vector exp of a non-positive argument: t = exp(-|g|) in
// (0, 1], silu = g / (1 + t) for g >= 0 and g * t / (1 + t) below, so nothing overflows
// (a few float32 ulps; the scalar std::exp form costs ~9 ns per element, this ~1). Lanes
// below -80, where the vector exp flushes to zero, take the scalar form. A partial last
// vector is padded: every element gets the same operations wherever it lies in the tensor
// (batch invariance: a verify pass of N rows computes what N decode steps would).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "specdec/cpu_vec.h"

namespace specdec {
namespace cpu {
namespace {

inline bool any_lane(v8i m) {
  uint64_t w[4];
  std::memcpy(w, &m, sizeof(w));
  return (w[0] | w[1] | w[2] | w[3]) != 0;
}

inline v8f silu8(v8f g) {
  const v8i neg = g < v8_set1(0.0f);
  const v8f t = v8_exp(neg ? g : -g);
  v8f r = (neg ? g * t : g) / (v8_set1(1.0f) + t);
  if (__builtin_expect(any_lane(g < v8_set1(-80.0f)), 0)) {
    for (int j = 0; j < 8; ++j)
      if (g[j] < -80.0f) r[j] = g[j] / (1.0f + std::exp(-g[j]));
  }
  return r;
}

}  // namespace

// out[i] = silu(g[i]) * up[i], or silu(g[i]) when up is null (the caller rounds and multiplies).
void silu_avx2(const float* g, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f s = silu8(v8_load(g + i));
    v8_store(out + i, up ? s * v8_load(up + i) : s);
  }
  if (i < n) {
    const size_t bytes = (n - i) * sizeof(float);
    float gb[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ub[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(gb, g + i, bytes);
    if (up) std::memcpy(ub, up + i, bytes);
    const v8f s = silu8(v8_load(gb));
    v8_store(gb, up ? s * v8_load(ub) : s);
    std::memcpy(out + i, gb, bytes);
  }
}

}  // namespace cpu
}  // namespace specdec
