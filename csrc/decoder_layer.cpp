// decoder_layer: one Llama-style decoder layer (attention block + SwiGLU MLP) in ONE op call.
//
// Why: at decode sizes a layer's ~20 Python-level calls (11 specdec ops, views, splits)
// cost ~2-3.5 us each in the interpreter and the dispatcher, ~1.5 ms per forward of a
// 30-layer model: as much as the norms, RoPE and attention compute. This op runs the same
// sequence of specdec kernels from C++ (no dispatcher between them), so the math, the
// rounding steps and the results are those of the separate ops, bit for bit:
//
//   q, k, v = proj(x)                 (slots q, k, v, or one merged qkv slot split in order)
//   q, k    = rope(q, k, cos, sin)
//   append_kv(k_cache, v_cache, k, v, cache_lens, kv_offset)
//   a       = verify_attention(q, k_cache, v_cache, cache_lens, tree_mask, scale)
//   x, h    = add_rms_norm(o(a), h, post_norm_weight, post_norm_eps)
//   g, u    = gate(x), up(x)         (or one merged gate_up slot, halves in order)
//   x, h    = add_rms_norm(down(silu_mul(g, u)), h, next_norm_weight, next_norm_eps)
//
// Projection slots: 7 (q, k, v, o, gate, up, down) or 4 (qkv, o, gate_up, down). Slot i is
// linear(x, weights[i], biases[i], scales[i]) when bits[i] == 0 (float weight, or int8 with a
// per-row scale) and qlinear(x, weights[i], scales[i], mins[i], biases[i], bits[i]) for
// bits 4 / 8; bits 4 | 32 / 8 | 32 (kQ8ActFlag) = qlinear_q8act (activations quantized per block). Every argument is validated before the caches are written; an error names the
// slot. The backend of the inputs picks the kernels (CPU, or CUDA when built with it).
// The CPU q / k / v and gate / up float linears share one parallel region on the float32 path.
//
// CPU, float32 activations, decode / verify sizes (B * N <= 64 rows): after the validation the
// layer runs the same CPU kernels on raw pointers (csrc/cpu/raw.h) with one workspace
// allocation, instead of the torch-level functions with their ~30 tensor allocations, views
// and repeated checks (~1 us each, ~30 us per layer at decode sizes). Same kernels, same
// parameters: the same results, bit for bit (tested against the separate ops).
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "cpu/raw.h"
#include "ops.h"
#include "paged_checks.h"
#include "q8act.h"

