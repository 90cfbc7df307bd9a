// verify_attention / append_kv / kv_commit over a paged cache, CUDA backend.
//
// Layout: k_pages / v_pages [num_pages, page_size, Hkv, D] with D contiguous and any non-overlapping
// strides otherwise (NHD, or views such as HND's transpose(1, 2); csrc/paged_checks.h), block_tables
// [B, max_blocks] int32, cache_lens [B] int32. Position s of request b, head h sits in page
// block_tables[b, s / page_size], slot s % page_size, at element page * stride(0) + slot * stride(1)
// + h * stride(2).
//
// Design (a first, simple form; the dense kernels of attention.cu stay the fast path):
//   verify: one warp per (request, query head, query node); the lanes split the head dim, a
//     warp sum gives each score, and a one-pass online softmax (fp32) accumulates V. Keys walk
//     through the block table one position at a time.
//   append: one thread per (request, node, KV head, element).
//   commit: one block per (request, cache) launch per layer and K / V; its threads copy the
//     elements of an accepted node's slot (H * D values) in ascending node order, which needs no
//     barrier: a destination cache_lens + i is never the source of a later move.
// Memory safety for any value (as the dense kernels): a page index outside [0, num_pages) or a
// position past a row's capacity is never dereferenced (the key is skipped, the write dropped).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/common.cuh"
#include "ops.h"
#include "paged_checks.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int kWarps = 4;          // warps per verify block
constexpr int kMaxDimPerLane = 8;  // D <= 32 * 8 = 256

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

struct PagedTable {
  const int32_t* table;  // [B, M]
  int64_t M, page_size, num_pages;
  int64_t page_stride, slot_stride, head_stride;  // the pool's strides, in elements
  // The element offset of position s's slot (head 0) in the pool, or -1 when it has none.
  __device__ __forceinline__ int64_t slot(int64_t b, int64_t s) const {
    if (s < 0 || s >= M * page_size) return -1;
    const int64_t page = table[b * M + s / page_size];
    if (page < 0 || page >= num_pages) return -1;
    return page * page_stride + s % page_size * slot_stride;
  }
};

template <typename T>
__global__ void __launch_bounds__(kWarps * 32) paged_verify_kernel(
    const T* __restrict__ q, int64_t q_sb, int64_t q_sn, int64_t q_sh, const T* __restrict__ kp,
    const T* __restrict__ vp, T* __restrict__ out, const int32_t* __restrict__ lens, const bool* __restrict__ mask,
    PagedTable pt, int64_t B, int64_t N, int64_t Nkv, int64_t Hq, int64_t Hkv, int64_t D, float scale) {
  const int lane = threadIdx.x & 31;
  const int64_t w = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);  // (b, i, hq)
  if (w >= B * N * Hq) return;
  const int64_t hq = w % Hq, i = (w / Hq) % N, b = w / (Hq * N);
  const int64_t h = hq / (Hq / Hkv);
  float qv[kMaxDimPerLane], acc[kMaxDimPerLane];
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int64_t d = lane + 32 * c;
    qv[c] = d < D ? to_float(q[b * q_sb + i * q_sn + hq * q_sh + d]) * scale : 0.f;
    acc[c] = 0.f;
  }
  const int64_t len = lens[b];
  const int64_t qoff = Nkv - N;
  // Positions past the row's capacity have no slot (skipped below): stop there, so that an unchecked
  // cache_lens of up to 2^31 - 1 does not walk 2^31 empty positions.
  const int64_t end = min(len + Nkv, pt.M * pt.page_size);
  float m = kNegInf, l = 0.f;
  for (int64_t s = 0; s < end; ++s) {
    if (s >= len) {
      const int64_t j = s - len;
      const bool visible = mask ? mask[(b * N + i) * Nkv + j] : j <= qoff + i;
      if (!visible) continue;
    }
    const int64_t slot = pt.slot(b, s);
    if (slot < 0) continue;
    const T* kr = kp + slot + h * pt.head_stride;  // v_pages has k_pages' strides (checked)
    const T* vr = vp + slot + h * pt.head_stride;
    float part = 0.f;
#pragma unroll
    for (int c = 0; c < kMaxDimPerLane; ++c) {
      const int64_t d = lane + 32 * c;
      if (d < D) part += qv[c] * to_float(kr[d]);
    }
    const float score = warp_sum(part);
    const float m_new = fmaxf(m, score);
    const float corr = m == kNegInf ? 0.f : __expf(m - m_new);
    const float p = __expf(score - m_new);
    l = l * corr + p;
#pragma unroll
    for (int c = 0; c < kMaxDimPerLane; ++c) {
      const int64_t d = lane + 32 * c;
      if (d < D) acc[c] = acc[c] * corr + p * to_float(vr[d]);
    }
    m = m_new;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* o = out + ((b * N + i) * Hq + hq) * D;
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int64_t d = lane + 32 * c;
    if (d < D) o[d] = from_float<T>(acc[c] * inv);
  }
}

