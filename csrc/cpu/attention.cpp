// verify_attention / append_kv, CPU backend. The kernel lives in
// csrc/include/specdec/cpu_attention.h (no torch); this file validates, packs the
// tree mask into bits, picks the ISA and runs the (request, KV head) tasks with
// at::parallel_for.
#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>
#include <memory>

#include "checks.h"
#include "ops.h"
#include "specdec/cpu_isa.h"

#define SPECDEC_CPU_ISA base
#include "cpu/raw.h"

namespace specdec {
namespace cpu {
void attention_range_avx2(const AttentionParams& P, int64_t begin, int64_t end);  // attention_avx2.cpp

namespace {

void attention_range_base(const AttentionParams& P, int64_t begin, int64_t end) {
  // Reused across calls (see attention_task); held by pointer: with the thread_local object itself inlined
  // into the kernel, GCC re-derived its address (a __tls_get_addr call) inside the key loops.
  thread_local std::unique_ptr<base::AttentionScratch> scratch;
  if (!scratch) scratch = std::make_unique<base::AttentionScratch>();
  base::attention_range(P, begin, end, *scratch);
}

DType to_dtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "specdec: unsupported dtype ", s);
  }
}

std::atomic<int64_t> g_prefetch{kAttentionPrefetchBlocks};

}  // namespace

int64_t set_attention_prefetch(int64_t blocks) {
  TORCH_CHECK(blocks >= 0 && blocks <= 64, "set_attention_prefetch: blocks must be in 0..64, got ", blocks);
  return g_prefetch.exchange(blocks);
}

std::vector<uint64_t> pack_tree_mask(const bool* mp, int64_t rows, int64_t Nkv) {
  const int64_t W = (Nkv + 63) / 64;  // W words of 64 bits per row
  std::vector<uint64_t> packed(rows * W, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < Nkv; ++j)
      if (mp[r * Nkv + j]) packed[r * W + (j >> 6)] |= uint64_t(1) << (j & 63);
  return packed;
}

void verify_attention_raw(const AttentionParams& P_in) {
  const bool avx2 = has_avx2_fma_f16c();
  AttentionParams P = P_in;
  P.prefetch = g_prefetch.load(std::memory_order_relaxed);
  // Fewer (request, KV head) tasks than a multiple of the threads (one request of a model with 3 KV
  // heads on 2 threads: one thread runs 2 tasks, the other 1) leave threads idle. The query rows of
  // a KV head then split into chunks (whole row tiles) so that the task count is a multiple of the
  // threads: each chunk walks the keys on its own (the K transposes are repeated), and rows never
  // interact, so the results are the same bits for any chunking and any thread count. Measured on
  // the bundled target's shapes (2 threads, 9 query / 3 KV heads, D = 64, prefix 60-600; exploratory):
  // 1.05-1.12x at 4 nodes, 1.18x at 8, 1.21-1.26x at 16, 1.28-1.30x at 32; one node (3 rows) is not split.
  // In the whole forward of the bundled target (prefix 200, interleaved): 1.014x at 8 and 16 nodes.
  if (P.row_chunk <= 0) {
    const int64_t T = at::get_num_threads(), tasks = P.B * P.Hkv, R = P.Hq / P.Hkv * P.N;
    constexpr int64_t tile = base::kRowTile;
    if (T > 1 && tasks % T != 0 && tasks < 4 * T && R >= 2 * tile) {
      int64_t c = 2;
      while (c < 8 && (tasks * c) % T != 0) ++c;
      const int64_t rows = (R + c - 1) / c;
      P.row_chunk = (rows + tile - 1) / tile * tile;
    }
  }
  at::parallel_for(0, attention_tasks(P), 1, [&](int64_t begin, int64_t end) {
    if (avx2) attention_range_avx2(P, begin, end);
    else attention_range_base(P, begin, end);
  });
}

}  // namespace cpu

at::Tensor verify_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_lens, const std::optional<at::Tensor>& tree_mask,
                                double scale) {
  checks::verify_attention(q_in, k_cache, v_cache, cache_lens, tree_mask, scale);
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const int64_t B = q.size(0), N = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  at::Tensor out = at::empty({B, N, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor lens = cache_lens.contiguous();

  // Bit-pack the [B, N, Nkv] bool mask: W words of 64 bits per row.
  const int64_t Nkv = tree_mask.has_value() ? tree_mask->size(2) : N;
  const int64_t W = (Nkv + 63) / 64;
  std::vector<uint64_t> packed;
  if (tree_mask.has_value()) packed = cpu::pack_tree_mask(tree_mask->contiguous().data_ptr<bool>(), B * N, Nkv);

  cpu::AttentionParams P;
  P.q = q.data_ptr();
  P.q_stride_b = q.stride(0);
  P.q_stride_n = q.stride(1);
  P.q_stride_h = q.stride(2);
  P.k_cache = k_cache.data_ptr();
  P.v_cache = v_cache.data_ptr();
  P.out = out.data_ptr();
  P.lens = lens.data_ptr<int32_t>();
  P.mask = tree_mask.has_value() ? packed.data() : nullptr;
  P.B = B; P.N = N; P.Hq = Hq; P.Hkv = Hkv; P.S = S; P.D = D; P.W = W; P.Nkv = Nkv;
  P.scale = static_cast<float>(scale);
  P.dtype = cpu::to_dtype(q.scalar_type());

  cpu::verify_attention_raw(P);
  return out;
}

void append_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k_new_in, const at::Tensor& v_new_in,
                   const at::Tensor& cache_lens, int64_t offset) {
  checks::append_kv(k_cache, v_cache, k_new_in, v_new_in, cache_lens, offset);
  const at::Tensor k_new = k_new_in.stride(3) == 1 ? k_new_in : k_new_in.contiguous();
  const at::Tensor v_new = v_new_in.stride(3) == 1 ? v_new_in : v_new_in.contiguous();
  const int64_t B = k_cache.size(0), H = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  const int64_t N = k_new.size(2);
  const int64_t es = k_cache.element_size();
  const at::Tensor lens_c = cache_lens.contiguous();  // a strided view of lengths is valid input
  const int32_t* lens = lens_c.data_ptr<int32_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kn = static_cast<const char*>(k_new.data_ptr());
  const char* vn = static_cast<const char*>(v_new.data_ptr());
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / H, h = t % H;
      for (int64_t j = 0; j < N; ++j) {
        const int64_t dst = ((b * H + h) * S + lens[b] + offset + j) * D * es;
        std::memcpy(kc + dst, kn + (b * k_new.stride(0) + h * k_new.stride(1) + j * k_new.stride(2)) * es, D * es);
        std::memcpy(vc + dst, vn + (b * v_new.stride(0) + h * v_new.stride(1) + j * v_new.stride(2)) * es, D * es);
      }
    }
  });
}

}  // namespace specdec
