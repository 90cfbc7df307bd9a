// kv_commit, CPU backend: compacts the accepted tree path of every layer in place.
// Tasks = (layer, K or V, request, KV head) rows of [S, D]; within a task the moves
// run in ascending order, which is overlap-safe because accepted is increasing and
// accepted[b, i] >= i (a destination is never a source still to be read). Identity
// moves (chains) are skipped, so a chain costs nothing but the length update.
// Bytes: 2 * L * B * Hkv * (moved rows) * D * sizeof(dtype), read and written.
#include <ATen/Parallel.h>

#include <cstring>

#include "checks.h"
#include "ops.h"

namespace specdec {

void kv_commit_cpu(at::TensorList k_caches, at::TensorList v_caches, at::Tensor& cache_lens,
                   const at::Tensor& accepted_in, const at::Tensor& num_accepted_in) {
  checks::kv_commit(k_caches, v_caches, cache_lens, accepted_in, num_accepted_in);
  const at::Tensor accepted = accepted_in.contiguous(), num_accepted = num_accepted_in.contiguous();
  const int64_t L = k_caches.size();
  const int64_t B = k_caches[0].size(0), S = k_caches[0].size(2), N = accepted.size(1);
  const int32_t* acc = accepted.data_ptr<int32_t>();
  const int32_t* num = num_accepted.data_ptr<int32_t>();
  int32_t* lens_ptr = cache_lens.data_ptr<int32_t>();
  const int64_t lens_stride = cache_lens.stride(0);  // cache_lens may be a strided view: updated in place
  auto lens = [&](int64_t b) -> int32_t& { return lens_ptr[b * lens_stride]; };

  // Skip the whole launch when every request's path is the identity (chains).
  bool any_move = false;
  for (int64_t b = 0; b < B && !any_move; ++b)
    for (int32_t i = 1; i <= num[b]; ++i)
      if (acc[b * N + i] != i) { any_move = true; break; }

  if (any_move) {
    std::vector<char*> bases(2 * L);
    std::vector<int64_t> heads(2 * L), dims(2 * L);
    for (int64_t l = 0; l < L; ++l) {
      bases[2 * l] = static_cast<char*>(k_caches[l].data_ptr());
      bases[2 * l + 1] = static_cast<char*>(v_caches[l].data_ptr());
      heads[2 * l] = k_caches[l].size(1);
      heads[2 * l + 1] = v_caches[l].size(1);
      dims[2 * l] = k_caches[l].size(3);
      dims[2 * l + 1] = v_caches[l].size(3);
    }
    const int64_t es = k_caches[0].element_size();
    at::parallel_for(0, 2 * L * B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t c = t / B, b = t % B;
        const int64_t H = heads[c], D = dims[c], row = D * es;
        const int64_t len = lens(b);
        for (int64_t h = 0; h < H; ++h) {
          char* base = bases[c] + ((b * H + h) * S) * row;
          for (int32_t i = 1; i <= num[b]; ++i) {
            const int64_t src = acc[b * N + i];
            if (src != i) std::memcpy(base + (len + i) * row, base + (len + src) * row, row);
          }
        }
      }
    });
  }
  for (int64_t b = 0; b < B; ++b) lens(b) += num[b] + 1;
}

}  // namespace specdec
