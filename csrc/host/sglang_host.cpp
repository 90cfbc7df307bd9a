// SGLang's conventions on CPU batches (specdec/compat/sglang_host.py), pybind11 functions over NumPy
// arrays (views of the caller's tensors, no copies): sglang_greedy, verify_tree_greedy's walk in one call
// (below), and sglang_prepare, the per-child work of the exact tree sampler:
//
// SGLang's coin u at a node accepts child c iff u <= P_c, P_c the running float32 sum of the node's
// target probabilities of the children tried so far, c included (its kernel's accumulation, in sibling
// order; a token repeated among siblings adds nothing here). specdec's rejection_sample takes per-child
// uniforms instead: child c gets 0.0 when SGLang's test passes (the op then accepts it iff its token has
// mass) and 1.0 when it fails (the op never accepts on 1.0). These are the tensor form's operations: float32
// additions from +0 in sibling order, the coin compared in float64. Compiled with -ffp-contract=off.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "host/numpy_ints.h"

namespace py = pybind11;

namespace specdec {
namespace {

template <typename T>
const T* data_of(const py::array& a, const char* name, int64_t n) {
  if (!py::isinstance<py::array_t<T>>(a) || !(a.flags() & py::array::c_style) || a.size() < n)
    throw std::invalid_argument(std::string("sglang host form: ") + name + " must be a C-contiguous array of " +
                                std::to_string(n) + " elements of the expected dtype");
  return static_cast<const T*>(a.data());
}

template <typename T>
T* mutable_of(py::array& a, const char* name, int64_t n) {
  const T* p = data_of<T>(a, name, n);
  if (!a.writeable()) throw std::invalid_argument(std::string("sglang host form: ") + name + " must be writable");
  return const_cast<T*>(p);
}

// A coin or candidate array of either supported dtype, read as double / int64.
struct Reader {
  const void* p;
  int kind;  // 0: int32, 1: int64, 2: float32, 3: float64
  double f(int64_t i) const {
    switch (kind) {
      case 2: return static_cast<const float*>(p)[i];
      case 3: return static_cast<const double*>(p)[i];
      default: throw std::logic_error("sglang host form: not a float array");
    }
  }
  int64_t i(int64_t k) const { return kind == 0 ? static_cast<const int32_t*>(p)[k] : static_cast<const int64_t*>(p)[k]; }
};

Reader ints(const py::array& a, const char* name, int64_t n) {
  if (py::isinstance<py::array_t<int32_t>>(a)) return Reader{data_of<int32_t>(a, name, n), 0};
  return Reader{data_of<int64_t>(a, name, n), 1};
}

Reader floats(const py::array& a, const char* name, int64_t n) {
  if (py::isinstance<py::array_t<float>>(a)) return Reader{data_of<float>(a, name, n), 2};
  return Reader{data_of<double>(a, name, n), 3};
}

// Tokens and the op's uniforms [B * N] (``final`` at the roots). Returns -1 (done) or k >= 0 (child k's
// candidate is outside [0, V): nothing else is meaningful).
int64_t sglang_prepare(const py::array& candidates, const py::array& coins, const py::array& probs, const py::array& kflat_a,
                       const py::array& pflat_a, const py::array& earlier_a, const py::array& final_a, int64_t B,
                       int64_t N, int64_t V, py::array& tokens_a, py::array& u_a) {
  const int64_t BN = B * N, K = kflat_a.size();
  const int64_t W = earlier_a.ndim() == 2 ? earlier_a.shape(1) : 0;
  const Reader cand = ints(candidates, "candidates", BN);
  const Reader coin = floats(coins, "coins", BN);
  const float* p = data_of<float>(probs, "probs", BN * V);
  const int64_t* kflat = data_of<int64_t>(kflat_a, "kflat", K);
  const int64_t* pflat = data_of<int64_t>(pflat_a, "pflat", K);
  const int64_t* earlier = data_of<int64_t>(earlier_a, "earlier", K * W);
  const double* fin = data_of<double>(final_a, "final", B);
  int64_t* tokens = mutable_of<int64_t>(tokens_a, "tokens", BN);
  double* u = mutable_of<double>(u_a, "u", BN);
  std::vector<int64_t> tk(K);
  std::vector<float> mass(K);
  for (int64_t r = 0; r < BN; ++r) {
    tokens[r] = -1;
    u[r] = 0.0;
  }
  for (int64_t b = 0; b < B; ++b) {
    tokens[b * N] = std::min<int64_t>(std::max<int64_t>(cand.i(b * N), 0), V - 1);
    u[b * N] = fin[b];
  }
  for (int64_t k = 0; k < K; ++k) {  // padding may hold anything: only the tree's nodes are read
    const int64_t t = cand.i(kflat[k]);
    if (t < 0 || t >= V) return k;
    tokens[kflat[k]] = tk[k] = t;
  }
  for (int64_t k = 0; k < K; ++k) {
    float s = 0.0f;
    bool dup = false;
    for (int64_t w = 0; w < W; ++w) {
      const int64_t j = earlier[k * W + w];
      if (j >= K) break;  // padding
      s += mass[j];
      dup = dup || tk[j] == tk[k];
    }
    mass[k] = dup ? 0.0f : p[pflat[k] * V + tk[k]];
    const float run = s + mass[k];
    u[kflat[k]] = coin.f(pflat[k]) <= static_cast<double>(run) ? 0.0 : 1.0;  // NaN: 1.0
  }
  return -1;
}


// Entry i of an int32 / int64 output (``wide``: int64) set to v.
inline void put(void* base, bool wide, int64_t i, int64_t v) {
  if (wide) static_cast<int64_t*>(base)[i] = v;
  else static_cast<int32_t*>(base)[i] = int32_t(v);
}

// verify_tree_greedy in one call, for the trees SGLang's builder emits (every link -1 or a higher index
// below N, no node reached by two links): from the root, the first child in sibling order whose candidate
// equals target_predict at the current node's flat index is accepted, at most S - 1 of them. Writes
// accept_index (flat indices, root first, -1 padded), accept_token_num and predicts (the target's token at
// each path node) and returns true; false, with nothing written, for any other input (the adapter's
// general path then checks it and names what is wrong).
bool sglang_greedy(py::array& predicts, py::array& accept_index, py::array& accept_token_num,
                   const py::array& candidates, const py::array& retrive_index, const py::array& next_token,
                   const py::array& next_sibling, const py::array& target_predict) {
  if (candidates.ndim() != 2 || accept_index.ndim() != 2) return false;
  const int64_t B = candidates.shape(0), N = candidates.shape(1), S = accept_index.shape(1), BN = B * N;
  if (B < 1 || N < 1 || S < 1 || accept_index.shape(0) != B || accept_token_num.ndim() != 1 ||
      predicts.ndim() != 1 || !predicts.writeable() || !accept_index.writeable() || !accept_token_num.writeable())
    return false;
  for (const py::array* a : {&retrive_index, &next_token, &next_sibling})
    if (a->ndim() != 2 || a->shape(0) != B || a->shape(1) != N) return false;
  const IntArray cand = int_array(candidates, BN), ri = int_array(retrive_index, BN), nt = int_array(next_token, BN),
                 ns = int_array(next_sibling, BN), tp = int_array(target_predict, BN);
  const IntArray pr = int_array(predicts, BN), ai = int_array(accept_index, B * S), an = int_array(accept_token_num, B);
  if (!cand || !ri || !nt || !ns || !tp || !pr || !ai || !an) return false;
  std::vector<int64_t> path(B * S, -1), count(B, 0);
  std::vector<char> reached(N);
  for (int64_t b = 0; b < B; ++b) {  // check every row before anything is written
    std::fill(reached.begin(), reached.end(), 0);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t r = ri[b * N + i];
      if (r < 0 || r >= BN) return false;
      for (const IntArray* l : {&nt, &ns}) {
        const int64_t j = (*l)[b * N + i];
        if (j == -1) continue;
        if (j <= i || j >= N || reached[j]) return false;
        reached[j] = 1;
      }
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    int64_t cur = 0, k = 0;
    path[b * S] = 0;
    while (k + 1 < S) {
      const int64_t want = tp[ri[b * N + cur]];
      int64_t c = nt[b * N + cur];
      while (c != -1 && cand[b * N + c] != want) c = ns[b * N + c];
      if (c == -1) break;
      path[b * S + ++k] = cur = c;
    }
    count[b] = k;
  }
  std::vector<int64_t> pred_at(B * S);  // read target_predict before predicts is written (they may alias)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j <= count[b]; ++j) pred_at[b * S + j] = tp[ri[b * N + path[b * S + j]]];
  void* const ai_out = accept_index.mutable_data();
  void* const an_out = accept_token_num.mutable_data();
  void* const pr_out = predicts.mutable_data();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < S; ++j) put(ai_out, ai.wide, b * S + j, j <= count[b] ? ri[b * N + path[b * S + j]] : -1);
    put(an_out, an.wide, b, count[b]);
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j <= count[b]; ++j) put(pr_out, pr.wide, ri[b * N + path[b * S + j]], pred_at[b * S + j]);
  return true;
}

}  // namespace

void bind_sglang_host(py::module_& m) {
  m.def("sglang_prepare", &sglang_prepare, py::arg("candidates"), py::arg("coins"), py::arg("probs"), py::arg("kflat"),
        py::arg("pflat"), py::arg("earlier"), py::arg("final"), py::arg("B"), py::arg("N"), py::arg("V"),
        py::arg("tokens"), py::arg("u"),
        "SGLang exact sampler, host form: the op's tokens and per-child uniforms (csrc/host/sglang_host.cpp).");
  m.def("sglang_greedy", &sglang_greedy, py::arg("predicts"), py::arg("accept_index"), py::arg("accept_token_num"),
        py::arg("candidates"), py::arg("retrive_index"), py::arg("retrive_next_token"),
        py::arg("retrive_next_sibling"), py::arg("target_predict"),
        "SGLang verify_tree_greedy on builder-form trees in one call, or False (csrc/host/sglang_host.cpp).");
}

}  // namespace specdec
