// rejection_sample / greedy_verify, CUDA backend.
//
// What it computes: the accepted root path of every request's token tree and the one
// extra token drawn (or argmax'ed) after it.
// Semantics are specdec/reference.py's and csrc/include/specdec/tree_walk.h's, step for
// step, and the arithmetic is csrc/include/specdec/sampling_fixed.h, shared with the CPU:
//  * children of a node = nodes c > node with parents[c] == node, tried in index order
//    (a block-wide "first match after c" search, no children lists);
//  * a node's target row becomes integer masses m (fixed point relative to the row's
//    largest entry, fixed::quantize) with Z = sum(m): integer sums, so block reductions and
//    scans in any order give the CPU's exact values;
//  * sampled drafts: child c with token x is accepted iff q_c(x) > 0 and
//    (u_c * q_c(x)) * double(Z) < double(m(x)); after a rejection
//    m <- max(0, m - floor(double(Z) * q_c)) (deterministic drafts: m[x] = 0) — SpecInfer's
//    multi-step speculative sampling (Miao et al. 2024), which is Leviathan et al. 2023 /
//    Chen et al. 2023 speculative sampling on a chain;
//  * when no child is accepted, one token is drawn by inverse CDF with u_0: the first index
//    whose inclusive prefix sum of m exceeds fixed::draw_threshold(Z, u_0) (u_0 >= 1: the
//    last index with mass); a residual of zero mass falls back to the node's own target
//    row, then to token 0.
//  * greedy: the first maximal index of the node's logits (NaN counts as maximal, the
//    first NaN wins: torch.argmax); the child whose token equals it is accepted.
//
// Design: one CTA of 512 threads per request walks its tree; every pass over a
// vocabulary row is a block-strided loop of 4 consecutive elements per thread (one
// 16-byte load when the row is 16-byte aligned, scalar loads otherwise, e.g. odd V).
// The residual is never normalised and is materialised lazily:
//   level 0  m = quantize(p_node) (a max pass for the row's exponent, then the mass pass);
//   level 1  after the first rejection, m = max(0, quantize(p_node) - floor(Z0 * q_c1)) (or
//            p_node's masses with x_1 zeroed) is recomputed on the fly from p and q_c1
//            wherever it is read — a chain never writes anything;
//   level 2  after a second rejection at the same node, m is written once into an int64
//            scratch row of this request ([B, roundup(V, 4)] from the caching allocator)
//            and updated in place by further rejections.
//
// Napkin math: each visited node reads its target row twice (max, then mass: V * 8 bytes);
// each rejection adds one pass over p and q_c (V * 8 bytes, plus 16 bytes per element at
// level 2); the final draw reads the current residual once, stopping at the crossing
// (half a row on average). B = 8, N = 16, V = 128256, 4 nodes visited: ~2.5 MB per request,
// read by one SM each (~100-200 GB/s per SM): ~15-25 us, far below a target forward.
// greedy_verify: one pass of V * sizeof(dtype) per visited node.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <climits>
#include <limits>
#include <type_traits>

#include "checks.h"
#include "common.cuh"
#include "ops.h"
#include "specdec/sampling_fixed.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 4;  // consecutive elements per thread per pass step

// ---------------------------------------------------------------- block reductions
// Every thread returns the same value, so all threads of the block take the same
// branches. Two barriers: the scratch array may be reused at once. Integer sums: exact.
__device__ __forceinline__ int64_t block_sum(int64_t v, int64_t* s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, (long long)v, o);
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  int64_t t = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t += s[w];
  __syncthreads();
  return t;
}

// Maximum of one float per thread (fmaxf ignores NaN; every lane gets the same value).
__device__ __forceinline__ float block_fmax(float v, float* s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t = fmaxf(t, s[w]);
  __syncthreads();
  return t;
}

__device__ __forceinline__ int block_min(int v, int* s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFullMask, v, o));
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  int t = INT_MAX;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t = min(t, s[w]);
  __syncthreads();
  return t;
}

