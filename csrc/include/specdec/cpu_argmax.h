// The first index of a float32 row's maximum (NaN counts as maximal, the first NaN wins: torch.argmax's
// semantics), vectorized: csrc/cpu/argmax_avx2.cpp, chosen at run time by tree_walk.h's argmax_row.
#pragma once

#include <cstdint>

namespace specdec {
namespace cpu {

int64_t argmax_f32_avx2(const float* row, int64_t V);

}  // namespace cpu
}  // namespace specdec
