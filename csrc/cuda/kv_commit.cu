// kv_commit, CUDA backend: compacts the accepted tree path of every layer's K and V
// cache in place, then advances the lengths.
//
// What it computes (specdec/reference.py kv_commit): for every cache and request b,
// position cache_lens[b] + i takes the row at cache_lens[b] + accepted[b, i] for
// i = 1 .. num_accepted[b] (i = 0 is the root, always in place), then
// cache_lens[b] += num_accepted[b] + 1. Used after tree verification (SpecInfer, Miao
// et al. 2024: only the accepted root path of the token tree stays in the cache) and to
// roll back a drafter's cache.
//
// Design: every layer in ONE launch — the 2L cache base pointers (with their head count
// and row size, so layers may differ) travel by value in the kernel arguments, up to
// kMaxCaches per launch (64 layers of K and V, 2 KB of parameters); deeper models take
// ceil(2L / kMaxCaches) launches. Block = (request, cache); its threads own (KV head,
// 16-byte chunk) columns of the rows and walk i in ascending order, a batch of 4 moves
// at a time (all loads of a batch before its stores). That is overlap-safe with no
// barrier: accepted is increasing with accepted[b, i] >= i, so a destination
// cache_lens + i is never the source of a later move (sources of later moves are
// >= their own index > i), and a source that an earlier-or-same-batch destination
// overwrites has already been loaded by the same thread. Identity moves
// (accepted[b, i] == i: every chain) are skipped: a chain reads 4 bytes per move.
// A second tiny kernel, stream ordered after the moves (which read cache_lens), adds
// num_accepted + 1 to the lengths.
//
// Unchecked values (strict checks off) never cause an out-of-bounds access: moves whose
// source is not a node index in [0, N) or whose rows lie outside [0, S) are skipped and
// num_accepted is clamped to [0, N - 1] for the moves; the length update is computed in int64 and
// saturated to int32 (advanced_len), so an unchecked cache_lens near 2^31 - 1 does not wrap negative.
//
// Napkin math: 2 * L * B * Hkv * moved * D * sizeof(dtype) bytes read and as many
// written; zero for chains. Llama-3-8B (L = 32, Hkv = 8, D = 128, bf16), B = 8, 3 moved
// rows: 2 * 32 * 8 * 8 * 3 * 256 B = 3.1 MB each way, ~1.5 us at 4.3 TB/s.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "checks.h"
#include "common.cuh"
#include "ops.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int kMaxCaches = 128;  // K and V of 64 layers per launch: 128 * 16 B of arguments
constexpr int kCommitThreads = 128;
constexpr int kBatch = 4;        // moves loaded before they are stored

struct CommitCaches {
  char* base[kMaxCaches];        // [B, H, S, D] contiguous, each
  int32_t heads[kMaxCaches];     // H of each cache
  int32_t row_bytes[kMaxCaches]; // D * sizeof(dtype) of each cache
  int count;
};

template <typename VT>
__global__ void __launch_bounds__(kCommitThreads) kv_commit_kernel(const CommitCaches caches,
                                                                   const int32_t* __restrict__ lens,  // [B], stride
                                                                   int64_t lens_stride,
                                                                   const int32_t* __restrict__ accepted,  // [B, N]
                                                                   const int32_t* __restrict__ num_acc,   // [B]
                                                                   int N, int S) {
  const int cidx = int(blockIdx.x % unsigned(caches.count));
  const int b = int(blockIdx.x / unsigned(caches.count));
  const int H = caches.heads[cidx];
  const int64_t row = caches.row_bytes[cidx];
  const int chunks = int(row / int64_t(sizeof(VT)));
  const int len = lens[b * lens_stride];
  const int n = min(max(num_acc[b], 0), N - 1);
  if (len < 0 || n == 0) return;
  const int32_t* acc = accepted + int64_t(b) * N;
  char* base = caches.base[cidx] + int64_t(b) * H * S * row;

  for (int col = threadIdx.x; col < H * chunks; col += kCommitThreads) {
    const int h = col / chunks, ch = col - h * chunks;
    char* hbase = base + int64_t(h) * S * row + int64_t(ch) * int64_t(sizeof(VT));
    for (int i0 = 1; i0 <= n; i0 += kBatch) {
      VT v[kBatch];
      bool mv[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int i = i0 + k;
        mv[k] = false;
        if (i <= n) {
          const int src = acc[i];
          mv[k] = src != i && src >= 0 && src < N && int64_t(len) + max(i, src) < S;
          if (mv[k]) v[k] = *reinterpret_cast<const VT*>(hbase + (int64_t(len) + src) * row);
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (mv[k]) *reinterpret_cast<VT*>(hbase + (int64_t(len) + i0 + k) * row) = v[k];
      }
    }
  }
}

// cache_lens[b] += num_accepted[b] + 1, after every move has read cache_lens.
__global__ void advance_lens_kernel(int32_t* __restrict__ lens, int64_t lens_stride,  // [B], stride
                                    const int32_t* __restrict__ num_acc,               // [B]
                                    int B) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < B) lens[b * lens_stride] = advanced_len(lens[b * lens_stride], num_acc[b]);
}

}  // namespace
}  // namespace cuda