// Exclusive prefix sum of one int64 per thread (thread order) and the block total.
__device__ __forceinline__ void block_scan(int64_t v, int64_t& excl, int64_t& total, int64_t* s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  long long x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x += y;
  }
  long long ex = __shfl_up_sync(kFullMask, x, 1);
  if (lane == 0) ex = 0;
  if (lane == 31) s[warp] = x;
  __syncthreads();
  int64_t wpre = 0, tot = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int64_t sw = s[w];
    if (w < warp) wpre += sw;
    tot += sw;
  }
  __syncthreads();
  excl = wpre + ex;
  total = tot;
}

// First c in (after, N) with parents[c] == node (a child of node, index order), or -1.
// parents[c] == node with node < c is always a valid parent, so bad values are skipped.
__device__ __forceinline__ int next_child(const int32_t* __restrict__ par, int N, int node, int after, int* s) {
  int best = INT_MAX;
  for (int c = after + 1 + int(threadIdx.x); c < N; c += kThreads) {
    if (par[c] == node) {
      best = c;
      break;
    }
  }
  best = block_min(best, s);
  return best == INT_MAX ? -1 : best;
}

__device__ __forceinline__ bool row_aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// x[k] = row[i + k] (0 past V). One 16-byte load when the row is 16-byte aligned.
__device__ __forceinline__ void load4(const float* __restrict__ row, int i, int V, bool vec, float (&x)[kVec]) {
  if (vec && i + kVec <= V) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(row + i));
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) x[k] = i + k < V ? __ldg(row + i + k) : 0.f;
  }
}

// ---------------------------------------------------------------- the residual masses m of the current node
struct Residual {
  int level;         // 0: m = quantize(p); 1: m = max(0, quantize(p) - floor(z0 * q1)) (deterministic: x1
                     // zeroed); 2: m = scr
  const float* p;    // [V] target row of the node
  const float* q1;   // [V] draft row of the first rejected child (sampled drafts)
  int64_t* scr;      // [Vp] scratch row of the request (level 2)
  double z0d;        // double(mass of p), the Z of the first rejection
  int e;             // exponent of p's largest entry (fixed::row_exponent)
  int x1;            // token of the first rejected child
  bool vp, vq1;      // p / q1 rows are 16-byte aligned
};

template <bool kHasQ>
__device__ __forceinline__ void residual4(const Residual& R, int i, int V, int64_t (&m)[kVec]) {
  if (R.level == 2) {
    // i % 4 == 0 and the scratch row stride is a multiple of 4: 32-byte aligned. Not __ldg:
    // this kernel writes the scratch.
    const longlong2 a = *reinterpret_cast<const longlong2*>(R.scr + i);
    const longlong2 c = *reinterpret_cast<const longlong2*>(R.scr + i + 2);
    m[0] = a.x;
    m[1] = a.y;
    m[2] = c.x;
    m[3] = c.y;
#pragma unroll
    for (int k = 0; k < kVec; ++k) m[k] = i + k < V ? m[k] : 0;
    return;
  }
  float pf[kVec];
  load4(R.p, i, V, R.vp, pf);  // 0 past V: no mass
#pragma unroll
  for (int k = 0; k < kVec; ++k) m[k] = fixed::quantize(pf[k], R.e);
  if (R.level == 0) return;
  if constexpr (kHasQ) {
    float qf[kVec];
    load4(R.q1, i, V, R.vq1, qf);
#pragma unroll
    for (int k = 0; k < kVec; ++k) m[k] = fixed::subtract(m[k], fixed::scaled_mass(R.z0d, qf[k]));
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) m[k] = i + k == R.x1 ? 0 : m[k];
  }
}

template <bool kHasQ>
__device__ __forceinline__ int64_t residual_at(const Residual& R, int x) {
  if (R.level == 2) return R.scr[x];
  const int64_t mx = fixed::quantize(__ldg(R.p + x), R.e);
  if (R.level == 0) return mx;
  if constexpr (kHasQ) {
    return fixed::subtract(mx, fixed::scaled_mass(R.z0d, __ldg(R.q1 + x)));
  } else {
    return x == R.x1 ? 0 : mx;
  }
}

