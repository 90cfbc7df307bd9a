// The CPU linear kernel compiled with -mavx2 -mfma -mf16c (see CMakeLists.txt); chosen at
// run time by csrc/cpu/linear.cpp when the CPU supports all three.
#define SPECDEC_CPU_ISA avx2
#include "specdec/cpu_linear.h"
#include "specdec/cpu_qlinear.h"
#include "specdec/cpu_gemm.h"

namespace specdec {
namespace cpu {

void linear_rows_avx2(const LinearParams& P, int64_t n_begin, int64_t n_end) {
  avx2::linear_rows(P, n_begin, n_end);
}

void gemm_linear_rows_avx2(const LinearParams& P, int64_t n_begin, int64_t n_end, float* scratch) {
  avx2::gemm_linear_rows(P, n_begin, n_end, scratch);
}

void gemm_q_rows_avx2(const QLinearParams& P, int64_t n_begin, int64_t n_end, float* scratch) {
  avx2::gemm_q_rows(P, n_begin, n_end, scratch);
}

void qlinear_rows_avx2(const QLinearParams& P, int64_t n_begin, int64_t n_end) {
  avx2::qlinear_rows(P, n_begin, n_end);
}

}  // namespace cpu
}  // namespace specdec
