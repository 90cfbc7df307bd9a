// The fixed-point arithmetic of rejection_sample, shared by the CPU walk (tree_walk.h) and
// the CUDA kernel (sampling.cu) so that both make the same decisions BY CONSTRUCTION.
// specdec/reference.py (quantize_row, _scaled_mass, draw_threshold) states the same rules.
//
// A target row p [V] becomes integer masses: entries that are NaN, infinite, zero or
// negative carry none; with M the largest other entry and e its binary exponent
// (M = f * 2^e, 0.5 <= f < 1), entry x becomes floor(x * 2^(kMassBits - e)) — a
// power-of-two scaling (exact) and a truncation, < 2^kMassBits. A row's mass is then an
// exact integer sum < V * 2^kMassBits <= 2^62 (V <= kMaxVocab), the same in every
// summation order; prefix sums for the inverse-CDF draw likewise. The float64 operations
// left are single rounded products (u * q * Z, Z * q, u * Z) and int64 -> double
// conversions, all correctly rounded on both backends, with no add to contract into an FMA.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define SPECDEC_HD __host__ __device__ __forceinline__
#else
#define SPECDEC_HD inline
#endif

namespace specdec {
namespace fixed {

constexpr int kMassBits = 42;
constexpr int64_t kMaxVocab = int64_t(1) << 20;
constexpr int64_t kMassCap = int64_t(1) << 62;
constexpr double kMassCapD = 4611686018427387904.0;  // 2^62

// Running maximum over the entries that carry mass (finite and > 0; NaN compares false).
SPECDEC_HD float max_mass_entry(float acc, float v) { return (v > acc && v < INFINITY) ? v : acc; }

// e with mx = f * 2^e, 0.5 <= f < 1 (mx finite, > 0).
SPECDEC_HD int row_exponent(float mx) {
  int e = 0;
  (void)frexp(double(mx), &e);
  return e;
}

// The integer mass of entry v of a row whose largest entry has exponent e.
SPECDEC_HD int64_t quantize(float v, int e) {
  const double x = double(v);
  if (!(x > 0.0) || !(x < INFINITY)) return 0;
  return int64_t(ldexp(x, kMassBits - e));  // in [0, 2^kMassBits): truncation == floor
}

SPECDEC_HD double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// floor(double(Z) * q) clamped to [0, 2^62] (NaN / non-positive -> 0): the mass a rejected
// draft row q removes from a residual of mass Z (Zd = double(Z)).
SPECDEC_HD int64_t scaled_mass(double Zd, float q) {
  const double t = mul(Zd, double(q));
  if (!(t > 0.0)) return 0;
  if (t >= kMassCapD) return kMassCap;
  return int64_t(t);
}

SPECDEC_HD int64_t subtract(int64_t m, int64_t s) { return m > s ? m - s : 0; }

// Child with draft probability qx of its own token, residual mass mx of that token, total
// Z: accepted iff qx > 0 and (u * qx) * double(Z) < double(mx), i.e. u < p(x) / q(x).
SPECDEC_HD bool accepts(double u, double qx, int64_t Z, int64_t mx) {
  return qx > 0.0 && mul(mul(u, qx), double(Z)) < double(mx);
}

// Inverse-CDF threshold for mass Z > 0: floor(u * double(Z)) clamped to [0, Z - 1]
// (u <= 0 or NaN -> 0; u >= 1 -> Z - 1, the last index with mass). The draw is the first
// index whose inclusive prefix sum exceeds it.
SPECDEC_HD int64_t draw_threshold(int64_t Z, double u) {
  const double Zd = double(Z);
  const double t = mul(u, Zd);
  if (!(t > 0.0)) return 0;
  if (t >= Zd) return Z - 1;
  const int64_t k = int64_t(t);
  return k < Z - 1 ? k : Z - 1;
}

}  // namespace fixed
}  // namespace specdec