namespace specdec {
namespace {

struct Kernels {
  decltype(&linear_cpu) linear;
  decltype(&qlinear_cpu) qlinear;
  decltype(&rope_cpu) rope;
  decltype(&append_kv_cpu) append_kv;
  decltype(&verify_attention_cpu) verify_attention;
  decltype(&add_rms_norm_cpu) add_rms_norm;
  decltype(&silu_mul_cpu) silu_mul;
  decltype(&append_kv_paged_cpu) append_kv_paged;
  decltype(&verify_attention_paged_cpu) verify_attention_paged;
  decltype(&qlinear_q8act_cpu) qlinear_q8act;
};

constexpr int64_t kQ8ActFlag = 32;  // bits | kQ8ActFlag: the slot's activations are quantized (qlinear_q8act)

// The op name errors carry: "decoder_layer", or "decoder_layer_paged" for the duration of a paged call.
thread_local const char* kOp = "decoder_layer";
constexpr std::array<const char*, 7> kSlots7 = {"q", "k", "v", "o", "gate", "up", "down"};
constexpr std::array<const char*, 4> kSlots4 = {"qkv", "o", "gate_up", "down"};

struct Slots {
  at::TensorList weights;
  const c10::List<std::optional<at::Tensor>>& scales;
  const c10::List<std::optional<at::Tensor>>& mins;
  const c10::List<std::optional<at::Tensor>>& biases;
  at::IntArrayRef bits;
  size_t n;
  const char* name(size_t i) const { return n == 7 ? kSlots7[i] : kSlots4[i]; }
  // Whether slot i holds qlinear_q8act's packed CPU layout (3-D; its scales give the shape).
  bool packed(size_t i) const { return (bits[i] & kQ8ActFlag) && weights[i].dim() == 3; }
  // The weight's (out, in) features.
  std::pair<int64_t, int64_t> shape(size_t i) const {
    const at::Tensor& w = weights[i];
    if (packed(i)) return {scales[i].has_value() ? scales[i]->size(0) : -1, w.size(1) * 32};
    return {w.size(0), (bits[i] & ~kQ8ActFlag) == 4 ? w.size(1) * 2 : w.size(1)};
  }
};

// linear / qlinear's own checks for slot i on `probe` (an input of the slot's width, x's dtype and device).
void check_slot(const Slots& S, size_t i, const at::Tensor& probe, int64_t out) {
  const int64_t in = probe.size(-1);
  const at::Tensor& w = S.weights[i];
  TORCH_CHECK(w.dim() == 2 || S.packed(i), kOp, ": weights[", i, "] (", S.name(i),
              ") must be a 2-D weight (or, for a q8-activation slot on the CPU, pack_q8act's 3-D layout), got ",
              w.sizes());
  const auto [n, k] = S.shape(i);
  TORCH_CHECK(n == out && k == in, kOp, ": weights[", i, "] (", S.name(i), ") must map ", in, " to ", out,
              " features, got a weight of ", w.sizes(), ((S.bits[i] & ~kQ8ActFlag) == 4 ? " (4-bit: [out, in / 2])" : ""));
  try {
    if (S.bits[i] == 0) {
      checks::linear(probe, w, S.biases[i], S.scales[i]);
    } else {
      TORCH_CHECK(S.scales[i].has_value(), "the group scales are missing (bits ", S.bits[i], ")");
      if (S.bits[i] & kQ8ActFlag)
        checks::qlinear_q8act(probe, w, *S.scales[i], S.mins[i], S.biases[i], S.bits[i] & ~kQ8ActFlag);
      else
        checks::qlinear(probe, w, *S.scales[i], S.mins[i], S.biases[i], S.bits[i]);
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, kOp, ": projection ", S.name(i), " (slot ", i, "): ", e.what_without_backtrace());
  }
}

at::Tensor project(const Kernels& K, const Slots& S, size_t i, const at::Tensor& x) {
  if (S.bits[i] == 0) return K.linear(x, S.weights[i], S.biases[i], S.scales[i]);
  if (S.bits[i] & kQ8ActFlag)
    return K.qlinear_q8act(x, S.weights[i], *S.scales[i], S.mins[i], S.biases[i], S.bits[i] & ~kQ8ActFlag);
  return K.qlinear(x, S.weights[i], *S.scales[i], S.mins[i], S.biases[i], S.bits[i]);
}

// ---------------------------------------------------------------- CPU float32 path
struct Dims {
  int64_t B, N, H, hq, hkv, D, nq, nkv, inter;
};

bool raw_ok(const at::Tensor& t) { return t.is_contiguous() && t.scalar_type() == at::kFloat; }

// Whether the raw CPU path takes this call (the validation has passed).
bool cpu_f32_path(const Slots& S, const Dims& d, const at::Tensor& x, const at::Tensor& h,
                  const at::Tensor& post_w, const at::Tensor& next_w, const at::Tensor& k_cache,
                  const at::Tensor& v_cache) {
  const int64_t M = d.B * d.N;
  if (x.is_cuda() || M < 1 || M > cpu::kLinearBlasRows || d.H < 1 || d.D < 1 || d.inter < 1) return false;
  if (!raw_ok(x) || !raw_ok(h) || !raw_ok(post_w) || !raw_ok(next_w) || !raw_ok(k_cache) || !raw_ok(v_cache))
    return false;
  for (size_t i = 0; i < S.n; ++i) {
    const at::Tensor& w = S.weights[i];
    if (!w.is_contiguous() || w.size(0) < 1) return false;
    if (S.biases[i].has_value() && !raw_ok(*S.biases[i])) return false;
    if (S.bits[i] == 0) {
      if (w.scalar_type() != at::kFloat && w.scalar_type() != at::kChar) return false;
      if (S.scales[i].has_value() && !S.scales[i]->is_contiguous()) return false;
    } else if (!S.scales[i]->is_contiguous() || (S.mins[i].has_value() && !S.mins[i]->is_contiguous())) {
      return false;
    }
  }
  return true;
}

// The kernel parameters of a bits-0 slot (float32 weight, or int8 with its per-row scale).
cpu::LinearParams linear_params(const Slots& S, size_t i, const float* x, int64_t M, int64_t K, float* y,
                                int64_t y_stride) {
  const at::Tensor& w = S.weights[i];
  cpu::LinearParams P;
  P.x = x;
  P.x_stride = K;
  P.w = w.data_ptr();
  P.scale = S.scales[i].has_value() ? S.scales[i]->data_ptr<float>() : nullptr;
  P.bias = S.biases[i].has_value() ? S.biases[i]->data_ptr<float>() : nullptr;
  P.y = y;
  P.y_stride = y_stride;
  P.M = M;
  P.N = w.size(0);
  P.K = K;
  P.wtype = w.scalar_type() == at::kFloat ? cpu::WType::kFloat32 : cpu::WType::kInt8;
  return P;
}

// y[M, N] (row stride y_stride) = slot i of x[M, K] (contiguous).
void project_raw(const Slots& S, size_t i, const float* x, int64_t M, int64_t K, float* y, int64_t y_stride) {
  if (S.bits[i] == 0) {
    cpu::linear_raw(linear_params(S, i, x, M, K, y, y_stride));
    return;
  }
  const at::Tensor& w = S.weights[i];
  cpu::QLinearParams P;
  P.x = x;
  P.x_stride = K;
  P.xsum = nullptr;
  P.qw = S.packed(i) ? nullptr : w.data_ptr();
  P.q8packed = S.packed(i) ? w.data_ptr<uint8_t>() : nullptr;
  P.scales = reinterpret_cast<const uint16_t*>(S.scales[i]->data_ptr<at::Half>());
  P.mins = S.mins[i].has_value() ? reinterpret_cast<const uint16_t*>(S.mins[i]->data_ptr<at::Half>()) : nullptr;
  P.bias = S.biases[i].has_value() ? S.biases[i]->data_ptr<float>() : nullptr;
  P.y = y;
  P.y_stride = y_stride;
  P.M = M;
  P.N = S.shape(i).first;
  P.K = K;
  P.bits = int(S.bits[i] & ~kQ8ActFlag);
  if (S.bits[i] & kQ8ActFlag) return cpu::qlinear_q8act_raw(x, K, P);
  cpu::qlinear_raw(P);
}

// Slots i0 .. i0 + count - 1 of x into consecutive contiguous outputs (out[j] = [M, N_j]): one
// parallel region for float32 weights, else one call each.
void project_all_raw(const Slots& S, size_t i0, size_t count, const float* x, int64_t M, int64_t K,
                     const std::vector<float*>& out) {
  bool plain = true;
  for (size_t i = i0; i < i0 + count; ++i)
    plain = plain && S.bits[i] == 0 && !S.scales[i].has_value() && S.weights[i].scalar_type() == at::kFloat;
  if (!plain || M > cpu::kLinearRowsPerPass) {
    for (size_t j = 0; j < count; ++j) project_raw(S, i0 + j, x, M, K, out[j], S.shape(i0 + j).first);
    return;
  }
  std::vector<cpu::LinearParams> P;
  for (size_t j = 0; j < count; ++j)
    P.push_back(linear_params(S, i0 + j, x, M, K, out[j], S.weights[i0 + j].size(0)));
  cpu::linear_multi_raw(P);
}

std::tuple<at::Tensor, at::Tensor> run_cpu_f32(const Slots& S, const Dims& d, const at::Tensor& x,
                                               const at::Tensor& h, const at::Tensor& post_w, double post_eps,
                                               const at::Tensor& next_w, double next_eps, at::Tensor& k_cache,
                                               at::Tensor& v_cache, const at::Tensor& cache_lens,
                                               const at::Tensor& cos_in, const at::Tensor& sin_in,
                                               const std::optional<at::Tensor>& tree_mask, int64_t kv_offset,
                                               double scale, const std::optional<at::Tensor>& block_tables,
                                               const at::Tensor* out_pair) {
  const int64_t B = d.B, N = d.N, H = d.H, D = d.D, nq = d.nq, nkv = d.nkv, I = d.inter, M = B * N;
  const bool seven = S.n == 7;
  // workspace: projections, roped q / k, attention, o, the mid residual and norm, gate / up, act, down
  const int64_t sizes[] = {M * (nq + 2 * nkv), M * nq, M * nkv, M * nq, M * H, M * H, M * H, M * 2 * I, M * I, M * H};
  int64_t total = 0;
  for (int64_t z : sizes) total += z;
  // the workspace never leaves the call: one per thread, grown when a call needs more (no allocation per layer)
  thread_local std::vector<float> ws;
  if (ws.size() < size_t(total)) ws.resize(size_t(total));
  float* p = ws.data();
  float* proj = p; p += sizes[0];
  float* qr = p; p += sizes[1];
  float* kr = p; p += sizes[2];
  float* att = p; p += sizes[3];
  float* o = p; p += sizes[4];
  float* x1 = p; p += sizes[5];
  float* h1 = p; p += sizes[6];
  float* gu = p; p += sizes[7];
  float* act = p; p += sizes[8];
  float* dn = p;
  // the outputs: the caller's pair (DecoderStack: two pairs per forward, layers alternating) or new tensors
  at::Tensor out_x = out_pair ? out_pair[0] : at::empty(x.sizes(), x.options());
  at::Tensor out_h = out_pair ? out_pair[1] : at::empty(x.sizes(), x.options());
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor lens_t = cache_lens.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const float* xp = x.data_ptr<float>();

  // q, k, v (row strides: separate outputs, or the merged projection's rows)
  const float *q, *k, *v;
  int64_t qs, ks, vs;
  if (seven) {
    project_all_raw(S, 0, 3, xp, M, H, {proj, proj + M * nq, proj + M * (nq + nkv)});
    q = proj, k = proj + M * nq, v = proj + M * (nq + nkv);
    qs = nq, ks = nkv, vs = nkv;
  } else {
    project_raw(S, 0, xp, M, H, proj, nq + 2 * nkv);
    q = proj, k = proj + nq, v = proj + nq + nkv;
    qs = ks = vs = nq + 2 * nkv;
  }
  cpu::rope_f32(q, qs, cos.data_ptr<float>(), sin.data_ptr<float>(), qr, M, d.hq, D);
  cpu::rope_f32(k, ks, cos.data_ptr<float>(), sin.data_ptr<float>(), kr, M, d.hkv, D);
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  at::Tensor paged_att;  // the paged attention's output: the o projection reads it in place (no copy)
  if (block_tables.has_value()) {
    // paged: append_kv_paged / verify_attention_paged on the workspace's roped k, v and q (same kernels as
    // the separate paged ops; the paged CPU kernels give the dense kernels' bits)
    const auto f32 = x.options();
    const at::Tensor k_t = at::from_blob(kr, {B, N, d.hkv, D}, f32);
    const at::Tensor v_t = at::from_blob(const_cast<float*>(v), {B, N, d.hkv, D}, {N * vs, vs, D, 1}, f32);
    append_kv_paged_cpu(k_cache, v_cache, k_t.transpose(1, 2), v_t.transpose(1, 2), *block_tables, cache_lens,
                        kv_offset);
    const at::Tensor q_t = at::from_blob(qr, {B, N, d.hq, D}, f32);
    paged_att = verify_attention_paged_cpu(q_t, k_cache, v_cache, *block_tables, cache_lens, tree_mask, scale)
                    .contiguous();
    att = paged_att.data_ptr<float>();
  } else {
  // append_kv: cache[b, h, lens[b] + kv_offset + j] = k / v of node j
  const int64_t Sc = k_cache.size(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hh = 0; hh < d.hkv; ++hh)
      for (int64_t j = 0; j < N; ++j) {
        const int64_t dst = ((b * d.hkv + hh) * Sc + lens[b] + kv_offset + j) * D;
        std::memcpy(kc + dst, kr + (b * N + j) * nkv + hh * D, D * sizeof(float));
        std::memcpy(vc + dst, v + (b * N + j) * vs + hh * D, D * sizeof(float));
      }
  // attention
  const int64_t Nkv = tree_mask.has_value() ? tree_mask->size(2) : N;
  std::vector<uint64_t> packed;
  if (tree_mask.has_value()) packed = cpu::pack_tree_mask(tree_mask->contiguous().data_ptr<bool>(), B * N, Nkv);
  cpu::AttentionParams A;
  A.q = qr;
  A.q_stride_b = N * nq;
  A.q_stride_n = nq;
  A.q_stride_h = D;
  A.k_cache = kc;
  A.v_cache = vc;
  A.out = att;
  A.lens = lens;
  A.mask = tree_mask.has_value() ? packed.data() : nullptr;
  A.B = B; A.N = N; A.Hq = d.hq; A.Hkv = d.hkv; A.S = Sc; A.D = D; A.W = (Nkv + 63) / 64; A.Nkv = Nkv;
  A.scale = static_cast<float>(scale);
  A.dtype = cpu::DType::kFloat32;
  cpu::verify_attention_raw(A);
  }
  // o, the residual and the post-attention norm
  project_raw(S, seven ? 3 : 1, att, M, nq, o, H);
  cpu::rms_norm_f32(o, h.data_ptr<float>(), post_w.data_ptr<float>(), x1, h1, M, H, static_cast<float>(post_eps));
  // gate / up, silu * up, down, the residual and the next norm
  int64_t gs;
  const float *g, *u;
  if (seven) {
    project_all_raw(S, 4, 2, x1, M, H, {gu, gu + M * I});
    g = gu, u = gu + M * I, gs = I;
  } else {
    project_raw(S, 2, x1, M, H, gu, 2 * I);
    g = gu, u = gu + I, gs = 2 * I;
  }
  cpu::silu_mul_rows_f32(g, u, gs, act, M, I);   // gate / up rows gs apart (I: separate, 2 I: merged)
  project_raw(S, S.n - 1, act, M, I, dn, H);
  cpu::rms_norm_f32(dn, h1, next_w.data_ptr<float>(), out_x.data_ptr<float>(), out_h.data_ptr<float>(), M, H,
                    static_cast<float>(next_eps));
  return {out_x, out_h};
}

std::tuple<at::Tensor, at::Tensor> run(const Kernels& K, const at::Tensor& x, const at::Tensor& h,
                                       at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales,
                                       const c10::List<std::optional<at::Tensor>>& mins,
                                       const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef bits,
                                       const at::Tensor& post_norm_weight, double post_norm_eps,
                                       const at::Tensor& next_norm_weight, double next_norm_eps, at::Tensor& k_cache, at::Tensor& v_cache,
                                       const at::Tensor& cache_lens, const at::Tensor& cos, const at::Tensor& sin,
                                       const std::optional<at::Tensor>& tree_mask, int64_t kv_offset, double scale,
                                       int64_t hq, int64_t hkv, const std::optional<at::Tensor>& block_tables,
                                       bool validate = true, const at::Tensor* out_pair = nullptr) {
  // validate = false: only DecoderStack, for a layer whose weights it has checked with these activations'
  // dtype and device, whose x / h are the previous layer's outputs and whose caches it compared with the
  // first layer's (which got every check with the same lens, cos / sin and mask)
  const bool paged = block_tables.has_value();
  kOp = paged ? "decoder_layer_paged" : "decoder_layer";
  // ---- validation (nothing is written before it all passes)
  const size_t n = weights.size();
  TORCH_CHECK(n == 7 || n == 4, kOp, ": weights must hold 7 projections (q, k, v, o, gate, up, down) or 4 "
              "(qkv, o, gate_up, down), got ", n);
  TORCH_CHECK(scales.size() == n && mins.size() == n && biases.size() == n && bits.size() == n, kOp,
              ": scales, mins, biases and bits must have one entry per projection (", n, "), got ", scales.size(),
              ", ", mins.size(), ", ", biases.size(), ", ", bits.size());
  for (size_t i = 0; i < n; ++i)
    TORCH_CHECK(bits[i] == 0 || bits[i] == 4 || bits[i] == 8 || bits[i] == (4 | kQ8ActFlag) ||
                bits[i] == (8 | kQ8ActFlag), kOp, ": bits[", i, "] must be 0 (linear), 4 or 8 (qlinear), or 36 / 40 "
                "(qlinear_q8act: 4 / 8 | 32), got ", bits[i]);
  TORCH_CHECK(x.dim() == 3, kOp, ": x must be [B, N, H] (the normed layer input), got ", x.sizes());
  TORCH_CHECK(h.sizes() == x.sizes() && h.scalar_type() == x.scalar_type() && h.device() == x.device(), kOp,
              ": h (the residual stream) must be ", x.scalar_type(), " ", x.sizes(), " on ", x.device(),
              " like x, got ", h.scalar_type(), " ", h.sizes(), " on ", h.device());
  TORCH_CHECK(hq >= 1 && hkv >= 1 && hq % hkv == 0, kOp, ": num_heads and num_kv_heads must be >= 1 with "
              "num_heads % num_kv_heads == 0, got ", hq, " and ", hkv);
  TORCH_CHECK(k_cache.dim() == 4, kOp, ": k_cache must be ", paged ? "[num_pages, page_size, Hkv, D]" : "[B, Hkv, S, D]",
              ", got ", k_cache.sizes());
  const int64_t B = x.size(0), N = x.size(1), H = x.size(2), D = k_cache.size(3);
  const int64_t nq = hq * D, nkv = hkv * D;
  const Slots S{weights, scales, mins, biases, bits, n};
  int64_t inter = 0;  // the MLP's width, from the down projection
  {
    const auto [dn, dk] = S.shape(n - 1);
    (void)dn;
    inter = dk;
  }
  if (validate) {
    // inputs of the o and down projections' widths, for their checks (the others take x itself)
    const at::Tensor a_probe = at::empty({1, nq}, x.options()), m_probe = at::empty({1, inter}, x.options());
    if (n == 7) {
      check_slot(S, 0, x, nq);
      check_slot(S, 1, x, nkv);
      check_slot(S, 2, x, nkv);
      check_slot(S, 3, a_probe, H);
      check_slot(S, 4, x, inter);
      check_slot(S, 5, x, inter);
      check_slot(S, 6, m_probe, H);
    } else {
      check_slot(S, 0, x, nq + 2 * nkv);
      check_slot(S, 1, a_probe, H);
      check_slot(S, 2, x, 2 * inter);
      check_slot(S, 3, m_probe, H);
    }
    for (const auto& [name, w, eps] : {std::tuple{"post_norm_weight", &post_norm_weight, post_norm_eps},
                                        std::tuple{"next_norm_weight", &next_norm_weight, next_norm_eps}}) {
      try {
        checks::rms_norm("add_rms_norm", x, &h, *w, eps);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, kOp, ": ", name, " / its eps: ", e.what_without_backtrace());
      }
    }
    const at::Tensor q_probe = at::empty({B, N, hq, D}, x.options());
    const at::Tensor k_probe = at::empty({B, N, hkv, D}, x.options());
    try {
      checks::rope(q_probe, k_probe, cos, sin);
      if (paged) {
        checks::append_kv_paged(k_cache, v_cache, k_probe.transpose(1, 2), k_probe.transpose(1, 2), *block_tables,
                                cache_lens, kv_offset);
        checks::verify_attention_paged(q_probe, k_cache, v_cache, *block_tables, cache_lens, tree_mask, scale);
      } else {
        checks::append_kv(k_cache, v_cache, k_probe.transpose(1, 2), k_probe.transpose(1, 2), cache_lens, kv_offset);
        checks::verify_attention(q_probe, k_cache, v_cache, cache_lens, tree_mask, scale);
      }
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, kOp, ": attention inputs: ", e.what_without_backtrace());
    }
  }

