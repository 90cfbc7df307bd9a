// Host entry points of every specdec op, per backend. Registered as torch ops in
// csrc/torch_bindings.cpp. Every function validates its arguments first
// (csrc/checks.h) and writes nothing before all checks pass.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

namespace specdec {

using SampleResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // accepted, num_accepted, out_tokens

// ---------------------------------------------------------------- CPU (csrc/cpu/*.cpp)
at::Tensor verify_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_lens, const std::optional<at::Tensor>& tree_mask,
                                double scale);
void append_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k_new, const at::Tensor& v_new,
                   const at::Tensor& cache_lens, int64_t offset);
SampleResult rejection_sample_cpu(const at::Tensor& tokens, const at::Tensor& parents,
                                  const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                                  const at::Tensor& uniforms);
SampleResult greedy_verify_cpu(const at::Tensor& tokens, const at::Tensor& parents,
                               const at::Tensor& target_logits);
void kv_commit_cpu(at::TensorList k_caches, at::TensorList v_caches, at::Tensor& cache_lens,
                   const at::Tensor& accepted, const at::Tensor& num_accepted);
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& weight_scale);
at::Tensor qlinear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits);
// argmax over the last dim of linear / qlinear's result (x's dtype; torch.argmax's semantics), int64 [...]:
// csrc/cpu/head_argmax.h. q8act: qlinear_q8act's product (the CPU packed layout or the usual one).
at::Tensor linear_argmax_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& weight_scale);
at::Tensor qlinear_argmax_float_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                                    int64_t bits);
at::Tensor qlinear_argmax_q8act_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                                    int64_t bits);
inline at::Tensor qlinear_argmax_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                     const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                                     int64_t bits, bool q8act) {
  return q8act ? qlinear_argmax_q8act_cpu(x, qweight, scales, mins, bias, bits)
               : qlinear_argmax_float_cpu(x, qweight, scales, mins, bias, bits);
}
namespace cpu {
// Prefill-size linears on the CPU (AVX2; float32 weights at kLinearBlasRows < M <= kLinearGemmRows,
// half, int8 and group-quantized weights at M > kLinearBlasRows): csrc/include/specdec/cpu_gemm.h's
// tiles (on, the default) or torch's BLAS GEMM / the few-row kernels; a process-wide switch for benchmarks
// and tests (specdec._C.set_cpu_gemm).
void set_gemm(bool on);
bool gemm_enabled();
// The AVX-512 few-row kernels (linear and qlinear, every weight type) at 4 (float32) or 5..kLinearRowsPerPass rows
// (csrc/cpu/linear_avx512.cpp; on, the default, where the CPU has AVX-512 F / DQ / VL): the AVX2 kernels'
// outputs bit for bit, faster at verify sizes. A process-wide switch for A/Bs and the bit-equality tests (specdec._C.set_cpu_avx512);
// returns the previous value. avx512_active(): the switch is on and the CPU has it.
bool set_avx512(bool on);
bool avx512_active();
// How many key blocks (64 keys) of K / V the CPU verify_attention requests ahead of the block it computes
// (software prefetch; csrc/include/specdec/cpu_attention.h; 0: none). The same bits at any distance; a
// process-wide switch for A/Bs (specdec._C.set_attention_prefetch); returns the previous value.
int64_t set_attention_prefetch(int64_t blocks);
// Prefill rows (thread-local, off by default; specdec._C.set_cpu_prefill, specdec.ops.prefill_rows()):
// while on, the calling thread's CPU linears take the GEMM tiles at EVERY row count (float32 weights up
// to kLinearGemmRows rows), not only above kLinearBlasRows. A prompt's rows then give the same bits
// whatever its length and whatever the batch it is prefilled with, but not the few-row kernels' bits,
// which decode steps and verify passes keep (a verify row equals a decode step bit for bit). For
// prefill only: plain and speculative decoding share it. Returns the previous value.
bool set_prefill(bool on);
bool prefill_enabled();
}  // namespace cpu
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                            const at::Tensor& sin);
at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up);

#ifdef SPECDEC_WITH_CUDA
// ---------------------------------------------------------------- CUDA (csrc/cuda/*.cu)
at::Tensor verify_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& cache_lens, const std::optional<at::Tensor>& tree_mask,
                                 double scale);
void append_kv_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k_new, const at::Tensor& v_new,
                    const at::Tensor& cache_lens, int64_t offset);
SampleResult rejection_sample_cuda(const at::Tensor& tokens, const at::Tensor& parents,
                                   const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                                   const at::Tensor& uniforms);