// The exponent of the largest entry of p that carries mass; INT_MIN when none does.
__device__ int row_exponent_of(const float* p, int V, bool vec, float* s) {
  float mx = 0.f;
#pragma unroll 4
  for (int i = kVec * int(threadIdx.x); i < V; i += kVec * kThreads) {
    float pf[kVec];
    load4(p, i, V, vec, pf);
#pragma unroll
    for (int k = 0; k < kVec; ++k) mx = fixed::max_mass_entry(mx, pf[k]);
  }
  mx = block_fmax(mx, s);
  return mx > 0.f ? fixed::row_exponent(mx) : INT_MIN;
}

// Z = sum(m), exact.
template <bool kHasQ>
__device__ int64_t mass(const Residual& R, int V, int64_t* s) {
  int64_t acc = 0;
#pragma unroll 4
  for (int i = kVec * int(threadIdx.x); i < V; i += kVec * kThreads) {
    int64_t m[kVec];
    residual4<kHasQ>(R, i, V, m);
    acc += (m[0] + m[1]) + (m[2] + m[3]);
  }
  return block_sum(acc, s);
}

// A second (or later) rejection at this node, child token x (residual mass mx) with draft
// row qc: m <- max(0, m - floor(Z * qc)) (deterministic: m[x] = 0), written to the scratch;
// returns the new mass.
template <bool kHasQ>
__device__ int64_t reject_into_scratch(Residual& R, const float* qc, int x, int64_t mx, int64_t Z, int V,
                                       int64_t* s) {
  if (R.level == 2) __syncthreads();  // every thread has read scr[x] for the acceptance test
  if (!kHasQ && R.level == 2) {
    if (threadIdx.x == 0) R.scr[x] = 0;
    __syncthreads();
    return Z - mx;
  }
  const bool vq = kHasQ && row_aligned16(qc);
  const double Zd = double(Z);
  int64_t acc = 0;
  for (int i = kVec * int(threadIdx.x); i < V; i += kVec * kThreads) {
    int64_t m[kVec], mn[kVec];
    residual4<kHasQ>(R, i, V, m);  // level 2: this thread's own elements, rewritten below
    if constexpr (kHasQ) {
      float qf[kVec];
      load4(qc, i, V, vq, qf);
#pragma unroll
      for (int k = 0; k < kVec; ++k) mn[k] = fixed::subtract(m[k], fixed::scaled_mass(Zd, qf[k]));
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) mn[k] = i + k == x ? 0 : m[k];
    }
    // i + 3 < roundup(V, 4) = row stride: the padding elements get 0 (m is 0 past V).
    *reinterpret_cast<longlong2*>(R.scr + i) = make_longlong2(mn[0], mn[1]);
    *reinterpret_cast<longlong2*>(R.scr + i + 2) = make_longlong2(mn[2], mn[3]);
    acc += (mn[0] + mn[1]) + (mn[2] + mn[3]);
  }
  R.level = 2;
  return block_sum(acc, s);
}

// Inverse-CDF draw from m of mass Z (see the file comment); -1 when Z is not > 0.
// Tiles of kThreads * 4 elements: a block scan of the per-thread sums gives each element's
// exact inclusive prefix sum; the first one above the threshold wins (it always has m > 0).
template <bool kHasQ>
__device__ int draw(const Residual& R, int64_t Z, double u, int V, int64_t* sd, int* si) {
  if (Z <= 0) return -1;
  const int64_t thr = fixed::draw_threshold(Z, u);
  int64_t carry = 0;
  for (int base = 0; base < V; base += kVec * kThreads) {
    const int i = base + kVec * int(threadIdx.x);
    int64_t m[kVec] = {0, 0, 0, 0};
    if (i < V) residual4<kHasQ>(R, i, V, m);
    int64_t run[kVec], acc = 0;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      acc += m[k];
      run[k] = acc;
    }
    int64_t excl, tile;
    block_scan(acc, excl, tile, sd);
    const int64_t pre = carry + excl;
    int hit = INT_MAX;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (hit == INT_MAX && pre + run[k] > thr) hit = i + k;
    }
    hit = block_min(hit, si);
    if (hit != INT_MAX) return hit;
    carry += tile;
  }
  return -1;  // unreachable: thr < Z and the tiles sum to Z exactly
}

