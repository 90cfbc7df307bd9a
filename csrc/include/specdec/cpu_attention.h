// verify_attention on the CPU: one task = one (request, KV head), or a chunk of its query rows
// (see verify_attention_raw in csrc/cpu/attention.cpp). The G query heads
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
// Masking: the step has Nkv new nodes at len + j (j < Nkv) and the N queries are the
// last N of them (query i = new node Nkv - N + i; Nkv = N is the plain tree form).
// Keys < len (the prefix) are always visible; key len + j is visible to query i iff
// bit j of mask row i is set (bit-packed, W = ceil(Nkv / 64) words per row), or
// j <= Nkv - N + i when no mask is given. A row that sees no key at all outputs zeros.
//
// This header is compiled once per ISA (SPECDEC_CPU_ISA names the namespace).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "specdec/cpu_vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

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
  const uint64_t* mask;     // [B, N, W] packed tree mask (N queries x Nkv new keys), or nullptr = causal
  int64_t B, N, Hq, Hkv, S, D, W;
  int64_t Nkv;              // new nodes of the step in the cache (>= N; the queries are the last N)
  float scale;
  DType dtype;
  int64_t row_chunk = 0;    // query rows per task (a multiple of the row tile); 0: chosen by verify_attention_raw
  int64_t prefetch = 0;     // key blocks of K / V requested ahead of the one computed (0: none; set_attention_prefetch)
  // Paged caches (k_cache / v_cache [num_pages, page_size, Hkv, D], D contiguous, K and V with one set
  // of strides: NHD, or a view such as HND's transpose): key s of request b, head h sits in page
  // block_table[b * max_blocks + s / page_size], slot s % page_size, at element
  // page * page_stride + slot * slot_stride + h * head_stride. nullptr: the dense layout.
  const int32_t* block_table = nullptr;
  int64_t page_size = 0, max_blocks = 0;
  int64_t page_stride = 0, slot_stride = 0, head_stride = 0;  // in elements
};

// Key blocks of K / V the CPU kernel requests ahead by default (set_attention_prefetch).
constexpr int64_t kAttentionPrefetchBlocks = 2;

// Tasks of a call: (request, KV head, chunk of query rows). Rows never interact (each is its own
// online softmax over the same key blocks), so how they are chunked changes no result bit.
inline int64_t attention_row_chunk(const AttentionParams& P) {
  const int64_t R = P.Hq / P.Hkv * P.N;
  return P.row_chunk > 0 && P.row_chunk < R ? P.row_chunk : R;
}
inline int64_t attention_tasks(const AttentionParams& P) {
  const int64_t R = P.Hq / P.Hkv * P.N, c = attention_row_chunk(P);
  return P.B * P.Hkv * ((R + c - 1) / c);
}

