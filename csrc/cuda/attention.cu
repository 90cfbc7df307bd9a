// verify_attention / append_kv, CUDA backend.
//
// What it computes: attention of the N queries of each request over its committed KV
// prefix plus the step's Nkv >= N new tree nodes (the queries are the LAST N of them:
// query i is new node Nkv - N + i; Nkv = N, the plain tree form, unless a [B, N, Nkv]
// mask says otherwise -- a dynamic draft tree expands its frontier this way, attending
// to ancestors drafted earlier in the same step). Query i of request b sees every cache
// position < cache_lens[b] (implicitly: no N x (prefix + N) mask is ever built) and
// position cache_lens[b] + j iff tree_mask[b, i, j] (None: j <= Nkv - N + i). fp32
// scores, softmax and accumulation; a query that sees no key outputs zeros.
//
// Design: flash-decoding (Dao et al., "Flash-Decoding for long-context inference",
// 2023) applied to tree verification (SpecInfer, Miao et al. 2024):
//  * one CTA = (request b, KV head h, KV split s, row tile). The G query heads that
//    share KV head h and the N nodes form R = G * N query rows (row r = i * G + g) that
//    read each K/V row once per CTA (GQA packing);
//  * the keys [0, cache_lens[b] + N) are cut into splits: up to 64 rows (B * N, the verify
//    and decode sizes) chunks of `chunk` keys at fixed absolute positions (split s:
//    [s * chunk, (s + 1) * chunk); chunk = 128 keys, doubled while the capacity S needs more
//    than 64 splits: specdec/cuda_plan.h); above (prefill) as many splits as fill the GPU
//    once, each request's keys cut evenly on the device. Each CTA writes its rows' partial
//    output normalised by its own softmax sum plus the log2-sum-exp, and a small combine
//    kernel merges the splits in split order, skipping those a row sees nothing of. With one
//    split the main kernel writes the output directly;
//  * batch invariance (up to 64 rows): nothing in a row's arithmetic depends on B, N, G or the
//    occupancy (the chunks, the key warps wk and their merge order are fixed per dtype, head
//    dim and S; rows are only partitioned over warps and tiles), and keys a row does not see
//    add exact zeros, so a chain verify gives each node the bits of its decode step;
//  * K/V blocks are streamed into shared memory with 16-byte cp.async, double
//    buffered; keys past the chunk (and everything past cache_lens + N, which may hold
//    NaN/inf junk) are zero-filled, never read;
//  * fp16 / bf16: tensor cores (mma.sync m16n8k16, fp32 accumulate; P is rounded to
//    the input dtype for P @ V, as flash-attention does). Warp = 16 query rows. fp32:
//    CUDA cores (tf32 would miss the fp32 tolerance); warp = 8 (D = 256: 4) query rows,
//    lane = key for Q K^T, lane = 4 head dims for P V;
//  * the CTA's warps split the key block (wk warps over keys, each taking fixed key steps of
//    every stage; up to 64 rows always 4 for 16-bit D <= 128, 2 for D = 256, 1 for fp32,
//    above as many as the row warps leave of 4) and cover the rows with the rest (wm warps
//    over rows); the wk partial states are merged through shared memory at the end, in
//    warp order;
//  * the tree mask is bit-packed in shared memory by the CTA prologue (warp ballots over
//    the [B, N, N] bool tensor; ceil(N / 64) words per node row, any N);
//  * online softmax in the log2 domain (scores pre-multiplied by scale * log2(e)).
//
// Napkin math (H200, ~4.3 TB/s): the kernel must read K and V of prefix + N once per
// (request, KV head): B * Hkv * (len + N) * D * 2 * sizeof(dtype) bytes. Llama-3-8B
// layer, B = 1, len = 4096, N = 16, Hkv = 8, D = 128, bf16: 16.8 MB -> ~3.9 us at the
// roofline (R = G * N = 64 rows: 4 row tiles of 16, 33 splits of 128 keys); the split
// partials add splits * B * N * Hq * D * 4 bytes written and read back, mostly from L2
// (8.6 MB here). Row tiles of the same (b, h, split) are adjacent in the grid so that the
// repeated K/V reads of R > 16 (16-bit; the fixed 4 key warps leave one row warp per CTA)
// hit L2. Q K^T + P V cost 4 * R * D FLOP per key:
// at R = 64 that is 64 FLOP / byte of bf16 K/V, well under the tensor-core ridge.
//
// append_kv: a strided 16-byte (or element-wise when unaligned) copy of
// B * Hkv * N * D * sizeof(dtype) bytes per tensor, reading and writing once.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAMacros.h>

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <mutex>

#include "checks.h"
#include "common.cuh"
#include "ops.h"
#include "specdec/cuda_plan.h"

