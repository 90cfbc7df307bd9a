// The launch plans of the CUDA verify_attention and linear / qlinear kernels: the numbers that
// fix the order in which each output row's sums are formed. Plain C++ (no CUDA headers): the CUDA
// launchers (csrc/cuda/attention.cu, csrc/cuda/linear.cu) take their plans from here, and every
// build, the CPU-only one too, exposes them as specdec._C.cuda_plan so that tests can check the
// batch-invariance rule without a GPU (docs/gpu.md, "Batch invariance").
//
// The rule: a row's result must not depend on how many other rows share the launch (B requests,
// N tree nodes each, G query heads per KV head), for the verify and decode sizes: B * N <=
// kLinearInvariantRows (64) rows per call, the rows one linear call of the step sees. So
//  * verify_attention splits the keys of a request into chunks of `chunk` keys at fixed absolute
//    positions [s * chunk, (s + 1) * chunk): chunk depends on the dtype, the head dim and the
//    cache's capacity only, never on B, N, G or the GPU's occupancy. A row's non-empty chunks are
//    then the same in a verify pass and in the decode step that produced its token, and chunks
//    holding none of its visible keys are skipped exactly by the merge.
//  * inside a chunk, `wk` warps interleave the key steps of each stage (warp k takes steps k, k + wk,
//    ...) and their states are merged in warp order: wk is fixed per (dtype, head dim). The rows of
//    a launch are only partitioned (wm warps over rows, row tiles), which never changes a row's sums.
//  * above 64 rows (prefill, large batches) verify_attention takes the occupancy-based plan (splits
//    sized to fill the GPU, more row warps per CTA): faster there, and not batch-invariant, like
//    linear's cuBLAS path at the same sizes.
//  * linear / qlinear up to kLinearInvariantRows rows: one warp per output column, lane-strided
//    16-byte steps along K, a fixed butterfly warp sum; the row count only picks how many
//    accumulators a lane holds. Above it: cuBLAS (float32 accumulation, NOT batch-invariant).
#pragma once

#include <cstdint>

namespace specdec {
namespace plan {

// linear / qlinear: rows (product of x's leading dims) served by specdec's own kernel.
constexpr int64_t kLinearInvariantRows = 64;

// verify_attention: the per-(dtype, head dim) tiling of csrc/cuda/attention.cu.
//   mma: 16-bit inputs on tensor cores (float16 / bfloat16); else float32 on CUDA cores.
constexpr int attn_key_block(bool mma, int head_dim) { return mma ? (head_dim <= 128 ? 64 : 32) : 32; }
constexpr int attn_key_step(bool mma) { return mma ? 16 : 32; }
constexpr int attn_rows_per_warp(bool mma, int head_dim) { return mma ? 16 : (head_dim == 256 ? 4 : 8); }
constexpr int attn_max_warps = 4;
// Key-splitting warps per CTA: every warp takes one key step of each stage (at most 4 warps).
constexpr int attn_key_warps(bool mma, int head_dim) {
  return attn_key_block(mma, head_dim) / attn_key_step(mma) < attn_max_warps
             ? attn_key_block(mma, head_dim) / attn_key_step(mma)
             : attn_max_warps;
}
// Chunk sizes: kAttnChunk keys while the capacity needs at most kAttnMaxSplits chunks, then doubled
// until it does (a power-of-two multiple of every key block).
constexpr int64_t kAttnChunk = 128;
constexpr int64_t kAttnMaxSplits = 64;

struct AttnPlan {
  bool invariant;  // batch_rows <= kLinearInvariantRows: the fixed plan below
  int64_t chunk;   // invariant: keys per split, at absolute positions [s * chunk, (s + 1) * chunk)
                   // else 0: the launcher picks the splits by occupancy and the kernel cuts each
                   // request's keys into even chunks of at least min_chunk keys
  int64_t splits;  // invariant: ceil(capacity / chunk) (splits past a request's keys exit at once); else 0
  int64_t min_chunk;  // occupancy plan only: fewest keys per split (partials <= half the K / V bytes)
  int wk;          // key-splitting warps per CTA (invariant: fixed per dtype and head dim)
  int wm;          // row warps per CTA (a partition of the rows only)
  int rows_per_tile, row_tiles;
};

// capacity: the cache's positions per request (S); rows: G * N query rows per (request, KV head);
// batch_rows: B * N, the rows of the step's linear calls.
inline AttnPlan attention_plan(bool mma, int head_dim, int64_t capacity, int64_t rows, int64_t batch_rows) {
  AttnPlan p{};
  p.invariant = batch_rows <= kLinearInvariantRows;
  const int rpw = attn_rows_per_warp(mma, head_dim);
  const int64_t row_warps = (rows + rpw - 1) / rpw < 1 ? 1 : (rows + rpw - 1) / rpw;
  if (p.invariant) {
    p.chunk = kAttnChunk;
    while (p.chunk * kAttnMaxSplits < capacity) p.chunk *= 2;
    p.splits = capacity <= p.chunk ? 1 : (capacity + p.chunk - 1) / p.chunk;
    p.wk = attn_key_warps(mma, head_dim);
    const int64_t max_wm = attn_max_warps / p.wk;
    p.wm = int(row_warps < max_wm ? row_warps : max_wm);
  } else {
    p.wm = int(row_warps < attn_max_warps ? row_warps : attn_max_warps);
    const int subs = attn_key_block(mma, head_dim) / attn_key_step(mma);
    const int by_rows = attn_max_warps / p.wm;
    p.wk = subs < by_rows ? subs : by_rows;
  }
  p.rows_per_tile = p.wm * rpw;
  p.row_tiles = int((rows + p.rows_per_tile - 1) / p.rows_per_tile);
  const int64_t kb = attn_key_block(mma, head_dim);
  const int64_t by_partials = 8 * int64_t(p.rows_per_tile) / (mma ? 2 : 4);
  p.min_chunk = ((by_partials > kb ? by_partials : kb) + kb - 1) / kb * kb;
  return p;
}

// linear / qlinear's own kernel: the accumulators per lane for `rows` rows (a template argument
// of the kernel: 1, 4, 16 or 64); 0 = cuBLAS (rows > kLinearInvariantRows).
constexpr int linear_row_block(int64_t rows) {
  return rows > kLinearInvariantRows ? 0 : rows <= 1 ? 1 : rows <= 4 ? 4 : rows <= 16 ? 16 : 64;
}

}  // namespace plan
}  // namespace specdec
