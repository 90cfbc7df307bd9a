// verify_attention on the CPU: one task = one (request, KV head). The G query heads
// that share the KV head and the N tree nodes form R = G * N query rows that walk the
// keys together in blocks of kKeyBlock (flash-attention style online softmax), so
// each K/V row is read and converted to fp32 once per task, not once per query head.
//
// Micro-kernels are broadcast-FMA forms without horizontal sums:
//   scores[r, k..k+8] += q[r, d] * Kt[d, k..k+8]      (K block transposed in L1)
//   acc[r, d..d+8]    += p[r, k] * V[k, d..d+8]
// Napkin math: R * (len + N) * D * 2 FMAs per task and (len + N) * D * 2 * sizeof(dtype)
// bytes read; at R = 64 the work is compute-bound on a CPU (AVX2: 16 FMA lanes/cycle).
//
// Masking: keys < len (the prefix) are always visible; key len + j is visible to
// node i iff bit j of mask row i is set (bit-packed, W = ceil(N / 64) words per row),
// or j <= i when no mask is given. A row that sees no key at all outputs zeros.
//
// This header is compiled once per ISA (SPECDEC_CPU_ISA names the namespace).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "specdec/cpu_vec.h"

#ifndef SPECDEC_CPU_ISA
#error "define SPECDEC_CPU_ISA before including cpu_attention.h"
#endif

namespace specdec {
namespace cpu {

struct AttentionParams {
  const void* q;            // [B, N, Hq, D] (strides below, D contiguous)
  int64_t q_stride_b, q_stride_n, q_stride_h;  // in elements
  const void* k_cache;      // [B, Hkv, S, D] contiguous
  const void* v_cache;      // [B, Hkv, S, D] contiguous
  void* out;                // [B, N, Hq, D] contiguous
  const int32_t* lens;      // [B]
  const uint64_t* mask;     // [B, N, W] packed tree mask, or nullptr = causal chain
  int64_t B, N, Hq, Hkv, S, D, W;
  float scale;
  DType dtype;
};

namespace SPECDEC_CPU_ISA {

constexpr int64_t kKeyBlock = 64;  // keys per block: 8 vectors of 8 scores per query row

// Scratch of one task, reused across tasks of a thread.
struct AttentionScratch {
  std::vector<float> q, acc, kt, v, s, row;
  std::vector<float> m, l;
};

// acc[0 : 8 NV] = acc * corr + sum_k p[k] * V[k, 0 : 8 NV], accumulators held in registers.
template <int NV>
inline void pv_chunk(float* acc, const float* V, int64_t Dp, const float* p, int64_t nk, float corr) {
  v8f a[NV];
  const v8f cv = v8_set1(corr);
  for (int v = 0; v < NV; ++v) a[v] = v8_load(acc + 8 * v) * cv;
  for (int64_t k = 0; k < nk; ++k) {
    if (p[k] == 0.f) continue;  // masked key: skip (its V may hold anything, even inf)
    const v8f pk = v8_set1(p[k]);
    const float* vr = V + k * Dp;
    for (int v = 0; v < NV; ++v) a[v] += pk * v8_load(vr + 8 * v);
  }
  for (int v = 0; v < NV; ++v) v8_store(acc + 8 * v, a[v]);
}

// One query row: chunks of up to 8 vectors (64 floats) of the head dim.
inline void pv_accumulate(float* acc, const float* V, int64_t Dp, const float* p, int64_t nk, float corr) {
  for (int64_t c = 0; c < Dp; c += 64) {
    const int64_t rem = std::min<int64_t>(8, (Dp - c) / 8);
    switch (rem) {
      case 1: pv_chunk<1>(acc + c, V + c, Dp, p, nk, corr); break;
      case 2: pv_chunk<2>(acc + c, V + c, Dp, p, nk, corr); break;
      case 3: pv_chunk<3>(acc + c, V + c, Dp, p, nk, corr); break;
      case 4: pv_chunk<4>(acc + c, V + c, Dp, p, nk, corr); break;
      case 5: pv_chunk<5>(acc + c, V + c, Dp, p, nk, corr); break;
      case 6: pv_chunk<6>(acc + c, V + c, Dp, p, nk, corr); break;
      case 7: pv_chunk<7>(acc + c, V + c, Dp, p, nk, corr); break;
      default: pv_chunk<8>(acc + c, V + c, Dp, p, nk, corr); break;
    }
  }
}

inline void attention_task(const AttentionParams& P, int64_t b, int64_t h, AttentionScratch& W) {
  const int64_t G = P.Hq / P.Hkv, N = P.N, D = P.D, R = G * N;
  const int64_t Dp = (D + 7) / 8 * 8;  // padded head dim (zero tail)
  const int64_t len = P.lens[b];
  const int64_t total = len + N;
  const int64_t es = dtype_size(P.dtype);
  W.q.assign(R * Dp, 0.f);
  W.acc.assign(R * Dp, 0.f);
  W.kt.assign(Dp * kKeyBlock, 0.f);
  W.v.assign(kKeyBlock * Dp, 0.f);
  W.s.resize(kKeyBlock);
  W.row.resize(Dp);
  W.m.assign(R, -std::numeric_limits<float>::infinity());
  W.l.assign(R, 0.f);

  // Query rows r = g * N + i  <->  head h * G + g, node i; pre-scaled.
  const char* qbase = static_cast<const char*>(P.q);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < N; ++i) {
      const int64_t off = b * P.q_stride_b + i * P.q_stride_n + (h * G + g) * P.q_stride_h;
      float* dst = W.q.data() + (g * N + i) * Dp;
      load_row(qbase + off * es, P.dtype, D, dst);
      for (int64_t d = 0; d < D; ++d) dst[d] *= P.scale;
    }
  }

