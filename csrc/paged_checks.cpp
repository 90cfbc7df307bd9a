#include "paged_checks.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <ostream>
#include <vector>

#include "checks.h"

namespace specdec {
namespace checks {
namespace {

bool want_values(const at::Tensor& t) { return t.device().is_cpu() || strict(); }
// A contiguous host copy of t's values; a contiguous CPU tensor is borrowed, not copied.
c10::MaybeOwned<at::Tensor> host(const at::Tensor& t) {
  if (t.device().is_cpu()) return t.expect_contiguous();
  return c10::MaybeOwned<at::Tensor>::owned(t.to(at::kCPU).contiguous());
}

bool is_float_dtype(at::ScalarType s) { return s == at::kFloat || s == at::kHalf || s == at::kBFloat16; }

template <typename Name>
void check_same_device(const char* op, const Name& name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), " like the other inputs, got ",
              t.device());
}

// A page pool's strides: D contiguous (stride 1, or D == 1), and the other three dims non-overlapping: sorted by
// stride (dims of size 1 ignored), each stride at least the extent of the dims below it. NHD, HND's
// transpose(1, 2) and a pool's half of [num_pages, 2, page_size, Hkv, D] pass; an expand()ed view does not.
bool page_strides_ok(const at::Tensor& p) {
  if (p.size(3) > 1 && p.stride(3) != 1) return false;
  std::array<std::pair<int64_t, int64_t>, 3> dims{};  // (stride, size)
  int n = 0;
  for (int d = 0; d < 3; ++d)
    if (p.size(d) > 1) {
      if (p.stride(d) <= 0) return false;
      dims[n++] = {p.stride(d), p.size(d)};
    }
  std::sort(dims.begin(), dims.begin() + n);
  int64_t extent = p.size(3);  // elements the dims below span
  for (int i = 0; i < n; ++i) {
    if (dims[i].first < extent) return false;
    extent = dims[i].first * dims[i].second;
  }
  return true;
}

template <typename Name>
void check_pages(const char* op, const Name& name, const at::Tensor& p) {
  TORCH_CHECK(p.dim() == 4, op, ": ", name, " must be [num_pages, page_size, Hkv, D], got ", p.sizes());
  TORCH_CHECK(is_float_dtype(p.scalar_type()), op, ": ", name, " must be float32, float16 or bfloat16, got ",
              p.scalar_type());
  TORCH_CHECK(page_strides_ok(p), op, ": ", name,
              " must have its head dim D contiguous and no two elements at one address (NHD pages, or a strided view "
              "such as HND pages' transpose(1, 2) or one half of a [num_pages, 2, ...] pool), got strides ",
              p.strides(), " for sizes ", p.sizes());
  TORCH_CHECK(p.size(0) >= 1 && p.size(1) >= 1, op, ": ", name, " must hold at least one page of at least one slot, got ",
              p.sizes());
}

// The bytes a tensor's elements occupy, [begin, end); empty for numel 0.
struct Span {
  uintptr_t begin = 0, end = 0;
};

Span span_of(const at::Tensor& t) {
  Span r;
  if (t.numel() == 0) return r;
  const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
  int64_t lo = 0, hi = 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    const int64_t span = (sizes[d] - 1) * strides[d];
    if (span < 0) lo += span;
    else hi += span;
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const int64_t es = t.element_size();
  return Span{base + lo * es, base + (hi + 1) * es};
}

// Whether r = sum_d j_d * stride_d for some |j_d| < size_d over dims[i..] (sorted by stride, largest first,
// non-overlapping: the dims below one stride span less than it, so only j = floor(r / s) or that + 1 can
// leave a remainder the lower dims reach).
bool lattice_hit(int64_t r, const std::array<std::pair<int64_t, int64_t>, 4>& dims, int n, int i) {
  if (i == n) return r == 0;
  const int64_t s = dims[i].first, size = dims[i].second;
  const int64_t f = r >= 0 ? r / s : -((-r + s - 1) / s);  // floor(r / s)
  for (int64_t j = f; j <= f + 1; ++j)
    if (j > -size && j < size && lattice_hit(r - j * s, dims, n, i + 1)) return true;
  return false;
}

// Whether two tensors touch a common byte: views of one buffer that are byte-disjoint (vLLM's
// per-layer [2, num_blocks, block_size, Hkv, D] cache, K = [0], V = [1]) do not, nor do two
// interleaved page pools of one layout (FlashInfer's [num_pages, 2, page_size, Hkv, D] pool, K =
// [:, 0], V = [:, 1]): same sizes and strides, and their offset is no difference of two indices. The
// byte ranges are compared first; the storage is asked only when they meet.
bool bytes_overlap(const at::Tensor& a, const Span& sa, const at::Tensor& b, const Span& sb) {
  if (!(sa.begin < sa.end && sb.begin < sb.end && sa.begin < sb.end && sb.begin < sa.end &&
        a.device() == b.device() && a.is_alias_of(b)))
    return false;
  const int64_t es = a.element_size();
  const int64_t delta = int64_t(sb.begin) - int64_t(sa.begin);
  if (a.dim() != 4 || a.sizes() != b.sizes() || a.strides() != b.strides() || b.element_size() != es ||
      delta % es != 0 || !page_strides_ok(a))
    return true;  // conservatively: they may share a byte
  std::array<std::pair<int64_t, int64_t>, 4> dims{};  // (stride, size), largest stride first
  int n = 0;
  for (int d = 0; d < 4; ++d)
    if (a.size(d) > 1) dims[n++] = {a.stride(d), a.size(d)};
  std::sort(dims.begin(), dims.begin() + n, [](const auto& x, const auto& y) { return x.first > y.first; });
  return lattice_hit(delta / es, dims, n, 0);
}

template <typename A, typename B>
[[noreturn]] void overlap_error(const char* op, const A& a_name, const B& b_name) {
  TORCH_CHECK(false, op, ": ", a_name, " and ", b_name,
              " share memory (the same tensor passed twice, or overlapping views of one buffer); every tensor this op "
              "writes must be memory of its own");
  std::abort();
}

// A tensor of kv_commit_paged in its messages, formatted only when a message needs it: layer l's K
// (kv = 0) or V (kv = 1) page pool, or (kv = -1) cache_lens.
struct TensorName {
  int kv;
  int64_t l;
};
std::ostream& operator<<(std::ostream& os, const TensorName& n) {
  if (n.kv < 0) return os << "cache_lens";
  return os << (n.kv == 0 ? "k_pages[" : "v_pages[") << n.l << "]";
}

// block_tables int32 [B, max_blocks] and cache_lens int32 [B] on ref's device.
void check_tables(const char* op, const at::Tensor& block_tables, const at::Tensor& cache_lens, int64_t B,
                  const at::Tensor& ref) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == at::kInt, op,
              ": block_tables must be int32 [B, max_blocks] with B = ", B, ", got ", block_tables.scalar_type(), " ",
              block_tables.sizes());
  TORCH_CHECK(block_tables.size(1) >= 1, op, ": block_tables must have at least one column, got ",
              block_tables.sizes());
  TORCH_CHECK(cache_lens.dim() == 1 && cache_lens.size(0) == B && cache_lens.scalar_type() == at::kInt, op,
              ": cache_lens must be int32 [", B, "], got ", cache_lens.scalar_type(), " ", cache_lens.sizes());
  check_same_device(op, "block_tables", block_tables, ref);
  check_same_device(op, "cache_lens", cache_lens, ref);
}