  // ---- the layer
  const Dims dims{B, N, H, hq, hkv, D, nq, nkv, inter};
  if (cpu_f32_path(S, dims, x, h, post_norm_weight, next_norm_weight, k_cache, v_cache))
    return run_cpu_f32(S, dims, x, h, post_norm_weight, post_norm_eps, next_norm_weight, next_norm_eps, k_cache,
                       v_cache, cache_lens, cos, sin, tree_mask, kv_offset, scale, block_tables, out_pair);
  at::Tensor q, k, v;
  if (n == 7) {
    q = project(K, S, 0, x);
    k = project(K, S, 1, x);
    v = project(K, S, 2, x);
  } else {
    const at::Tensor qkv = project(K, S, 0, x);
    q = qkv.narrow(-1, 0, nq);
    k = qkv.narrow(-1, nq, nkv);
    v = qkv.narrow(-1, nq + nkv, nkv);
  }
  auto [qr, kr] = K.rope(q.view({B, N, hq, D}), k.view({B, N, hkv, D}), cos, sin);
  at::Tensor a;
  if (paged) {
    K.append_kv_paged(k_cache, v_cache, kr.transpose(1, 2), v.view({B, N, hkv, D}).transpose(1, 2), *block_tables,
                      cache_lens, kv_offset);
    a = K.verify_attention_paged(qr, k_cache, v_cache, *block_tables, cache_lens, tree_mask, scale);
  } else {
    K.append_kv(k_cache, v_cache, kr.transpose(1, 2), v.view({B, N, hkv, D}).transpose(1, 2), cache_lens, kv_offset);
    a = K.verify_attention(qr, k_cache, v_cache, cache_lens, tree_mask, scale);
  }
  auto [x1, h1] = K.add_rms_norm(project(K, S, n == 7 ? 3 : 1, a.reshape({B, N, nq})), h, post_norm_weight, post_norm_eps);
  at::Tensor g, u;
  if (n == 7) {
    g = project(K, S, 4, x1);
    u = project(K, S, 5, x1);
  } else {
    const at::Tensor gu = project(K, S, 2, x1);
    g = gu.narrow(-1, 0, inter);
    u = gu.narrow(-1, inter, inter);
  }
  return K.add_rms_norm(project(K, S, n - 1, K.silu_mul(g, u)), h1, next_norm_weight, next_norm_eps);
}

}  // namespace