namespace specdec {
namespace cuda {
namespace {

// ---------------------------------------------------------------- compile-time knobs
template <typename T, int D>
struct AttnPolicy {
  // the numbers that fix a row's summation order come from specdec/cuda_plan.h (shared with the tests)
  static constexpr bool kMma = !std::is_same_v<T, float>;         // tensor cores for 16-bit inputs
  static constexpr int kRowsPerWarp = plan::attn_rows_per_warp(kMma, D);
  static constexpr int kBK = plan::attn_key_block(kMma, D);       // keys per pipeline stage
  static constexpr int kSub = plan::attn_key_step(kMma);          // keys per warp step
  static constexpr int kSubs = kBK / kSub;                         // warp steps per stage
  static constexpr int kKeyWarps = plan::attn_key_warps(kMma, D);  // warps over keys (fixed: batch invariance)
  static constexpr int kLd = D + (kMma ? 8 : 4);                   // smem row stride (elements): conflict-free
  static constexpr int kMaxWarps = plan::attn_max_warps;
  static constexpr int kChunks = D * int(sizeof(T)) / 16;          // 16-byte chunks per K/V/Q row
  static constexpr int kElemsPerChunk = 16 / int(sizeof(T));
  static constexpr size_t kKvBytes = size_t(2) * 2 * kBK * kLd * sizeof(T);  // 2 stages x (K, V)
  static constexpr size_t kDumpBytes = size_t(kMaxWarps) * kRowsPerWarp * D * sizeof(float);
  static constexpr size_t kRegionBytes = kKvBytes > kDumpBytes ? kKvBytes : kDumpBytes;
  static_assert(D % 16 == 0, "head dim must be a multiple of 16");
  static_assert(kBK % kSub == 0, "stage must hold whole warp steps");
  static_assert(kSubs % kKeyWarps == 0, "every key warp takes the same steps of a stage");
  static_assert(plan::kAttnChunk % kBK == 0, "a split holds whole stages");
};

__host__ __device__ constexpr size_t round16(size_t x) { return (x + 15) / 16 * 16; }

// Dynamic shared memory layout (byte offsets); identical on host and device.
struct AttnSmem {
  size_t q, mask, m, l, p, total;
};
template <typename T, int D>
__host__ __device__ inline AttnSmem attn_smem(int nwarps, int rows_per_tile, int mask_words) {
  using Pol = AttnPolicy<T, D>;
  AttnSmem s;
  size_t off = round16(Pol::kRegionBytes);  // [stages][K, V][kBK][kLd] T, reused as [warps * RPW][D] fp32
  s.q = off;
  off += round16(size_t(rows_per_tile) * Pol::kLd * sizeof(T));          // [rows_per_tile][kLd] T
  s.mask = off;
  off += round16(size_t(rows_per_tile) * mask_words * sizeof(uint64_t));  // [node rows][W] packed mask
  s.m = off;
  off += round16(size_t(nwarps) * Pol::kRowsPerWarp * sizeof(float));     // running max per warp row
  s.l = off;
  off += round16(size_t(nwarps) * Pol::kRowsPerWarp * sizeof(float));     // running sum per warp row
  s.p = off;
  if (!Pol::kMma) off += round16(size_t(nwarps) * Pol::kRowsPerWarp * 32 * sizeof(float));  // fp32 P
  s.total = off;
  return s;
}

struct AttnParams {
  const void* q;          // [B, N, Hq, D], element strides below, D contiguous, rows 16-byte aligned
  int64_t q_sb, q_sn, q_sh;
  const void* k;          // [B, Hkv, S, D] contiguous
  const void* v;          // [B, Hkv, S, D] contiguous
  const int32_t* lens;    // [B] contiguous
  const uint8_t* mask;    // [B, N, Nkv] bool contiguous, or nullptr = causal chain
  void* out;              // [B, N, Hq, D] contiguous, q's dtype (written when splits == 1)
  float* part_o;          // [splits, B * N * Hq, D] fp32, normalised per split (splits > 1)
  float* part_lse;        // [splits, B * N * Hq] fp32, log2(sum exp2) per split (splits > 1)
  int B, N, Hq, Hkv, S, G, R;  // R = G * N query rows per (request, KV head)
  int Nkv;                // new nodes in the cache (>= N): the queries are the last N of them
  int W;                  // mask words per node row = ceil(Nkv / 64)
  int splits, row_tiles;  // grid = B * Hkv * splits * row_tiles
  int chunk;              // > 0: keys per split at fixed positions [s * chunk, (s + 1) * chunk) (batch-
                          // invariant plan, cuda_plan.h); 0: each request's keys cut into `splits` even
                          // chunks of at least min_chunk keys (the occupancy plan, above 64 rows)
  int min_chunk;          // occupancy plan: fewest keys per split (multiple of the key block)
  int wm, wk;             // warps over rows x warps over keys (wm * wk <= 4; wk fixed per T, D)
  float scale_log2;       // scale * log2(e)
};

// ---------------------------------------------------------------- tensor-core primitives (sm_80+)
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d[16x8] += a[16x16] * b[16x8]; fragments in the PTX ISA m16n8k16 layout.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------- per-warp engines
// Both engines keep, for their rows, the running max m (log2 domain), the running sum
// l and the unnormalised output O, and expose the same interface:
//   init(); load_q(); process(one warp step of keys); dump(state -> shared memory).
// `vis(lr, pos)` says whether tile row lr sees absolute cache position pos; `full`
// means every key of the step is visible to every row (prefix keys), so no mask work.

// fp16 / bf16: warp = 16 rows, step = 16 keys. Lane (g = lane / 4, t = lane % 4) holds
// rows g and g + 8; S / O accumulator columns 2t, 2t + 1 of every 8-wide n-tile.
template <typename T, int D>
struct MmaEngine {
  static constexpr int LD = AttnPolicy<T, D>::kLd;
  static constexpr int KD = D / 16;        // k-steps of Q K^T; pairs of 8-wide n-tiles of P V
  static constexpr bool kQRegs = D <= 128; // Q fragments stay in registers (D = 256: re-read from smem)
  float o[D / 8][4];
  float m[2], l[2];
  uint32_t qf[kQRegs ? KD : 1][4];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    m[0] = m[1] = kNegInf;
    l[0] = l[1] = 0.f;
  }

