#include "checks.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "specdec/sampling_fixed.h"

namespace specdec {
namespace checks {
namespace {

std::atomic<bool> g_strict{false};

// Values are read on the host: a CPU tensor as is, a CUDA tensor only in strict mode.
bool want_values(const at::Tensor& t) { return t.device().is_cpu() || strict(); }
at::Tensor host(const at::Tensor& t) { return t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous(); }

bool is_float_dtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), " like the other inputs, got ",
              t.device());
}

void check_int_vector(const char* op, const char* name, const at::Tensor& t, int64_t B, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == B && t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, " [", B,
              "], got ", t.scalar_type(), " ", t.sizes());
}

void check_cache(const char* op, const char* name, const at::Tensor& c) {
  TORCH_CHECK(c.dim() == 4, op, ": ", name, " must be [B, Hkv, S, D], got ", c.sizes());
  TORCH_CHECK(is_float_dtype(c.scalar_type()), op, ": ", name, " must be float32, float16 or bfloat16, got ",
              c.scalar_type());
  TORCH_CHECK(c.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", c.strides());
}

// 0 <= cache_lens[b] <= S - N for every request.
void check_lens_fit(const char* op, const at::Tensor& cache_lens, int64_t S, int64_t N) {
  if (!want_values(cache_lens)) return;
  at::Tensor h = host(cache_lens);
  const int32_t* lens = h.data_ptr<int32_t>();
  for (int64_t b = 0; b < h.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] + N <= S, op, ": cache_lens[", b, "] = ", lens[b],
                " leaves no room for N = ", N, " new nodes in a cache of capacity S = ", S,
                " (expected 0 <= cache_lens <= S - N)");
  }
}

void check_tree(const char* op, const at::Tensor& tokens, const at::Tensor& parents, int64_t V) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong, op, ": tokens must be int64 [B, N], got ",
              tokens.scalar_type(), " ", tokens.sizes());
  TORCH_CHECK(tokens.size(1) >= 1, op, ": tokens must hold at least the root node (N >= 1), got ", tokens.sizes());
  TORCH_CHECK(parents.dim() == 2 && parents.scalar_type() == at::kInt && parents.sizes() == tokens.sizes(), op,
              ": parents must be int32 [B, N] = ", tokens.sizes(), ", got ", parents.scalar_type(), " ",
              parents.sizes());
  check_same_device(op, "parents", parents, tokens);
  if (!want_values(parents)) return;
  at::Tensor ht = host(tokens), hp = host(parents);
  const int64_t* tok = ht.data_ptr<int64_t>();
  const int32_t* par = hp.data_ptr<int32_t>();
  const int64_t B = tokens.size(0), N = tokens.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(par[b * N] == -1, op, ": parents[", b, ", 0] must be -1 (node 0 is the root), got ", par[b * N]);
    for (int64_t i = 1; i < N; ++i) {
      const int32_t p = par[b * N + i];
      TORCH_CHECK(p >= -1 && p < i, op, ": parents[", b, ", ", i, "] = ", p,
                  " must be -1 (padding) or a node index < ", i, " (topological order)");
      if (p >= 0) {
        const int64_t t = tok[b * N + i];
        TORCH_CHECK(t >= 0 && t < V, op, ": tokens[", b, ", ", i, "] = ", t, " is out of range [0, ", V,
                    ") for vocabulary size V = ", V);
      }
    }
  }
}

void check_probs(const char* op, const char* name, const at::Tensor& t, int64_t B, int64_t N) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == N && t.scalar_type() == at::kFloat, op, ": ", name,
              " must be float32 [B, N, V] with B = ", B, ", N = ", N, ", got ", t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.size(2) >= 1, op, ": ", name, " must have a vocabulary of at least 1, got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
  if (strict()) {
    TORCH_CHECK(at::isfinite(t).all().item<bool>() && (t >= 0).all().item<bool>(), op, ": ", name,
                " must hold finite, non-negative probabilities (found NaN, inf or a negative value)");
  }
}

