// Tree speculative sampling and greedy verification for ONE request, on raw pointers
// (no torch): the CPU kernels call these per request, in parallel over requests.
//
// Semantics are specdec/reference.py's, step for step:
//  * children of a node = nodes c > node with parents[c] == node, tried in index order;
//  * a node's target row p becomes integer masses m = quantize(p) (fixed point relative to
//    the row's largest entry, see quantize_exponent / quantize) with Z = sum(m);
//  * child c (token x) is accepted iff q_c(x) > 0 and (u_c * q_c(x)) * double(Z) < double(m[x]);
//    a rejection sets m <- max(0, m - scaled_mass(Z, q_c)) (deterministic drafts: m[x] = 0);
//  * the final draw is the first index whose inclusive integer prefix sum exceeds
//    draw_threshold(Z, u_0) (u_0 >= 1: the last index with mass); zero mass falls back to
//    the node's own target row, then to token 0.
// Integer sums are exact in any order and the float64 operations are single rounded
// products (no FMA contraction: the CPU file is built with -ffp-contract=off, the CUDA
// kernel uses __dmul_rn), so the CPU, CUDA and reference decisions are identical by
// construction, ties included.
// Reference: SpecInfer (Miao et al. 2024), multi-step speculative sampling; Leviathan
// et al. 2023 / Chen et al. 2023 for the chain case.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "specdec/cpu_argmax.h"
#include "specdec/cpu_isa.h"
#include "specdec/sampling_fixed.h"

namespace specdec {
namespace cpu {

struct TreeOutputs {
  int32_t* accepted;     // [N], -1 padded
  int32_t* num_accepted; // [1]
  int64_t* out_tokens;   // [N], -1 padded
};

// Children lists in index order: first_child[n], next_sibling[c]. Out-of-range parents
// (only possible when values are unchecked) are treated as padding.
inline void build_children(const int32_t* parents, int64_t N, std::vector<int32_t>& first_child,
                           std::vector<int32_t>& next_sibling) {
  first_child.assign(N, -1);
  next_sibling.assign(N, -1);
  std::vector<int32_t> last(N, -1);
  for (int64_t c = 1; c < N; ++c) {
    const int32_t p = parents[c];
    if (p < 0 || p >= c) continue;
    if (last[p] < 0) first_child[p] = int32_t(c);
    else next_sibling[last[p]] = int32_t(c);
    last[p] = int32_t(c);
  }
}

// m = quantize(p) for one row; returns Z = sum(m).
inline int64_t quantize_row(const float* p, int64_t V, int64_t* m) {
  int e = INT_MIN;
  float mx = 0.f;
  for (int64_t i = 0; i < V; ++i) mx = fixed::max_mass_entry(mx, p[i]);
  if (mx > 0.f) e = fixed::row_exponent(mx);
  int64_t Z = 0;
  for (int64_t i = 0; i < V; ++i) {
    m[i] = e == INT_MIN ? 0 : fixed::quantize(p[i], e);
    Z += m[i];
  }
  return Z;
}

// Inverse-CDF draw from the masses m of total Z; -1 when Z is not > 0.
inline int64_t draw_from(const int64_t* m, int64_t V, int64_t Z, double u) {
  if (Z <= 0) return -1;
  const int64_t thr = fixed::draw_threshold(Z, u);
  int64_t csum = 0;
  for (int64_t i = 0; i < V; ++i) {
    csum += m[i];
    if (csum > thr) return i;
  }
  return -1;  // unreachable: thr < Z
}

// One request of rejection_sample. p: [N, V]; q: [N, V] or nullptr (deterministic);
// u: [N]; mnode, scratch: V int64 each.
inline void rejection_sample_request(const int64_t* tokens, const int32_t* parents, const float* p, const float* q,
                                     const double* u, int64_t N, int64_t V, std::vector<int64_t>& mnode,
                                     std::vector<int64_t>& scratch, std::vector<int32_t>& first_child,
                                     std::vector<int32_t>& next_sibling, TreeOutputs out) {
  build_children(parents, N, first_child, next_sibling);
  mnode.resize(V);
  scratch.resize(V);
  for (int64_t i = 0; i < N; ++i) {
    out.accepted[i] = -1;
    out.out_tokens[i] = -1;
  }
  out.accepted[0] = 0;
  int64_t count = 0;  // accepted draft nodes
  int64_t node = 0;
  while (true) {
    const int64_t Z0 = quantize_row(p + node * V, V, mnode.data());
    bool residual = false;  // the masses live in scratch (true) or are mnode itself (false)
    int64_t Z = Z0;
    int64_t chosen = -1;
    for (int32_t c = first_child[node]; c >= 0; c = next_sibling[c]) {
      const int64_t x = tokens[c];
      if (x < 0 || x >= V) continue;  // unchecked bad token: never accepted, never read
      const double qx = q ? double(q[c * V + x]) : 1.0;
      const int64_t mx = residual ? scratch[x] : mnode[x];
      if (fixed::accepts(u[c], qx, Z, mx)) {
        chosen = c;
        break;
      }
      if (!residual) {
        for (int64_t i = 0; i < V; ++i) scratch[i] = mnode[i];
        residual = true;
      }
      if (q) {
        const float* qc = q + c * V;
        const double Zd = double(Z);
        int64_t z = 0;
        for (int64_t i = 0; i < V; ++i) {
          scratch[i] = fixed::subtract(scratch[i], fixed::scaled_mass(Zd, qc[i]));
          z += scratch[i];
        }
        Z = z;
      } else {
        Z -= scratch[x];
        scratch[x] = 0;
      }
    }
    if (chosen >= 0) {
      ++count;
      out.accepted[count] = int32_t(chosen);
      out.out_tokens[count - 1] = tokens[chosen];
      node = chosen;
      continue;
    }
    int64_t tok = draw_from(residual ? scratch.data() : mnode.data(), V, Z, u[0]);
    if (tok < 0) tok = draw_from(mnode.data(), V, Z0, u[0]);
    if (tok < 0) tok = 0;
    out.out_tokens[count] = tok;
    break;
  }
  *out.num_accepted = int32_t(count);
}

// First index of the maximum; NaN counts as the maximum (torch.argmax semantics). float32 rows (whose
// to_float is the identity) take the AVX2 form where the CPU has it: the same index on every row.
template <typename T, typename ToFloat>
inline int64_t argmax_row(const T* row, int64_t V, ToFloat to_float) {
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2_fma_f16c()) return argmax_f32_avx2(row, V);
  }
  int64_t best = 0;
  float bv = to_float(row[0]);
  if (std::isnan(bv)) return 0;
  for (int64_t i = 1; i < V; ++i) {
    const float x = to_float(row[i]);
    if (std::isnan(x)) return i;
    if (x > bv) {
      bv = x;
      best = i;
    }
  }
  return best;
}