namespace SPECDEC_CPU_ISA {

constexpr int64_t kKeyBlock = 64;  // keys per block: 8 vectors of 8 scores per query row

// Scratch of one task, reused across the tasks and calls of a thread (thread_local in the callers).
struct AttentionScratch {
  std::vector<float> q, acc, kt, v, s, row;
  std::vector<float> m, l, corr;
  std::vector<int64_t> tile_end;  // per row tile: the end of the keys any of its rows can see
  std::vector<float> kt2, v2;     // a tree node's key blocks past the first (the tree tail below)
  std::vector<float> qt, at, st;  // one tile of a tree node's rows: q, acc, scores
  std::vector<int64_t> keys, rows;  // a tree node's visible new keys (slots) and its rows in the task
};

// A software prefetch of the cache line holding p into L2 (a block of K and V is 32 KiB of fp32 at
// D = 64: two blocks ahead into L1 would evict the block being computed). An asm statement on x86:
// GCC drops a __builtin_prefetch whose only caller is a lambda it finds free of side effects.
inline void prefetch_line(const char* p) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

constexpr int64_t kRowTile = 3;     // query rows per micro-kernel call (3 x 4 accumulators)

// scores[r0 + t, 0:64] = q[r0 + t] . Kt[:, 0:64] for t < 3; 4 vectors (32 keys) at a time, so
// each K load feeds 3 FMAs and each q broadcast 4 (12 accumulators in registers).
inline void qk_tile(const float* q, int64_t Dp, const float* kt, int64_t D, float* scores) {
  for (int64_t kc = 0; kc < kKeyBlock; kc += 32) {
    v8f a[kRowTile][4];
    for (int t = 0; t < kRowTile; ++t)
      for (int c = 0; c < 4; ++c) a[t][c] = v8_set1(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const float* kr = kt + d * kKeyBlock + kc;
      const v8f k0 = v8_load(kr), k1 = v8_load(kr + 8), k2 = v8_load(kr + 16), k3 = v8_load(kr + 24);
      for (int t = 0; t < kRowTile; ++t) {
        const v8f qd = v8_set1(q[t * Dp + d]);
        a[t][0] += qd * k0;
        a[t][1] += qd * k1;
        a[t][2] += qd * k2;
        a[t][3] += qd * k3;
      }
    }
    for (int t = 0; t < kRowTile; ++t)
      for (int c = 0; c < 4; ++c) v8_store(scores + t * kKeyBlock + kc + 8 * c, a[t][c]);
  }
}

// A key block's V rows as runs of consecutive keys: key k0 + i of the block is at v + i * vs, i < n.
// A dense cache (or a page that holds the whole block) is one run; a paged one with smaller pages
// has a run per page, read in place.
struct VRun {
  const float* v;
  int64_t k0, n;
};

// acc[r0 + t, dims] = acc * corr[t] + sum_k p[t, k] V[k, dims] for t < 3, 4 vectors (32 dims)
// at a time (12 accumulators in registers); NV < 4 for the tail of the head dim. The keys are
// summed in order whatever the runs, so the runs change no result bit.
template <int NV>
inline void pv_tile(float* acc, int64_t Dp, const float* p, const VRun* runs, int64_t nruns, int64_t vs,
                    int64_t c0, const float* corr) {
  v8f a[kRowTile][NV];
  for (int t = 0; t < kRowTile; ++t) {
    const v8f cv = v8_set1(corr[t]);
    for (int c = 0; c < NV; ++c) a[t][c] = v8_load(acc + t * Dp + 8 * c) * cv;
  }
  for (int64_t u = 0; u < nruns; ++u) {
    const float* V = runs[u].v + c0;
    const float* pu = p + runs[u].k0;
    for (int64_t k = 0; k < runs[u].n; ++k) {
      v8f vk[NV];
      for (int c = 0; c < NV; ++c) vk[c] = v8_load(V + k * vs + 8 * c);
      for (int t = 0; t < kRowTile; ++t) {
        const v8f pk = v8_set1(pu[t * kKeyBlock + k]);
        for (int c = 0; c < NV; ++c) a[t][c] += pk * vk[c];
      }
    }
  }
  for (int t = 0; t < kRowTile; ++t)
    for (int c = 0; c < NV; ++c) v8_store(acc + t * Dp + 8 * c, a[t][c]);
}

// pv_tile over the whole head dim: groups of 32 dims, then the tail.
inline void pv_rows(float* acc, int64_t Dp, const float* p, const VRun* runs, int64_t nruns, int64_t vs,
                    const float* corr) {
  int64_t c = 0;
  for (; c + 32 <= Dp; c += 32) pv_tile<4>(acc + c, Dp, p, runs, nruns, vs, c, corr);
  switch ((Dp - c) / 8) {
    case 1: pv_tile<1>(acc + c, Dp, p, runs, nruns, vs, c, corr); break;
    case 2: pv_tile<2>(acc + c, Dp, p, runs, nruns, vs, c, corr); break;
    case 3: pv_tile<3>(acc + c, Dp, p, runs, nruns, vs, c, corr); break;
    default: break;
  }
}

#if defined(__AVX2__)
// dst[i * dstride + j] = src[j * sstride + i] for an 8 x 8 block of floats (data movement only).
inline void transpose8x8(const float* src, int64_t sstride, float* dst, int64_t dstride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * sstride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * dstride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dstride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

// One row's online-softmax step over a key block whose invisible keys already score -inf:
// s <- p = exp(s - m_new) (0 for -inf), l = l * corr + sum p (8 lanes, key k in lane k % 8, folded
// at the end), m = m_new; corr = exp(m_old - m_new) for the P V step (1 while nothing is visible).
inline void softmax_block_row(float* s, float& m, float& l, float& corr) {
  const float ninf = -std::numeric_limits<float>::infinity();
  v8f vmax = v8_load(s);
  for (int c = 1; c < 8; ++c) {
    const v8f x = v8_load(s + 8 * c);
    vmax = x > vmax ? x : vmax;
  }
  const float bmax = v8_hmax(vmax);
  const float m_old = m;
  const float m_new = bmax > m_old ? bmax : m_old;
  if (m_new == ninf) {  // nothing visible yet: keep acc and l as they are
    for (int64_t k = 0; k < kKeyBlock; ++k) s[k] = 0.f;
    corr = 1.f;
    return;
  }
  const float c_old = m_old == ninf ? 0.f : std::exp(m_old - m_new);
  const v8f mv = v8_set1(m_new);
  v8f psum = v8_set1(0.f);
  for (int c = 0; c < 8; ++c) {
    const v8f x = v8_load(s + 8 * c);
    v8f p = v8_exp(x - mv);
    p = x == v8_set1(ninf) ? v8_set1(0.f) : p;  // masked keys contribute exactly 0
    psum += p;
    v8_store(s + 8 * c, p);
  }
  l = l * c_old + v8_hsum(psum);
  m = m_new;
  corr = c_old;
}

// Query rows [r_begin, r_end) of the G * N rows (row r = query head h * G + r / N, node r % N)
// of request b, KV head h.
inline void attention_task(const AttentionParams& P, int64_t b, int64_t h, int64_t r_begin, int64_t r_end,
                           AttentionScratch& W) {
  const int64_t G = P.Hq / P.Hkv, N = P.N, D = P.D, R = r_end - r_begin;
  const int64_t Rp = (R + kRowTile - 1) / kRowTile * kRowTile;  // rows padded to the tile (zero rows)
  const int64_t Dp = (D + 7) / 8 * 8;                              // head dim padded to 8 (zero tail)
  const int64_t len = P.lens[b];
  const int64_t total = len + P.Nkv;
  const int64_t qoff = P.Nkv - N;  // new-node index of query 0
  const int64_t es = dtype_size(P.dtype);
  const float ninf = -std::numeric_limits<float>::infinity();
  // q's padding (rows >= R, dims >= D) and the accumulators start at zero. Kt, V and the
  // scores need no clearing: every block writes the keys it uses, the scores of keys past the
  // block's end are set to -inf before the softmax reads them, and V rows past it and the
  // padding dims are never read into an output (the scratch is reused across calls).
  W.q.assign(Rp * Dp, 0.f);
  W.acc.assign(Rp * Dp, 0.f);
  if (W.kt.size() < size_t(Dp * kKeyBlock)) W.kt.resize(Dp * kKeyBlock);
  if (W.v.size() < size_t(kKeyBlock * Dp)) W.v.resize(kKeyBlock * Dp);
  if (W.s.size() < size_t(Rp * kKeyBlock)) W.s.resize(Rp * kKeyBlock);
  if (W.row.size() < size_t(Dp)) W.row.resize(Dp);
  W.m.assign(Rp, ninf);
  W.l.assign(Rp, 0.f);
  W.corr.assign(Rp, 0.f);

  // Query rows r = g * N + i  <->  head h * G + g, node i; pre-scaled.
  const char* qbase = static_cast<const char*>(P.q);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = (r_begin + r) / N, i = (r_begin + r) % N;
    const int64_t off = b * P.q_stride_b + i * P.q_stride_n + (h * G + g) * P.q_stride_h;
    float* dst = W.q.data() + r * Dp;
    load_row(qbase + off * es, P.dtype, D, dst);
    for (int64_t d = 0; d < D; ++d) dst[d] *= P.scale;
  }

  // Causal (no mask): row r sees the keys before len + qoff + i + 1, so a key block at or past the
  // end of every row of a tile is skipped for that tile (a prefill chunk of N queries skips about
  // half its blocks). Skipping is exact: a fully masked block leaves m, l and acc as they are (its
  // scores are -inf, corr = exp(0) = 1, every p = 0), so the results do not change by a bit.
  W.tile_end.assign(Rp / kRowTile, total);
  if (!P.mask) {
    for (int64_t t = 0; t < Rp / kRowTile; ++t) {
      int64_t e = 0;
      for (int64_t r = t * kRowTile; r < std::min(R, (t + 1) * kRowTile); ++r)
        e = std::max<int64_t>(e, len + qoff + (r_begin + r) % N + 1);
      W.tile_end[t] = std::min(total, e);
    }
  }
  // no K / V block is read that none of the task's tiles sees
  const int64_t keys_end = *std::max_element(W.tile_end.begin(), W.tile_end.end());

  // Key s of this (request, KV head): dense rows are D elements apart; paged rows rs = slot_stride
  // apart within a page (Hkv * D for NHD pages, D for HND; the values read are the same either way,
  // so are the results).
  const bool paged = P.block_table != nullptr;
  const int64_t rs = paged ? P.slot_stride : D;
  auto kv_row = [&](const void* cache, int64_t s) -> const char* {
    const char* base = static_cast<const char*>(cache);
    if (!paged) return base + ((b * P.Hkv + h) * P.S + s) * D * es;
    const int64_t page = P.block_table[b * P.max_blocks + s / P.page_size];
    return base + (page * P.page_stride + s % P.page_size * P.slot_stride + h * P.head_stride) * es;
  };
  // key s as column k of a transposed fp32 block kt [D, kKeyBlock]; value s as row k of a block [k, Dp]
  auto put_key = [&](float* kt, int64_t k, int64_t s) {
    load_row(kv_row(P.k_cache, s), P.dtype, D, W.row.data());
    for (int64_t d = 0; d < D; ++d) kt[d * kKeyBlock + k] = W.row[d];
  };
  auto put_value = [&](float* v, int64_t k, int64_t s) { load_row(kv_row(P.v_cache, s), P.dtype, D, v + k * Dp); };

  // A float32 cache with D % 8 == 0 is read in place for V, and its K blocks are transposed in
  // 8 x 8 tiles with AVX2 (the same values: data movement only). Paged: K in place when every run
  // of 8 keys lies in one page, V when the whole key block does, or else in runs of one page each
  // when pages hold at least 16 keys; otherwise (smaller pages, other dtypes) the rows are copied.
  const bool direct = P.dtype == DType::kFloat32 && D == Dp;
  [[maybe_unused]] const bool direct_k = direct && (!paged || P.page_size % 8 == 0);
  const bool direct_v = direct && (!paged || P.page_size % kKeyBlock == 0);
  const bool run_v = direct && !direct_v && P.page_size >= 16;
  const int64_t vs = direct_v || run_v ? rs : Dp;  // V row stride (in place or the scratch's)
  VRun runs[kKeyBlock];
  int64_t nruns = 0;
  // With a tree mask the rows share only the prefix's full key blocks; the rest is each node's own
  // (below), so that a node sees its visible keys at the positions a decode step would.
  const int64_t joint_end = P.mask ? std::min(keys_end, len / kKeyBlock * kKeyBlock) : keys_end;
  // Software prefetch of the K / V rows P.prefetch blocks ahead: a decode step's keys of one KV head
  // (150 keys: ~77 KB of fp32 K and V) come from DRAM after the layer's weights went through the
  // caches, and without it the kernel waits on them (measured: benchmarks/bench_prefetch.py).
  // Values are only requested earlier, so no result bit depends on it.
  const int64_t row_bytes = D * es;
  auto prefetch_row = [&](const char* r) {  // every 64-byte line the row touches, once
    const uintptr_t first = reinterpret_cast<uintptr_t>(r) & ~uintptr_t(63);
    for (uintptr_t a = first; a < reinterpret_cast<uintptr_t>(r) + uintptr_t(row_bytes); a += 64)
      prefetch_line(reinterpret_cast<const char*>(a));
  };
  auto prefetch_block = [&](int64_t s0) {
    for (int64_t s = s0, e = std::min(s0 + kKeyBlock, keys_end); s < e; ++s) {
      prefetch_row(kv_row(P.k_cache, s));
      prefetch_row(kv_row(P.v_cache, s));
    }
  };
  for (int64_t i = 0; i < P.prefetch; ++i) prefetch_block(i * kKeyBlock);
  for (int64_t s0 = 0; s0 < joint_end; s0 += kKeyBlock) {
    if (P.prefetch > 0) prefetch_block(s0 + P.prefetch * kKeyBlock);
    const int64_t nk = std::min(kKeyBlock, total - s0);
    // K block -> transposed fp32 Kt[d, k]; V block -> fp32 V[k, d], keys k < nk (the lanes of
    // the keys past nk hold earlier values: their scores are overwritten with -inf below).
    int64_t k = 0;
#if defined(__AVX2__)
    if (direct_k) {
      for (; k + 8 <= nk; k += 8) {
        const float* kf = reinterpret_cast<const float*>(kv_row(P.k_cache, s0 + k));
        for (int64_t d = 0; d < D; d += 8) transpose8x8(kf + d, rs, W.kt.data() + d * kKeyBlock + k, kKeyBlock);
      }
    }
#endif
    for (; k < nk; ++k) put_key(W.kt.data(), k, s0 + k);
    // V block: fp32 rows in place (one run, or one per page), else copied to the scratch (one run).
    if (run_v) {
      for (nruns = 0, k = 0; k < nk; k += runs[nruns++].n) {
        const int64_t n = std::min(nk - k, P.page_size - (s0 + k) % P.page_size);  // to the page's end
        runs[nruns] = {reinterpret_cast<const float*>(kv_row(P.v_cache, s0 + k)), k, n};
      }
    } else if (direct_v) {
      runs[0] = {reinterpret_cast<const float*>(kv_row(P.v_cache, s0)), 0, nk};
      nruns = 1;
    } else {
      for (k = 0; k < nk; ++k) put_value(W.v.data(), k, s0 + k);
      runs[0] = {W.v.data(), 0, nk};
      nruns = 1;
    }
    // 1) scores of every row against the block
    for (int64_t r0 = 0; r0 < Rp; r0 += kRowTile)
      if (s0 < W.tile_end[r0 / kRowTile]) qk_tile(W.q.data() + r0 * Dp, Dp, W.kt.data(), D, W.s.data() + r0 * kKeyBlock);
    // 2) mask + online softmax per row: s <- p = exp(s - m_new), corr = exp(m_old - m_new)
    const bool touches_tree = s0 + nk > len;
    for (int64_t r = 0; r < Rp; ++r) {
      if (s0 >= W.tile_end[r / kRowTile]) continue;  // the tile sees none of this block
      float* s = W.s.data() + r * kKeyBlock;
      if (r >= R) {  // padding row of the last tile
        for (int64_t k = 0; k < kKeyBlock; ++k) s[k] = 0.f;
        continue;
      }
      const int64_t i = (r_begin + r) % N;
      for (int64_t k = nk; k < kKeyBlock; ++k) s[k] = ninf;
      if (touches_tree) {
        const uint64_t* mrow = P.mask ? P.mask + (b * N + i) * P.W : nullptr;
        for (int64_t k = std::max<int64_t>(0, len - s0); k < nk; ++k) {
          const int64_t j = s0 + k - len;
          const bool visible = mrow ? ((mrow[j >> 6] >> (j & 63)) & 1u) != 0 : j <= qoff + i;
          if (!visible) s[k] = ninf;
        }
      }
      softmax_block_row(s, W.m[r], W.l[r], W.corr[r]);
    }
    // 3) acc = acc * corr + P V
    for (int64_t r0 = 0; r0 < Rp; r0 += kRowTile) {
      if (s0 >= W.tile_end[r0 / kRowTile]) continue;
      float* acc = W.acc.data() + r0 * Dp;
      const float* p = W.s.data() + r0 * kKeyBlock;
      const float* corr = W.corr.data() + r0;
      pv_rows(acc, Dp, p, runs, nruns, vs, corr);
    }
  }

  // Tree nodes (a mask): a node's keys from the last full prefix block on are the prefix's rest, then
  // the new keys it sees in slot order, laid out in blocks of kKeyBlock by that order -- exactly the
  // blocks (lanes, runs and block boundaries) of the decode step whose cache holds the prefix and the
  // node's visible keys, so every node gives its decode step's bits, however its ancestors sit among
  // the other nodes. Block 0 keeps the prefix's rest in its first keys for every node; each node
  // writes its own keys after them (and, past kKeyBlock keys, into a second scratch). The rows of a
  // node (its G query heads) run together in tiles of kRowTile.
  if (P.mask) {
    const int64_t base = len / kKeyBlock * kKeyBlock, shared = len - base;
    for (int64_t k = 0; k < shared; ++k) put_key(W.kt.data(), k, base + k), put_value(W.v.data(), k, base + k);
    if (W.kt2.size() < size_t(Dp * kKeyBlock)) W.kt2.resize(Dp * kKeyBlock);
    if (W.v2.size() < size_t(kKeyBlock * Dp)) W.v2.resize(kKeyBlock * Dp);
    if (W.qt.size() < size_t(kRowTile * Dp)) W.qt.resize(kRowTile * Dp), W.at.resize(kRowTile * Dp);
    if (W.st.size() < size_t(kRowTile * kKeyBlock)) W.st.resize(kRowTile * kKeyBlock);
    float* qtile = W.qt.data();
    float* atile = W.at.data();
    float* st = W.st.data();
    float mt[kRowTile], lt[kRowTile], ct[kRowTile];
    std::vector<int64_t>& rows = W.rows;
    for (int64_t i = 0; i < N; ++i) {
      rows.clear();
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = g * N + i - r_begin;
        if (r >= 0 && r < R) rows.push_back(r);
      }
      const int64_t nr = int64_t(rows.size());
      if (nr == 0) continue;
      const uint64_t* mrow = P.mask + (b * N + i) * P.W;
      W.keys.clear();
      for (int64_t j = 0; j < P.Nkv; ++j)
        if ((mrow[j >> 6] >> (j & 63)) & 1u) W.keys.push_back(len + j);
      const int64_t total_i = shared + int64_t(W.keys.size());
      for (int64_t t0 = 0; t0 < nr; t0 += kRowTile) {
        const int64_t nt = std::min<int64_t>(kRowTile, nr - t0);
        for (int64_t t = 0; t < kRowTile; ++t) {
          float* qd = qtile + t * Dp;
          float* ad = atile + t * Dp;
          if (t < nt) {
            std::copy(W.q.data() + rows[t0 + t] * Dp, W.q.data() + (rows[t0 + t] + 1) * Dp, qd);
            std::copy(W.acc.data() + rows[t0 + t] * Dp, W.acc.data() + (rows[t0 + t] + 1) * Dp, ad);
            mt[t] = W.m[rows[t0 + t]], lt[t] = W.l[rows[t0 + t]];
          } else {
            std::fill(qd, qd + Dp, 0.f), std::fill(ad, ad + Dp, 0.f);
            mt[t] = ninf, lt[t] = 0.f;
          }
        }
        for (int64_t j0 = 0; j0 < total_i; j0 += kKeyBlock) {
          const int64_t nk = std::min(kKeyBlock, total_i - j0);
          float* kt = j0 == 0 ? W.kt.data() : W.kt2.data();
          float* vb = j0 == 0 ? W.v.data() : W.v2.data();
          if (t0 == 0 || j0 > 0)  // the node's own keys of this block (block 0's stay for its next tiles)
            for (int64_t k = j0 == 0 ? shared : 0; k < nk; ++k)
              put_key(kt, k, W.keys[j0 + k - shared]), put_value(vb, k, W.keys[j0 + k - shared]);
          qk_tile(qtile, Dp, kt, D, st);
          for (int64_t t = 0; t < kRowTile; ++t) {
            float* srow = st + t * kKeyBlock;
            for (int64_t k = nk; k < kKeyBlock; ++k) srow[k] = ninf;
            if (t < nt) softmax_block_row(srow, mt[t], lt[t], ct[t]);
            else std::fill(srow, srow + kKeyBlock, 0.f), ct[t] = 0.f;
          }
          const VRun run{vb, 0, nk};
          pv_rows(atile, Dp, st, &run, 1, Dp, ct);
        }
        for (int64_t t = 0; t < nt; ++t) {
          std::copy(atile + t * Dp, atile + (t + 1) * Dp, W.acc.data() + rows[t0 + t] * Dp);
          W.m[rows[t0 + t]] = mt[t], W.l[rows[t0 + t]] = lt[t];
        }
      }
    }
  }

  char* obase = static_cast<char*>(P.out);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = (r_begin + r) / N, i = (r_begin + r) % N;
    float* acc = W.acc.data() + r * Dp;
    const float inv = W.l[r] > 0.f ? 1.f / W.l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
    const int64_t off = ((b * N + i) * P.Hq + h * G + g) * D;
    store_row(acc, P.dtype, D, obase + off * es);
  }
}

// Tasks [begin, end) of attention_tasks(P).
inline void attention_range(const AttentionParams& P, int64_t begin, int64_t end, AttentionScratch& W) {
  const int64_t R = P.Hq / P.Hkv * P.N, c = attention_row_chunk(P), chunks = (R + c - 1) / c;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t bh = t / chunks, r0 = (t % chunks) * c;
    attention_task(P, bh / P.Hkv, bh % P.Hkv, r0, std::min(R, r0 + c), W);
  }
}

}  // namespace SPECDEC_CPU_ISA
}  // namespace cpu
}  // namespace specdec