template <typename T>
__global__ void paged_append_kernel(T* __restrict__ kp, T* __restrict__ vp, const T* __restrict__ kn,
                                    const T* __restrict__ vn, int64_t n_sb, int64_t n_sh, int64_t n_sn,
                                    const int32_t* __restrict__ lens, PagedTable pt, int64_t B, int64_t H, int64_t N,
                                    int64_t D, int64_t offset) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // (b, j, h, d)
  if (e >= B * N * H * D) return;
  const int64_t d = e % D, h = (e / D) % H, j = (e / (D * H)) % N, b = e / (D * H * N);
  // int64 (cache_lens[b] may be up to 2^31 - 1 with strict checks off). As the dense append_kv: a
  // request whose new positions do not all fit its row writes nothing; a bad page drops its slot.
  const int64_t start = int64_t(lens[b]) + offset;
  if (lens[b] < 0 || start > pt.M * pt.page_size - N) return;
  const int64_t slot = pt.slot(b, start + j);
  if (slot < 0) return;
  const int64_t src = b * n_sb + h * n_sh + j * n_sn + d;
  kp[slot + h * pt.head_stride + d] = kn[src];  // v_pages has k_pages' strides (checked)
  vp[slot + h * pt.head_stride + d] = vn[src];
}

// U: an unsigned type of the element size (the copy moves bits).
template <typename U>
__global__ void paged_commit_kernel(U* __restrict__ pages, int64_t H, int64_t D, const int32_t* __restrict__ lens,
                                    int64_t lens_stride, const int32_t* __restrict__ accepted,
                                    const int32_t* __restrict__ num_accepted, int64_t N, PagedTable pt) {
  const int64_t b = blockIdx.x;
  const int64_t len = lens[b * lens_stride];
  const int32_t n = min(max(num_accepted[b], 0), int32_t(N - 1));
  for (int32_t i = 1; i <= n; ++i) {
    const int64_t src = accepted[b * N + i];
    if (src == i || src < 0 || src >= N) continue;
    const int64_t ds = pt.slot(b, len + i), ss = pt.slot(b, len + src);
    if (ds < 0 || ss < 0) continue;
    for (int64_t e = threadIdx.x; e < H * D; e += blockDim.x) {
      const int64_t o = e / D * pt.head_stride + e % D;
      pages[ds + o] = pages[ss + o];
    }
  }
}

__global__ void paged_advance_lens_kernel(int32_t* __restrict__ lens, int64_t lens_stride,
                                          const int32_t* __restrict__ num_accepted, int64_t B) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < B) lens[b * lens_stride] = advanced_len(lens[b * lens_stride], num_accepted[b]);
}

PagedTable make_table(const at::Tensor& table, const at::Tensor& pages) {
  return PagedTable{table.data_ptr<int32_t>(), table.size(1), pages.size(1), pages.size(0),
                    pages.stride(0), pages.stride(1), pages.stride(2)};
}

}  // namespace
}  // namespace cuda