// One request of greedy_verify given best(node), the target's argmax at a node.
template <typename Best>
inline void greedy_walk(const int64_t* tokens, const int32_t* parents, int64_t N, Best best_of,
                        std::vector<int32_t>& first_child, std::vector<int32_t>& next_sibling, TreeOutputs out) {
  build_children(parents, N, first_child, next_sibling);
  for (int64_t i = 0; i < N; ++i) {
    out.accepted[i] = -1;
    out.out_tokens[i] = -1;
  }
  out.accepted[0] = 0;
  int64_t count = 0;
  int64_t node = 0;
  while (true) {
    const int64_t best = best_of(node);
    int64_t chosen = -1;
    for (int32_t c = first_child[node]; c >= 0; c = next_sibling[c]) {
      if (tokens[c] == best) {
        chosen = c;
        break;
      }
    }
    out.out_tokens[count] = best;
    if (chosen < 0) break;
    ++count;
    out.accepted[count] = int32_t(chosen);
    node = chosen;
  }
  *out.num_accepted = int32_t(count);
}

// One request of greedy_verify. logits: [N, V].
template <typename T, typename ToFloat>
inline void greedy_verify_request(const int64_t* tokens, const int32_t* parents, const T* logits, int64_t N,
                                  int64_t V, ToFloat to_float, std::vector<int32_t>& first_child,
                                  std::vector<int32_t>& next_sibling, TreeOutputs out) {
  greedy_walk(tokens, parents, N, [&](int64_t node) { return argmax_row(logits + node * V, V, to_float); },
              first_child, next_sibling, out);
}

}  // namespace cpu
}  // namespace specdec
