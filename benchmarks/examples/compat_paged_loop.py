"""A minimal paged serving loop that uses only specdec.compat for attention, verification and commit.

The loop keeps its own page pool and block table (NHD pages, a :class:`specdec.paged_cache.
BlockAllocator`), drafts with a prompt-lookup n-gram (one-hot proposals, as vLLM's n-gram
proposer), runs the model's layers itself, and calls:

* FlashInfer's conventions for the KV: ``append_paged_kv_cache`` and the attention wrapper
  ``BatchPrefillWithPagedKVCacheWrapper`` (``plan`` once per step with ``kv_indptr / kv_indices /
  kv_last_page_len`` built from its table, ``run`` per layer);
* vLLM's conventions for the decision: ``tree_rejection_sample`` on the ragged drafts (a chain is
  a tree whose parents are the previous draft), greedy rows by temperature 0;
* vLLM's block-table commit: ``commit_accepted_kv`` (a chain moves no byte; a tree would).

``run_loop`` returns each request's greedy continuation; ``main`` checks it against
``specdec.Engine`` on the bundled SmolLM2 model:

    python benchmarks/examples/compat_paged_loop.py --new-tokens 24
"""
from __future__ import annotations

import argparse
from typing import List, Sequence

import torch

from specdec.compat import flashinfer as fi
from specdec.compat import vllm
from specdec.paged_cache import BlockAllocator


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class PagedLlama:
    """A Llama-family Hugging Face model's weights, run over a paged KV pool through compat calls."""

    def __init__(self, model, num_pages: int, page_size: int = 16, max_blocks: int = 64):
        cfg = model.config
        self.model = model
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq
        self.ps = page_size
        L = cfg.num_hidden_layers
        shape = (num_pages, page_size, self.hkv, self.d)
        self.pools = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(L)]
        self.alloc = BlockAllocator(num_pages)
        self.table = torch.full((8, max_blocks), -1, dtype=torch.int32)
        self.attn = fi.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")  # planned per step, run per layer

    def ensure(self, row: int, length: int) -> None:
        """Pages for positions < length of request ``row`` (its block-table row)."""
        have = len(self.alloc.blocks(row)) if row in self.alloc else 0
        if row not in self.alloc:
            self.alloc.add(row)
        need = -(-length // self.ps) - have
        if need > 0:
            new = self.alloc.allocate(row, need)
            self.table[row, have:have + need] = torch.tensor(new, dtype=torch.int32)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, rows: Sequence[int], lens: torch.Tensor) -> torch.Tensor:
        """ids [B, N] at positions lens[b] + j (a causal chain of new tokens) -> logits [B, N, V]."""
        B, N = ids.shape
        inner = self.model.model
        for b, r in enumerate(rows):
            self.ensure(r, int(lens[b]) + N)
        meta = fi.kv_lens_to_metadata(self.table[list(rows)], lens + N, self.ps)
        qo_indptr = torch.arange(B + 1, dtype=torch.int32) * N
        self.attn.plan(qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, self.hq, self.hkv, self.d,
                       self.ps, causal=True, sm_scale=self.model.model.layers[0].self_attn.scaling)
        pos = lens[:, None].long() + torch.arange(N)[None, :]
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos)
        cos, sin = cos[:, :, None], sin[:, :, None]
        for layer, pool in zip(inner.layers, self.pools):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = _rope(a.q_proj(x).view(B, N, self.hq, self.d), cos, sin)
            k = _rope(a.k_proj(x).view(B, N, self.hkv, self.d), cos, sin)
            v = a.v_proj(x).view(B, N, self.hkv, self.d)
            fi.append_paged_kv_cache(k.reshape(B * N, self.hkv, self.d), v.reshape(B * N, self.hkv, self.d), pool,
                                     meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, num_new=N)
            o = self.attn.run(q.reshape(B * N, self.hq, self.d), pool)
            h = h + a.o_proj(o.reshape(B, N, self.hq * self.d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(inner.norm(h))


def lookup_draft(context: List[int], k: int, ngram: int = 2) -> List[int]:
    """The k tokens after the latest earlier occurrence of the context's last n-gram (padded by repeating)."""
    tail = context[-ngram:]
    for s in range(len(context) - ngram - 1, -1, -1):
        if context[s:s + ngram] == tail:
            got = context[s + ngram:s + ngram + k]
            if got:
                return (got + [got[-1]] * k)[:k]
    return [context[-1]] * k


def run_loop(model, prompts: Sequence[Sequence[int]], new_tokens: int, k: int = 4, page_size: int = 16):
    B = len(prompts)
    longest = max(len(p) for p in prompts) + new_tokens * (k + 1) + k + 1  # every row steps until all are done
    lm = PagedLlama(model, num_pages=B * (-(-longest // page_size)) + B, page_size=page_size,
                    max_blocks=-(-longest // page_size) + 1)
    rows = list(range(B))
    lens = torch.zeros(B, dtype=torch.int32)
    for b, p in enumerate(prompts):  # prefill everything but the last prompt token (the first root)
        if len(p) > 1:
            lm.forward(torch.tensor([p[:-1]]), [b], lens[b:b + 1])
            lens[b] = len(p) - 1
    ctx = [list(p) for p in prompts]
    out: List[List[int]] = [[] for _ in range(B)]
    parents = torch.tensor([-1] + list(range(k - 1)), dtype=torch.int32).repeat(B)
    cu = torch.arange(1, B + 1, dtype=torch.int32) * k
    while min(len(o) for o in out) < new_tokens:
        drafts = [lookup_draft(c, k) for c in ctx]
        ids = torch.tensor([[c[-1]] + d for c, d in zip(ctx, drafts)])
        logits = lm.forward(ids, rows, lens)                      # [B, k + 1, V]
        res = vllm.tree_rejection_sample(torch.tensor(drafts, dtype=torch.int32).flatten(), parents, [k] * B, k, cu,
                                         None, logits.reshape(B * (k + 1), -1).float(), torch.zeros(B))
        lens = vllm.commit_accepted_kv(lm.pools, lm.table, torch.tensor(rows), lens, res.accepted, res.num_accepted)
        for b in range(B):
            toks = [t for t in res.output_token_ids[b].tolist() if t >= 0]
            ctx[b] += toks
            out[b] += toks
    return [o[:new_tokens] for o in out]


def engine_greedy(model, prompts, new_tokens):
    from specdec.drafters.prompt_lookup import PromptLookup
    from specdec.engine import Engine
    from specdec.models.hf import HFCausalLM
    from specdec.request import RequestParams

    eng = Engine(HFCausalLM(model), PromptLookup(ngram=2, k=4), max_batch=len(prompts),
                 max_len=max(len(p) for p in prompts) + new_tokens + 8)
    for i, p in enumerate(prompts):
        eng.add_request(i, p, RequestParams(max_new_tokens=new_tokens))
    got = {i: [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_tokens
    return [got[i] for i in range(len(prompts))]


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Repeat after me: the cat sat on the mat. The cat sat"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    from specdec.models.bundled import load_bundled
    torch.manual_seed(0)
    model, tok = load_bundled("smollm2-135m")[:2]
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    mine = run_loop(model, prompts, args.new_tokens)
    ref = engine_greedy(model, prompts, args.new_tokens)
    for p, a, b in zip(PROMPTS, mine, ref):
        print(f"{'OK ' if a == b else 'DIFF'} {p!r} -> {tok.decode(a)!r}")
    return 0 if mine == ref else 1


if __name__ == "__main__":
    raise SystemExit(main())
