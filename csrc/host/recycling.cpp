// specdec._C.recycling_observe: TokenRecycling's table update after a verify pass, on the
// host, in one call (the CPU path of TokenRecycling.observe_verify; a CUDA target keeps the
// torch path, which runs on the device with no host synchronisation).
//
// For every node of the pass (row-major over [b, N], padding = token -1 skipped) the w
// tokens with the largest logits, in decreasing order (equal logits: the lower token id
// first; NaN logits are never chosen), are written into the node token's row of the
// one-token table and, when the node has a previous token (its parent's token, or for a
// root the token before it in its sequence), into the pair table's hashed row with the
// pair's key. Nodes are written in flat order, so when two nodes share a row the later one
// wins: the same rule as the torch path (which sends the earlier writes to a sink row).
//
// The arrays are numpy views of the drafter's tensors (shared memory); they must be
// C-contiguous with the exact dtypes (no converting copy is ever made, so the writes land
// in the tables). Cost on the bundled target's shapes (13 nodes, V = 49152, 2 threads): the
// top-w pass reads the logits once, testing the maximum of every 32 values against the
// current w-th value; 28 us for this call, 41 us for observe_verify with it, against 318 us
// for the ~45 small torch calls of the torch path.
#include <ATen/Parallel.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace specdec {
namespace {

constexpr int kMaxW = 64;
constexpr uint64_t kPairHash = 0x9E3779B1ull;  // specdec/drafters/recycling.py: _HASH

// The w largest of x[0, V) as indices, largest first; ties: lower index first.
void top_w(const float* x, int64_t V, int w, int64_t* out) {
  float val[kMaxW + 1];
  int64_t idx[kMaxW + 1];
  int n = 0;
  auto insert = [&](float v, int64_t i) {  // v beats val[w - 1] (or n < w)
    int p = n < w ? n : w - 1;
    while (p > 0 && val[p - 1] < v) {
      val[p] = val[p - 1];
      idx[p] = idx[p - 1];
      --p;
    }
    val[p] = v;
    idx[p] = i;
    if (n < w) ++n;
  };
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t k = 0;
  for (; k < V && n < w; ++k) insert(std::isnan(x[k]) ? ninf : x[k], k);
  float thr = val[w - 1];
  // 32 values per step: their maximum is tested against the current w-th value (SSE, baseline x86-64);
  // a scalar pass only when it wins (rare after the first few thousand logits)
#if defined(__SSE2__)
  for (; k + 32 <= V; k += 32) {
    const float* p = x + k;
    const __m128 m = _mm_max_ps(
        _mm_max_ps(_mm_max_ps(_mm_loadu_ps(p), _mm_loadu_ps(p + 4)), _mm_max_ps(_mm_loadu_ps(p + 8), _mm_loadu_ps(p + 12))),
        _mm_max_ps(_mm_max_ps(_mm_loadu_ps(p + 16), _mm_loadu_ps(p + 20)),
                   _mm_max_ps(_mm_loadu_ps(p + 24), _mm_loadu_ps(p + 28))));
    if (!_mm_movemask_ps(_mm_cmpgt_ps(m, _mm_set1_ps(thr)))) continue;
    for (int j = 0; j < 32; ++j) {
      if (p[j] > thr) {
        insert(p[j], k + j);
        thr = val[w - 1];
      }
    }
  }
#endif
  for (; k < V; ++k) {
    if (x[k] > thr) {
      insert(x[k], k);
      thr = val[w - 1];
    }
  }
  for (int j = 0; j < w; ++j) out[j] = idx[j];
}

std::string shape_of(const py::array& a) {
  std::string s = "[";
  for (py::ssize_t d = 0; d < a.ndim(); ++d) s += (d ? ", " : "") + std::to_string(a.shape(d));
  return s + "]";
}

template <typename T>
T* data_of(py::array& a, const char* name, bool write) {
  if (!a.dtype().is(py::dtype::of<T>()))
    throw std::invalid_argument(std::string("recycling_observe: ") + name + " must be " +
                                py::str(py::dtype::of<T>()).cast<std::string>() + ", got " +
                                py::str(a.dtype()).cast<std::string>());
  if (!(a.flags() & py::array::c_style))
    throw std::invalid_argument(std::string("recycling_observe: ") + name + " must be C-contiguous");
  if (write && !a.writeable())
    throw std::invalid_argument(std::string("recycling_observe: ") + name + " must be writeable");
  return static_cast<T*>(write ? a.mutable_data() : const_cast<void*>(a.data()));
}

void recycling_observe(py::array table, py::object pair_table_obj, py::object pair_keys_obj, py::array tokens,
                       py::array parents, py::object prev_roots_obj, py::array logits) {
  if (tokens.ndim() != 2 || parents.ndim() != 2 || tokens.shape(0) != parents.shape(0) ||
      tokens.shape(1) != parents.shape(1))
    throw std::invalid_argument("recycling_observe: tokens and parents must both be [b, N], got " + shape_of(tokens) +
                                " and " + shape_of(parents));
  const int64_t b = tokens.shape(0), N = tokens.shape(1), M = b * N;
  if (logits.ndim() != 3 || logits.shape(0) != b || logits.shape(1) != N)
    throw std::invalid_argument("recycling_observe: logits must be [b, N, V] for tokens " + shape_of(tokens) +
                                ", got " + shape_of(logits));
  const int64_t V = logits.shape(2);
  if (table.ndim() != 2 || table.shape(0) < V + 1)
    throw std::invalid_argument("recycling_observe: table must be [>= V + 1, w] with V = " + std::to_string(V) +
                                ", got " + shape_of(table));
  const int w = static_cast<int>(table.shape(1));
  if (w < 1 || w > kMaxW || w > V)
    throw std::invalid_argument("recycling_observe: table width must be in [1, min(64, V)], got " + std::to_string(w));
  int64_t* tab = data_of<int64_t>(table, "table", true);
  const int64_t* tok = data_of<int64_t>(tokens, "tokens", false);
  const int32_t* par = data_of<int32_t>(parents, "parents", false);
  const float* lg = data_of<float>(logits, "logits", false);
  int64_t* ptab = nullptr;
  int64_t* pkeys = nullptr;
  int64_t H = 0;
  if (!pair_table_obj.is_none()) {
    py::array pt = pair_table_obj.cast<py::array>(), pk = pair_keys_obj.cast<py::array>();
    if (pt.ndim() != 2 || pt.shape(1) != w || pk.ndim() != 1 || pk.shape(0) != pt.shape(0) || pt.shape(0) < 2)
      throw std::invalid_argument("recycling_observe: pair_table must be [H + 1, w] and pair_keys [H + 1]");
    H = pt.shape(0) - 1;
    if (H & (H - 1)) throw std::invalid_argument("recycling_observe: the pair table needs a power-of-two row count");
    ptab = data_of<int64_t>(pt, "pair_table", true);
    pkeys = data_of<int64_t>(pk, "pair_keys", true);
  }
  std::vector<int64_t> prev_roots(b, -1);
  if (!prev_roots_obj.is_none()) {
    py::array pr = prev_roots_obj.cast<py::array>();
    if (pr.ndim() == 1 && pr.shape(0) == b) {
      const int64_t* p = data_of<int64_t>(pr, "prev_roots", false);
      prev_roots.assign(p, p + b);
    }
  }
  for (int64_t i = 0; i < M; ++i) {
    if (tok[i] >= V) throw std::invalid_argument("recycling_observe: token " + std::to_string(tok[i]) +
                                                 " outside the vocabulary of " + std::to_string(V));
    if (par[i] >= N)
      throw std::invalid_argument("recycling_observe: parent index " + std::to_string(par[i]) +
                                  " outside the tree of " + std::to_string(N) + " nodes");
  }
  std::vector<int64_t> top(M * w);
  {
    py::gil_scoped_release release;
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        if (tok[i] >= 0) top_w(lg + i * V, V, w, top.data() + i * w);
    });
  }
  for (int64_t i = 0; i < M; ++i) {
    const int64_t t = tok[i];
    if (t < 0) continue;
    std::memcpy(tab + t * w, top.data() + i * w, w * sizeof(int64_t));
    if (!ptab) continue;
    const int64_t r = i / N, p = par[i];
    const int64_t prev = p < 0 ? prev_roots[r] : tok[r * N + p];
    if (prev < 0) continue;
    const int64_t key = prev * V + t;
    const int64_t row = static_cast<int64_t>((static_cast<uint64_t>(key) * kPairHash) & static_cast<uint64_t>(H - 1));
    std::memcpy(ptab + row * w, top.data() + i * w, w * sizeof(int64_t));
    pkeys[row] = key;
  }
}

}  // namespace

void bind_recycling(py::module_& m) {
  m.def("recycling_observe", &recycling_observe, py::arg("table").noconvert(), py::arg("pair_table"),
        py::arg("pair_keys"), py::arg("tokens").noconvert(), py::arg("parents").noconvert(), py::arg("prev_roots"),
        py::arg("logits").noconvert(),
        "TokenRecycling's table update from one verify pass (numpy views of the tables, written in place): "
        "the top-w tokens of every node's logits into its token's row and its (previous token, token) pair's row.");
}

}  // namespace specdec