// [first byte, one past the last byte) that a tensor's elements occupy; empty for numel 0.
struct ByteRange {
  uintptr_t begin = 0, end = 0;
  int64_t index = 0;
};

ByteRange byte_range(const at::Tensor& t, int64_t index) {
  ByteRange r;
  r.index = index;
  if (t.numel() == 0) return r;
  int64_t lo = 0, hi = 0;  // element offsets of the extreme elements
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t span = (t.size(d) - 1) * t.stride(d);
    if (span < 0) lo += span;
    else hi += span;
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const int64_t es = t.element_size();
  r.begin = base + lo * es;
  r.end = base + (hi + 1) * es;
  return r;
}

bool overlaps(const at::Tensor& a, const ByteRange& ra, const at::Tensor& b, const ByteRange& rb) {
  return ra.end > ra.begin && rb.end > rb.begin && ra.begin < rb.end && rb.begin < ra.end &&
         a.device() == b.device();
}

[[noreturn]] void overlap_error(const char* op, const std::function<std::string(int64_t)>& name, int64_t a,
                                int64_t b) {
  TORCH_CHECK(false, op, ": ", name(std::min(a, b)), " and ", name(std::max(a, b)),
              " share memory (the same tensor passed twice, or overlapping views); every tensor this op writes "
              "must be memory of its own");
  std::abort();
}

// Tensors an op writes (ts[0, n_written)) must not share memory with each other or with
// the inputs it reads meanwhile (ts[n_written, end)): two CUDA blocks would race on the
// same rows, and the CPU loop would read what it has already overwritten. Read-only inputs
// may share memory with each other. O(n log n) over the written tensors; name(i) describes
// tensor i for the message.
void check_no_overlap(const char* op, const std::vector<const at::Tensor*>& ts, size_t n_written,
                      const std::function<std::string(int64_t)>& name) {
  std::vector<ByteRange> rs;
  rs.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) rs.push_back(byte_range(*ts[i], int64_t(i)));
  std::vector<ByteRange> w(rs.begin(), rs.begin() + n_written);
  w.erase(std::remove_if(w.begin(), w.end(), [](const ByteRange& r) { return r.end <= r.begin; }), w.end());
  std::sort(w.begin(), w.end(), [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  for (size_t i = 1, widest = 0; i < w.size(); ++i) {
    if (overlaps(*ts[w[i].index], w[i], *ts[w[widest].index], w[widest])) overlap_error(op, name, w[i].index, w[widest].index);
    if (w[i].end > w[widest].end) widest = i;
  }
  for (size_t r = n_written; r < ts.size(); ++r)
    for (const ByteRange& x : w)
      if (overlaps(*ts[r], rs[r], *ts[x.index], x)) overlap_error(op, name, int64_t(r), x.index);
}

}  // namespace

bool strict() { return g_strict.load(std::memory_order_relaxed); }
void set_strict(bool on) { g_strict.store(on, std::memory_order_relaxed); }

