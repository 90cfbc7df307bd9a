// qlinear_q8act's AVX-VNNI tier (VEX vpdpbusd on ymm), compiled with -mavx2 -mfma -mf16c -mavxvnni
// -ffp-contract=off (CMakeLists.txt); the AVX2 tier's bits.
#define Q8ACT_NS avxvnni_q8
#define Q8ACT_VNNI 1
#include "cpu/qlinear_q8act_ymm.h"

namespace specdec {
namespace cpu {

void q8act_rows_avxvnni(const Q8ActParams& P, int64_t t_begin, int64_t t_end) {
  avxvnni_q8::rows(P, t_begin, t_end);
}

}  // namespace cpu
}  // namespace specdec
