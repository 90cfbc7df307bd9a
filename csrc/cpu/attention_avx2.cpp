// The CPU attention kernel compiled with -mavx2 -mfma (see CMakeLists.txt); chosen at
// run time by csrc/cpu/attention.cpp when the CPU supports both.
#define SPECDEC_CPU_ISA avx2
#include "specdec/cpu_attention.h"

namespace specdec {
namespace cpu {

void attention_range_avx2(const AttentionParams& P, int64_t begin, int64_t end) {
  thread_local avx2::AttentionScratch scratch;  // reused across calls (see attention_task)
  avx2::attention_range(P, begin, end, scratch);
}

}  // namespace cpu
}  // namespace specdec