void verify_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& cache_lens, const std::optional<at::Tensor>& tree_mask, double scale) {
  const char* op = "verify_attention";
  TORCH_CHECK(q.dim() == 4, op, ": q must be [B, N, Hq, D], got ", q.sizes());
  TORCH_CHECK(is_float_dtype(q.scalar_type()), op, ": q must be float32, float16 or bfloat16, got ", q.scalar_type());
  check_cache(op, "k_cache", k_cache);
  check_cache(op, "v_cache", v_cache);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have the shape of k_cache ", k_cache.sizes(),
              ", got ", v_cache.sizes());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), op,
              ": k_cache and v_cache must have q's dtype ", q.scalar_type(), ", got ", k_cache.scalar_type(), " and ",
              v_cache.scalar_type());
  const int64_t B = q.size(0), N = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(N >= 1, op, ": q must hold at least one node (N >= 1), got ", q.sizes());
  TORCH_CHECK(k_cache.size(0) == B, op, ": k_cache batch must equal q's B = ", B, ", got ", k_cache.sizes());
  TORCH_CHECK(k_cache.size(3) == D, op, ": k_cache head dim must equal q's D = ", D, ", got ", k_cache.sizes());
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, op, ": q heads Hq = ", Hq, " must be a multiple of the KV heads Hkv = ", Hkv);
  TORCH_CHECK(N <= S, op, ": N = ", N, " new nodes exceed the cache capacity S = ", S);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_same_device(op, "k_cache", k_cache, q);
  check_same_device(op, "v_cache", v_cache, q);
  check_same_device(op, "cache_lens", cache_lens, q);
  check_int_vector(op, "cache_lens", cache_lens, B, at::kInt);
  // Nkv: the step's new nodes in the cache; q holds the last N of them (Nkv = N without a mask).
  int64_t Nkv = N;
  if (tree_mask.has_value()) {
    const at::Tensor& m = *tree_mask;
    TORCH_CHECK(m.dim() == 3 && m.size(0) == B && m.size(1) == N && m.size(2) >= N && m.scalar_type() == at::kBool,
                op, ": tree_mask must be bool [B, Nq, Nkv] = [", B, ", ", N, ", Nkv >= ", N,
                "] (queries = the last Nq of Nkv new nodes), got ", m.scalar_type(), " ", m.sizes());
    check_same_device(op, "tree_mask", m, q);
    Nkv = m.size(2);
    TORCH_CHECK(Nkv <= S, op, ": tree_mask has Nkv = ", Nkv, " new nodes, more than the cache capacity S = ", S);
  }
  check_lens_fit(op, cache_lens, S, Nkv);
}

void append_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_new,
               const at::Tensor& v_new, const at::Tensor& cache_lens, int64_t offset) {
  const char* op = "append_kv";
  check_cache(op, "k_cache", k_cache);
  check_cache(op, "v_cache", v_cache);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(), op,
              ": v_cache must match k_cache ", k_cache.scalar_type(), " ", k_cache.sizes(), ", got ",
              v_cache.scalar_type(), " ", v_cache.sizes());
  const int64_t B = k_cache.size(0), Hkv = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(k_new.dim() == 4 && k_new.size(0) == B && k_new.size(1) == Hkv && k_new.size(3) == D, op,
              ": k_new must be [B, Hkv, N, D] = [", B, ", ", Hkv, ", N, ", D, "], got ", k_new.sizes());
  TORCH_CHECK(v_new.sizes() == k_new.sizes(), op, ": v_new must have the shape of k_new ", k_new.sizes(), ", got ",
              v_new.sizes());
  TORCH_CHECK(k_new.scalar_type() == k_cache.scalar_type() && v_new.scalar_type() == k_cache.scalar_type(), op,
              ": k_new and v_new must have the cache dtype ", k_cache.scalar_type(), ", got ", k_new.scalar_type(),
              " and ", v_new.scalar_type());
  const int64_t N = k_new.size(2);
  TORCH_CHECK(N >= 1 && N <= S, op, ": k_new must hold 1 <= N <= S = ", S, " nodes, got N = ", N);
  TORCH_CHECK(offset >= 0 && offset <= S - N, op, ": offset must lie in [0, S - N] = [0, ", S - N,
              "] (the new nodes go to cache_lens[b] + offset + j), got ", offset);
  check_same_device(op, "v_cache", v_cache, k_cache);
  check_same_device(op, "k_new", k_new, k_cache);
  check_same_device(op, "v_new", v_new, k_cache);
  check_same_device(op, "cache_lens", cache_lens, k_cache);
  check_int_vector(op, "cache_lens", cache_lens, B, at::kInt);
  static const char* kNames[] = {"k_cache", "v_cache", "k_new", "v_new", "cache_lens"};
  check_no_overlap(op, {&k_cache, &v_cache, &k_new, &v_new, &cache_lens}, 2,
                   [](int64_t i) { return std::string(kNames[i]); });
  check_lens_fit(op, cache_lens, S, offset + N);
}