void kv_commit_cuda(at::TensorList k_caches, at::TensorList v_caches, at::Tensor& cache_lens,
                    const at::Tensor& accepted_in, const at::Tensor& num_accepted_in) {
  checks::kv_commit(k_caches, v_caches, cache_lens, accepted_in, num_accepted_in);
  const c10::cuda::CUDAGuard device_guard(cache_lens.device());
  const int64_t B = k_caches[0].size(0), S = k_caches[0].size(2), N = accepted_in.size(1);
  if (B == 0) return;
  TORCH_CHECK(B <= std::numeric_limits<int32_t>::max() / cuda::kMaxCaches &&
                  S < std::numeric_limits<int32_t>::max() && N < std::numeric_limits<int32_t>::max(),
              "kv_commit: sizes too large for the CUDA kernel (B = ", B, ", S = ", S, ", N = ", N, ")");
  const at::Tensor accepted = accepted_in.contiguous(), num_accepted = num_accepted_in.contiguous();
  const int64_t es = k_caches[0].element_size();

  // Every cache: K of layer l at 2l, V at 2l + 1.
  std::vector<char*> bases;
  std::vector<int64_t> heads, row_bytes;
  for (size_t l = 0; l < k_caches.size(); ++l) {
    for (const at::Tensor* t : {&k_caches[l], &v_caches[l]}) {
      TORCH_CHECK(t->size(1) <= std::numeric_limits<int32_t>::max() &&
                      t->size(3) * es <= std::numeric_limits<int32_t>::max(),
                  "kv_commit: cache shape too large for the CUDA kernel, got ", t->sizes());
      bases.push_back(static_cast<char*>(t->data_ptr()));
      heads.push_back(t->size(1));
      row_bytes.push_back(t->size(3) * es);
    }
  }
  // Widest move every cache allows: 16 bytes, else 4, else the element.
  auto all_divisible = [&](int64_t a) {
    for (size_t c = 0; c < bases.size(); ++c) {
      if (row_bytes[c] % a != 0 || reinterpret_cast<uintptr_t>(bases[c]) % a != 0) return false;
    }
    return true;
  };
  const int vec = all_divisible(16) ? 16 : all_divisible(4) ? 4 : int(es);

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t lens_stride = cache_lens.stride(0);
  for (size_t c0 = 0; c0 < bases.size(); c0 += cuda::kMaxCaches) {
    cuda::CommitCaches cs{};
    cs.count = int(std::min<size_t>(cuda::kMaxCaches, bases.size() - c0));
    for (int c = 0; c < cs.count; ++c) {
      cs.base[c] = bases[c0 + c];
      cs.heads[c] = int32_t(heads[c0 + c]);
      cs.row_bytes[c] = int32_t(row_bytes[c0 + c]);
    }
    const unsigned grid = unsigned(B * cs.count);
    auto launch = [&](auto vt_tag) {
      using VT = decltype(vt_tag);
      cuda::kv_commit_kernel<VT><<<grid, cuda::kCommitThreads, 0, stream>>>(
          cs, cache_lens.data_ptr<int32_t>(), lens_stride, accepted.data_ptr<int32_t>(),
          num_accepted.data_ptr<int32_t>(), int(N), int(S));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vec == 16) launch(uint4{});
    else if (vec == 4) launch(uint32_t{});
    else launch(uint16_t{});
  }
  const int threads = 256;
  cuda::advance_lens_kernel<<<unsigned(cuda::ceil_div(B, threads)), threads, 0, stream>>>(
      cache_lens.data_ptr<int32_t>(), lens_stride, num_accepted.data_ptr<int32_t>(), int(B));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace specdec
