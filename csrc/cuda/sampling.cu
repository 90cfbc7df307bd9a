// rejection_sample / greedy_verify, CUDA backend.
//
// What it computes: the accepted root path of every request's token tree and the one
// extra token drawn (or argmax'ed) after it. Semantics are specdec/reference.py's and
// csrc/include/specdec/tree_walk.h's, step for step, so that CPU and CUDA integer outputs
// are identical:
//  * children of a node = nodes c > node with parents[c] == node, tried in index order
//    (a block-wide "first match after c" search, no children lists);
//  * sampled drafts: child c with token x is accepted iff q_c(x) > 0 and
//    u_c * q_c(x) * Z < r(x), where r is the current UNNORMALISED residual and Z = sum(r)
//    in float64; after a rejection r <- max(0, r - Z * q_c) (deterministic drafts:
//    r[x] = 0) — SpecInfer's multi-step speculative sampling (Miao et al. 2024), which
//    is Leviathan et al. 2023 / Chen et al. 2023 speculative sampling on a chain;
//  * when no child is accepted, one token is drawn from r by inverse CDF with u_0: the
//    first index whose float64 running sum exceeds u_0 * Z, else (u_0 ~ 1: rounding left
//    the threshold at or above every partial sum) the last index with r > 0; a residual of
//    zero mass falls back to the node's own target row, then to token 0.
//  * greedy: the first maximal index of the node's logits (NaN counts as maximal, the
//    first NaN wins: torch.argmax); the child whose token equals it is accepted.
//
// Design: one CTA of 512 threads per request walks its tree; every pass over a
// vocabulary row is a block-strided loop of 4 consecutive elements per thread (one
// 16-byte load when the row is 16-byte aligned, scalar loads otherwise, e.g. odd V).
// The residual is never normalised and is materialised lazily:
//   level 0  r = p_node (no pass beyond the mass Z);
//   level 1  after the first rejection, r = max(0, p_node - Z0 * q_c1) (or p_node with
//            x_1 zeroed) is recomputed on the fly from p and q_c1 wherever it is read —
//            a chain never writes anything;
//   level 2  after a second rejection at the same node, r is written once into a float64
//            scratch row of this request ([B, roundup(V, 4)] from the caching allocator)
//            and updated in place by further rejections.
// float64 products and differences use __dmul_rn / __dsub_rn (no FMA contraction), so
// every residual element is bitwise the CPU's; only sums are reassociated (block
// reductions / scans), which changes a decision only on exact ties (measure zero), as
// the contract states. Uniforms are float64 so that u * Z is resolved at float64
// precision rather than at fp32 (which would make ties V-dependent and frequent).
//
// Napkin math: each visited node reads its target row once for Z (V * 4 bytes); each
// rejection adds one pass over p and q_c (V * 8 bytes, plus 16 bytes per element at
// level 2); the final draw reads the current residual once, stopping at the crossing
// (half a row on average). B = 8, N = 16, V = 128256, 4 nodes visited: ~2 MB per request,
// read by one SM each (~100-200 GB/s per SM): ~10-20 us, far below a target forward.
// greedy_verify: one pass of V * sizeof(dtype) per visited node.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <climits>
#include <limits>

#include "checks.h"
#include "common.cuh"
#include "ops.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 4;  // consecutive elements per thread per pass step

// ---------------------------------------------------------------- block reductions
// Every thread returns the same value (identical reduction order), so all threads of the
// block take the same branches. Two barriers: the scratch array may be reused at once.
__device__ __forceinline__ double block_sum(double v, double* s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(kFullMask, v, o));
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  double t = 0.0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t = __dadd_rn(t, s[w]);
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

__device__ __forceinline__ int block_max(int v, int* s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, o));
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  int t = INT_MIN;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t = max(t, s[w]);
  __syncthreads();
  return t;
}