at::Tensor verify_attention_paged_cuda(const at::Tensor& q_in, const at::Tensor& k_pages, const at::Tensor& v_pages,
                                       const at::Tensor& block_tables, const at::Tensor& cache_lens,
                                       const std::optional<at::Tensor>& tree_mask, double scale) {
  checks::verify_attention_paged(q_in, k_pages, v_pages, block_tables, cache_lens, tree_mask, scale);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const int64_t B = q.size(0), N = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k_pages.size(2);
  TORCH_CHECK(D <= 32 * cuda::kMaxDimPerLane, "verify_attention_paged: head dim D must be <= ",
              32 * cuda::kMaxDimPerLane, " on CUDA, got ", D);
  at::Tensor out = at::empty({B, N, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor lens = cache_lens.contiguous(), table = block_tables.contiguous();
  const int64_t Nkv = tree_mask.has_value() ? tree_mask->size(2) : N;
  const at::Tensor mask = tree_mask.has_value() ? tree_mask->contiguous() : at::Tensor();
  const int64_t warps = B * N * Hq;
  if (warps == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  SPECDEC_DISPATCH_FLOAT(q.scalar_type(), "verify_attention_paged", T, [&] {
    cuda::paged_verify_kernel<T><<<cuda::ceil_div(warps, cuda::kWarps), cuda::kWarps * 32, 0, stream>>>(
        reinterpret_cast<const T*>(q.data_ptr()), q.stride(0), q.stride(1), q.stride(2),
        reinterpret_cast<const T*>(k_pages.data_ptr()), reinterpret_cast<const T*>(v_pages.data_ptr()),
        reinterpret_cast<T*>(out.data_ptr()), lens.data_ptr<int32_t>(),
        mask.defined() ? mask.data_ptr<bool>() : nullptr, cuda::make_table(table, k_pages), B, N, Nkv, Hq, Hkv, D,
        static_cast<float>(scale));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

void append_kv_paged_cuda(at::Tensor& k_pages, at::Tensor& v_pages, const at::Tensor& k_new_in,
                          const at::Tensor& v_new_in, const at::Tensor& block_tables, const at::Tensor& cache_lens,
                          int64_t offset) {
  checks::append_kv_paged(k_pages, v_pages, k_new_in, v_new_in, block_tables, cache_lens, offset);
  const c10::cuda::CUDAGuard guard(k_pages.device());
  // one stride set for both: k_new and v_new are made contiguous
  const at::Tensor k_new = k_new_in.contiguous(), v_new = v_new_in.contiguous();
  const int64_t B = k_new.size(0), H = k_new.size(1), N = k_new.size(2), D = k_new.size(3);
  const at::Tensor lens = cache_lens.contiguous(), table = block_tables.contiguous();
  const int64_t total = B * N * H * D;
  if (total == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  SPECDEC_DISPATCH_FLOAT(k_pages.scalar_type(), "append_kv_paged", T, [&] {
    cuda::paged_append_kernel<T><<<cuda::ceil_div(total, 256), 256, 0, stream>>>(
        reinterpret_cast<T*>(k_pages.data_ptr()), reinterpret_cast<T*>(v_pages.data_ptr()),
        reinterpret_cast<const T*>(k_new.data_ptr()), reinterpret_cast<const T*>(v_new.data_ptr()), k_new.stride(0),
        k_new.stride(1), k_new.stride(2), lens.data_ptr<int32_t>(), cuda::make_table(table, k_pages), B, H, N, D,
        offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void kv_commit_paged_cuda(at::TensorList k_pages, at::TensorList v_pages, const at::Tensor& block_tables,
                          at::Tensor& cache_lens, const at::Tensor& accepted_in, const at::Tensor& num_accepted_in) {
  checks::kv_commit_paged(k_pages, v_pages, block_tables, cache_lens, accepted_in, num_accepted_in);
  const c10::cuda::CUDAGuard guard(k_pages[0].device());
  const at::Tensor accepted = accepted_in.contiguous(), num_accepted = num_accepted_in.contiguous();
  const at::Tensor table = block_tables.contiguous();
  const int64_t B = table.size(0), N = accepted.size(1);
  if (B == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t es = k_pages[0].element_size();
  for (size_t l = 0; l < k_pages.size(); ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& pages = kv == 0 ? k_pages[l] : v_pages[l];
      const int64_t H = pages.size(2), D = pages.size(3);
      const cuda::PagedTable pt = cuda::make_table(table, pages);
      if (es == 4) {
        cuda::paged_commit_kernel<uint32_t><<<B, 256, 0, stream>>>(
            reinterpret_cast<uint32_t*>(pages.data_ptr()), H, D, cache_lens.data_ptr<int32_t>(),
            cache_lens.stride(0), accepted.data_ptr<int32_t>(), num_accepted.data_ptr<int32_t>(), N, pt);
      } else {
        cuda::paged_commit_kernel<uint16_t><<<B, 256, 0, stream>>>(
            reinterpret_cast<uint16_t*>(pages.data_ptr()), H, D, cache_lens.data_ptr<int32_t>(),
            cache_lens.stride(0), accepted.data_ptr<int32_t>(), num_accepted.data_ptr<int32_t>(), N, pt);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  cuda::paged_advance_lens_kernel<<<cuda::ceil_div(B, 128), 128, 0, stream>>>(
      cache_lens.data_ptr<int32_t>(), cache_lens.stride(0), num_accepted.data_ptr<int32_t>(), B);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace specdec