  // ldmatrix x4 row addresses for a 16 x 16 tile at (row0, col0) of a [.][LD] array:
  // matrices (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15).
  static __device__ __forceinline__ uint32_t addr_rows_then_cols(const T* base, int row0, int lane) {
    return smem_u32(base + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8);
  }
  // Matrices (rows 0-7, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15).
  static __device__ __forceinline__ uint32_t addr_cols_then_rows(const T* base, int row0, int lane) {
    return smem_u32(base + (row0 + (lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8);
  }

  __device__ __forceinline__ void load_q(const T* sQ, int lr0, int lane) {
    if constexpr (kQRegs) {
      const uint32_t addr = addr_rows_then_cols(sQ, lr0, lane);
#pragma unroll
      for (int kd = 0; kd < KD; ++kd) ldmatrix_x4(qf[kd], addr + kd * 32);
    }
  }

  template <class Vis>
  __device__ __forceinline__ void process(const T* sQ,  // [rows][LD]
                                          const T* sK,  // [kBK][LD]
                                          const T* sV,  // [kBK][LD]
                                          float* /*sP: fp32 engine only*/, int lr0, int kb, int pos0,
                                          bool full, const Vis& vis, float sl2, int lane) {
    const int g = lane >> 2, t = lane & 3;
    // S = Q K^T for keys kb .. kb + 15: s[0] keys 0-7, s[1] keys 8-15.
    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    // B operand (k = head dim, n = key) is K row-major in smem: non-transposed ldmatrix.
    const uint32_t k_addr = addr_cols_then_rows(sK, kb, lane);
    if constexpr (kQRegs) {
#pragma unroll
      for (int kd = 0; kd < KD; ++kd) {
        uint32_t bk[4];
        ldmatrix_x4(bk, k_addr + kd * 32);
        mma16816<T>(s[0], qf[kd], bk[0], bk[1]);
        mma16816<T>(s[1], qf[kd], bk[2], bk[3]);
      }
    } else {
      const uint32_t q_addr = addr_rows_then_cols(sQ, lr0, lane);
#pragma unroll
      for (int kd = 0; kd < KD; ++kd) {
        uint32_t a[4], bk[4];
        ldmatrix_x4(a, q_addr + kd * 32);
        ldmatrix_x4(bk, k_addr + kd * 32);
        mma16816<T>(s[0], a, bk[0], bk[1]);
        mma16816<T>(s[1], a, bk[2], bk[3]);
      }
    }

    // Scale, mask, online softmax. s[n][c]: row g + 8 * (c / 2), key kb + 8n + 2t + (c % 2).
    float mx[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float x = s[n][c] * sl2;
        if (!full && !vis(lr0 + g + 8 * (c >> 1), pos0 + 8 * n + 2 * t + (c & 1))) x = kNegInf;
        s[n][c] = x;
        mx[c >> 1] = fmaxf(mx[c >> 1], x);
      }
    }
    float corr[2], base[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(kFullMask, mx[hh], 1));
      mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(kFullMask, mx[hh], 2));
      const float m_new = fmaxf(m[hh], mx[hh]);
      base[hh] = m_new == kNegInf ? 0.f : m_new;  // nothing visible yet: exp2(-inf - 0) = 0
      corr[hh] = exp2f(m[hh] - base[hh]);
      m[hh] = m_new;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float pv = exp2f(s[n][c] - base[c >> 1]);  // masked: exactly 0
        s[n][c] = pv;
        rs[c >> 1] += pv;
      }
    }
    // l is a per-lane partial sum (this lane's key columns); reduced across the quad in dump().
    l[0] = l[0] * corr[0] + rs[0];
    l[1] = l[1] * corr[1] + rs[1];
    if (__any_sync(kFullMask, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
      }
    }

    // O += P V. The S accumulator layout of two n-tiles is the A layout of one k = 16 step.
    uint32_t pa[4];
    pa[0] = pack2<T>(s[0][0], s[0][1]);
    pa[1] = pack2<T>(s[0][2], s[0][3]);
    pa[2] = pack2<T>(s[1][0], s[1][1]);
    pa[3] = pack2<T>(s[1][2], s[1][3]);
    // B operand (k = key, n = head dim) is V row-major in smem: transposed ldmatrix.
    const uint32_t v_addr = addr_rows_then_cols(sV, kb, lane);
#pragma unroll
    for (int nd = 0; nd < KD; ++nd) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, v_addr + nd * 32);
      mma16816<T>(o[2 * nd], pa, bv[0], bv[1]);
      mma16816<T>(o[2 * nd + 1], pa, bv[2], bv[3]);
    }
  }

  // State -> shared memory: sO [16][D] fp32, sM / sL [16] (this warp's rows).
  __device__ __forceinline__ void dump(float* sO, float* sM, float* sL, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<float2*>(sO + g * D + n * 8 + 2 * t) = make_float2(o[n][0], o[n][1]);
      *reinterpret_cast<float2*>(sO + (g + 8) * D + n * 8 + 2 * t) = make_float2(o[n][2], o[n][3]);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      l[hh] += __shfl_xor_sync(kFullMask, l[hh], 1);
      l[hh] += __shfl_xor_sync(kFullMask, l[hh], 2);
    }
    if (t == 0) {
      sM[g] = m[0];
      sM[g + 8] = m[1];
      sL[g] = l[0];
      sL[g + 8] = l[1];
    }
  }
};