static const Kernels& kernels_for(const at::Tensor& x) {
  static const Kernels kCpu{&linear_cpu, &qlinear_cpu, &rope_cpu, &append_kv_cpu,
                            &verify_attention_cpu, &add_rms_norm_cpu, &silu_mul_cpu,
                            &append_kv_paged_cpu, &verify_attention_paged_cpu, &qlinear_q8act_cpu};
#ifdef SPECDEC_WITH_CUDA
  static const Kernels kCuda{&linear_cuda, &qlinear_cuda, &rope_cuda, &append_kv_cuda,
                             &verify_attention_cuda, &add_rms_norm_cuda, &silu_mul_cuda,
                             &append_kv_paged_cuda, &verify_attention_paged_cuda, &qlinear_q8act_cuda};
  return x.is_cuda() ? kCuda : kCpu;
#else
  return kCpu;
#endif
}

// Registered for CPU and CUDA: the inputs' device picks the kernels.
std::tuple<at::Tensor, at::Tensor> decoder_layer(const at::Tensor& x, const at::Tensor& h, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& scales, const c10::List<std::optional<at::Tensor>>& mins,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef bits, const at::Tensor& post_norm_weight,
    double post_norm_eps, const at::Tensor& next_norm_weight, double next_norm_eps, at::Tensor& k_cache,
    at::Tensor& v_cache, const at::Tensor& cache_lens, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& tree_mask, int64_t kv_offset, double scale, int64_t num_heads,
    int64_t num_kv_heads) {
  return run(kernels_for(x), x, h, weights, scales, mins, biases, bits, post_norm_weight, post_norm_eps,
             next_norm_weight, next_norm_eps, k_cache, v_cache, cache_lens, cos, sin, tree_mask, kv_offset, scale,
             num_heads, num_kv_heads, std::nullopt);
}

