// The CPU attention kernel compiled with -mavx2 -mfma (see CMakeLists.txt); chosen at
// run time by csrc/cpu/attention.cpp when the CPU supports both.
#define SPECDEC_CPU_ISA avx2
#include <memory>

#include "specdec/cpu_attention.h"

namespace specdec {
namespace cpu {

void attention_range_avx2(const AttentionParams& P, int64_t begin, int64_t end) {
  // Reused across calls (see attention_task); held by pointer: with the thread_local object itself inlined
  // into the kernel, GCC re-derived its address (a __tls_get_addr call) inside the key loops.
  thread_local std::unique_ptr<avx2::AttentionScratch> scratch;
  if (!scratch) scratch = std::make_unique<avx2::AttentionScratch>();
  avx2::attention_range(P, begin, end, *scratch);
}

}  // namespace cpu
}  // namespace specdec
