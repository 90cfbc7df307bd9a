// SuffixIndex implementation (see csrc/include/specdec/suffix_index.h for the contract
// and the cost model). Torch-free: errors are std::invalid_argument with the function,
// the argument, what was expected and what came; every check runs before any change.
#include "specdec/suffix_index.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <queue>
#include <tuple>
#include <sstream>
#include <stdexcept>

namespace specdec {

namespace {

template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw std::invalid_argument(os.str());
}

}  // namespace

SuffixIndex::SuffixIndex(int max_depth, int64_t max_tokens, int64_t max_docs, int64_t vocab_size)
    : max_depth_(max_depth), max_tokens_(max_tokens), max_docs_(max_docs), vocab_size_(vocab_size) {
  if (max_depth < 1 || max_depth > 1024) fail("SuffixIndex: max_depth must lie in [1, 1024], got ", max_depth);
  if (max_tokens < 0) fail("SuffixIndex: max_tokens must be >= 1 (or 0 = unbounded), got ", max_tokens);
  if (max_docs < 0) fail("SuffixIndex: max_docs must be >= 1 (or 0 = unbounded), got ", max_docs);
  if (vocab_size < 0 || vocab_size > std::numeric_limits<int32_t>::max())
    fail("SuffixIndex: vocab_size must lie in [1, 2^31) (or 0 = unchecked), got ", vocab_size);
  nodes_.push_back(Node{-1, -1, 0, 0, -1, -1, -1, 0});
}

void SuffixIndex::set_vocab_size(int64_t vocab_size) {
  std::unique_lock lock(mu_);
  if (vocab_size < 0 || vocab_size > std::numeric_limits<int32_t>::max())
    fail("SuffixIndex.set_vocab_size: vocab_size must lie in [1, 2^31) (or 0 = unchecked), got ", vocab_size);
  if (vocab_size > 0) {
    for (const auto& [id, doc] : docs_)
      for (size_t i = 0; i < doc.tokens.size(); ++i)
        if (doc.tokens[i] >= vocab_size)
          fail("SuffixIndex.set_vocab_size: document ", id, " holds token ", doc.tokens[i], " at position ", i,
               ", outside the vocabulary [0, ", vocab_size, ")");
  }
  vocab_size_ = vocab_size;
}

void SuffixIndex::check_tokens(const char* fn, const std::vector<int64_t>& tokens) const {
  const int64_t hi = vocab_size_ > 0 ? vocab_size_ : std::numeric_limits<int32_t>::max();
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= hi)
      fail(fn, ": token ", tokens[i], " at position ", i, " lies outside the vocabulary [0, ", hi, ")");
}

int32_t SuffixIndex::child(int32_t node, int32_t token) const {
  auto it = edges_.find(key(node, token));
  return it == edges_.end() ? -1 : it->second;
}