// The same layer on a paged cache: k_cache / v_cache are page pools [num_pages, page_size, Hkv, D] read and
// written through block_tables [B, max_blocks] int32 (append_kv_paged / verify_attention_paged).
std::tuple<at::Tensor, at::Tensor> decoder_layer_paged(const at::Tensor& x, const at::Tensor& h,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales,
    const c10::List<std::optional<at::Tensor>>& mins, const c10::List<std::optional<at::Tensor>>& biases,
    at::IntArrayRef bits, const at::Tensor& post_norm_weight, double post_norm_eps,
    const at::Tensor& next_norm_weight, double next_norm_eps, at::Tensor& k_pages, at::Tensor& v_pages,
    const at::Tensor& cache_lens, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& tree_mask, int64_t kv_offset, double scale, int64_t num_heads,
    int64_t num_kv_heads, const at::Tensor& block_tables) {
  return run(kernels_for(x), x, h, weights, scales, mins, biases, bits, post_norm_weight, post_norm_eps,
             next_norm_weight, next_norm_eps, k_pages, v_pages, cache_lens, cos, sin, tree_mask, kv_offset, scale,
             num_heads, num_kv_heads, block_tables);
}

}  // namespace specdec

// ---------------------------------------------------------------- a stack of layers in one call
namespace specdec {
namespace {

// Whether DecoderStack's float32 CPU layers write into two output pairs per forward (true, the default) or
// allocate theirs per layer (false; for A/Bs, the same bits): specdec._C.set_stack_buffers.
std::atomic<bool>& stack_buffers() {
  static std::atomic<bool> on{true};
  return on;
}

// torch.classes.specdec.DecoderStack: the layers of a model, held once, run by one call per forward.
// Each layer is exactly decoder_layer / decoder_layer_paged (the same function, arguments and checks),
// so the results are those of the per-layer calls bit for bit; what the stack saves is the Python
// loop and the dispatcher's argument conversion of every layer's projection lists, per layer and step.
struct DecoderStack : torch::CustomClassHolder {
  struct Layer {
    std::vector<at::Tensor> weights;
    c10::List<std::optional<at::Tensor>> scales, mins, biases;
    std::vector<int64_t> bits;
    at::Tensor post_w, next_w;
    double post_eps, next_eps, scale;
  };
  int64_t hq, hkv;
  std::vector<Layer> layers;
  bool checked = false;  // every layer passed decoder_layer's checks in one forward with:
  at::ScalarType checked_dtype = at::kFloat;
  at::Device checked_device = at::kCPU;