struct SampleParams {
  const int64_t* tokens;   // [B, N] contiguous
  const int32_t* parents;  // [B, N] contiguous
  const float* p;          // [B, N, V] target_probs, contiguous
  const float* q;          // [B, N, V] draft_probs, contiguous (kHasQ only)
  const double* u;         // [B, N] uniforms, contiguous
  int64_t* scratch;        // [B, Vp] int64 residual rows (N >= 3 only: level 2 needs two siblings)
  int32_t* accepted;       // [B, N] out, -1 padded
  int32_t* num_accepted;   // [B] out
  int64_t* out_tokens;     // [B, N] out, -1 padded
  int N, V, Vp;
};

// One CTA per request. All control flow is block-uniform (every value it depends on comes
// from a block reduction or from the same global address read by every thread).
template <bool kHasQ>
__global__ void __launch_bounds__(kThreads) rejection_sample_kernel(const SampleParams p) {
  __shared__ int64_t s_l[kWarps];
  __shared__ float s_f[kWarps];
  __shared__ int s_i[kWarps];
  const int b = blockIdx.x, N = p.N, V = p.V;
  const int64_t* tok = p.tokens + int64_t(b) * N;
  const int32_t* par = p.parents + int64_t(b) * N;
  const double* u = p.u + int64_t(b) * N;
  int32_t* acc_out = p.accepted + int64_t(b) * N;
  int64_t* tok_out = p.out_tokens + int64_t(b) * N;
  for (int i = threadIdx.x; i < N; i += kThreads) {
    acc_out[i] = -1;
    tok_out[i] = -1;
  }
  __syncthreads();  // the padding is written before thread 0 writes the path
  if (threadIdx.x == 0) acc_out[0] = 0;
  const double u0 = u[0];
  int64_t* scr = p.scratch != nullptr ? p.scratch + int64_t(b) * p.Vp : nullptr;

  int node = 0, count = 0;
  while (true) {
    Residual R;
    R.level = 0;
    R.p = p.p + (int64_t(b) * N + node) * V;
    R.vp = row_aligned16(R.p);
    R.q1 = nullptr;
    R.vq1 = false;
    R.scr = scr;
    R.x1 = -1;
    R.e = row_exponent_of(R.p, V, R.vp, s_f);
    const int64_t z0 = R.e == INT_MIN ? 0 : mass<kHasQ>(R, V, s_l);
    R.z0d = double(z0);
    int64_t Z = z0;
    int chosen = -1;
    for (int c = next_child(par, N, node, node, s_i); c >= 0; c = next_child(par, N, node, c, s_i)) {
      const int64_t x64 = tok[c];
      if (x64 < 0 || x64 >= V) continue;  // unchecked bad token: never accepted, never read
      const int x = int(x64);
      const float* qc = kHasQ ? p.q + (int64_t(b) * N + c) * V : nullptr;
      const double qx = kHasQ ? double(__ldg(qc + x)) : 1.0;
      const int64_t mx = R.e == INT_MIN ? 0 : residual_at<kHasQ>(R, x);
      if (fixed::accepts(u[c], qx, Z, mx)) {
        chosen = c;
        break;
      }
      if (R.e == INT_MIN) continue;  // no mass at all: every child is rejected, nothing to subtract
      if (R.level == 0) {  // first rejection: m = max(0, quantize(p) - floor(Z q_c)), never stored
        R.level = 1;
        R.q1 = qc;
        R.vq1 = kHasQ && row_aligned16(qc);
        R.x1 = x;
        Z = kHasQ ? mass<kHasQ>(R, V, s_l) : Z - mx;
      } else {
        Z = reject_into_scratch<kHasQ>(R, qc, x, mx, Z, V, s_l);
      }
    }
    if (chosen >= 0) {
      ++count;
      if (threadIdx.x == 0) {
        acc_out[count] = chosen;
        tok_out[count - 1] = tok[chosen];
      }
      node = chosen;
      continue;
    }
    int t = draw<kHasQ>(R, Z, u0, V, s_l, s_i);
    if (t < 0 && R.level != 0) {  // residual mass 0: the node's own target row
      R.level = 0;
      t = draw<kHasQ>(R, z0, u0, V, s_l, s_i);
    }
    if (t < 0) t = 0;  // the target row itself has no mass: documented rule
    if (threadIdx.x == 0) {
      tok_out[count] = t;
      p.num_accepted[b] = count;
    }
    break;
  }
}