// fp32: warp = RPW rows, step = 32 keys. Q K^T: lane = key; P V: lane owns the float4
// columns c = lane + 32 u of the head dim. P goes through a per-warp smem row [RPW][32].
template <int D>
struct SimtEngine {
  static constexpr int LD = AttnPolicy<float, D>::kLd;
  static constexpr int RPW = AttnPolicy<float, D>::kRowsPerWarp;
  static constexpr int C4 = D / 4;
  static constexpr int U = (C4 + 31) / 32;
  float4 o[RPW][U];
  float m[RPW], l[RPW];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
#pragma unroll
      for (int u = 0; u < U; ++u) o[r][u] = make_float4(0.f, 0.f, 0.f, 0.f);
      m[r] = kNegInf;
      l[r] = 0.f;
    }
  }
  __device__ __forceinline__ void load_q(const float*, int, int) {}

  template <class Vis>
  __device__ __forceinline__ void process(const float* sQ,  // [rows][LD]
                                          const float* sK,  // [kBK][LD]
                                          const float* sV,  // [kBK][LD]
                                          float* sP,        // [RPW][32] this warp's
                                          int lr0, int kb, int pos0, bool full, const Vis& vis, float sl2,
                                          int lane) {
    float s[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) s[r] = 0.f;
    const float* krow = sK + (kb + lane) * LD;
#pragma unroll 4
    for (int d = 0; d < D; d += 4) {
      const float4 kv = *reinterpret_cast<const float4*>(krow + d);  // conflict-free: LD = D + 4
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const float4 qv = *reinterpret_cast<const float4*>(sQ + (lr0 + r) * LD + d);  // broadcast
        s[r] = fmaf(qv.x, kv.x, s[r]);
        s[r] = fmaf(qv.y, kv.y, s[r]);
        s[r] = fmaf(qv.z, kv.z, s[r]);
        s[r] = fmaf(qv.w, kv.w, s[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      float x = s[r] * sl2;
      if (!full && !vis(lr0 + r, pos0 + lane)) x = kNegInf;
      const float m_new = fmaxf(m[r], warp_max(x));  // warp-uniform
      const float base = m_new == kNegInf ? 0.f : m_new;
      const float corr = exp2f(m[r] - base);
      m[r] = m_new;
      const float pv = exp2f(x - base);
      l[r] = l[r] * corr + pv;  // per-lane partial (this lane's keys), reduced in dump()
      if (corr != 1.f) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          o[r][u].x *= corr;
          o[r][u].y *= corr;
          o[r][u].z *= corr;
          o[r][u].w *= corr;
        }
      }
      sP[r * 32 + lane] = pv;
    }
    __syncwarp();
#pragma unroll 1
    for (int j = 0; j < 32; j += 4) {
      float4 pj[RPW];
#pragma unroll
      for (int r = 0; r < RPW; ++r) pj[r] = *reinterpret_cast<const float4*>(sP + r * 32 + j);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int c = lane + 32 * u;
          if (c < C4) {
            const float4 vv = *reinterpret_cast<const float4*>(sV + (kb + j + jj) * LD + 4 * c);
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
              const float w = jj == 0 ? pj[r].x : jj == 1 ? pj[r].y : jj == 2 ? pj[r].z : pj[r].w;
              o[r][u].x = fmaf(w, vv.x, o[r][u].x);
              o[r][u].y = fmaf(w, vv.y, o[r][u].y);
              o[r][u].z = fmaf(w, vv.z, o[r][u].z);
              o[r][u].w = fmaf(w, vv.w, o[r][u].w);
            }
          }
        }
      }
    }
    __syncwarp();  // sP is rewritten by the next step
  }

  __device__ __forceinline__ void dump(float* sO, float* sM, float* sL, int lane) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = lane + 32 * u;
        if (c < C4) *reinterpret_cast<float4*>(sO + r * D + 4 * c) = o[r][u];
      }
      const float lr = warp_sum(l[r]);
      if (lane == 0) {
        sM[r] = m[r];
        sL[r] = lr;
      }
    }
  }
};

template <typename T, int D>
using EngineFor = std::conditional_t<AttnPolicy<T, D>::kMma, MmaEngine<T, D>, SimtEngine<D>>;

