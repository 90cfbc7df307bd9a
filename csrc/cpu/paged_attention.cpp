// verify_attention / append_kv over a paged cache, CPU backend. The attention runs the dense
// kernel of csrc/include/specdec/cpu_attention.h with AttentionParams::block_table set (the same
// tasks, key blocks and arithmetic; only the address of a key row differs), so a paged call gives
// the dense call's bits for the same keys.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "ops.h"
#include "paged_checks.h"

#define SPECDEC_CPU_ISA base
#include "cpu/raw.h"

namespace specdec {
namespace {

cpu::DType to_dtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return cpu::DType::kFloat32;
    case at::kHalf: return cpu::DType::kFloat16;
    case at::kBFloat16: return cpu::DType::kBFloat16;
    default: TORCH_CHECK(false, "specdec: unsupported dtype ", s);
  }
}

// t itself (borrowed) when its last dim is contiguous, else a contiguous copy.
c10::MaybeOwned<at::Tensor> rows_contiguous(const at::Tensor& t) {
  if (t.stride(-1) == 1) return c10::MaybeOwned<at::Tensor>::borrowed(t);
  return c10::MaybeOwned<at::Tensor>::owned(t.contiguous());
}

}  // namespace

at::Tensor verify_attention_paged_cpu(const at::Tensor& q_in, const at::Tensor& k_pages, const at::Tensor& v_pages,
                                      const at::Tensor& block_tables, const at::Tensor& cache_lens,
                                      const std::optional<at::Tensor>& tree_mask, double scale) {
  checks::verify_attention_paged(q_in, k_pages, v_pages, block_tables, cache_lens, tree_mask, scale);
  const auto qm = rows_contiguous(q_in);
  const at::Tensor& q = *qm;
  const int64_t B = q.size(0), N = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t page_size = k_pages.size(1), Hkv = k_pages.size(2);
  at::Tensor out = at::empty({B, N, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const auto lens = cache_lens.expect_contiguous();  // borrowed when contiguous (no copy, no refcount)
  const auto table = block_tables.expect_contiguous();

  const int64_t Nkv = tree_mask.has_value() ? tree_mask->size(2) : N;
  std::vector<uint64_t> packed;
  if (tree_mask.has_value()) packed = cpu::pack_tree_mask(tree_mask->contiguous().data_ptr<bool>(), B * N, Nkv);

  cpu::AttentionParams P;
  P.q = q.data_ptr();
  P.q_stride_b = q.stride(0);
  P.q_stride_n = q.stride(1);
  P.q_stride_h = q.stride(2);
  P.k_cache = k_pages.data_ptr();
  P.v_cache = v_pages.data_ptr();
  P.out = out.data_ptr();
  P.lens = lens->data_ptr<int32_t>();
  P.mask = tree_mask.has_value() ? packed.data() : nullptr;
  P.B = B; P.N = N; P.Hq = Hq; P.Hkv = Hkv; P.D = D; P.W = (Nkv + 63) / 64; P.Nkv = Nkv;
  P.S = table->size(1) * page_size;  // a row's capacity (unused for addressing)
  P.scale = static_cast<float>(scale);
  P.dtype = to_dtype(q.scalar_type());
  P.block_table = table->data_ptr<int32_t>();
  P.page_size = page_size;
  P.max_blocks = table->size(1);
  P.page_stride = k_pages.stride(0);  // v_pages has the same strides (checked)
  P.slot_stride = k_pages.stride(1);
  P.head_stride = k_pages.stride(2);

  cpu::verify_attention_raw(P);
  return out;
}

void append_kv_paged_cpu(at::Tensor& k_pages, at::Tensor& v_pages, const at::Tensor& k_new_in,
                         const at::Tensor& v_new_in, const at::Tensor& block_tables, const at::Tensor& cache_lens,
                         int64_t offset) {
  checks::append_kv_paged(k_pages, v_pages, k_new_in, v_new_in, block_tables, cache_lens, offset);
  const auto k_new = rows_contiguous(k_new_in), v_new = rows_contiguous(v_new_in);
  const int64_t B = k_new->size(0), H = k_new->size(1), N = k_new->size(2), D = k_new->size(3);
  const int64_t ps = k_pages.size(1), es = k_pages.element_size();
  const auto lens_c = cache_lens.expect_contiguous(), table_c = block_tables.expect_contiguous();
  const int32_t* lens = lens_c->data_ptr<int32_t>();
  const int32_t* table = table_c->data_ptr<int32_t>();
  const int64_t M = table_c->size(1);
  char* kc = static_cast<char*>(k_pages.data_ptr());
  char* vc = static_cast<char*>(v_pages.data_ptr());
  const char* kn = static_cast<const char*>(k_new->data_ptr());
  const char* vn = static_cast<const char*>(v_new->data_ptr());
  const int64_t row = D * es;
  // page / slot / head strides of the pools in bytes (v_pages has k_pages' strides: checked)
  const int64_t pstr = k_pages.stride(0) * es, sstr = k_pages.stride(1) * es, hstr = k_pages.stride(2) * es;
  const int64_t ks0 = k_new->stride(0), ks1 = k_new->stride(1), ks2 = k_new->stride(2);
  const int64_t vs0 = v_new->stride(0), vs1 = v_new->stride(1), vs2 = v_new->stride(2);
  // Tasks = (request, KV head) as in the dense append_kv; position s goes to its page's slot s % ps,
  // the nodes in runs that share a page (one table lookup per page).
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / H, h = t % H;
      const int64_t s = lens[b] + offset;
      for (int64_t j = 0, n; j < N; j += n) {
        const int64_t slot = (s + j) % ps;
        n = std::min(N - j, ps - slot);
        const int64_t dst = int64_t(table[b * M + (s + j) / ps]) * pstr + slot * sstr + h * hstr;
        const char* ksrc = kn + (b * ks0 + h * ks1 + j * ks2) * es;
        const char* vsrc = vn + (b * vs0 + h * vs1 + j * vs2) * es;
        for (int64_t i = 0; i < n; ++i) {
          std::memcpy(kc + dst + i * sstr, ksrc + i * ks2 * es, row);
          std::memcpy(vc + dst + i * sstr, vsrc + i * vs2 * es, row);
        }
      }
    }
  });
}

}  // namespace specdec
