// kv_commit over paged caches, CPU backend: for every layer, K and V, request, position
// cache_lens[b] + i takes the row at cache_lens[b] + accepted[b, i] (both through the row's block
// table), i = 1..num_accepted[b]; node 0 (the root) is always in place. As in the dense kv_commit
// (csrc/cpu/kv_commit.cpp) the moves of a task run in ascending order, which is overlap-safe
// (accepted is increasing and accepted[b, i] >= i), identity moves are skipped (a chain moves no
// byte), and the moved rows lie among the step's new positions, i.e. in the row's last pages.
// At page size 1 a row is a page: the same moves, one slot each (a caller that owns its token
// pool may rewrite its block table instead; see specdec.paged_ops.commit_block_table).
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"
#include "paged_checks.h"

namespace specdec {

void kv_commit_paged_cpu(at::TensorList k_pages, at::TensorList v_pages, const at::Tensor& block_tables,
                         at::Tensor& cache_lens, const at::Tensor& accepted_in, const at::Tensor& num_accepted_in) {
  checks::kv_commit_paged(k_pages, v_pages, block_tables, cache_lens, accepted_in, num_accepted_in);
  // borrowed when contiguous (no copy, no refcount)
  const auto accepted = accepted_in.expect_contiguous(), num_accepted = num_accepted_in.expect_contiguous();
  const auto table_c = block_tables.expect_contiguous();
  const int64_t L = k_pages.size(), B = table_c->size(0), M = table_c->size(1), N = accepted->size(1);
  const int64_t ps = k_pages[0].size(1);
  const int32_t* table = table_c->data_ptr<int32_t>();
  const int32_t* acc = accepted->data_ptr<int32_t>();
  const int32_t* num = num_accepted->data_ptr<int32_t>();
  int32_t* lens_ptr = cache_lens.data_ptr<int32_t>();
  const int64_t lens_stride = cache_lens.stride(0);  // cache_lens may be a strided view: updated in place
  auto lens = [&](int64_t b) -> int32_t& { return lens_ptr[b * lens_stride]; };

  bool any_move = false;
  for (int64_t b = 0; b < B && !any_move; ++b)
    for (int32_t i = 1; i <= num[b]; ++i)
      if (acc[b * N + i] != i) { any_move = true; break; }

  if (any_move) {
    std::vector<char*> bases(2 * L);
    std::vector<int64_t> heads(2 * L), dims(2 * L);
    for (int64_t l = 0; l < L; ++l) {
      bases[2 * l] = static_cast<char*>(k_pages[l].data_ptr());
      bases[2 * l + 1] = static_cast<char*>(v_pages[l].data_ptr());
      heads[2 * l] = k_pages[l].size(2);
      heads[2 * l + 1] = v_pages[l].size(2);
      dims[2 * l] = k_pages[l].size(3);
      dims[2 * l + 1] = v_pages[l].size(3);
    }
    const int64_t es = k_pages[0].element_size();
    at::parallel_for(0, 2 * L * B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t c = t / B, b = t % B;
        const int64_t H = heads[c], row = dims[c] * es, slot = H * row;  // a slot holds H rows
        const int64_t len = lens(b);
        auto at_pos = [&](int64_t s) { return bases[c] + (int64_t(table[b * M + s / ps]) * ps + s % ps) * slot; };
        for (int32_t i = 1; i <= num[b]; ++i) {
          const int64_t src = acc[b * N + i];
          // the slot's H heads are contiguous: one copy per accepted node
          if (src != i) std::memcpy(at_pos(len + i), at_pos(len + src), slot);
        }
      }
    });
  }
  for (int64_t b = 0; b < B; ++b) lens(b) += num[b] + 1;
}

}  // namespace specdec
