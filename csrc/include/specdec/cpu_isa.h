// Run-time ISA detection for the CPU kernels that are compiled twice (baseline and
// AVX2+FMA(+F16C) translation units) and dispatched per call.
#pragma once

namespace specdec {
namespace cpu {

// True when the CPU runs the AVX2 + FMA (+ F16C) builds (every x86 CPU with AVX2 has F16C).
inline bool has_avx2_fma_f16c() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

// True when the CPU (and the OS, which must save zmm state) runs the AVX-512 F / DQ / VL build
// (csrc/cpu/linear_avx512.cpp) on top of the AVX2 one.
inline bool has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = has_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

}  // namespace cpu
}  // namespace specdec