void rejection_sample(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target_probs,
                      const std::optional<at::Tensor>& draft_probs, const at::Tensor& uniforms) {
  const char* op = "rejection_sample";
  TORCH_CHECK(target_probs.dim() == 3, op, ": target_probs must be float32 [B, N, V], got ", target_probs.sizes());
  check_tree(op, tokens, parents, target_probs.size(2));
  const int64_t B = tokens.size(0), N = tokens.size(1);
  check_probs(op, "target_probs", target_probs, B, N);
  TORCH_CHECK(target_probs.size(2) <= fixed::kMaxVocab, op, ": target_probs vocabulary V = ", target_probs.size(2),
              " exceeds the largest the sampler supports (", fixed::kMaxVocab,
              ": a row's integer mass must stay below 2^62)");
  check_same_device(op, "target_probs", target_probs, tokens);
  if (draft_probs.has_value()) {
    check_probs(op, "draft_probs", *draft_probs, B, N);
    TORCH_CHECK(draft_probs->size(2) == target_probs.size(2), op, ": draft_probs vocabulary must equal target_probs' V = ",
                target_probs.size(2), ", got ", draft_probs->sizes());
    check_same_device(op, "draft_probs", *draft_probs, tokens);
  }
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == N &&
                  uniforms.scalar_type() == at::kDouble,
              op, ": uniforms must be float64 [B, N] = [", B, ", ", N, "], got ", uniforms.scalar_type(), " ",
              uniforms.sizes());
  check_same_device(op, "uniforms", uniforms, tokens);
  if (want_values(uniforms)) {
    at::Tensor h = host(uniforms);
    const double* u = h.data_ptr<double>();
    for (int64_t i = 0; i < B * N; ++i) {
      TORCH_CHECK(u[i] >= 0.0 && u[i] <= 1.0, op, ": uniforms[", i / N, ", ", i % N, "] = ", u[i],
                  " must lie in [0, 1]");
    }
  }
}

void greedy_verify(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target_logits) {
  const char* op = "greedy_verify";
  if (target_logits.scalar_type() == at::kLong) {  // the argmax at every node, already taken: int64 [B, N]
    check_tree(op, tokens, parents, std::numeric_limits<int64_t>::max());
    TORCH_CHECK(target_logits.dim() == 2 && target_logits.sizes() == tokens.sizes(), op,
                ": int64 target_logits (the argmax at each node) must be [B, N] = ", tokens.sizes(), ", got ",
                target_logits.sizes());
    TORCH_CHECK(target_logits.is_contiguous(), op, ": target_logits must be contiguous, got strides ",
                target_logits.strides());
    check_same_device(op, "target_logits", target_logits, tokens);
    return;
  }
  TORCH_CHECK(target_logits.dim() == 3, op, ": target_logits must be [B, N, V] (or int64 [B, N]: the argmax at "
              "each node), got ", target_logits.sizes());
  check_tree(op, tokens, parents, target_logits.size(2));
  const int64_t B = tokens.size(0), N = tokens.size(1);
  TORCH_CHECK(target_logits.size(0) == B && target_logits.size(1) == N && target_logits.size(2) >= 1, op,
              ": target_logits must be [B, N, V] with B = ", B, ", N = ", N, ", got ", target_logits.sizes());
  TORCH_CHECK(is_float_dtype(target_logits.scalar_type()), op,
              ": target_logits must be float32, float16 or bfloat16 (or int64 [B, N]: the argmax at each node), got ",
              target_logits.scalar_type());
  TORCH_CHECK(target_logits.is_contiguous(), op, ": target_logits must be contiguous, got strides ",
              target_logits.strides());
  check_same_device(op, "target_logits", target_logits, tokens);
}

