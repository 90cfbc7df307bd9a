// The all-greedy CPU batch of specdec.compat.vllm.rejection_sample in one call: the pybind11 function
// specdec._C.vllm_greedy over NumPy views of the caller's tensors (no copies).
//
// A batch where every request has the same S >= 1 drafts and every row is greedy (temperature <= 0; the
// draft distributions, if given, are only checked for their shape: greedy rows do not read them):
// request b's rows j = 0 .. S - 1 of target_probs check draft j; draft j is accepted iff it is its row's
// argmax (greedy_verify's argmax: first index of the maximum, NaN counts as the maximum), the first
// rejected row emits its argmax, and a request whose S drafts all pass emits its bonus token. Output
// [B, max_spec_len + 1] int32, -1 after the emitted tokens: what the adapter's tensor form gives.
//
// Anything else (ragged counts, a sampled row, a token id outside [0, V), an array of another dtype or
// layout, counts that do not add up) returns None, and the adapter takes its general path, which raises
// its own errors: this function decides nothing it would refuse.
#include <ATen/Parallel.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "host/numpy_ints.h"
#include "specdec/tree_walk.h"

namespace py = pybind11;

namespace specdec {
namespace {

py::object vllm_greedy(const py::array& draft_ids, const py::list& num_draft_tokens,
                       const py::array& cu_num_draft_tokens, const py::array& target_probs,
                       const py::array& bonus_token_ids, const py::object& temperature, int64_t max_spec_len,
                       const py::object& draft_probs) {
  // the counts: a list of exact ints (a bool or another type is the general path's error to raise)
  const int64_t B = int64_t(PyList_GET_SIZE(num_draft_tokens.ptr()));
  std::vector<int64_t> n(B);
  for (int64_t b = 0; b < B; ++b) {
    PyObject* x = PyList_GET_ITEM(num_draft_tokens.ptr(), b);
    if (!PyLong_CheckExact(x)) return py::none();
    int overflow = 0;
    n[b] = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow) return py::none();
  }
  if (B == 0 || draft_ids.ndim() != 1 || cu_num_draft_tokens.ndim() != 1 || target_probs.ndim() != 2 ||
      bonus_token_ids.ndim() != 2 || bonus_token_ids.shape(1) != 1 || bonus_token_ids.shape(0) != B)
    return py::none();
  const int64_t S = n[0], T = draft_ids.shape(0), V = target_probs.shape(1);
  if (S < 1 || max_spec_len < S || T != B * S || target_probs.shape(0) != T || V < 1) return py::none();
  if (!py::isinstance<py::array_t<float>>(target_probs) || !(target_probs.flags() & py::array::c_style))
    return py::none();
  const IntArray d = int_array(draft_ids, T), cu = int_array(cu_num_draft_tokens, B),
                 bonus = int_array(bonus_token_ids, B);
  if (!d || !cu || !bonus) return py::none();
  for (int64_t b = 0; b < B; ++b) {
    if (n[b] != S || cu[b] != (b + 1) * S) return py::none();
    if (bonus[b] < 0 || bonus[b] >= V) return py::none();
  }
  for (int64_t i = 0; i < T; ++i)
    if (d[i] < 0 || d[i] >= V) return py::none();
  if (!temperature.is_none()) {  // a [B] float32 / float64 temperature: every row greedy (<= 0; NaN is not)
    const py::array t = py::reinterpret_borrow<py::array>(temperature);
    if (t.ndim() != 1 || t.shape(0) != B || !(t.flags() & py::array::c_style)) return py::none();
    for (int64_t b = 0; b < B; ++b) {
      double x;
      if (py::isinstance<py::array_t<float>>(t)) x = static_cast<const float*>(t.data())[b];
      else if (py::isinstance<py::array_t<double>>(t)) x = static_cast<const double*>(t.data())[b];
      else return py::none();
      if (!(x <= 0.0)) return py::none();
    }
  }
  if (!draft_probs.is_none()) {  // unread by greedy rows, but the general path would refuse a malformed one
    const py::array q = py::reinterpret_borrow<py::array>(draft_probs);
    if (q.ndim() != 2 || q.shape(0) != T || q.shape(1) != V || q.dtype().kind() != 'f') return py::none();
  }
  const int64_t W = max_spec_len + 1;
  py::array_t<int32_t> out({B, W});
  int32_t* o = out.mutable_data();
  const float* rows = static_cast<const float*>(target_probs.data());
  {
    py::gil_scoped_release nogil;
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        int32_t* ob = o + b * W;
        int64_t j = 0;
        for (; j < S; ++j) {
          const int64_t a = cpu::argmax_row(rows + (b * S + j) * V, V, [](float x) { return x; });
          ob[j] = int32_t(a);
          if (a != d[b * S + j]) break;
        }
        int64_t next = j + 1;
        if (j == S) ob[S] = int32_t(bonus[b]), next = S + 1;
        for (int64_t c = next; c < W; ++c) ob[c] = -1;
      }
    });
  }
  return std::move(out);
}

}  // namespace

void bind_vllm_host(py::module_& m) {
  m.def("vllm_greedy", &vllm_greedy, py::arg("draft_ids"), py::arg("num_draft_tokens"),
        py::arg("cu_num_draft_tokens"), py::arg("target_probs"), py::arg("bonus_token_ids"), py::arg("temperature"),
        py::arg("max_spec_len"), py::arg("draft_probs"),
        "vLLM rejection_sample, all-greedy equal-count CPU batches in one call, or None (csrc/host/vllm_host.cpp).");
}

}  // namespace specdec
