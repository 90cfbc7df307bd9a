// Argument validation shared by every backend of every op.
//
// Metadata (rank, shape, dtype, device, layout) is always checked. Values held in
// tensors (lengths, tokens, parents, accepted paths, uniforms) are checked for CPU
// tensors always; for CUDA tensors only in strict mode (specdec.ops.set_strict_checks),
// because reading them costs a device -> host copy and a synchronization that the
// ops otherwise never do (CUDA-graph capture). The CUDA kernels stay memory-safe for
// any value: out-of-range indices are treated as padding, never dereferenced.
// All checks run before an op writes anything, so bad input changes nothing.
#pragma once

#include <optional>

#include <ATen/ATen.h>

namespace specdec {
namespace checks {

bool strict();
void set_strict(bool on);

void verify_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& cache_lens, const std::optional<at::Tensor>& tree_mask, double scale);
void append_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_new,
               const at::Tensor& v_new, const at::Tensor& cache_lens, int64_t offset);
void rejection_sample(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target_probs,
                      const std::optional<at::Tensor>& draft_probs, const at::Tensor& uniforms);
void greedy_verify(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target_logits);
void kv_commit(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cache_lens,
               const at::Tensor& accepted, const at::Tensor& num_accepted);
void linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
            const std::optional<at::Tensor>& weight_scale);

void qlinear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
             const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits);
// The float weight [N, K] (dtype) a group-quantized weight stands for: d * q (+ m), or
// d * (q - 8) for 4-bit without mins. Used for the large-M (BLAS / cuBLAS) path.
at::Tensor qlinear_dequantize(const at::Tensor& qweight, const at::Tensor& scales,
                              const std::optional<at::Tensor>& mins, int64_t bits, at::ScalarType dtype);

// rms_norm / add_rms_norm (residual != nullptr): x [..., H], residual like x, weight [H] of x's dtype.
void rms_norm(const char* op, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
              double eps);
// rope: q [B, N, Hq, D], k [B, N, Hkv, D], cos / sin [B, N, D], one float dtype, D even.
void rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
// silu_mul: gate and up of one shape and float dtype.
void silu_mul(const at::Tensor& gate, const at::Tensor& up);

// Rows of linear's x: the product of its leading sizes (well defined for K = 0).
int64_t linear_rows(const at::Tensor& x);
// linear's result when there is nothing to stream (M = 0, N = 0 or K = 0): bias broadcast
// over [..., N] (zeros without one), in x's dtype — the value of the empty sum. Empty
// std::optional otherwise. The same on every backend.
std::optional<at::Tensor> linear_trivial(const at::Tensor& x, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias);

}  // namespace checks
}  // namespace specdec