  // Layer l's caches like the first layer's (which got decoder_layer's checks): shape, strides, dtype, device.
  static void same_as_first(const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs, int64_t l) {
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& c = kv == 0 ? ks[l] : vs[l];
      const at::Tensor& r = kv == 0 ? ks[0] : vs[0];
      TORCH_CHECK(c.sizes() == r.sizes() && c.strides() == r.strides() && c.scalar_type() == r.scalar_type() &&
                      c.device() == r.device(), "DecoderStack.forward: ", kv == 0 ? "k_caches[" : "v_caches[", l,
                  "] must be ", r.scalar_type(), " ", r.sizes(), " with strides ", r.strides(), " on ", r.device(),
                  " like layer 0's, got ", c.scalar_type(), " ", c.sizes(), " with strides ", c.strides(), " on ",
                  c.device());
    }
    TORCH_CHECK(!ks[l].is_alias_of(vs[l]), "DecoderStack.forward: k_caches[", l, "] and v_caches[", l,
                "] must be distinct tensors");
  }

  DecoderStack(int64_t num_heads, int64_t num_kv_heads) : hq(num_heads), hkv(num_kv_heads) {}

  int64_t num_layers() const { return int64_t(layers.size()); }

  // Appends layer len(self): the arguments of decoder_layer that do not change between forwards.
  void add_layer(std::vector<at::Tensor> weights, c10::List<std::optional<at::Tensor>> scales,
                 c10::List<std::optional<at::Tensor>> mins, c10::List<std::optional<at::Tensor>> biases,
                 std::vector<int64_t> bits, at::Tensor post_norm_weight, double post_norm_eps,
                 at::Tensor next_norm_weight, double next_norm_eps, double scale) {
    layers.push_back(Layer{std::move(weights), std::move(scales), std::move(mins), std::move(biases), std::move(bits),
                           std::move(post_norm_weight), std::move(next_norm_weight), post_norm_eps, next_norm_eps,
                           scale});
  }