// ---------------------------------------------------------------- greedy
// First index of the maximum of row[0, V); NaN counts as the maximum (the first NaN wins).
template <typename T>
__device__ int block_argmax(const T* __restrict__ row, int V, float* sv, int* si, int* sn) {
  constexpr int E = 16 / int(sizeof(T));
  const bool vec = row_aligned16(row);
  float bv = kNegInf;
  int bi = INT_MAX, nan_i = INT_MAX;
#pragma unroll 2
  for (int i = E * int(threadIdx.x); i < V; i += E * kThreads) {
    float x[E];
    if (vec && i + E <= V) {
      unpack16<T>(__ldg(reinterpret_cast<const uint4*>(row + i)), x);
    } else {
#pragma unroll
      for (int k = 0; k < E; ++k) x[k] = i + k < V ? to_float(row[i + k]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < E; ++k) {
      if (i + k >= V) break;
      const float v = x[k];
      if (isnan(v)) {
        nan_i = min(nan_i, i + k);
      } else if (bi == INT_MAX || v > bv) {  // strict: the first of equal maxima stays
        bv = v;
        bi = i + k;
      }
    }
  }
  // Reduce (max value, then min index) and min NaN index: a total order, so the
  // butterfly leaves the same winner in every lane.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, bv, o);
    const int oi = __shfl_xor_sync(kFullMask, bi, o);
    nan_i = min(nan_i, __shfl_xor_sync(kFullMask, nan_i, o));
    if (oi != INT_MAX && (bi == INT_MAX || ov > bv || (ov == bv && oi < bi))) {
      bv = ov;
      bi = oi;
    }
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    sv[warp] = bv;
    si[warp] = bi;
    sn[warp] = nan_i;
  }
  __syncthreads();
  bv = kNegInf;
  bi = INT_MAX;
  nan_i = INT_MAX;
  for (int w = 0; w < kWarps; ++w) {
    nan_i = min(nan_i, sn[w]);
    const float ov = sv[w];
    const int oi = si[w];
    if (oi != INT_MAX && (bi == INT_MAX || ov > bv || (ov == bv && oi < bi))) {
      bv = ov;
      bi = oi;
    }
  }
  __syncthreads();
  return nan_i != INT_MAX ? nan_i : bi;
}

