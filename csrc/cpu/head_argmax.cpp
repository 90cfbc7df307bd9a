// The blocked argmax behind linear_argmax / qlinear_argmax on the CPU (csrc/cpu/head_argmax.h): slabs of the
// vocabulary computed into a per-thread buffer and reduced to their first maximum, then the slabs' winners
// merged in column order. The argmax semantics are torch.argmax's (tree_walk.h's argmax_row: the first NaN, else
// the first index of the maximum), so a row's answer equals torch.argmax of the op's materialised result.
#include "cpu/head_argmax.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <vector>

#include "specdec/cpu_argmax.h"
#include "specdec/cpu_isa.h"

namespace specdec {
namespace cpu {
namespace {

int64_t argmax_scalar(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(row[j])) return j;
    if (row[j] > row[best]) best = j;
  }
  return best;
}

inline int64_t argmax_f32(const float* row, int64_t n) {
  return has_avx2_fma_f16c() ? argmax_f32_avx2(row, n) : argmax_scalar(row, n);
}

// Round n values to dtype and back (the op's result is in x's dtype; its argmax is taken there).
void round_to(float* y, int64_t n, at::ScalarType dtype) {
  if (dtype == at::kHalf)
    for (int64_t j = 0; j < n; ++j) y[j] = static_cast<float>(c10::Half(y[j]));
  else if (dtype == at::kBFloat16)
    for (int64_t j = 0; j < n; ++j) y[j] = static_cast<float>(c10::BFloat16(y[j]));
}

}  // namespace

void blocked_argmax(int64_t M, int64_t N, at::ScalarType out_dtype, const ArgmaxSlab& slab, int64_t* out) {
  if (M <= 0) return;
  TORCH_CHECK(N >= 1, "blocked_argmax: no column to take an argmax over");
  const int64_t slabs = (N + kArgmaxSlab - 1) / kArgmaxSlab;
  // per slab and row: the column of its first maximum (or first NaN) and its value (the calling thread's, kept
  // across calls: the tasks below write disjoint entries)
  thread_local std::vector<int64_t> idx;
  thread_local std::vector<float> val;
  if (idx.size() < size_t(slabs * M)) {
    idx.resize(size_t(slabs * M));
    val.resize(size_t(slabs * M));
  }
  int64_t* const idx_p = idx.data();  // the tasks write through these (a thread_local named in the lambda would be
  float* const val_p = val.data();    // the executing thread's own)
  at::parallel_for(0, slabs, 1, [&](int64_t s0, int64_t s1) {
    thread_local std::vector<float> buf;
    if (buf.size() < size_t(M * kArgmaxSlab)) buf.resize(M * kArgmaxSlab);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t n0 = s * kArgmaxSlab, n = std::min(kArgmaxSlab, N - n0);
      slab(n0, n0 + n, buf.data(), kArgmaxSlab);
      for (int64_t m = 0; m < M; ++m) {
        float* row = buf.data() + m * kArgmaxSlab;
        round_to(row, n, out_dtype);
        const int64_t j = argmax_f32(row, n);
        idx_p[s * M + m] = n0 + j;
        val_p[s * M + m] = row[j];
      }
    }
  });
  for (int64_t m = 0; m < M; ++m) {  // slabs in column order: the first NaN, else the first strict maximum
    int64_t best = idx[m];
    float bv = val[m];
    for (int64_t s = 0; s < slabs && !std::isnan(bv); ++s) {
      const float v = val[s * M + m];
      if (std::isnan(v) || v > bv) {
        bv = v;
        best = idx[s * M + m];
      }
    }
    out[m] = best;
  }
}

at::Tensor argmax_rows_cpu(const at::Tensor& y_in) {
  const int64_t N = y_in.size(-1), M = N > 0 ? y_in.numel() / N : 0;
  at::Tensor out = at::empty({M}, y_in.options().dtype(at::kLong));
  if (M == 0) return out;
  const at::Tensor y = y_in.reshape({M, N}).to(at::kFloat).contiguous();  // exact: half / bf16 widen exactly
  const float* p = y.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) o[m] = argmax_f32(p + m * N, N);
  });
  return out;
}

}  // namespace cpu
}  // namespace specdec
