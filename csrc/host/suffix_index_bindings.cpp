// pybind11 class specdec._C.SuffixIndex and specdec._C.suffix_speculate (the host-side
// structure of SuffixDrafter / DocumentDrafter). The GIL is released while the trie is
// read or updated: arguments are converted to C++ vectors first, so another Python
// thread may run (and other readers may query the same index) meanwhile.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "specdec/suffix_index.h"

namespace py = pybind11;

namespace specdec {

void bind_suffix_index(py::module_& m) {
  using gil_release = py::call_guard<py::gil_scoped_release>;
  py::class_<SuffixIndex>(m, "SuffixIndex",
                          "Depth-bounded suffix trie over a FIFO store of token documents with occurrence counts "
                          "(see csrc/include/specdec/suffix_index.h).")
      .def(py::init<int, int64_t, int64_t, int64_t>(), py::arg("max_depth") = 32, py::arg("max_tokens") = 0,
           py::arg("max_docs") = 0, py::arg("vocab_size") = 0)
      .def("add", &SuffixIndex::add, py::arg("tokens"), gil_release(),
           "Add a document (FIFO eviction to the budget first); returns its id.")
      .def("extend", &SuffixIndex::extend, py::arg("doc"), py::arg("tokens"), gil_release(),
           "Append tokens to a live document: O(new tokens * max_depth).")
      .def("remove", &SuffixIndex::remove, py::arg("doc"), gil_release())
      .def("clear", &SuffixIndex::clear, gil_release())
      .def("set_vocab_size", &SuffixIndex::set_vocab_size, py::arg("vocab_size"))
      .def_property_readonly("num_tokens", &SuffixIndex::num_tokens)
      .def_property_readonly("num_docs", &SuffixIndex::num_docs)
      .def_property_readonly("num_nodes", &SuffixIndex::num_nodes)
      .def_property_readonly("max_depth", &SuffixIndex::max_depth)
      .def_property_readonly("max_tokens", &SuffixIndex::max_tokens)
      .def_property_readonly("max_docs", &SuffixIndex::max_docs)
      .def_property_readonly("vocab_size", &SuffixIndex::vocab_size)
      .def("memory_bytes", &SuffixIndex::memory_bytes, "Host bytes held (node pool, hash map, documents).")
      .def("doc_ids", &SuffixIndex::doc_ids)
      .def("doc_tokens", &SuffixIndex::doc_tokens, py::arg("doc"))
      .def("continuations", &SuffixIndex::continuations, py::arg("context"), py::arg("max_match"),
           py::arg("min_match") = 1, gil_release(),
           "(match_len, [(token, count), ...] sorted by token) after the longest suffix of context "
           "(<= max_match) that occurs with a continuation.");

  m.def(
      "suffix_speculate",
      [](const std::vector<const SuffixIndex*>& sources, const std::vector<int64_t>& context, int max_match,
         int min_match, int max_nodes, int max_spec, double spec_factor, double spec_offset, double min_token_prob) {
        SuffixSpeculateParams prm{max_match, min_match, max_nodes, max_spec, spec_factor, spec_offset, min_token_prob};
        SuffixSpeculation s;
        {
          py::gil_scoped_release release;
          s = SuffixIndex::speculate(sources, context.data(), static_cast<int>(context.size()), prm);
        }
        return py::make_tuple(s.tokens, s.parents, s.probs, s.match_len);
      },
      py::arg("sources"), py::arg("context"), py::arg("max_match"), py::arg("min_match"), py::arg("max_nodes"),
      py::arg("max_spec"), py::arg("spec_factor"), py::arg("spec_offset"), py::arg("min_token_prob"),
      "Token tree from the longest context-suffix match in each source: (tokens, parents, probs, match_len); "
      "parents index the draft nodes 1.. with 0 = the root.");
}

}  // namespace specdec