  const char* kbase = static_cast<const char*>(P.k_cache) + ((b * P.Hkv + h) * P.S) * D * es;
  const char* vbase = static_cast<const char*>(P.v_cache) + ((b * P.Hkv + h) * P.S) * D * es;
  const float ninf = -std::numeric_limits<float>::infinity();

  for (int64_t s0 = 0; s0 < total; s0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, total - s0);
    // K block -> transposed fp32 Kt[d, k]; V block -> fp32 V[k, d]. Unused keys are zero.
    for (int64_t k = 0; k < kKeyBlock; ++k) {
      if (k < nk) {
        load_row(kbase + (s0 + k) * D * es, P.dtype, D, W.row.data());
        for (int64_t d = 0; d < D; ++d) W.kt[d * kKeyBlock + k] = W.row[d];
        load_row(vbase + (s0 + k) * D * es, P.dtype, D, W.v.data() + k * Dp);
      } else {
        for (int64_t d = 0; d < D; ++d) W.kt[d * kKeyBlock + k] = 0.f;
        for (int64_t d = 0; d < Dp; ++d) W.v[k * Dp + d] = 0.f;
      }
    }
    const bool touches_tree = s0 + nk > len;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = r % N;
      // scores for the 64 keys of the block: 8 accumulators of 8 lanes
      v8f sc[8];
      for (int c = 0; c < 8; ++c) sc[c] = v8_set1(0.f);
      const float* qr = W.q.data() + r * Dp;
      for (int64_t d = 0; d < D; ++d) {
        const v8f qd = v8_set1(qr[d]);
        const float* kt = W.kt.data() + d * kKeyBlock;
        for (int c = 0; c < 8; ++c) sc[c] += qd * v8_load(kt + 8 * c);
      }
      float* s = W.s.data();
      for (int c = 0; c < 8; ++c) v8_store(s + 8 * c, sc[c]);
      for (int64_t k = nk; k < kKeyBlock; ++k) s[k] = ninf;
      if (touches_tree) {
        const uint64_t* mrow = P.mask ? P.mask + (b * N + i) * P.W : nullptr;
        for (int64_t k = std::max<int64_t>(0, len - s0); k < nk; ++k) {
          const int64_t j = s0 + k - len;
          const bool visible = mrow ? ((mrow[j >> 6] >> (j & 63)) & 1u) != 0 : j <= i;
          if (!visible) s[k] = ninf;
        }
      }
      float bmax = ninf;
      for (int c = 0; c < 8; ++c) {
        const float mc = v8_hmax(v8_load(s + 8 * c));
        bmax = mc > bmax ? mc : bmax;
      }
      const float m_old = W.m[r];
      const float m_new = bmax > m_old ? bmax : m_old;
      if (m_new == ninf) continue;  // nothing visible yet
      const float corr = m_old == ninf ? 0.f : std::exp(m_old - m_new);
      const v8f mv = v8_set1(m_new);
      v8f psum = v8_set1(0.f);
      for (int c = 0; c < 8; ++c) {
        const v8f x = v8_load(s + 8 * c);
        v8f p = v8_exp(x - mv);
        p = x == v8_set1(ninf) ? v8_set1(0.f) : p;  // masked keys contribute exactly 0
        psum += p;
        v8_store(s + 8 * c, p);
      }
      W.l[r] = W.l[r] * corr + v8_hsum(psum);
      W.m[r] = m_new;
      pv_accumulate(W.acc.data() + r * Dp, W.v.data(), Dp, s, nk, corr);
    }
  }

  char* obase = static_cast<char*>(P.out);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = r / N, i = r % N;
    float* acc = W.acc.data() + r * Dp;
    const float inv = W.l[r] > 0.f ? 1.f / W.l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
    const int64_t off = ((b * N + i) * P.Hq + h * G + g) * D;
    store_row(acc, P.dtype, D, obase + off * es);
  }
}

}  // namespace SPECDEC_CPU_ISA
}  // namespace cpu
}  // namespace specdec