// Exclusive prefix sum of one double per thread (thread order) and the block total.
__device__ __forceinline__ void block_scan(double v, double& excl, double& total, double* s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x = __dadd_rn(x, y);
  }
  double ex = __shfl_up_sync(kFullMask, x, 1);
  if (lane == 0) ex = 0.0;
  if (lane == 31) s[warp] = x;
  __syncthreads();
  double wpre = 0.0, tot = 0.0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const double sw = s[w];
    if (w < warp) wpre = __dadd_rn(wpre, sw);
    tot = __dadd_rn(tot, sw);
  }
  __syncthreads();
  excl = __dadd_rn(wpre, ex);
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

__device__ __forceinline__ double relu(double d) { return d > 0.0 ? d : 0.0; }  // NaN -> 0, as the CPU

// ---------------------------------------------------------------- the residual r of the current node
struct Residual {
  int level;         // 0: r = p; 1: r = max(0, p - z0 * q1) (deterministic: p with x1 zeroed); 2: r = scr
  const float* p;    // [V] target row of the node
  const float* q1;   // [V] draft row of the first rejected child (sampled drafts)
  double* scr;       // [Vp] scratch row of the request (level 2)
  double z0;         // mass of p, the Z of the first rejection
  int x1;            // token of the first rejected child
  bool vp, vq1;      // p / q1 rows are 16-byte aligned
};

template <bool kHasQ>
__device__ __forceinline__ void residual4(const Residual& R, int i, int V, double (&r)[kVec]) {
  if (R.level == 2) {
    // i % 4 == 0 and the scratch row stride is a multiple of 4: 32-byte aligned. Not __ldg:
    // this kernel writes the scratch.
    const double2 a = *reinterpret_cast<const double2*>(R.scr + i);
    const double2 c = *reinterpret_cast<const double2*>(R.scr + i + 2);
    r[0] = a.x;
    r[1] = a.y;
    r[2] = c.x;
    r[3] = c.y;
#pragma unroll
    for (int k = 0; k < kVec; ++k) r[k] = i + k < V ? r[k] : 0.0;
    return;
  }
  float pf[kVec];
  load4(R.p, i, V, R.vp, pf);
  if (R.level == 0) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) r[k] = double(pf[k]);
  } else if constexpr (kHasQ) {
    float qf[kVec];
    load4(R.q1, i, V, R.vq1, qf);
#pragma unroll
    for (int k = 0; k < kVec; ++k) r[k] = relu(__dsub_rn(double(pf[k]), __dmul_rn(R.z0, double(qf[k]))));
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) r[k] = i + k == R.x1 ? 0.0 : double(pf[k]);
  }
}

template <bool kHasQ>
__device__ __forceinline__ double residual_at(const Residual& R, int x) {
  if (R.level == 2) return R.scr[x];
  const double px = double(__ldg(R.p + x));
  if (R.level == 0) return px;
  if constexpr (kHasQ) {
    return relu(__dsub_rn(px, __dmul_rn(R.z0, double(__ldg(R.q1 + x)))));
  } else {
    return x == R.x1 ? 0.0 : px;
  }
}

// Z = sum(r) in float64.
template <bool kHasQ>
__device__ double mass(const Residual& R, int V, double* s) {
  double acc = 0.0;
  if (R.level == 0) {  // the pass every visited node makes: plain loads, several in flight
#pragma unroll 4
    for (int i = kVec * int(threadIdx.x); i < V; i += kVec * kThreads) {
      float pf[kVec];
      load4(R.p, i, V, R.vp, pf);
      acc = __dadd_rn(acc, __dadd_rn(__dadd_rn(double(pf[0]), double(pf[1])), __dadd_rn(double(pf[2]), double(pf[3]))));
    }
    return block_sum(acc, s);
  }
  for (int i = kVec * int(threadIdx.x); i < V; i += kVec * kThreads) {
    double r[kVec];
    residual4<kHasQ>(R, i, V, r);
    acc = __dadd_rn(acc, __dadd_rn(__dadd_rn(r[0], r[1]), __dadd_rn(r[2], r[3])));
  }
  return block_sum(acc, s);
}