int32_t SuffixIndex::child_or_new(int32_t node, int32_t token) {
  auto [it, inserted] = edges_.try_emplace(key(node, token), -1);
  if (!inserted) return it->second;
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {
    if (nodes_.size() >= static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
      edges_.erase(it);
      throw std::length_error("SuffixIndex: more than 2^31 - 1 nodes");
    }
    id = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& p = nodes_[node];
  nodes_[id] = Node{token, node, 0, 0, -1, p.first_child, -1, p.depth + 1};
  if (p.first_child >= 0) nodes_[p.first_child].prev = id;
  p.first_child = id;
  it->second = id;
  return id;
}

void SuffixIndex::free_node(int32_t id) {
  Node& n = nodes_[id];
  Node& p = nodes_[n.parent];
  if (n.prev >= 0) nodes_[n.prev].next = n.next; else p.first_child = n.next;
  if (n.next >= 0) nodes_[n.next].prev = n.prev;
  edges_.erase(key(n.parent, n.token));
  n = Node{-1, -1, 0, 0, -1, -1, -1, 0};
  free_.push_back(id);
}

void SuffixIndex::append_token(Doc& doc, int32_t token) {
  // the suffixes ending at the new token: root + token, and every active suffix (depth < max_depth) + token
  std::vector<int32_t>& act = doc.active;
  size_t w = 0;
  int32_t carry = child_or_new(0, token);  // depth 1
  nodes_[carry].count += 1;
  nodes_[0].child_sum += 1;
  // act is ordered by depth (1, 2, ...): rebuild it in place as depth 1 (new), then act[i] + token
  for (size_t r = 0; r < act.size(); ++r) {
    const int32_t a = act[r];
    const int32_t prev_carry = carry;
    if (nodes_[a].depth < max_depth_) {
      const int32_t c = child_or_new(a, token);
      nodes_[c].count += 1;
      nodes_[a].child_sum += 1;
      carry = c;
    } else {
      carry = -1;
    }
    act[w++] = prev_carry;
    if (carry < 0) break;
  }
  if (carry >= 0) {
    if (w < act.size()) act[w++] = carry; else { act.push_back(carry); ++w; }
  }
  act.resize(w);
  doc.tokens.push_back(token);
  tokens_ += 1;
}

void SuffixIndex::erase_doc(std::map<int64_t, Doc>::iterator it) {
  const std::vector<int32_t>& t = it->second.tokens;
  const int n = static_cast<int>(t.size());
  std::vector<int32_t> path;
  path.reserve(max_depth_);
  // every (start i, depth d) pair was counted once when the token at i + d - 1 arrived
  for (int i = 0; i < n; ++i) {
    path.clear();
    int32_t node = 0;
    for (int j = i; j < n && j - i < max_depth_; ++j) {
      node = child(node, t[j]);
      if (node < 0) throw std::logic_error("SuffixIndex: corrupted trie (missing path during removal)");
      path.push_back(node);
    }
    for (int k = static_cast<int>(path.size()) - 1; k >= 0; --k) {
      Node& x = nodes_[path[k]];
      x.count -= 1;
      nodes_[x.parent].child_sum -= 1;
      if (x.count == 0) free_node(path[k]);
    }
  }
  tokens_ -= n;
  docs_.erase(it);
}

void SuffixIndex::evict_for(int64_t extra_tokens, int64_t extra_docs, int64_t keep_doc) {
  auto over = [&] {
    return (max_tokens_ > 0 && tokens_ + extra_tokens > max_tokens_) ||
           (max_docs_ > 0 && static_cast<int64_t>(docs_.size()) + extra_docs > max_docs_);
  };
  auto it = docs_.begin();
  while (over() && it != docs_.end()) {
    if (it->first == keep_doc) { ++it; continue; }
    auto victim = it++;
    erase_doc(victim);
  }
}

int64_t SuffixIndex::add(const std::vector<int64_t>& tokens) {
  check_tokens("SuffixIndex.add", tokens);
  std::unique_lock lock(mu_);
  size_t skip = 0;
  if (max_tokens_ > 0 && static_cast<int64_t>(tokens.size()) > max_tokens_) skip = tokens.size() - max_tokens_;
  evict_for(static_cast<int64_t>(tokens.size() - skip), 1, -1);
  const int64_t id = next_id_++;
  Doc& doc = docs_[id];
  doc.tokens.reserve(tokens.size() - skip);
  for (size_t i = skip; i < tokens.size(); ++i) append_token(doc, static_cast<int32_t>(tokens[i]));
  return id;
}

void SuffixIndex::extend(int64_t id, const std::vector<int64_t>& tokens) {
  check_tokens("SuffixIndex.extend", tokens);
  std::unique_lock lock(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end()) fail("SuffixIndex.extend: no document ", id, " (evicted or never added)");
  if (max_tokens_ > 0 && static_cast<int64_t>(it->second.tokens.size() + tokens.size()) > max_tokens_)
    fail("SuffixIndex.extend: document ", id, " would hold ", it->second.tokens.size() + tokens.size(),
         " tokens > max_tokens = ", max_tokens_);
  evict_for(static_cast<int64_t>(tokens.size()), 0, id);
  for (int64_t t : tokens) append_token(it->second, static_cast<int32_t>(t));
}

void SuffixIndex::remove(int64_t id) {
  std::unique_lock lock(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end()) fail("SuffixIndex.remove: no document ", id, " (evicted or never added)");
  erase_doc(it);
}

void SuffixIndex::clear() {
  std::unique_lock lock(mu_);
  nodes_.clear();
  nodes_.push_back(Node{-1, -1, 0, 0, -1, -1, -1, 0});
  nodes_.shrink_to_fit();
  free_.clear();
  free_.shrink_to_fit();
  edges_ = {};
  docs_.clear();
  tokens_ = 0;
}

int64_t SuffixIndex::num_tokens() const { std::shared_lock lock(mu_); return tokens_; }
int64_t SuffixIndex::num_docs() const { std::shared_lock lock(mu_); return static_cast<int64_t>(docs_.size()); }
int64_t SuffixIndex::num_nodes() const {
  std::shared_lock lock(mu_);
  return static_cast<int64_t>(nodes_.size() - free_.size());
}

int64_t SuffixIndex::memory_bytes() const {
  std::shared_lock lock(mu_);
  // node pool + free list + hash map (one heap node of key/value/next/hash per edge + buckets) + documents
  int64_t bytes = static_cast<int64_t>(nodes_.capacity() * sizeof(Node) + free_.capacity() * sizeof(int32_t));
  bytes += static_cast<int64_t>(edges_.size() * (sizeof(std::pair<const uint64_t, int32_t>) + 2 * sizeof(void*)) +
                                edges_.bucket_count() * sizeof(void*));
  for (const auto& [id, doc] : docs_)
    bytes += static_cast<int64_t>(sizeof(Doc) + 48 + (doc.tokens.capacity() + doc.active.capacity()) * 4);
  return bytes;
}

std::vector<int64_t> SuffixIndex::doc_ids() const {
  std::shared_lock lock(mu_);
  std::vector<int64_t> ids;
  for (const auto& kv : docs_) ids.push_back(kv.first);
  return ids;
}

std::vector<int64_t> SuffixIndex::doc_tokens(int64_t id) const {
  std::shared_lock lock(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end()) fail("SuffixIndex.doc_tokens: no document ", id, " (evicted or never added)");
  return std::vector<int64_t>(it->second.tokens.begin(), it->second.tokens.end());
}

int SuffixIndex::match_locked(const int64_t* ctx, int n, int max_match, int min_match, int32_t* out) const {
  // hi: longest suffix worth walking (a match needs a child, so depth < max_depth)
  int lo = std::max(1, min_match), hi = std::min({max_match, n, max_depth_ - 1});
  auto walk = [&](int m) -> int32_t {
    int32_t node = 0;
    for (int j = n - m; j < n && node >= 0; ++j) {
      const int64_t t = ctx[j];
      if (t < 0 || t > std::numeric_limits<int32_t>::max()) return -1;
      node = child(node, static_cast<int32_t>(t));
    }
    return (node >= 0 && nodes_[node].first_child >= 0) ? node : -1;
  };
  int best = 0;
  int32_t best_node = -1;
  if (lo > hi) { *out = -1; return 0; }
  // monotone predicate (a continued occurrence of s + x is one of s): binary search the largest m
  while (lo <= hi) {
    const int mid = (lo + hi) / 2;
    const int32_t node = walk(mid);
    if (node >= 0) { best = mid; best_node = node; lo = mid + 1; } else { hi = mid - 1; }
  }
  *out = best_node;
  return best;
}

std::pair<int, std::vector<std::pair<int64_t, int64_t>>> SuffixIndex::continuations(
    const std::vector<int64_t>& ctx, int max_match, int min_match) const {
  std::shared_lock lock(mu_);
  int32_t node = -1;
  const int m = match_locked(ctx.data(), static_cast<int>(ctx.size()), max_match, min_match, &node);
  std::vector<std::pair<int64_t, int64_t>> kids;
  if (node >= 0)
    for (int32_t c = nodes_[node].first_child; c >= 0; c = nodes_[c].next)
      kids.emplace_back(nodes_[c].token, nodes_[c].count);
  std::sort(kids.begin(), kids.end());
  return {m, kids};
}

SuffixSpeculation SuffixIndex::speculate(const std::vector<const SuffixIndex*>& sources, const int64_t* ctx, int n,
                                         const SuffixSpeculateParams& prm) {
  SuffixSpeculation out;
  if (prm.max_nodes < 1 || n < 1) return out;
  // combined trie of the proposal: node 0 = root
  struct CNode { int64_t token; int32_t parent; int32_t depth; double score; int32_t order; };
  std::vector<CNode> comb{{-1, -1, 0, 1.0, 0}};
  std::unordered_map<uint64_t, int32_t> comb_edges;
  for (const SuffixIndex* src : sources) {
    if (src == nullptr) continue;
    std::shared_lock lock(src->mu_);
    int32_t start = -1;
    const int m = src->match_locked(ctx, n, prm.max_match, prm.min_match, &start);
    if (m == 0) continue;
    out.match_len = std::max(out.match_len, m);
    const double want = std::floor(prm.spec_factor * m + prm.spec_offset);
    const int depth_cap = static_cast<int>(std::min<double>({static_cast<double>(prm.max_spec), want,
                                                             static_cast<double>(src->max_depth_ - m)}));
    if (depth_cap < 1) continue;
    // best-first over this source: (path probability, source node, combined parent, depth)
    using Item = std::tuple<double, int32_t, int32_t, int32_t>;
    auto cmp = [](const Item& a, const Item& b) { return std::get<0>(a) < std::get<0>(b); };
    std::priority_queue<Item, std::vector<Item>, decltype(cmp)> heap(cmp);
    auto push_children = [&](int32_t snode, double prob, int32_t cparent, int32_t depth) {
      const Node& s = src->nodes_[snode];
      if (depth >= depth_cap || s.child_sum <= 0) return;
      for (int32_t c = s.first_child; c >= 0; c = src->nodes_[c].next) {
        const double p = prob * static_cast<double>(src->nodes_[c].count) / static_cast<double>(s.child_sum);
        if (p >= prm.min_token_prob) heap.emplace(p, c, cparent, depth + 1);
      }
    };
    push_children(start, 1.0, 0, 0);
    int popped = 0;
    while (!heap.empty() && popped < prm.max_nodes) {
      auto [p, snode, cparent, depth] = heap.top();
      heap.pop();
      ++popped;
      const int32_t tok = src->nodes_[snode].token;
      auto [it, inserted] = comb_edges.try_emplace(key(cparent, tok), static_cast<int32_t>(comb.size()));
      if (inserted) {
        comb.push_back(CNode{tok, cparent, depth, p, static_cast<int32_t>(comb.size())});
      } else {
        comb[it->second].score = std::max(comb[it->second].score, p);
      }
      push_children(snode, p, it->second, depth);
    }
  }
  if (comb.size() == 1) return out;
  // top max_nodes by score (a parent's score >= its child's: ties broken by depth keep the set closed)
  std::vector<int32_t> order;
  for (int32_t i = 1; i < static_cast<int32_t>(comb.size()); ++i) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (comb[a].score != comb[b].score) return comb[a].score > comb[b].score;
    if (comb[a].depth != comb[b].depth) return comb[a].depth < comb[b].depth;
    return a < b;
  });
  if (static_cast<int>(order.size()) > prm.max_nodes) order.resize(prm.max_nodes);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (comb[a].depth != comb[b].depth) return comb[a].depth < comb[b].depth;
    return a < b;
  });
  std::unordered_map<int32_t, int32_t> renum{{0, 0}};
  for (size_t i = 0; i < order.size(); ++i) renum[order[i]] = static_cast<int32_t>(i + 1);
  for (int32_t c : order) {
    auto pit = renum.find(comb[c].parent);
    if (pit == renum.end()) throw std::logic_error("SuffixIndex.speculate: selected node without its parent");
    out.tokens.push_back(comb[c].token);
    out.parents.push_back(pit->second);
    out.probs.push_back(comb[c].score);
  }
  return out;
}

}  // namespace specdec