  // [x, h, kept...]: every layer in order on (x, h); k_caches / v_caches one per layer (page pools with
  // block_tables); kept[i] = the residual stream h entering layer capture[i] (a copy).
  std::vector<at::Tensor> forward(at::Tensor x, at::Tensor h, std::vector<at::Tensor> k_caches,
                                  std::vector<at::Tensor> v_caches, at::Tensor cache_lens, at::Tensor cos,
                                  at::Tensor sin, std::optional<at::Tensor> tree_mask, int64_t kv_offset,
                                  std::vector<int64_t> capture, std::optional<at::Tensor> block_tables) {
    const int64_t L = num_layers();
    TORCH_CHECK(int64_t(k_caches.size()) == L && int64_t(v_caches.size()) == L, "DecoderStack.forward: k_caches and "
                "v_caches must hold one cache per layer (", L, "), got ", k_caches.size(), " and ", v_caches.size());
    for (int64_t c : capture)
      TORCH_CHECK(c >= 0 && c < L, "DecoderStack.forward: capture must name layers in [0, ", L, "), got ", c);
    std::vector<at::Tensor> out(2 + capture.size());
    // The first layer gets every check. Later layers share its lens, cos / sin, mask and activations' shape,
    // so they get every check only until one forward has passed them with this dtype and device (their
    // weights are held here and cannot change shape); after that, their caches are compared with the
    // first layer's (no probe tensors: a forward of ~30 layers made ~250 of them)
    const bool trusted = checked && checked_dtype == x.scalar_type() && checked_device == x.device();
    if (trusted)  // before any layer writes its cache
      for (int64_t l = 1; l < L; ++l) same_as_first(k_caches, v_caches, l);
    // The float32 CPU layers write their (x, h) into two pairs made once per forward, alternating: layer l reads
    // one pair and writes the other (a layer's inputs are dead once it has run); the last layer's pair is
    // returned, new to this forward. The same kernels and bits as one pair per layer (decoder_layer's).
    at::Tensor pairs[2][2];
    const bool reuse = x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 &&
                       stack_buffers().load(std::memory_order_relaxed);
    if (reuse)
      for (auto& pair : pairs)
        for (auto& t : pair) t = at::empty(x.sizes(), x.options());
    for (int64_t l = 0; l < L; ++l) {
      for (size_t i = 0; i < capture.size(); ++i)
        if (capture[i] == l) out[2 + i] = h.clone();
      const bool full = l == 0 || !trusted;
      const Layer& Y = layers[l];
      std::tie(x, h) = run(kernels_for(x), x, h, Y.weights, Y.scales, Y.mins, Y.biases, Y.bits, Y.post_w, Y.post_eps,
                           Y.next_w, Y.next_eps, k_caches[l], v_caches[l], cache_lens, cos, sin, tree_mask,
                           kv_offset, Y.scale, hq, hkv, block_tables, full, reuse ? pairs[l % 2] : nullptr);
    }
    checked = true;
    checked_dtype = x.scalar_type();
    checked_device = x.device();
    out[0] = x;
    out[1] = h;
    return out;
  }
};

}  // namespace

bool set_stack_buffers(bool on) { return stack_buffers().exchange(on); }

}  // namespace specdec

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.class_<specdec::DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t>())
      .def("add_layer", &specdec::DecoderStack::add_layer)
      .def("num_layers", &specdec::DecoderStack::num_layers)
      .def("forward", &specdec::DecoderStack::forward);
}
