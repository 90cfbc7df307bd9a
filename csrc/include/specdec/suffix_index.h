// SuffixIndex: a depth-bounded suffix trie over a FIFO store of token documents, the
// host-side structure behind SuffixDrafter (per-request index + global cache across
// requests) and DocumentDrafter (a user document store). Torch-free.
//
// What it stores: for every document d and every end position j, the strings
// d[i..j] with j - i + 1 <= max_depth are paths from the root; a node's `count` is the
// number of (document, end position) occurrences of its string. Hence
// count(s + a) <= count(s), and child_sum(s) = sum of the children's counts is the number
// of occurrences of s that have a next token inside the bound: count(s + a) / child_sum(s)
// is the empirical probability that `a` follows `s` (the frequency score of
// SuffixDecoding, Oliaro et al. 2024, arXiv:2411.04975).
//
// Cost: appending one token to a document touches at most max_depth nodes (the
// document keeps the nodes of its suffixes that end at its last token: its "active"
// list), so add / extend cost O(new tokens * max_depth) whatever the length of the
// document or of the store. Removing a document walks the same (start, depth) pairs and
// decrements them: O(length * max_depth); nodes whose count reaches 0 are unlinked and
// recycled (a free list), so FIFO eviction is real and memory stays bounded by the
// token budget: nodes <= max_depth * tokens stored.
// A lookup walks the last max_match tokens of the context from the root (binary search
// over the match length: the predicate "the suffix of length m occurs with a
// continuation" is monotone in m), O(max_match * log max_match) hash lookups, never
// O(context).
//
// Thread safety: lookups take a shared lock, updates an exclusive one, so any number
// of readers (the requests of a step, several drafters) may query while no update runs.
#pragma once

#include <cstdint>
#include <map>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace specdec {

struct SuffixSpeculateParams {
  int max_match = 16;           // longest context suffix tried
  int min_match = 1;            // shortest suffix that still counts as a match
  int max_nodes = 16;           // draft nodes per proposal (root excluded)
  int max_spec = 16;            // draft depth cap
  double spec_factor = 1.0;     // draft depth = min(max_spec, spec_factor * match_len + spec_offset)
  double spec_offset = 0.0;
  double min_token_prob = 0.1;  // a node is kept when its path probability is >= this
};

// One proposal: draft node i (0-based, root excluded) has token tokens[i], parent
// parents[i] (0 = the root, p > 0 = draft node p - 1) and path probability probs[i]
// (product of the frequency scores from the root). Breadth-first (topological) order.
struct SuffixSpeculation {
  std::vector<int64_t> tokens;
  std::vector<int32_t> parents;
  std::vector<double> probs;
  int32_t match_len = 0;        // longest match over the sources used
};

class SuffixIndex {
 public:
  // max_depth >= 1: longest indexed string; max_tokens / max_docs: FIFO budget (0 = none);
  // vocab_size > 0: every token must lie in [0, vocab_size).
  SuffixIndex(int max_depth, int64_t max_tokens, int64_t max_docs, int64_t vocab_size);

  // A new document (empty allowed: it can be extended later). Evicts the oldest documents
  // until the budget holds; a document longer than max_tokens keeps its last max_tokens
  // tokens. Returns its id (ids increase: FIFO order). Validates before changing anything.
  int64_t add(const std::vector<int64_t>& tokens);
  // Append tokens to a live document (O(new tokens * max_depth)). In a bounded index,
  // older documents are evicted to make room; a document may not outgrow max_tokens.
  void extend(int64_t doc, const std::vector<int64_t>& tokens);
  void remove(int64_t doc);
  void clear();
  void set_vocab_size(int64_t vocab_size);

  int64_t num_tokens() const;
  int64_t num_docs() const;
  int64_t num_nodes() const;
  int64_t memory_bytes() const;
  int max_depth() const { return max_depth_; }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t max_docs() const { return max_docs_; }
  int64_t vocab_size() const { return vocab_size_; }
  std::vector<int64_t> doc_ids() const;
  std::vector<int64_t> doc_tokens(int64_t doc) const;

  // Longest m in [min_match, max_match] (and < max_depth) such that the last m tokens of
  // ctx occur with a continuation; 0 when none. Children (token, count) of that match.
  std::pair<int, std::vector<std::pair<int64_t, int64_t>>> continuations(const std::vector<int64_t>& ctx,
                                                                          int max_match, int min_match) const;

  // Proposal from several indexes at once (a node's score = the max over the sources of its
  // path probability); see SuffixSpeculateParams.
  static SuffixSpeculation speculate(const std::vector<const SuffixIndex*>& sources, const int64_t* ctx, int n,
                                     const SuffixSpeculateParams& params);

 private:
  struct Node {
    int32_t token;
    int32_t parent;
    int32_t count;
    int32_t child_sum;
    int32_t first_child;
    int32_t next;   // sibling list (doubly linked: O(1) unlink)
    int32_t prev;
    int32_t depth;
  };
  struct Doc {
    std::vector<int32_t> tokens;
    std::vector<int32_t> active;  // nodes of the suffixes ending at the last token, depth 1..
  };

  static uint64_t key(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
  }
  int32_t child(int32_t node, int32_t token) const;
  int32_t child_or_new(int32_t node, int32_t token);
  void free_node(int32_t node);
  void append_token(Doc& doc, int32_t token);
  void erase_doc(std::map<int64_t, Doc>::iterator it);
  void evict_for(int64_t extra_tokens, int64_t extra_docs, int64_t keep_doc);
  void check_tokens(const char* fn, const std::vector<int64_t>& tokens) const;
  int match_locked(const int64_t* ctx, int n, int max_match, int min_match, int32_t* node) const;

  int max_depth_;
  int64_t max_tokens_, max_docs_, vocab_size_;
  std::vector<Node> nodes_;  // node 0 = root
  std::vector<int32_t> free_;
  std::unordered_map<uint64_t, int32_t> edges_;  // (parent, token) -> child
  std::map<int64_t, Doc> docs_;                  // id order = FIFO order
  int64_t next_id_ = 0;
  int64_t tokens_ = 0;
  mutable std::shared_mutex mu_;
};

}  // namespace specdec
