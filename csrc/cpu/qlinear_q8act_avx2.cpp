// qlinear_q8act's AVX2 tier (vpmaddubsw + vpmaddwd) and the vector activation quantization that every
// vector tier uses, compiled with -mavx2 -mfma -mf16c -ffp-contract=off (CMakeLists.txt).
#define Q8ACT_NS avx2_q8
#define Q8ACT_VNNI 0
#include "cpu/qlinear_q8act_ymm.h"

#include <cmath>

namespace specdec {
namespace cpu {

void q8act_rows_avx2(const Q8ActParams& P, int64_t t_begin, int64_t t_end) { avx2_q8::rows(P, t_begin, t_end); }

// Step 1 of the definition with vectors: amax by max (exact in any order), d and id by scalar
// divisions, the codes by vcvtps2dq (round half to even, the default MXCSR mode) after the clamp; then
// the block's code sum R and s = float(R) * d.
void q8_quantize_avx2(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* a, float* dq, int32_t* R,
                      float* s) {
  const int64_t G = K / kQ8Block;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i ones8 = _mm256_set1_epi8(1);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xb = x + m * x_stride + g * kQ8Block;
      __m256 v[4];
      for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(xb + 8 * k);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.0f, inv = 127.0f / amax, id = std::isfinite(inv) ? inv : 0.0f;
      const __m256 idv = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
      __m256i q[4];  // the clamp is a no-op for finite x (|x * id| < 127.5); NaN becomes -127
      for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[k], idv), lo), hi));
      const __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i codes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + m * K + g * kQ8Block), codes);
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, codes), ones16);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      R[m * G + g] = _mm_cvtsi128_si32(s4);
      s[m * G + g] = static_cast<float>(R[m * G + g]) * d;
      dq[m * G + g] = d;
    }
  }
}

}  // namespace cpu
}  // namespace specdec
