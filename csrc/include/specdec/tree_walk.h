// Tree speculative sampling and greedy verification for ONE request, on raw pointers
// (no torch): the CPU kernels call these per request, in parallel over requests.
//
// Semantics are specdec/reference.py's, step for step:
//  * children of a node = nodes c > node with parents[c] == node, tried in index order;
//  * the current distribution r is p = target_probs[node] until a child is rejected;
//    it is then materialised once in float64 as max(0, r - Z * q_c) (deterministic
//    drafts: r[x] = 0) and updated in place by later rejections; Z = sum(r) in float64;
//  * child c (token x) is accepted iff q_c(x) > 0 and u_c * q_c(x) * Z < r(x);
//  * the final draw is the first index whose float64 running sum exceeds u_0 * Z,
//    else (rounding, u ~ 1) the last index with r > 0; zero mass falls back to the
//    node's own target row, then to token 0.
// Float64 sums make the result independent of the summation order except on exact ties.
// Reference: SpecInfer (Miao et al. 2024), multi-step speculative sampling; Leviathan
// et al. 2023 / Chen et al. 2023 for the chain case.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

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

inline double sum_row(const float* p, int64_t V) {
  double z = 0.0;
  for (int64_t i = 0; i < V; ++i) z += double(p[i]);
  return z;
}
inline double sum_row(const double* r, int64_t V) {
  double z = 0.0;
  for (int64_t i = 0; i < V; ++i) z += r[i];
  return z;
}

// Inverse-CDF draw from an unnormalised row of mass Z > 0; -1 when Z is not > 0.
template <typename T>
inline int64_t draw_from(const T* r, int64_t V, double Z, double u) {
  if (!(Z > 0.0)) return -1;
  const double threshold = u * Z;
  double csum = 0.0;
  int64_t last_pos = -1;
  for (int64_t i = 0; i < V; ++i) {
    const double x = double(r[i]);
    csum += x;
    if (csum > threshold) return i;
    if (x > 0.0) last_pos = i;
  }
  return last_pos;  // rounding left the threshold at or above the total (u ~ 1)
}

// One request of rejection_sample. p: [N, V]; q: [N, V] or nullptr (deterministic);
// u: [N]; scratch: V doubles.
inline void rejection_sample_request(const int64_t* tokens, const int32_t* parents, const float* p, const float* q,
                                     const double* u, int64_t N, int64_t V, std::vector<double>& scratch,
                                     std::vector<int32_t>& first_child, std::vector<int32_t>& next_sibling,
                                     TreeOutputs out) {
  build_children(parents, N, first_child, next_sibling);
  scratch.resize(V);
  for (int64_t i = 0; i < N; ++i) {
    out.accepted[i] = -1;
    out.out_tokens[i] = -1;
  }
  out.accepted[0] = 0;
  int64_t count = 0;  // accepted draft nodes
  int64_t node = 0;
  while (true) {
    const float* p_node = p + node * V;
    bool residual = false;  // r lives in scratch (true) or is p_node itself (false)
    double Z = sum_row(p_node, V);
    int64_t chosen = -1;
    for (int32_t c = first_child[node]; c >= 0; c = next_sibling[c]) {
      const int64_t x = tokens[c];
      if (x < 0 || x >= V) continue;  // unchecked bad token: never accepted, never read
      const double qx = q ? double(q[c * V + x]) : 1.0;
      const double rx = residual ? scratch[x] : double(p_node[x]);
      if (qx > 0.0 && u[c] * qx * Z < rx) {
        chosen = c;
        break;
      }
      if (!residual) {
        for (int64_t i = 0; i < V; ++i) scratch[i] = double(p_node[i]);
        residual = true;
      }
      if (q) {
        const float* qc = q + c * V;
        for (int64_t i = 0; i < V; ++i) {
          const double d = scratch[i] - Z * double(qc[i]);
          scratch[i] = d > 0.0 ? d : 0.0;
        }
      } else {
        scratch[x] = 0.0;
      }
      Z = sum_row(scratch.data(), V);
    }
    if (chosen >= 0) {
      ++count;
      out.accepted[count] = int32_t(chosen);
      out.out_tokens[count - 1] = tokens[chosen];
      node = chosen;
      continue;
    }
    int64_t tok = residual ? draw_from(scratch.data(), V, Z, u[0]) : draw_from(p_node, V, Z, u[0]);
    if (tok < 0) tok = draw_from(p_node, V, sum_row(p_node, V), u[0]);
    if (tok < 0) tok = 0;
    out.out_tokens[count] = tok;
    break;
  }
  *out.num_accepted = int32_t(count);
}

// First index of the maximum; NaN counts as the maximum (torch.argmax semantics).
template <typename T, typename ToFloat>
inline int64_t argmax_row(const T* row, int64_t V, ToFloat to_float) {
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

// One request of greedy_verify. logits: [N, V].
template <typename T, typename ToFloat>
inline void greedy_verify_request(const int64_t* tokens, const int32_t* parents, const T* logits, int64_t N,
                                  int64_t V, ToFloat to_float, std::vector<int32_t>& first_child,
                                  std::vector<int32_t>& next_sibling, TreeOutputs out) {
  build_children(parents, N, first_child, next_sibling);
  for (int64_t i = 0; i < N; ++i) {
    out.accepted[i] = -1;
    out.out_tokens[i] = -1;
  }
  out.accepted[0] = 0;
  int64_t count = 0;
  int64_t node = 0;
  while (true) {
    const int64_t best = argmax_row(logits + node * V, V, to_float);
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

}  // namespace cpu
}  // namespace specdec