// Every request: 0 <= cache_lens[b] and cache_lens[b] + need <= max_blocks * page_size, and the blocks
// of positions [first(b), cache_lens[b] + need) name pages in [0, num_pages). first(b) = 0 for an op that
// reads the prefix (verify_attention), cache_lens[b] + skip for the ops that write only new positions.
void check_table_values(const char* op, const at::Tensor& block_tables, const at::Tensor& cache_lens, int64_t need,
                        int64_t page_size, int64_t num_pages, bool from_zero, int64_t skip = 0) {
  if (!want_values(cache_lens) || !want_values(block_tables)) return;
  const auto hl = host(cache_lens), ht = host(block_tables);
  const int32_t* lens = hl->data_ptr<int32_t>();
  const int32_t* bt = ht->data_ptr<int32_t>();
  const int64_t B = ht->size(0), M = ht->size(1), cap = M * page_size;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] + need <= cap, op, ": cache_lens[", b, "] = ", lens[b],
                " leaves no room for ", need, " new positions in a row of capacity max_blocks * page_size = ", M,
                " * ", page_size, " = ", cap, " (expected 0 <= cache_lens <= ", cap - need, ")");
    const int64_t end = lens[b] + need;
    if (end == 0) continue;
    const int64_t first = from_zero ? 0 : (lens[b] + skip) / page_size;
    for (int64_t j = first; j <= (end - 1) / page_size; ++j) {
      const int32_t page = bt[b * M + j];
      TORCH_CHECK(page >= 0 && page < num_pages, op, ": block_tables[", b, ", ", j, "] = ", page,
                  " must name a page in [0, num_pages = ", num_pages, ") (it holds positions ", j * page_size, "..",
                  (j + 1) * page_size - 1, ", used by this call)");
    }
  }
}

}  // namespace