// ---------------------------------------------------------------- main kernel
template <typename T, int D>
__global__ void __launch_bounds__(128) verify_attention_kernel(const AttnParams p) {
  using Pol = AttnPolicy<T, D>;
  constexpr int RPW = Pol::kRowsPerWarp, BK = Pol::kBK, SUB = Pol::kSub, LD = Pol::kLd;
  constexpr int CPR = Pol::kChunks, EPC = Pol::kElemsPerChunk;
  extern __shared__ __align__(16) unsigned char smem[];

  const int wm = p.wm, wk = p.wk, nwarps = wm * wk, nthreads = nwarps * 32;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int RT = wm * RPW;  // query rows per tile
  const int G = p.G, N = p.N;

  // Row tile fastest: the tiles of one (b, h, split) run together and share K/V in L2.
  int64_t bid = blockIdx.x;
  const int rt = int(bid % p.row_tiles);
  bid /= p.row_tiles;
  const int split = int(bid % p.splits);
  bid /= p.splits;
  const int h = int(bid % p.Hkv);
  const int b = int(bid / p.Hkv);
  const int row0 = rt * RT;
  const int64_t rows_all = int64_t(p.B) * N * p.Hq;

  // Unchecked lengths (strict checks off) are clamped so that no read leaves the cache.
  const int Nkv = p.Nkv, qoff = Nkv - N;  // query i is new node qoff + i
  const int len = max(0, min(p.lens[b], p.S - Nkv));
  const int total = len + Nkv;  // keys [0, total): prefix then the Nkv new nodes
  // Batch invariance: the split's keys sit at fixed absolute positions (p.chunk depends on the
  // dtype, the head dim and the capacity S only), so a row's partials do not depend on B, N or G.
  // The occupancy plan (p.chunk == 0, more than 64 rows) cuts this request's keys evenly instead.
  const int64_t even = ceil_div(ceil_div(total, p.splits), BK) * BK;
  const int64_t chunk = p.chunk > 0 ? int64_t(p.chunk) : (even > p.min_chunk ? even : int64_t(p.min_chunk));
  const int64_t kbeg64 = int64_t(split) * chunk;
  if (kbeg64 >= total) {  // empty split (short request): contributes nothing to the combine
    for (int lr = tid; lr < RT; lr += nthreads) {
      const int r = row0 + lr;
      if (r < p.R) {
        const int i = r / G, g = r - i * G;
        p.part_lse[int64_t(split) * rows_all + (int64_t(b) * N + i) * p.Hq + h * G + g] = kNegInf;
      }
    }
    return;
  }
  const int kbeg = int(kbeg64);
  const int kend = int(kbeg64 + chunk < total ? kbeg64 + chunk : int64_t(total));

  const AttnSmem lay = attn_smem<T, D>(nwarps, RT, p.mask != nullptr ? p.W : 0);
  T* sKV = reinterpret_cast<T*>(smem);       // [2 stages][K, V][BK][LD]
  float* sO = reinterpret_cast<float*>(smem);  // after the key loop: [nwarps * RPW][D]
  T* sQ = reinterpret_cast<T*>(smem + lay.q);
  uint64_t* sMask = reinterpret_cast<uint64_t*>(smem + lay.mask);
  float* sM = reinterpret_cast<float*>(smem + lay.m);
  float* sL = reinterpret_cast<float*>(smem + lay.l);
  float* sP = reinterpret_cast<float*>(smem + lay.p) + warp * RPW * 32;  // fp32 engine only

  // Prologue 1: Q tile (its own cp.async group). Rows past R are zero.
  const T* qg = static_cast<const T*>(p.q);
  for (int x = tid; x < RT * CPR; x += nthreads) {
    const int lr = x / CPR, c = x - lr * CPR, r = row0 + lr;
    T* dst = sQ + lr * LD + c * EPC;
    if (r < p.R) {
      const int i = r / G, g = r - i * G;
      cp_async16(dst, qg + b * p.q_sb + i * p.q_sn + (h * G + g) * p.q_sh + c * EPC);
    } else {
      zero16(dst);
    }
  }
  cp_async_commit();

  // Prologue 2: bit-pack the mask rows of the nodes this tile covers (warp ballots).
  const int i_lo = row0 / G;
  const int i_hi = min(N - 1, (row0 + RT - 1) / G);
  const int W = p.W;
  if (p.mask != nullptr) {
    const int pairs = (i_hi - i_lo + 1) * W;
    for (int pr = warp; pr < pairs; pr += nwarps) {  // warp-uniform loop
      const int ni = pr / W, w = pr - ni * W;
      const uint8_t* mrow = p.mask + (int64_t(b) * N + i_lo + ni) * Nkv;
      const int j0 = w * 64 + lane, j1 = j0 + 32;
      const unsigned lo = __ballot_sync(kFullMask, j0 < Nkv && mrow[j0] != 0);
      const unsigned hi = __ballot_sync(kFullMask, j1 < Nkv && mrow[j1] != 0);
      if (lane == 0) sMask[pr] = uint64_t(lo) | (uint64_t(hi) << 32);
    }
  }

  // K/V stages: keys [kbeg + st * BK, + BK) into buffer st & 1; keys >= kend zero-filled.
  const int64_t kv_off = (int64_t(b) * p.Hkv + h) * p.S * D;
  const T* kg = static_cast<const T*>(p.k) + kv_off;
  const T* vg = static_cast<const T*>(p.v) + kv_off;
  const int nblk = int(ceil_div(kend - kbeg, BK));
  auto load_stage = [&](int st) {
    T* sK = sKV + (st & 1) * 2 * BK * LD;
    T* sV = sK + BK * LD;
    const int pos0 = kbeg + st * BK;
    for (int x = tid; x < BK * CPR; x += nthreads) {
      const int kk = x / CPR, c = x - kk * CPR, pos = pos0 + kk;
      if (pos < kend) {
        cp_async16(sK + kk * LD + c * EPC, kg + int64_t(pos) * D + c * EPC);
        cp_async16(sV + kk * LD + c * EPC, vg + int64_t(pos) * D + c * EPC);
      } else {
        zero16(sK + kk * LD + c * EPC);
        zero16(sV + kk * LD + c * EPC);
      }
    }
    cp_async_commit();
  };

  const bool has_mask = p.mask != nullptr;
  // Does tile row lr see cache position pos (kbeg <= pos)? Prefix: always; tree node j = pos - len:
  // mask bit (or j <= qoff + i); past the chunk: never. Padding rows (r >= R) reuse the last node's row.
  auto vis = [&](int lr, int pos) -> bool {
    if (pos >= kend) return false;
    if (pos < len) return true;
    const int i = min((row0 + lr) / G, N - 1);
    const int j = pos - len;
    if (has_mask) return ((sMask[(i - i_lo) * W + (j >> 6)] >> (j & 63)) & 1u) != 0;
    return j <= qoff + i;
  };

  EngineFor<T, D> eng;
  eng.init();
  const int mt = warp % wm, ks = warp / wm;
  const int lr0 = mt * RPW;
  const int steps = Pol::kSubs / wk;  // warp steps per stage for this warp
  const int sb0 = ks * steps;
  const int full_end = min(len, kend);

  load_stage(0);
  for (int st = 0; st < nblk; ++st) {
    if (st + 1 < nblk) {
      load_stage(st + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (st == 0) eng.load_q(sQ, lr0, lane);
    const T* sK = sKV + (st & 1) * 2 * BK * LD;
    const T* sV = sK + BK * LD;
    const int pos0 = kbeg + st * BK;
    for (int sb = sb0; sb < sb0 + steps; ++sb) {
      const int kb = sb * SUB, kpos = pos0 + kb;
      if (kpos >= kend) break;  // the rest of the stage is past the chunk
      eng.process(sQ, sK, sV, sP, lr0, kb, kpos, kpos + SUB <= full_end, vis, p.scale_log2, lane);
    }
    __syncthreads();  // the buffer is refilled by the next iteration's prefetch
  }

  // Merge the wk key-splitting warps of each row group, normalise, write.
  eng.dump(sO + warp * RPW * D, sM + warp * RPW, sL + warp * RPW, lane);
  __syncthreads();
  constexpr int C4 = D / 4;
  for (int x = tid; x < RT * C4; x += nthreads) {
    const int lr = x / C4, c = x - lr * C4, r = row0 + lr;
    if (r >= p.R) break;  // rows only grow with x
    const int mrow = lr / RPW, rr = lr - mrow * RPW;
    float M = kNegInf;
    for (int k = 0; k < wk; ++k) M = fmaxf(M, sM[(k * wm + mrow) * RPW + rr]);
    float Lsum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (M != kNegInf) {
      for (int k = 0; k < wk; ++k) {
        const int wr = (k * wm + mrow) * RPW + rr;
        const float mk = sM[wr];
        if (mk == kNegInf) continue;
        const float f = exp2f(mk - M);
        Lsum += f * sL[wr];
        const float4 ov = *reinterpret_cast<const float4*>(sO + wr * D + 4 * c);
        acc.x += f * ov.x;
        acc.y += f * ov.y;
        acc.z += f * ov.z;
        acc.w += f * ov.w;
      }
    }
    const float inv = Lsum > 0.f ? 1.f / Lsum : 0.f;  // a row that saw nothing: zeros
    acc.x *= inv;
    acc.y *= inv;
    acc.z *= inv;
    acc.w *= inv;
    const int i = r / G, g = r - i * G;
    const int64_t orow = (int64_t(b) * N + i) * p.Hq + h * G + g;
    if (p.splits == 1) {
      store4(static_cast<T*>(p.out) + orow * D + 4 * c, acc);
    } else {
      const int64_t prow = int64_t(split) * rows_all + orow;
      store4(p.part_o + prow * D + 4 * c, acc);
      if (c == 0) p.part_lse[prow] = Lsum > 0.f ? M + log2f(Lsum) : kNegInf;
    }
  }
}

// Merge the split partials of each output row: out = sum_s w_s O_s / sum_s w_s with
// w_s = 2^(lse_s - max lse). Block = (D / 4, rows per block); one float4 per thread.
template <typename T>
__global__ void attention_combine_kernel(const float* __restrict__ part_o,    // [splits, rows, D]
                                         const float* __restrict__ part_lse,  // [splits, rows]
                                         T* __restrict__ out,                 // [rows, D]
                                         int splits, int64_t rows, int D) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const int c = threadIdx.x;  // float4 column
  float M = kNegInf;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, part_lse[s * rows + row]);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  if (M != kNegInf) {
    for (int s = 0; s < splits; ++s) {
      const float ls = part_lse[s * rows + row];
      if (ls == kNegInf) continue;  // empty split or nothing visible there: O_s is not even written
      const float w = exp2f(ls - M);
      wsum += w;
      const float4 o = *reinterpret_cast<const float4*>(part_o + (s * rows + row) * D + 4 * c);
      acc.x += w * o.x;
      acc.y += w * o.y;
      acc.z += w * o.z;
      acc.w += w * o.w;
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  acc.x *= inv;
  acc.y *= inv;
  acc.z *= inv;
  acc.w *= inv;
  store4(out + row * D + 4 * c, acc);
}

// The dynamic shared memory a launch of verify_attention_kernel<T, D> may use on the current device.
// cudaFuncSetAttribute(MaxDynamicSharedMemorySize) is per (kernel, device), not per launch: setting it
// before each launch to that launch's size (which grows with the mask words, i.e. with N) would race
// between host threads -- a thread that lowers the limit between another thread's set and launch makes
// that launch fail. So the limit is raised ONCE per (instantiation, device) to the largest size any
// launch can ask for: the device's opt-in maximum less the kernel's static shared memory (none today).
// Larger layouts are refused by the caller with a clear error. A launch reserves only the bytes it
// asks for, so the high limit costs no occupancy.
template <typename T, int D>
size_t verify_attention_smem_limit() {
  static std::once_flag once[C10_COMPILE_TIME_MAX_GPUS];
  static size_t limit[C10_COMPILE_TIME_MAX_GPUS];
  const int dev = int(c10::cuda::current_device());
  TORCH_CHECK(dev >= 0 && dev < C10_COMPILE_TIME_MAX_GPUS, "verify_attention: device index ", dev,
              " out of range");
  std::call_once(once[dev], [dev] {  // a throw leaves the flag unset: the next call retries
    auto kernel = verify_attention_kernel<T, D>;
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(c10::DeviceIndex(dev));
    const size_t optin = prop->sharedMemPerBlockOptin;
    const size_t dyn = optin > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dyn)));
    limit[dev] = dyn;
  });
  return limit[dev];
}