// A second (or later) rejection at this node, child token x with draft row qc:
// r <- max(0, r - Z * qc) (deterministic: r[x] = 0), written to the scratch; returns sum(r).
template <bool kHasQ>
__device__ double reject_into_scratch(Residual& R, const float* qc, int x, double Z, int V, double* s) {
  if (R.level == 2) __syncthreads();  // every thread has read scr[x] for the acceptance test
  if (!kHasQ && R.level == 2) {
    if (threadIdx.x == 0) R.scr[x] = 0.0;
    __syncthreads();
    return mass<kHasQ>(R, V, s);
  }
  const bool vq = row_aligned16(qc);
  double acc = 0.0;
  for (int i = kVec * int(threadIdx.x); i < V; i += kVec * kThreads) {
    double r[kVec], rn[kVec];
    residual4<kHasQ>(R, i, V, r);  // level 2: this thread's own elements, rewritten below
    if constexpr (kHasQ) {
      float qf[kVec];
      load4(qc, i, V, vq, qf);
#pragma unroll
      for (int k = 0; k < kVec; ++k) rn[k] = relu(__dsub_rn(r[k], __dmul_rn(Z, double(qf[k]))));
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) rn[k] = i + k == x ? 0.0 : r[k];
    }
    // i + 3 < roundup(V, 4) = row stride: the padding elements get 0.
    *reinterpret_cast<double2*>(R.scr + i) = make_double2(rn[0], rn[1]);
    *reinterpret_cast<double2*>(R.scr + i + 2) = make_double2(rn[2], rn[3]);
    acc = __dadd_rn(acc, __dadd_rn(__dadd_rn(rn[0], rn[1]), __dadd_rn(rn[2], rn[3])));
  }
  R.level = 2;
  return block_sum(acc, s);
}

// Inverse-CDF draw from r of mass Z (see the file comment); -1 when Z is not > 0.
// Tiles of kThreads * 4 elements: a block scan of the per-thread sums gives each element's
// float64 running sum; the first element with r > 0 whose running sum exceeds u * Z wins
// (r > 0 guards against reassociated partial sums that tie across a zero element).
template <bool kHasQ>
__device__ int draw(const Residual& R, double Z, double u, int V, double* sd, int* si) {
  if (!(Z > 0.0)) return -1;
  const double thr = __dmul_rn(u, Z);
  double carry = 0.0;
  int last = -1;
  for (int base = 0; base < V; base += kVec * kThreads) {
    const int i = base + kVec * int(threadIdx.x);
    double r[kVec] = {0.0, 0.0, 0.0, 0.0};
    if (i < V) residual4<kHasQ>(R, i, V, r);
    double run[kVec], acc = 0.0;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      acc = __dadd_rn(acc, r[k]);
      run[k] = acc;
      if (r[k] > 0.0) last = i + k;
    }
    double excl, tile;
    block_scan(acc, excl, tile, sd);
    const double pre = __dadd_rn(carry, excl);
    int hit = INT_MAX;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (hit == INT_MAX && r[k] > 0.0 && __dadd_rn(pre, run[k]) > thr) hit = i + k;
    }
    hit = block_min(hit, si);
    if (hit != INT_MAX) return hit;
    carry = __dadd_rn(carry, tile);
  }
  return block_max(last, si);  // u ~ 1: the threshold is at or above every partial sum
}

struct SampleParams {
  const int64_t* tokens;   // [B, N] contiguous
  const int32_t* parents;  // [B, N] contiguous
  const float* p;          // [B, N, V] target_probs, contiguous
  const float* q;          // [B, N, V] draft_probs, contiguous (kHasQ only)
  const double* u;         // [B, N] uniforms, contiguous
  double* scratch;         // [B, Vp] float64 residual rows (N >= 3 only: level 2 needs two siblings)
  int32_t* accepted;       // [B, N] out, -1 padded
  int32_t* num_accepted;   // [B] out
  int64_t* out_tokens;     // [B, N] out, -1 padded
  int N, V, Vp;
};