void verify_attention_paged(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                            const at::Tensor& block_tables, const at::Tensor& cache_lens,
                            const std::optional<at::Tensor>& tree_mask, double scale) {
  const char* op = "verify_attention_paged";
  TORCH_CHECK(q.dim() == 4, op, ": q must be [B, N, Hq, D], got ", q.sizes());
  TORCH_CHECK(is_float_dtype(q.scalar_type()), op, ": q must be float32, float16 or bfloat16, got ", q.scalar_type());
  check_pages(op, "k_pages", k_pages);
  check_pages(op, "v_pages", v_pages);
  TORCH_CHECK(v_pages.sizes() == k_pages.sizes(), op, ": v_pages must have the shape of k_pages ", k_pages.sizes(),
              ", got ", v_pages.sizes());
  TORCH_CHECK(v_pages.strides() == k_pages.strides(), op, ": v_pages must have the strides of k_pages ",
              k_pages.strides(), " (one page layout), got ", v_pages.strides());
  TORCH_CHECK(k_pages.scalar_type() == q.scalar_type() && v_pages.scalar_type() == q.scalar_type(), op,
              ": k_pages and v_pages must have q's dtype ", q.scalar_type(), ", got ", k_pages.scalar_type(), " and ",
              v_pages.scalar_type());
  const int64_t B = q.size(0), N = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k_pages.size(2);
  TORCH_CHECK(N >= 1, op, ": q must hold at least one node (N >= 1), got ", q.sizes());
  TORCH_CHECK(k_pages.size(3) == D, op, ": k_pages head dim must equal q's D = ", D, ", got ", k_pages.sizes());
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, op, ": q heads Hq = ", Hq, " must be a multiple of the KV heads Hkv = ", Hkv);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_same_device(op, "k_pages", k_pages, q);
  check_same_device(op, "v_pages", v_pages, q);
  check_tables(op, block_tables, cache_lens, B, q);
  int64_t Nkv = N;
  if (tree_mask.has_value()) {
    const at::Tensor& m = *tree_mask;
    TORCH_CHECK(m.dim() == 3 && m.size(0) == B && m.size(1) == N && m.size(2) >= N && m.scalar_type() == at::kBool,
                op, ": tree_mask must be bool [B, Nq, Nkv] = [", B, ", ", N, ", Nkv >= ", N,
                "] (queries = the last Nq of Nkv new nodes), got ", m.scalar_type(), " ", m.sizes());
    check_same_device(op, "tree_mask", m, q);
    Nkv = m.size(2);
  }
  check_table_values(op, block_tables, cache_lens, Nkv, k_pages.size(1), k_pages.size(0), true);
}