template <typename T, int D>
void launch_verify_attention(AttnParams p, const at::Tensor& out, cudaStream_t stream) {
  using Pol = AttnPolicy<T, D>;
  // The plan (specdec/cuda_plan.h). Up to 64 rows (B * N, the verify and decode sizes): key warps
  // fixed per (T, D), splits of a fixed chunk of keys at fixed positions, chunk from the capacity S
  // only -- never from B, N, G or the occupancy, so each row gets the same bits whatever else the
  // launch holds (the cost: more than 16 query rows per (request, KV head) take more row tiles,
  // re-reading K / V from L2, instead of more row warps per CTA). Above: the occupancy plan.
  const plan::AttnPlan pl = plan::attention_plan(Pol::kMma, D, p.S, p.R, int64_t(p.B) * p.N);
  TORCH_CHECK(pl.wm >= 1 && pl.wk >= 1 && pl.wm * pl.wk <= Pol::kMaxWarps && Pol::kSubs % pl.wk == 0 &&
                  (!pl.invariant || (pl.wk == Pol::kKeyWarps && pl.chunk % Pol::kBK == 0 &&
                                     pl.chunk <= std::numeric_limits<int>::max())),
              "verify_attention: internal error: bad launch plan");
  p.wm = pl.wm;
  p.wk = pl.wk;
  p.row_tiles = pl.row_tiles;
  p.chunk = pl.invariant ? int(pl.chunk) : 0;
  p.min_chunk = int(pl.min_chunk);
  const int threads = p.wm * p.wk * 32;
  const AttnSmem lay = attn_smem<T, D>(p.wm * p.wk, pl.rows_per_tile, p.mask != nullptr ? p.W : 0);
  const size_t smem_limit = verify_attention_smem_limit<T, D>();
  TORCH_CHECK(lay.total <= smem_limit, "verify_attention: N = ", p.N, " tree nodes need ", lay.total,
              " bytes of shared memory per block on CUDA (the bit-packed mask rows), more than the device's ",
              smem_limit);
  auto kernel = verify_attention_kernel<T, D>;
  const int64_t base = int64_t(p.B) * p.Hkv * p.row_tiles;
  if (pl.invariant) {
    p.splits = int(pl.splits);
  } else {
    // Split the keys until the grid fills the GPU once (one wave at the achievable occupancy). Each
    // split writes rows_per_tile * D fp32 partials that the combine reads back (mostly from L2):
    // min_chunk keeps this traffic at most half of the K/V bytes it reads.
    int per_sm = 1;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, lay.total));
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int64_t target = int64_t(std::max(per_sm, 1)) * sms;
    int64_t splits = base >= target ? 1 : ceil_div(target, base);
    splits = std::min<int64_t>({splits, ceil_div(p.S, p.min_chunk), 64});
    p.splits = int(std::max<int64_t>(splits, 1));
  }

  const int64_t rows = int64_t(p.B) * p.N * p.Hq;
  at::Tensor part_o, part_lse;
  if (p.splits > 1) {
    auto fopts = out.options().dtype(at::kFloat);
    part_o = at::empty({p.splits, rows, D}, fopts);
    part_lse = at::empty({p.splits, rows}, fopts);
    p.part_o = part_o.data_ptr<float>();
    p.part_lse = part_lse.data_ptr<float>();
  }
  const int64_t grid = base * p.splits;
  TORCH_CHECK(grid <= std::numeric_limits<int32_t>::max(), "verify_attention: grid of ", grid,
              " blocks is too large (B * Hkv * row tiles * splits)");
  kernel<<<unsigned(grid), threads, lay.total, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.splits > 1) {
    const int cols = D / 4;
    const int rows_per_block = std::max(1, 128 / cols);
    const dim3 block(cols, rows_per_block);
    attention_combine_kernel<T><<<unsigned(ceil_div(rows, rows_per_block)), block, 0, stream>>>(
        p.part_o, p.part_lse, static_cast<T*>(p.out), p.splits, rows, D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// q with D contiguous and 16-byte aligned rows (for cp.async); strides of size-1 dims are irrelevant.
bool q_rows_aligned(const at::Tensor& q) {
  if (q.stride(3) != 1 || !aligned16(q.data_ptr())) return false;
  const int64_t es = q.element_size();
  for (int d = 0; d < 3; ++d) {
    if (q.size(d) > 1 && (q.stride(d) * es) % 16 != 0) return false;
  }
  return true;
}

// ---------------------------------------------------------------- append_kv
// One thread per VT-sized chunk of one new row: cache[b, h, len_b + offset + j, :] = new[b, h, j, :].
template <typename VT>
__global__ void append_kv_kernel(char* __restrict__ k_cache,        // [B, H, S, D] contiguous
                                 char* __restrict__ v_cache,        // [B, H, S, D] contiguous
                                 const char* __restrict__ k_new,    // [B, H, N, D], byte strides below
                                 const char* __restrict__ v_new,    // [B, H, N, D], byte strides below
                                 const int32_t* __restrict__ lens,  // [B]
                                 int64_t kb_s, int64_t kh_s, int64_t kn_s, int64_t vb_s, int64_t vh_s,
                                 int64_t vn_s, int B, int H, int S, int N, int64_t offset, int64_t row_bytes) {
  const int64_t chunks = row_bytes / int64_t(sizeof(VT));
  const int64_t total = int64_t(B) * H * N * chunks;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = idx % chunks;
    int64_t rest = idx / chunks;
    const int j = int(rest % N);
    rest /= N;
    const int h = int(rest % H);
    const int b = int(rest / H);
    // int64: with strict checks off cache_lens[b] may be anything up to 2^31 - 1, and an int32
    // cache_lens[b] + offset would wrap negative, pass the guard and write before the cache.
    const int64_t len = int64_t(lens[b]) + offset;
    if (lens[b] < 0 || len > int64_t(S) - N) continue;  // unchecked bad length: write nothing, not out of bounds
    const int64_t dst = ((int64_t(b) * H + h) * S + len + j) * row_bytes + c * int64_t(sizeof(VT));
    const int64_t off = c * int64_t(sizeof(VT));
    *reinterpret_cast<VT*>(k_cache + dst) =
        *reinterpret_cast<const VT*>(k_new + b * kb_s + h * kh_s + j * kn_s + off);
    *reinterpret_cast<VT*>(v_cache + dst) =
        *reinterpret_cast<const VT*>(v_new + b * vb_s + h * vh_s + j * vn_s + off);
  }
}

}  // namespace
}  // namespace cuda