// T = int64_t: logits holds the argmax at each node ([B, N], V = 1), read instead of taken.
template <typename T>
__global__ void __launch_bounds__(kThreads) greedy_verify_kernel(const int64_t* __restrict__ tokens,  // [B, N]
                                                                 const int32_t* __restrict__ parents,  // [B, N]
                                                                 const T* __restrict__ logits,  // [B, N, V]
                                                                 int32_t* __restrict__ accepted,       // [B, N]
                                                                 int32_t* __restrict__ num_accepted,   // [B]
                                                                 int64_t* __restrict__ out_tokens,     // [B, N]
                                                                 int N, int V) {
  __shared__ float s_v[kWarps];
  __shared__ int s_i[kWarps], s_n[kWarps];
  const int b = blockIdx.x;
  const int64_t* tok = tokens + int64_t(b) * N;
  const int32_t* par = parents + int64_t(b) * N;
  int32_t* acc_out = accepted + int64_t(b) * N;
  int64_t* tok_out = out_tokens + int64_t(b) * N;
  for (int i = threadIdx.x; i < N; i += kThreads) {
    acc_out[i] = -1;
    tok_out[i] = -1;
  }
  __syncthreads();
  if (threadIdx.x == 0) acc_out[0] = 0;
  int node = 0, count = 0;
  while (true) {
    int64_t best;
    if constexpr (std::is_same_v<T, int64_t>) {
      best = logits[int64_t(b) * N + node];
    } else {
      best = block_argmax<T>(logits + (int64_t(b) * N + node) * V, V, s_v, s_i, s_n);
    }
    // The first child (index order) whose token is the argmax.
    int cand = INT_MAX;
    for (int c = node + 1 + int(threadIdx.x); c < N; c += kThreads) {
      if (par[c] == node && tok[c] == best) {
        cand = c;
        break;
      }
    }
    cand = block_min(cand, s_i);
    if (threadIdx.x == 0) tok_out[count] = best;
    if (cand == INT_MAX) break;
    ++count;
    if (threadIdx.x == 0) acc_out[count] = cand;
    node = cand;
  }
  if (threadIdx.x == 0) num_accepted[b] = count;
}

// One block per row of y [M, V]: out[m] = the first index of the row's maximum (the first NaN when it has one).
template <typename T>
__global__ void __launch_bounds__(kThreads) argmax_rows_kernel(const T* __restrict__ y, int64_t* __restrict__ out,
                                                               int V) {
  __shared__ float s_v[kWarps];
  __shared__ int s_i[kWarps], s_n[kWarps];
  const int best = block_argmax<T>(y + int64_t(blockIdx.x) * V, V, s_v, s_i, s_n);
  if (threadIdx.x == 0) out[blockIdx.x] = best;
}

SampleResult make_outputs(const at::Tensor& tokens) {
  const int64_t B = tokens.size(0), N = tokens.size(1);
  auto opts = tokens.options();
  return {at::empty({B, N}, opts.dtype(at::kInt)), at::empty({B}, opts.dtype(at::kInt)),
          at::empty({B, N}, opts.dtype(at::kLong))};
}

void check_sizes(const char* op, int64_t B, int64_t N, int64_t V) {
  TORCH_CHECK(V <= std::numeric_limits<int32_t>::max() - 8 * kThreads && N < std::numeric_limits<int32_t>::max() &&
                  B <= std::numeric_limits<int32_t>::max(),
              op, ": sizes too large for the CUDA kernel (B = ", B, ", N = ", N, ", V = ", V, ")");
}

}  // namespace
}  // namespace cuda