void append_kv_paged(const at::Tensor& k_pages, const at::Tensor& v_pages, const at::Tensor& k_new,
                     const at::Tensor& v_new, const at::Tensor& block_tables, const at::Tensor& cache_lens,
                     int64_t offset) {
  const char* op = "append_kv_paged";
  check_pages(op, "k_pages", k_pages);
  check_pages(op, "v_pages", v_pages);
  TORCH_CHECK(v_pages.sizes() == k_pages.sizes() && v_pages.scalar_type() == k_pages.scalar_type(), op,
              ": v_pages must match k_pages ", k_pages.scalar_type(), " ", k_pages.sizes(), ", got ",
              v_pages.scalar_type(), " ", v_pages.sizes());
  TORCH_CHECK(v_pages.strides() == k_pages.strides(), op, ": v_pages must have the strides of k_pages ",
              k_pages.strides(), " (one page layout), got ", v_pages.strides());
  const int64_t Hkv = k_pages.size(2), D = k_pages.size(3);
  TORCH_CHECK(k_new.dim() == 4 && k_new.size(1) == Hkv && k_new.size(3) == D, op, ": k_new must be [B, Hkv, N, D] = [B, ",
              Hkv, ", N, ", D, "], got ", k_new.sizes());
  const int64_t B = k_new.size(0), N = k_new.size(2);
  TORCH_CHECK(v_new.sizes() == k_new.sizes(), op, ": v_new must have the shape of k_new ", k_new.sizes(), ", got ",
              v_new.sizes());
  TORCH_CHECK(k_new.scalar_type() == k_pages.scalar_type() && v_new.scalar_type() == k_pages.scalar_type(), op,
              ": k_new and v_new must have the cache dtype ", k_pages.scalar_type(), ", got ", k_new.scalar_type(),
              " and ", v_new.scalar_type());
  TORCH_CHECK(N >= 1, op, ": k_new must hold at least one node (N >= 1), got ", k_new.sizes());
  TORCH_CHECK(offset >= 0, op, ": offset must be >= 0 (the new nodes go to cache_lens[b] + offset + j), got ", offset);
  check_same_device(op, "v_pages", v_pages, k_pages);
  check_same_device(op, "k_new", k_new, k_pages);
  check_same_device(op, "v_new", v_new, k_pages);
  check_tables(op, block_tables, cache_lens, B, k_pages);
  const Span sk = span_of(k_pages), sv = span_of(v_pages);
  if (bytes_overlap(k_pages, sk, v_pages, sv)) overlap_error(op, "k_pages", "v_pages");
  static const char* kRead[] = {"k_new", "v_new", "block_tables", "cache_lens"};
  const at::Tensor* read[] = {&k_new, &v_new, &block_tables, &cache_lens};
  for (int i = 0; i < 4; ++i) {
    const Span sr = span_of(*read[i]);
    if (bytes_overlap(k_pages, sk, *read[i], sr)) overlap_error(op, "k_pages", kRead[i]);
    if (bytes_overlap(v_pages, sv, *read[i], sr)) overlap_error(op, "v_pages", kRead[i]);
  }
  check_table_values(op, block_tables, cache_lens, offset + N, k_pages.size(1), k_pages.size(0), false, offset);
}