// ---------------------------------------------------------------- host entry points
at::Tensor verify_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in,
                                 const at::Tensor& cache_lens, const std::optional<at::Tensor>& tree_mask,
                                 double scale) {
  checks::verify_attention(q_in, k_cache_in, v_cache_in, cache_lens, tree_mask, scale);
  const int64_t B = q_in.size(0), N = q_in.size(1), Hq = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_cache_in.size(1), S = k_cache_in.size(2);
  TORCH_CHECK(D == 64 || D == 80 || D == 96 || D == 128 || D == 256,
              "verify_attention: head dim D must be one of 64, 80, 96, 128, 256 on CUDA, got ", D);
  const int64_t Nkv = tree_mask.has_value() ? tree_mask->size(2) : N;
  TORCH_CHECK(S + Nkv < std::numeric_limits<int32_t>::max() / 2 && B < std::numeric_limits<int32_t>::max() &&
                  Hq * N < std::numeric_limits<int32_t>::max(),
              "verify_attention: sizes too large for the CUDA kernel (B = ", B, ", N = ", N, ", Hq = ", Hq,
              ", S = ", S, ")");
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  at::Tensor out = at::empty({B, N, Hq, D}, q_in.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;

  // HF passes q as a transposed view: any strides with D contiguous and 16-byte aligned rows
  // are read in place; anything else is copied once.
  at::Tensor q = q_in;
  if (!cuda::q_rows_aligned(q)) q = q_in.contiguous();
  if (!cuda::q_rows_aligned(q)) q = q_in.clone(at::MemoryFormat::Contiguous);
  // Caches are contiguous (checked); a view at an odd element offset is not 16-byte aligned,
  // which cp.async needs: copy (read-only here, so correctness is kept; slow, rare).
  const at::Tensor k_cache = cuda::aligned16(k_cache_in.data_ptr()) ? k_cache_in : k_cache_in.clone();
  const at::Tensor v_cache = cuda::aligned16(v_cache_in.data_ptr()) ? v_cache_in : v_cache_in.clone();
  const at::Tensor lens = cache_lens.contiguous();
  at::Tensor mask;
  if (tree_mask.has_value()) mask = tree_mask->contiguous();

  cuda::AttnParams p{};
  p.q = q.data_ptr();
  p.q_sb = q.stride(0);
  p.q_sn = q.stride(1);
  p.q_sh = q.stride(2);
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.lens = lens.data_ptr<int32_t>();
  p.mask = mask.defined() ? reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()) : nullptr;
  p.out = out.data_ptr();
  p.part_o = nullptr;
  p.part_lse = nullptr;
  p.B = int(B);
  p.N = int(N);
  p.Hq = int(Hq);
  p.Hkv = int(Hkv);
  p.S = int(S);
  p.G = int(Hq / Hkv);
  p.R = int(p.G * N);
  p.Nkv = int(Nkv);
  p.W = int(cuda::ceil_div(Nkv, 64));
  p.scale_log2 = float(scale * 1.4426950408889634);  // log2(e)
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  SPECDEC_DISPATCH_FLOAT(q.scalar_type(), "verify_attention", T, [&] {
    SPECDEC_DISPATCH_HEAD_DIM(int(D), "verify_attention", kD, [&] {
      cuda::launch_verify_attention<T, kD>(p, out, stream);
    });
  });
  return out;
}