void kv_commit(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cache_lens,
               const at::Tensor& accepted, const at::Tensor& num_accepted) {
  const char* op = "kv_commit";
  TORCH_CHECK(!k_caches.empty(), op, ": k_caches must hold at least one layer, got an empty list");
  TORCH_CHECK(v_caches.size() == k_caches.size(), op, ": v_caches must hold as many layers as k_caches (",
              k_caches.size(), "), got ", v_caches.size());
  const at::Tensor& ref = k_caches[0];
  check_cache(op, "k_caches[0]", ref);
  const int64_t B = ref.size(0), S = ref.size(2);
  for (size_t l = 0; l < k_caches.size(); ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& c = kv == 0 ? k_caches[l] : v_caches[l];
      const std::string name = std::string(kv == 0 ? "k_caches[" : "v_caches[") + std::to_string(l) + "]";
      check_cache(op, name.c_str(), c);
      TORCH_CHECK(c.size(0) == B && c.size(2) == S, op, ": ", name, " must have batch ", B, " and capacity ", S,
                  " like k_caches[0], got ", c.sizes());
      TORCH_CHECK(c.scalar_type() == ref.scalar_type(), op, ": ", name, " must have dtype ", ref.scalar_type(),
                  " like k_caches[0], got ", c.scalar_type());
      check_same_device(op, name.c_str(), c, ref);
    }
  }
  check_int_vector(op, "cache_lens", cache_lens, B, at::kInt);
  check_int_vector(op, "num_accepted", num_accepted, B, at::kInt);
  TORCH_CHECK(accepted.dim() == 2 && accepted.size(0) == B && accepted.scalar_type() == at::kInt, op,
              ": accepted must be int32 [B, N] with B = ", B, ", got ", accepted.scalar_type(), " ", accepted.sizes());
  const int64_t N = accepted.size(1);
  TORCH_CHECK(N >= 1 && N <= S, op, ": accepted must have 1 <= N <= S = ", S, " columns, got ", accepted.sizes());
  check_same_device(op, "cache_lens", cache_lens, ref);
  check_same_device(op, "accepted", accepted, ref);
  check_same_device(op, "num_accepted", num_accepted, ref);
  {
    // Every written tensor (the 2L caches, cache_lens) distinct from the others and from
    // the paths read while the caches are written.
    const int64_t L = int64_t(k_caches.size());
    std::vector<const at::Tensor*> ts;
    ts.reserve(2 * L + 3);
    for (int64_t l = 0; l < L; ++l) ts.push_back(&k_caches[l]);
    for (int64_t l = 0; l < L; ++l) ts.push_back(&v_caches[l]);
    ts.push_back(&cache_lens);
    ts.push_back(&accepted);
    ts.push_back(&num_accepted);
    check_no_overlap(op, ts, size_t(2 * L + 1), [L](int64_t i) {
      if (i < L) return "k_caches[" + std::to_string(i) + "]";
      if (i < 2 * L) return "v_caches[" + std::to_string(i - L) + "]";
      static const char* kTail[] = {"cache_lens", "accepted", "num_accepted"};
      return std::string(kTail[i - 2 * L]);
    });
  }
  if (!want_values(cache_lens)) return;
  at::Tensor hl = host(cache_lens), ha = host(accepted), hn = host(num_accepted);
  const int32_t* lens = hl.data_ptr<int32_t>();
  const int32_t* acc = ha.data_ptr<int32_t>();
  const int32_t* num = hn.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int32_t n = num[b];
    TORCH_CHECK(n >= 0 && n < N, op, ": num_accepted[", b, "] = ", n, " must lie in [0, N - 1] = [0, ", N - 1, "]");
    TORCH_CHECK(acc[b * N] == 0, op, ": accepted[", b, ", 0] must be 0 (the root), got ", acc[b * N]);
    for (int32_t i = 1; i <= n; ++i) {
      TORCH_CHECK(acc[b * N + i] > acc[b * N + i - 1] && acc[b * N + i] < N, op, ": accepted[", b, ", ", i, "] = ",
                  acc[b * N + i], " must be a node index in (accepted[", b, ", ", i - 1, "] = ", acc[b * N + i - 1],
                  ", N) (a root path in topological order)");
    }
    TORCH_CHECK(lens[b] >= 0 && int64_t(lens[b]) + acc[b * N + n] < S, op, ": cache_lens[", b, "] = ", lens[b],
                " + accepted node ", acc[b * N + n], " lies past the cache capacity S = ", S);
  }
}

void linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
            const std::optional<at::Tensor>& weight_scale) {
  const char* op = "linear";
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., K], got a 0-d tensor");
  TORCH_CHECK(is_float_dtype(x.scalar_type()), op, ": x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be [N, K], got ", weight.sizes());
  check_same_device(op, "weight", weight, x);
  TORCH_CHECK(weight.size(1) == x.size(-1), op, ": weight must be [N, K] with K = x.size(-1) = ", x.size(-1),
              ", got ", weight.sizes());
  const int64_t N = weight.size(0);
  const bool quantized = weight.scalar_type() == at::kChar;
  if (quantized) {
    TORCH_CHECK(weight_scale.has_value(), op, ": an int8 weight needs weight_scale (float32 [", N,
                "], one scale per output row), got None");
  } else {
    TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight must have the dtype of x (", x.scalar_type(),
                ") or be int8 with weight_scale, got ", weight.scalar_type());
    TORCH_CHECK(!weight_scale.has_value(), op, ": weight_scale is only for int8 weights, got a ",
                weight.scalar_type(), " weight with a weight_scale");
  }
  if (weight_scale.has_value()) {
    const at::Tensor& s = *weight_scale;
    TORCH_CHECK(s.dim() == 1 && s.size(0) == N && s.scalar_type() == at::kFloat, op,
                ": weight_scale must be float32 [", N, "], got ", s.scalar_type(), " ", s.sizes());
    check_same_device(op, "weight_scale", s, x);
  }
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N && b.scalar_type() == x.scalar_type(), op, ": bias must be ",
                x.scalar_type(), " [", N, "], got ", b.scalar_type(), " ", b.sizes());
    check_same_device(op, "bias", b, x);
  }
}

void qlinear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
             const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits) {
  const char* op = "qlinear";
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., K], got a 0-d tensor");
  TORCH_CHECK(is_float_dtype(x.scalar_type()), op, ": x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(bits == 8 || bits == 4, op, ": bits must be 8 (Q8_0) or 4 (Q4_0 / Q4_1), got ", bits);
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % 32 == 0, op, ": x's K = ", K, " must be a multiple of the group size 32");
  TORCH_CHECK(qweight.dim() == 2, op, ": qweight must be [N, ", bits == 8 ? "K" : "K / 2", "], got ", qweight.sizes());
  const int64_t N = qweight.size(0), G = K / 32;
  if (bits == 8) {
    TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.size(1) == K, op,
                ": an 8-bit qweight must be int8 [N, K] with K = ", K, ", got ", qweight.scalar_type(), " ",
                qweight.sizes());
    TORCH_CHECK(!mins.has_value(), op, ": mins are only for 4-bit weights (Q4_1), got mins with bits = 8");
  } else {
    TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.size(1) == K / 2, op,
                ": a 4-bit qweight must be uint8 [N, K / 2] with K = ", K, " (two codes per byte), got ",
                qweight.scalar_type(), " ", qweight.sizes());
  }
  TORCH_CHECK(qweight.is_contiguous(), op, ": qweight must be contiguous, got strides ", qweight.strides());
  check_same_device(op, "qweight", qweight, x);
  auto group_tensor = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == G && t.scalar_type() == at::kHalf, op, ": ", name,
                " must be float16 [N, K / 32] = [", N, ", ", G, "], got ", t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
    check_same_device(op, name, t, x);
  };
  group_tensor("scales", scales);
  if (mins.has_value()) group_tensor("mins", *mins);
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N && b.scalar_type() == x.scalar_type(), op, ": bias must be ",
                x.scalar_type(), " [", N, "], got ", b.scalar_type(), " ", b.sizes());
    check_same_device(op, "bias", b, x);
  }
}