void kv_commit_paged(at::TensorList k_pages, at::TensorList v_pages, const at::Tensor& block_tables,
                     const at::Tensor& cache_lens, const at::Tensor& accepted, const at::Tensor& num_accepted) {
  const char* op = "kv_commit_paged";
  TORCH_CHECK(!k_pages.empty(), op, ": k_pages must hold at least one layer, got an empty list");
  TORCH_CHECK(v_pages.size() == k_pages.size(), op, ": v_pages must hold as many layers as k_pages (", k_pages.size(),
              "), got ", v_pages.size());
  const at::Tensor& ref = k_pages[0];
  check_pages(op, "k_pages[0]", ref);
  const int64_t num_pages = ref.size(0), page_size = ref.size(1);
  const int64_t L = int64_t(k_pages.size());
  for (int64_t l = 0; l < L; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& c = kv == 0 ? k_pages[l] : v_pages[l];
      const TensorName name{kv, l};
      check_pages(op, name, c);
      TORCH_CHECK(c.size(0) == num_pages && c.size(1) == page_size, op, ": ", name, " must have ", num_pages,
                  " pages of ", page_size, " slots like k_pages[0], got ", c.sizes());
      TORCH_CHECK(c.scalar_type() == ref.scalar_type(), op, ": ", name, " must have dtype ", ref.scalar_type(),
                  " like k_pages[0], got ", c.scalar_type());
      check_same_device(op, name, c, ref);
    }
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt, op,
              ": block_tables must be int32 [B, max_blocks], got ", block_tables.scalar_type(), " ",
              block_tables.sizes());
  const int64_t B = block_tables.size(0);
  check_tables(op, block_tables, cache_lens, B, ref);
  TORCH_CHECK(num_accepted.dim() == 1 && num_accepted.size(0) == B && num_accepted.scalar_type() == at::kInt, op,
              ": num_accepted must be int32 [", B, "], got ", num_accepted.scalar_type(), " ", num_accepted.sizes());
  TORCH_CHECK(accepted.dim() == 2 && accepted.size(0) == B && accepted.scalar_type() == at::kInt, op,
              ": accepted must be int32 [B, N] with B = ", B, ", got ", accepted.scalar_type(), " ", accepted.sizes());
  const int64_t N = accepted.size(1);
  TORCH_CHECK(N >= 1, op, ": accepted must have at least one column (the root), got ", accepted.sizes());
  check_same_device(op, "accepted", accepted, ref);
  check_same_device(op, "num_accepted", num_accepted, ref);
  // Every written tensor (the 2L page pools, cache_lens) is memory of its own; pairs in the order
  // k_pages[0], v_pages[0], k_pages[1], ..., cache_lens (each against the later ones, then the inputs).
  const int64_t nw = 2 * L + 1;
  std::vector<const at::Tensor*> written(nw);
  std::vector<Span> spans(nw);
  for (int64_t l = 0; l < L; ++l) {
    written[2 * l] = &k_pages[l];
    written[2 * l + 1] = &v_pages[l];
  }
  written[2 * L] = &cache_lens;
  for (int64_t i = 0; i < nw; ++i) spans[i] = span_of(*written[i]);
  auto name = [&](int64_t i) { return i == 2 * L ? TensorName{-1, 0} : TensorName{int(i % 2), i / 2}; };
  static const char* kRead[] = {"block_tables", "accepted", "num_accepted"};
  const at::Tensor* read[] = {&block_tables, &accepted, &num_accepted};
  const Span read_spans[] = {span_of(block_tables), span_of(accepted), span_of(num_accepted)};
  for (int64_t i = 0; i < nw; ++i) {
    for (int64_t j = i + 1; j < nw; ++j)
      if (bytes_overlap(*written[i], spans[i], *written[j], spans[j])) overlap_error(op, name(i), name(j));
    for (int r = 0; r < 3; ++r)
      if (bytes_overlap(*written[i], spans[i], *read[r], read_spans[r])) overlap_error(op, name(i), kRead[r]);
  }
  // The new nodes of the step sit at cache_lens[b] + j, j < N: their blocks must be in range
  // (position cache_lens[b] itself, the root, is never moved).
  check_table_values(op, block_tables, cache_lens, N, page_size, num_pages, false);
  if (!want_values(num_accepted) || !want_values(accepted)) return;
  const auto ha = host(accepted), hn = host(num_accepted);
  const int32_t* acc = ha->data_ptr<int32_t>();
  const int32_t* num = hn->data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int32_t n = num[b];
    TORCH_CHECK(n >= 0 && n < N, op, ": num_accepted[", b, "] = ", n, " must lie in [0, N - 1] = [0, ", N - 1, "]");
    TORCH_CHECK(acc[b * N] == 0, op, ": accepted[", b, ", 0] must be 0 (the root), got ", acc[b * N]);
    for (int32_t i = 1; i <= n; ++i) {
      TORCH_CHECK(acc[b * N + i] > acc[b * N + i - 1] && acc[b * N + i] < N, op, ": accepted[", b, ", ", i, "] = ",
                  acc[b * N + i], " must be a node index in (accepted[", b, ", ", i - 1, "] = ", acc[b * N + i - 1],
                  ", N) (a root path in topological order)");
    }
  }
}

}  // namespace checks
}  // namespace specdec