void append_kv_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k_new_in, const at::Tensor& v_new_in,
                    const at::Tensor& cache_lens, int64_t offset) {
  checks::append_kv(k_cache, v_cache, k_new_in, v_new_in, cache_lens, offset);
  const c10::cuda::CUDAGuard device_guard(k_cache.device());
  const int64_t B = k_cache.size(0), H = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  const int64_t N = k_new_in.size(2);
  if (B == 0 || H == 0 || D == 0) return;
  TORCH_CHECK(S + N < std::numeric_limits<int32_t>::max() && B < std::numeric_limits<int32_t>::max() &&
                  H < std::numeric_limits<int32_t>::max(),
              "append_kv: sizes too large for the CUDA kernel (B = ", B, ", Hkv = ", H, ", S = ", S, ")");
  // HF gives k_new / v_new as transposed views: any strides with D contiguous are read in place.
  const at::Tensor k_new = k_new_in.stride(3) == 1 ? k_new_in : k_new_in.contiguous();
  const at::Tensor v_new = v_new_in.stride(3) == 1 ? v_new_in : v_new_in.contiguous();
  const at::Tensor lens = cache_lens.contiguous();
  const int64_t es = k_cache.element_size();
  const int64_t row_bytes = D * es;

  // Widest chunk that every pointer, byte stride and the row size allow: 16, 4 or 2 bytes.
  auto all_divisible = [&](int64_t a) {
    bool ok = row_bytes % a == 0;
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_cache, &v_cache, &k_new, &v_new}) {
      ok = ok && reinterpret_cast<uintptr_t>(t->data_ptr()) % a == 0;
    }
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_new, &v_new}) {
      for (int d = 0; d < 3; ++d) ok = ok && (t->stride(d) * es) % a == 0;
    }
    return ok;
  };
  const int vec = all_divisible(16) ? 16 : all_divisible(4) ? 4 : 2;
  const int64_t total = B * H * N * (row_bytes / vec);
  if (total == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>(cuda::ceil_div(total, threads), int64_t(1) << 20);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto vt_tag) {
    using VT = decltype(vt_tag);
    cuda::append_kv_kernel<VT><<<unsigned(blocks), threads, 0, stream>>>(
        static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr()),
        static_cast<const char*>(k_new.data_ptr()), static_cast<const char*>(v_new.data_ptr()),
        lens.data_ptr<int32_t>(), k_new.stride(0) * es, k_new.stride(1) * es, k_new.stride(2) * es,
        v_new.stride(0) * es, v_new.stride(1) * es, v_new.stride(2) * es, int(B), int(H), int(S), int(N),
        offset, row_bytes);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (vec == 16) launch(uint4{});
  else if (vec == 4) launch(uint32_t{});
  else launch(uint16_t{});
}

}  // namespace specdec
