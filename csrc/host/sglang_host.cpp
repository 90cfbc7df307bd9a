// The per-child float64 work of specdec.compat.sglang's exact tree sampler on CPU batches
// (specdec/compat/sglang_host.py): pybind11 functions specdec._C.sglang_prepare and
// specdec._C.sglang_uniforms over NumPy arrays (views of the caller's tensors, no copies).
//
// SGLang's coin u at a node accepts child c iff u <= P_c, P_c the node's target mass of the
// children tried so far, c included; specdec's rejection_sample takes per-child uniforms instead:
// child c gets (u - P_prev) / (S_row - P_prev), clamped to [0, 1] (1 when S_row - P_prev <= 0),
// P_prev the earlier siblings' mass (a token repeated among siblings counts once), S_row the row's
// float32 sum. These are the tensor form's float64 operations, in the same order: P_prev is summed
// from +0 over the earlier siblings in sibling order, and the caller takes this path only when
// every P_prev has at most two nonzero terms and every mass is finite (then any order gives the same
// sum, so the result is the tensor form's reduction; otherwise sglang_prepare returns -2 and the
// caller's array form lets torch reduce). Compiled with -ffp-contract=off (no fused multiply-add).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

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

// Tokens, earlier-sibling masses and the rows the walk is likely to stand on (a child is unlikely when its
// parent's coin exceeds the earlier mass by more than its own mass times 1 + slack). Returns -1 (done),
// -2 (a P_prev of three or more nonzero terms, or a mass that is not finite: use the array form;
// the outputs are then partial) or k >= 0 (child k's candidate is outside [0, V): nothing else
// is meaningful).
int64_t sglang_prepare(const py::array& candidates, const py::array& coins, const py::array& probs, const py::array& kflat_a,
                       const py::array& pflat_a, const py::array& earlier_a, int64_t B, int64_t N, int64_t V,
                       double slack, py::array& tokens_a, py::array& p_prev_a, py::array& likely_a) {
  const int64_t BN = B * N, K = kflat_a.size();
  const int64_t W = earlier_a.ndim() == 2 ? earlier_a.shape(1) : 0;
  const Reader cand = ints(candidates, "candidates", BN);
  const Reader coin = floats(coins, "coins", BN);
  const float* p = data_of<float>(probs, "probs", BN * V);
  const int64_t* kflat = data_of<int64_t>(kflat_a, "kflat", K);
  const int64_t* pflat = data_of<int64_t>(pflat_a, "pflat", K);
  const int64_t* earlier = data_of<int64_t>(earlier_a, "earlier", K * W);
  int64_t* tokens = mutable_of<int64_t>(tokens_a, "tokens", BN);
  double* p_prev = mutable_of<double>(p_prev_a, "p_prev", K);
  bool* likely = mutable_of<bool>(likely_a, "likely", BN);
  std::vector<int64_t> tk(K);
  std::vector<double> p_child(K), mass(K);
  for (int64_t r = 0; r < BN; ++r) {
    tokens[r] = -1;
    likely[r] = false;
  }
  for (int64_t b = 0; b < B; ++b) {
    tokens[b * N] = std::min<int64_t>(std::max<int64_t>(cand.i(b * N), 0), V - 1);
    likely[b * N] = true;
  }
  for (int64_t k = 0; k < K; ++k) {  // padding may hold anything: only the tree's nodes are read
    const int64_t t = cand.i(kflat[k]);
    if (t < 0 || t >= V) return k;
    tokens[kflat[k]] = tk[k] = t;
    p_child[k] = p[pflat[k] * V + t];  // the float32 value, exactly
  }
  bool spread = false;
  for (int64_t k = 0; k < K; ++k) {  // parents come before their children: likely[pflat[k]] is final here
    double s = 0.0;
    int nonzero = 0;
    bool dup = false;
    for (int64_t w = 0; w < W; ++w) {
      const int64_t j = earlier[k * W + w];
      if (j >= K) break;  // padding
      s += mass[j];
      nonzero += mass[j] != 0.0;
      dup = dup || tk[j] == tk[k];
    }
    const double m = dup ? 0.0 : p_child[k];
    spread = spread || nonzero >= 3 || !(m - m == 0.0);
    mass[k] = m;
    p_prev[k] = s;
    const int64_t par = pflat[k];
    if (likely[par] && !(coin.f(par) - s > p_child[k] * (1.0 + slack) + 1e-300)) likely[kflat[k]] = true;  // NaN: likely
  }
  return spread ? -2 : -1;
}

// The op's uniforms [B * N]: each child's mapping where its parent's row sum is known, 1.0 where it
// is not (never read unless the walk stands on that row: the caller checks), ``final`` at the roots.
void sglang_uniforms(const py::array& kflat_a, const py::array& pflat_a, const py::array& coins, const py::array& p_prev_a,
                     const py::array& sums_a, const py::array& known_a, const py::array& final_a, int64_t B, int64_t N,
                     py::array& u_a) {
  const int64_t BN = B * N, K = kflat_a.size();
  const int64_t* kflat = data_of<int64_t>(kflat_a, "kflat", K);
  const int64_t* pflat = data_of<int64_t>(pflat_a, "pflat", K);
  const Reader coin = floats(coins, "coins", BN);
  const double* p_prev = data_of<double>(p_prev_a, "p_prev", K);
  const double* sums = data_of<double>(sums_a, "sums", BN);
  const bool* known = data_of<bool>(known_a, "known", BN);
  const double* fin = data_of<double>(final_a, "final", B);
  double* u = mutable_of<double>(u_a, "u", BN);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t par = pflat[k];
    if (!known[par]) {
      u[kflat[k]] = 1.0;
      continue;
    }
    const double pp = p_prev[k], denom = sums[par] - pp;
    const double x = denom > 0 ? (coin.f(par) - pp) / denom : 1.0;
    u[kflat[k]] = std::min(std::max(x, 0.0), 1.0);  // NaN stays NaN, as Python's min / max and torch.clamp
  }
  for (int64_t b = 0; b < B; ++b) u[b * N] = fin[b];
}

}  // namespace

void bind_sglang_host(py::module_& m) {
  m.def("sglang_prepare", &sglang_prepare, py::arg("candidates"), py::arg("coins"), py::arg("probs"), py::arg("kflat"),
        py::arg("pflat"), py::arg("earlier"), py::arg("B"), py::arg("N"), py::arg("V"), py::arg("slack"), py::arg("tokens"),
        py::arg("p_prev"), py::arg("likely"),
        "SGLang exact sampler, host form: tokens, earlier-sibling masses and likely rows (csrc/host/sglang_host.cpp).");
  m.def("sglang_uniforms", &sglang_uniforms, py::arg("kflat"), py::arg("pflat"), py::arg("coins"), py::arg("p_prev"),
        py::arg("sums"), py::arg("known"), py::arg("final"), py::arg("B"), py::arg("N"), py::arg("u"),
        "SGLang exact sampler, host form: the op's per-child uniforms (csrc/host/sglang_host.cpp).");
}

}  // namespace specdec
