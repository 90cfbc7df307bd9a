// The first index of a float32 row's maximum, AVX2 (compiled with -mavx2; chosen at run time by
// tree_walk.h's argmax_row): the scalar loop's semantics exactly (torch.argmax's: the first NaN wins
// when there is one, else the first index whose value equals the maximum, +0 and -0 equal), in two
// vector passes: the maximum and whether any NaN occurs, then the first index holding it.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "specdec/cpu_argmax.h"

namespace specdec {
namespace cpu {

int64_t argmax_f32_avx2(const float* row, int64_t V) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  __m256 n0 = _mm256_setzero_ps(), n1 = n0;  // NaN lanes seen (all ones)
  int64_t i = 0;
  for (; i + 32 <= V; i += 32) {
    const __m256 x0 = _mm256_loadu_ps(row + i), x1 = _mm256_loadu_ps(row + i + 8);
    const __m256 x2 = _mm256_loadu_ps(row + i + 16), x3 = _mm256_loadu_ps(row + i + 24);
    n0 = _mm256_or_ps(n0, _mm256_or_ps(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q), _mm256_cmp_ps(x1, x1, _CMP_UNORD_Q)));
    n1 = _mm256_or_ps(n1, _mm256_or_ps(_mm256_cmp_ps(x2, x2, _CMP_UNORD_Q), _mm256_cmp_ps(x3, x3, _CMP_UNORD_Q)));
    m0 = _mm256_max_ps(m0, x0);  // a NaN here only spoils the maximum, which is then not used
    m1 = _mm256_max_ps(m1, x1);
    m2 = _mm256_max_ps(m2, x2);
    m3 = _mm256_max_ps(m3, x3);
  }
  for (; i + 8 <= V; i += 8) {
    const __m256 x = _mm256_loadu_ps(row + i);
    n0 = _mm256_or_ps(n0, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(m0, x);
  }
  bool nan = _mm256_movemask_ps(_mm256_or_ps(n0, n1)) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  float best = lanes[0];
  for (int k = 1; k < 8; ++k) best = lanes[k] > best ? lanes[k] : best;
  for (int64_t j = i; j < V; ++j) {
    if (std::isnan(row[j])) nan = true;
    else if (row[j] > best) best = row[j];
  }
  // second pass: the first NaN, or the first element equal to the maximum
  const __m256 t = _mm256_set1_ps(best);
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 x = _mm256_loadu_ps(row + j);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(x, x, _CMP_UNORD_Q) : _mm256_cmp_ps(x, t, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; j < V; ++j)
    if (nan ? std::isnan(row[j]) : row[j] == best) return j;
  return 0;  // not reached: the maximum (or a NaN) is in the row
}

}  // namespace cpu
}  // namespace specdec