SampleResult rejection_sample_cuda(const at::Tensor& tokens_in, const at::Tensor& parents_in,
                                   const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                                   const at::Tensor& uniforms_in) {
  checks::rejection_sample(tokens_in, parents_in, target_probs, draft_probs, uniforms_in);
  const int64_t B = tokens_in.size(0), N = tokens_in.size(1), V = target_probs.size(2);
  cuda::check_sizes("rejection_sample", B, N, V);
  const c10::cuda::CUDAGuard device_guard(tokens_in.device());
  const at::Tensor tokens = tokens_in.contiguous(), parents = parents_in.contiguous();
  const at::Tensor uniforms = uniforms_in.contiguous();
  SampleResult res = cuda::make_outputs(tokens);
  if (B == 0) return res;
  const int64_t Vp = cuda::ceil_div(V, cuda::kVec) * cuda::kVec;
  // Level-2 residuals need two rejected siblings, i.e. N >= 3.
  at::Tensor scratch;
  if (N >= 3) scratch = at::empty({B, Vp}, target_probs.options().dtype(at::kLong));

  cuda::SampleParams p{};
  p.tokens = tokens.data_ptr<int64_t>();
  p.parents = parents.data_ptr<int32_t>();
  p.p = target_probs.data_ptr<float>();
  p.q = draft_probs.has_value() ? draft_probs->data_ptr<float>() : nullptr;
  p.u = uniforms.data_ptr<double>();
  p.scratch = scratch.defined() ? scratch.data_ptr<int64_t>() : nullptr;
  p.accepted = std::get<0>(res).data_ptr<int32_t>();
  p.num_accepted = std::get<1>(res).data_ptr<int32_t>();
  p.out_tokens = std::get<2>(res).data_ptr<int64_t>();
  p.N = int(N);
  p.V = int(V);
  p.Vp = int(Vp);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  SPECDEC_BOOL_SWITCH(draft_probs.has_value(), kHasQ, [&] {
    cuda::rejection_sample_kernel<kHasQ><<<unsigned(B), cuda::kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return res;
}

SampleResult greedy_verify_cuda(const at::Tensor& tokens_in, const at::Tensor& parents_in,
                                const at::Tensor& target_logits) {
  checks::greedy_verify(tokens_in, parents_in, target_logits);
  const bool predicts = target_logits.scalar_type() == at::kLong;  // the argmax at each node, [B, N]
  const int64_t B = tokens_in.size(0), N = tokens_in.size(1), V = predicts ? 1 : target_logits.size(2);
  cuda::check_sizes("greedy_verify", B, N, V);
  const c10::cuda::CUDAGuard device_guard(tokens_in.device());
  const at::Tensor tokens = tokens_in.contiguous(), parents = parents_in.contiguous();
  SampleResult res = cuda::make_outputs(tokens);
  if (B == 0) return res;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (predicts) {
    cuda::greedy_verify_kernel<int64_t><<<unsigned(B), cuda::kThreads, 0, stream>>>(
        tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(), target_logits.data_ptr<int64_t>(),
        std::get<0>(res).data_ptr<int32_t>(), std::get<1>(res).data_ptr<int32_t>(),
        std::get<2>(res).data_ptr<int64_t>(), int(N), 1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return res;
  }
  SPECDEC_DISPATCH_FLOAT(target_logits.scalar_type(), "greedy_verify", T, [&] {
    cuda::greedy_verify_kernel<T><<<unsigned(B), cuda::kThreads, 0, stream>>>(
        tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(), static_cast<const T*>(target_logits.data_ptr()),
        std::get<0>(res).data_ptr<int32_t>(), std::get<1>(res).data_ptr<int32_t>(),
        std::get<2>(res).data_ptr<int64_t>(), int(N), int(V));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return res;
}

at::Tensor argmax_rows_cuda(const at::Tensor& y_in) {
  TORCH_CHECK(y_in.dim() >= 1 && y_in.size(-1) >= 1, "argmax_rows: y must be [..., V] with V >= 1, got ",
              y_in.sizes());
  const int64_t V = y_in.size(-1), M = y_in.numel() / V;
  cuda::check_sizes("argmax_rows", M, 1, V);
  const c10::cuda::CUDAGuard device_guard(y_in.device());
  const std::vector<int64_t> shape(y_in.sizes().begin(), y_in.sizes().end() - 1);
  at::Tensor out = at::empty({M}, y_in.options().dtype(at::kLong));
  if (M == 0) return out.view(shape);
  const at::Tensor y = y_in.reshape({M, V}).contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  SPECDEC_DISPATCH_FLOAT(y.scalar_type(), "argmax_rows", T, [&] {
    cuda::argmax_rows_kernel<T><<<unsigned(M), cuda::kThreads, 0, stream>>>(static_cast<const T*>(y.data_ptr()),
                                                                           out.data_ptr<int64_t>(), int(V));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out.view(shape);
}

}  // namespace specdec