// One CTA per request. All control flow is block-uniform (every value it depends on comes
// from a block reduction or from the same global address read by every thread).
template <bool kHasQ>
__global__ void __launch_bounds__(kThreads) rejection_sample_kernel(const SampleParams p) {
  __shared__ double s_d[kWarps];
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
  double* scr = p.scratch != nullptr ? p.scratch + int64_t(b) * p.Vp : nullptr;

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
    R.z0 = mass<kHasQ>(R, V, s_d);
    double Z = R.z0;
    int chosen = -1;
    for (int c = next_child(par, N, node, node, s_i); c >= 0; c = next_child(par, N, node, c, s_i)) {
      const int64_t x64 = tok[c];
      if (x64 < 0 || x64 >= V) continue;  // unchecked bad token: never accepted, never read
      const int x = int(x64);
      const float* qc = kHasQ ? p.q + (int64_t(b) * N + c) * V : nullptr;
      const double qx = kHasQ ? double(__ldg(qc + x)) : 1.0;
      const double rx = residual_at<kHasQ>(R, x);
      // accept iff u < p(x) / q(x) with p = r / Z, i.e. u * q(x) * Z < r(x)
      if (qx > 0.0 && __dmul_rn(__dmul_rn(u[c], qx), Z) < rx) {
        chosen = c;
        break;
      }
      if (R.level == 0) {  // first rejection: r = max(0, p - Z q_c), never stored
        R.level = 1;
        R.q1 = qc;
        R.vq1 = kHasQ && row_aligned16(qc);
        R.x1 = x;
        Z = mass<kHasQ>(R, V, s_d);
      } else {
        Z = reject_into_scratch<kHasQ>(R, qc, x, Z, V, s_d);
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
    int t = draw<kHasQ>(R, Z, u0, V, s_d, s_i);
    if (t < 0 && R.level != 0) {  // residual mass 0 (rounding): the node's own target row
      R.level = 0;
      t = draw<kHasQ>(R, R.z0, u0, V, s_d, s_i);
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
    const int best = block_argmax<T>(logits + (int64_t(b) * N + node) * V, V, s_v, s_i, s_n);
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
  if (N >= 3) scratch = at::empty({B, Vp}, target_probs.options().dtype(at::kDouble));

  cuda::SampleParams p{};
  p.tokens = tokens.data_ptr<int64_t>();
  p.parents = parents.data_ptr<int32_t>();
  p.p = target_probs.data_ptr<float>();
  p.q = draft_probs.has_value() ? draft_probs->data_ptr<float>() : nullptr;
  p.u = uniforms.data_ptr<double>();
  p.scratch = scratch.defined() ? scratch.data_ptr<double>() : nullptr;
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
  const int64_t B = tokens_in.size(0), N = tokens_in.size(1), V = target_logits.size(2);
  cuda::check_sizes("greedy_verify", B, N, V);
  const c10::cuda::CUDAGuard device_guard(tokens_in.device());
  const at::Tensor tokens = tokens_in.contiguous(), parents = parents_in.contiguous();
  SampleResult res = cuda::make_outputs(tokens);
  if (B == 0) return res;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  SPECDEC_DISPATCH_FLOAT(target_logits.scalar_type(), "greedy_verify", T, [&] {
    cuda::greedy_verify_kernel<T><<<unsigned(B), cuda::kThreads, 0, stream>>>(
        tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(), static_cast<const T*>(target_logits.data_ptr()),
        std::get<0>(res).data_ptr<int32_t>(), std::get<1>(res).data_ptr<int32_t>(),
        std::get<2>(res).data_ptr<int64_t>(), int(N), int(V));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return res;
}

}  // namespace specdec