at::Tensor qlinear_dequantize(const at::Tensor& qweight, const at::Tensor& scales,
                              const std::optional<at::Tensor>& mins, int64_t bits, at::ScalarType dtype) {
  const int64_t N = qweight.size(0), G = scales.size(1);
  at::Tensor codes;
  if (bits == 8) {
    codes = qweight.to(at::kFloat).view({N, G, 32});
  } else {
    const at::Tensor b = qweight.view({N, G, 16}).to(at::kInt);
    codes = at::cat({at::bitwise_and(b, 15), at::bitwise_right_shift(b, 4)}, 2).to(at::kFloat);  // [N, G, 32]
    if (!mins.has_value()) codes = codes - 8.0;
  }
  at::Tensor w = codes * scales.to(at::kFloat).unsqueeze(2);
  if (mins.has_value()) w = w + mins->to(at::kFloat).unsqueeze(2);
  return w.view({N, G * 32}).to(dtype);
}

int64_t linear_rows(const at::Tensor& x) {
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  return M;
}

std::optional<at::Tensor> linear_trivial(const at::Tensor& x, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias) {
  const int64_t N = weight.size(0), K = weight.size(1);
  if (linear_rows(x) != 0 && N != 0 && K != 0) return std::nullopt;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::zeros(out_shape, x.options());
  if (bias.has_value() && y.numel() > 0) y.copy_(bias->expand(out_shape));
  return y;
}

void rms_norm(const char* op, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
              double eps) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., H], got a 0-d tensor");
  TORCH_CHECK(is_float_dtype(x.scalar_type()), op, ": x must be float32, float16 or bfloat16, got ", x.scalar_type());
  const int64_t H = x.size(-1);
  if (residual != nullptr) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), op,
                ": residual must be ", x.scalar_type(), " ", x.sizes(), " like x, got ", residual->scalar_type(), " ",
                residual->sizes());
    check_same_device(op, "residual", *residual, x);
  }
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.scalar_type() == x.scalar_type(), op,
              ": weight must be ", x.scalar_type(), " [", H, "] (x's dtype and last size), got ", weight.scalar_type(),
              " ", weight.sizes());
  check_same_device(op, "weight", weight, x);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be a finite number >= 0, got ", eps);
}

void rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "rope";
  TORCH_CHECK(q.dim() == 4, op, ": q must be [B, N, Hq, D], got ", q.sizes());
  TORCH_CHECK(is_float_dtype(q.scalar_type()), op, ": q must be float32, float16 or bfloat16, got ", q.scalar_type());
  const int64_t B = q.size(0), N = q.size(1), D = q.size(3);
  TORCH_CHECK(D % 2 == 0, op, ": the head dim D must be even (rotate-half pairs), got D = ", D);
  TORCH_CHECK(k.dim() == 4 && k.size(0) == B && k.size(1) == N && k.size(3) == D && k.scalar_type() == q.scalar_type(),
              op, ": k must be ", q.scalar_type(), " [B, N, Hkv, D] = [", B, ", ", N, ", Hkv, ", D, "], got ",
              k.scalar_type(), " ", k.sizes());
  check_same_device(op, "k", k, q);
  auto table = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == N && t.size(2) == D &&
                    t.scalar_type() == q.scalar_type(),
                op, ": ", name, " must be ", q.scalar_type(), " [B, N, D] = [", B, ", ", N, ", ", D,
                "] (the model's rotary table at each position), got ", t.scalar_type(), " ", t.sizes());
    check_same_device(op, name, t, q);
  };
  table("cos", cos);
  table("sin", sin);
}

void silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  const char* op = "silu_mul";
  TORCH_CHECK(is_float_dtype(gate.scalar_type()), op, ": gate must be float32, float16 or bfloat16, got ",
              gate.scalar_type());
  TORCH_CHECK(up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type(), op, ": up must be ",
              gate.scalar_type(), " ", gate.sizes(), " like gate, got ", up.scalar_type(), " ", up.sizes());
  check_same_device(op, "up", up, gate);
}

}  // namespace checks
}  // namespace specdec
