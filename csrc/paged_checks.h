// Argument validation of the paged KV ops (csrc/cpu/paged_*.cpp, csrc/cuda/paged_kv.cu), in the
// style of csrc/checks.h: metadata always; the values of block_tables, cache_lens and the accepted
// paths for CPU tensors always and for CUDA tensors in strict mode only. Nothing is written before
// every check has passed.
//
// Layout (NHD): k_pages / v_pages [num_pages, page_size, Hkv, D] contiguous; block_tables
// [B, max_blocks] int32 (entry j of row b: the page of positions [j * page_size, (j + 1) * page_size));
// cache_lens [B] int32. A row's capacity is max_blocks * page_size; only the blocks that hold a
// position the op reads or writes are checked (the rest of a row may be any value, -1 padding included).
#pragma once

#include <optional>

#include <ATen/ATen.h>

namespace specdec {
namespace checks {

void verify_attention_paged(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                            const at::Tensor& block_tables, const at::Tensor& cache_lens,
                            const std::optional<at::Tensor>& tree_mask, double scale);
void append_kv_paged(const at::Tensor& k_pages, const at::Tensor& v_pages, const at::Tensor& k_new,
                     const at::Tensor& v_new, const at::Tensor& block_tables, const at::Tensor& cache_lens,
                     int64_t offset);
void kv_commit_paged(at::TensorList k_pages, at::TensorList v_pages, const at::Tensor& block_tables,
                     const at::Tensor& cache_lens, const at::Tensor& accepted, const at::Tensor& num_accepted);

}  // namespace checks
}  // namespace specdec
