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
    // per pool (layer l's K at 2l, V at 2l + 1): base, heads, row bytes and page / slot / head strides in bytes
    struct Pool {
      char* base;
      int64_t H, row, pstr, sstr, hstr;
    };
    std::vector<Pool> pools(2 * L);
    const int64_t es = k_pages[0].element_size();
    for (int64_t c = 0; c < 2 * L; ++c) {
      const at::Tensor& p = c % 2 == 0 ? k_pages[c / 2] : v_pages[c / 2];
      pools[c] = Pool{static_cast<char*>(p.data_ptr()), p.size(2), p.size(3) * es, p.stride(0) * es, p.stride(1) * es,
                      p.stride(2) * es};
    }
    at::parallel_for(0, 2 * L * B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const Pool& pl = pools[t / B];
        const int64_t b = t % B, len = lens(b);
        auto at_pos = [&](int64_t s) { return pl.base + int64_t(table[b * M + s / ps]) * pl.pstr + s % ps * pl.sstr; };
        // NHD: a slot's H heads are contiguous, one copy per accepted node; other layouts one per head
        const bool whole = pl.H == 1 || pl.hstr == pl.row;
        for (int32_t i = 1; i <= num[b]; ++i) {
          const int64_t src = acc[b * N + i];
          if (src == i) continue;
          char* d = at_pos(len + i);
          const char* s = at_pos(len + src);
          if (whole) std::memcpy(d, s, pl.H * pl.row);
          else
            for (int64_t h = 0; h < pl.H; ++h) std::memcpy(d + h * pl.hstr, s + h * pl.hstr, pl.row);
        }
      }
    });
  }
  for (int64_t b = 0; b < B; ++b) lens(b) += num[b] + 1;
}

}  // namespace specdec
