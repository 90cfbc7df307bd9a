// rejection_sample / greedy_verify, CPU backend: one task per request (at::parallel_for),
// the tree walk itself in csrc/include/specdec/tree_walk.h.
//
// Napkin math: every visited node reads its target row twice (its largest entry, then the
// integer masses and Z); a rejection adds one pass over the masses and q_c for that row
// only; the final draw one more pass over the current row. B = 8, N = 16, V = 49152 accepted to the end: 8 * 16 *
// 49152 * 4 B = 25 MB read.
#include <ATen/Parallel.h>

#include "checks.h"
#include "ops.h"
#include "specdec/cpu_vec.h"
#include "specdec/tree_walk.h"

namespace specdec {

namespace {

SampleResult make_outputs(const at::Tensor& tokens) {
  const int64_t B = tokens.size(0), N = tokens.size(1);
  auto opts = tokens.options();
  return {at::empty({B, N}, opts.dtype(at::kInt)), at::empty({B}, opts.dtype(at::kInt)),
          at::empty({B, N}, opts.dtype(at::kLong))};
}

cpu::TreeOutputs outputs_of(SampleResult& res, int64_t b, int64_t N) {
  return {std::get<0>(res).data_ptr<int32_t>() + b * N, std::get<1>(res).data_ptr<int32_t>() + b,
          std::get<2>(res).data_ptr<int64_t>() + b * N};
}

}  // namespace

SampleResult rejection_sample_cpu(const at::Tensor& tokens_in, const at::Tensor& parents_in,
                                  const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                                  const at::Tensor& uniforms_in) {
  checks::rejection_sample(tokens_in, parents_in, target_probs, draft_probs, uniforms_in);
  const at::Tensor tokens = tokens_in.contiguous(), parents = parents_in.contiguous();
  const at::Tensor uniforms = uniforms_in.contiguous();
  const int64_t B = tokens.size(0), N = tokens.size(1), V = target_probs.size(2);
  SampleResult res = make_outputs(tokens);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  const float* p = target_probs.data_ptr<float>();
  const float* q = draft_probs.has_value() ? draft_probs->data_ptr<float>() : nullptr;
  const double* u = uniforms.data_ptr<double>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> mnode, scratch;
    std::vector<int32_t> first_child, next_sibling;
    for (int64_t b = begin; b < end; ++b) {
      cpu::rejection_sample_request(tok + b * N, par + b * N, p + b * N * V, q ? q + b * N * V : nullptr, u + b * N,
                                    N, V, mnode, scratch, first_child, next_sibling, outputs_of(res, b, N));
    }
  });
  return res;
}

SampleResult greedy_verify_cpu(const at::Tensor& tokens_in, const at::Tensor& parents_in,
                               const at::Tensor& target_logits) {
  checks::greedy_verify(tokens_in, parents_in, target_logits);
  const at::Tensor tokens = tokens_in.contiguous(), parents = parents_in.contiguous();
  const auto dtype = target_logits.scalar_type();
  const int64_t B = tokens.size(0), N = tokens.size(1), V = dtype == at::kLong ? 1 : target_logits.size(2);
  SampleResult res = make_outputs(tokens);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  const void* logits = target_logits.data_ptr();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> first_child, next_sibling;
    for (int64_t b = begin; b < end; ++b) {
      const cpu::TreeOutputs out = outputs_of(res, b, N);
      if (dtype == at::kLong) {  // the argmax at each node, already taken (e.g. ops.qlinear_argmax)
        const int64_t* best = static_cast<const int64_t*>(logits) + b * N;
        cpu::greedy_walk(tok + b * N, par + b * N, N, [best](int64_t node) { return best[node]; }, first_child,
                         next_sibling, out);
      } else if (dtype == at::kFloat) {
        cpu::greedy_verify_request(tok + b * N, par + b * N, static_cast<const float*>(logits) + b * N * V, N, V,
                                   [](float x) { return x; }, first_child, next_sibling, out);
      } else if (dtype == at::kHalf) {
        cpu::greedy_verify_request(tok + b * N, par + b * N, static_cast<const uint16_t*>(logits) + b * N * V, N, V,
                                   [](uint16_t x) { return cpu::half_to_float(x); }, first_child, next_sibling, out);
      } else {
        cpu::greedy_verify_request(tok + b * N, par + b * N, static_cast<const uint16_t*>(logits) + b * N * V, N, V,
                                   [](uint16_t x) { return cpu::bf16_to_float(x); }, first_child, next_sibling, out);
      }
    }
  });
  return res;
}

}  // namespace specdec
