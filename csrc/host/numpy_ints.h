// An int32 / int64 NumPy array read as int64, for the host functions over NumPy views of the caller's
// tensors (csrc/host/sglang_host.cpp, csrc/host/vllm_host.cpp).
#pragma once

#include <pybind11/numpy.h>

#include <cstdint>

namespace specdec {

struct IntArray {
  const void* p = nullptr;  // null: the array is not a C-contiguous int32 / int64 array of the asked size
  bool wide = false;        // int64 (else int32)
  int64_t operator[](int64_t i) const {
    return wide ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
  }
  explicit operator bool() const { return p != nullptr; }
};

// ``a`` as an IntArray when it is C-contiguous, int32 or int64, and holds exactly ``n`` entries.
inline IntArray int_array(const pybind11::array& a, int64_t n) {
  IntArray r;
  if (!(a.flags() & pybind11::array::c_style) || a.size() != n) return r;
  if (pybind11::isinstance<pybind11::array_t<int64_t>>(a)) r.wide = true;
  else if (!pybind11::isinstance<pybind11::array_t<int32_t>>(a)) return r;
  r.p = a.data();
  return r;
}

}  // namespace specdec