SampleResult greedy_verify_cuda(const at::Tensor& tokens, const at::Tensor& parents,
                                const at::Tensor& target_logits);
void kv_commit_cuda(at::TensorList k_caches, at::TensorList v_caches, at::Tensor& cache_lens,
                    const at::Tensor& accepted, const at::Tensor& num_accepted);
at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& weight_scale);
at::Tensor qlinear_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits);
// The first index of each row's maximum of y [..., V] (float32 / float16 / bfloat16; torch.argmax's semantics),
// int64 [...] (csrc/cuda/sampling.cu); linear_argmax / qlinear_argmax on CUDA: the product materialised by the
// CUDA linear / qlinear kernels, then this (csrc/cuda/linear.cu).
at::Tensor argmax_rows_cuda(const at::Tensor& y);
at::Tensor linear_argmax_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& weight_scale);
at::Tensor qlinear_argmax_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                               int64_t bits, bool q8act);
at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                            const at::Tensor& sin);
at::Tensor silu_mul_cuda(const at::Tensor& gate, const at::Tensor& up);
#endif

// ---------------------------------------------------------------- composite (csrc/decoder_layer.cpp)
// Whether DecoderStack's float32 CPU layers write into two output pairs per forward, alternating (true, the
// default), or allocate their outputs per layer (false); the same bits either way; returns the previous value.
bool set_stack_buffers(bool on);
// One Llama-style decoder layer from the ops above, registered for CPU and CUDA: the inputs'
// device picks the backend's kernels.
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const at::Tensor& h, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales,
    const c10::List<std::optional<at::Tensor>>& mins, const c10::List<std::optional<at::Tensor>>& biases,
    at::IntArrayRef bits, const at::Tensor& post_norm_weight, double post_norm_eps, const at::Tensor& next_norm_weight,
    double next_norm_eps, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cache_lens, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& tree_mask, int64_t kv_offset, double scale,
    int64_t num_heads, int64_t num_kv_heads);
// The same layer on a paged cache (k_pages / v_pages [num_pages, page_size, Hkv, D], block_tables).
std::tuple<at::Tensor, at::Tensor> decoder_layer_paged(
    const at::Tensor& x, const at::Tensor& h, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales,
    const c10::List<std::optional<at::Tensor>>& mins, const c10::List<std::optional<at::Tensor>>& biases,
    at::IntArrayRef bits, const at::Tensor& post_norm_weight, double post_norm_eps, const at::Tensor& next_norm_weight,
    double next_norm_eps, at::Tensor& k_pages, at::Tensor& v_pages, const at::Tensor& cache_lens, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& tree_mask, int64_t kv_offset, double scale,
    int64_t num_heads, int64_t num_kv_heads, const at::Tensor& block_tables);

}  // namespace specdec

// ---------------------------------------------------------------- paged KV (csrc/cpu/paged_*.cpp, csrc/cuda/paged_kv.cu)
// The three KV ops over a paged cache: k_pages / v_pages [num_pages, page_size, Hkv, D] (NHD),
// block_tables [B, max_blocks] int32 (position s of request b: page block_tables[b, s / page_size],
// slot s % page_size), cache_lens [B] int32. Same semantics as the dense ops above.
namespace specdec {
at::Tensor verify_attention_paged_cpu(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                                      const at::Tensor& block_tables, const at::Tensor& cache_lens,
                                      const std::optional<at::Tensor>& tree_mask, double scale);
void append_kv_paged_cpu(at::Tensor& k_pages, at::Tensor& v_pages, const at::Tensor& k_new, const at::Tensor& v_new,
                         const at::Tensor& block_tables, const at::Tensor& cache_lens, int64_t offset);
void kv_commit_paged_cpu(at::TensorList k_pages, at::TensorList v_pages, const at::Tensor& block_tables,
                         at::Tensor& cache_lens, const at::Tensor& accepted, const at::Tensor& num_accepted);
#ifdef SPECDEC_WITH_CUDA
at::Tensor verify_attention_paged_cuda(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                                       const at::Tensor& block_tables, const at::Tensor& cache_lens,
                                       const std::optional<at::Tensor>& tree_mask, double scale);
void append_kv_paged_cuda(at::Tensor& k_pages, at::Tensor& v_pages, const at::Tensor& k_new, const at::Tensor& v_new,
                          const at::Tensor& block_tables, const at::Tensor& cache_lens, int64_t offset);
void kv_commit_paged_cuda(at::TensorList k_pages, at::TensorList v_pages, const at::Tensor& block_tables,
                          at::Tensor& cache_lens, const at::Tensor& accepted, const at::Tensor& num_accepted);
#endif
}  // namespace specdec
