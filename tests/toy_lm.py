"""A tiny Llama-like LM in plain torch that speaks the HFCausalLM protocol.

Used by the tests to exercise the decoding loop without transformers or the HF
adapter: random weights from a fixed seed, RoPE at position ``cache_lens[b] +
depth``, GQA attention through ``specdec.ops.append_kv`` / ``verify_attention`` on a
:class:`specdec.cache.StaticKVCache`. ``full_logits`` recomputes the logits of a
whole sequence with plain causal attention and no cache: the independent oracle.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from specdec import ops
from specdec.cache import StaticKVCache


class ToyLM:
    def __init__(self, vocab: int = 12, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 seed: int = 0, scale: float = 3.0, dtype: torch.dtype = torch.float32) -> None:
        g = torch.Generator().manual_seed(seed)

        def w(*shape, s=1.0):
            return (torch.randn(*shape, generator=g) * s / math.sqrt(shape[-1])).to(dtype)

        self.vocab_size = vocab
        self.hidden = hidden
        self.num_layers = layers
        self.num_heads = heads
        self.num_kv_heads = kv_heads
        self.head_dim = hidden // heads
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.hooked = True
        self.model = None
        self.embed = torch.randn(vocab, hidden, generator=g).to(dtype)
        self.layers = []
        for _ in range(layers):
            self.layers.append(dict(
                wq=w(heads * self.head_dim, hidden), wk=w(kv_heads * self.head_dim, hidden),
                wv=w(kv_heads * self.head_dim, hidden), wo=w(hidden, heads * self.head_dim),
                w1=w(2 * hidden, hidden), w2=w(hidden, 2 * hidden)))
        self.head = w(vocab, hidden, s=scale)  # scale: sharper next-token distributions
        self.forward_calls = 0

    # ------------------------------------------------------------------ pieces
    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, N, H, D], pos [B, N] -> rotated x."""
        D = x.shape[-1]
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        ang = pos.to(torch.float32)[..., None] * inv  # [B, N, D/2]
        cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
        return out.to(x.dtype)

    # ------------------------------------------------------------------ protocol
    def new_cache(self, batch: int, capacity: int) -> StaticKVCache:
        return StaticKVCache(self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity, self.dtype, "cpu")

    def forward(self, cache: StaticKVCache, tokens: torch.Tensor, depths: torch.Tensor,
                tree_mask: Optional[torch.Tensor], kv_offset: int = 0) -> torch.Tensor:
        self.forward_calls += 1
        B, N = tokens.shape
        if kv_offset and tree_mask is None:
            tree_mask = torch.ones(N, kv_offset + N, dtype=torch.bool).tril(kv_offset).expand(B, N, kv_offset + N)
        pos = cache.lens.to(torch.int64)[:, None] + depths.to(torch.int64)
        x = self.embed[tokens.clamp(min=0)]  # [B, N, H]
        for i, lw in enumerate(self.layers):
            h = self._norm(x)
            q = (h @ lw["wq"].T).view(B, N, self.num_heads, self.head_dim)
            k = (h @ lw["wk"].T).view(B, N, self.num_kv_heads, self.head_dim)
            v = (h @ lw["wv"].T).view(B, N, self.num_kv_heads, self.head_dim)
            q, k = self._rope(q, pos), self._rope(k, pos)
            ops.append_kv(cache.k[i], cache.v[i], k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
                          cache.lens, kv_offset)
            a = ops.verify_attention(q.contiguous(), cache.k[i], cache.v[i], cache.lens, tree_mask)
            x = x + a.reshape(B, N, -1) @ lw["wo"].T
            x = x + torch.relu(self._norm(x) @ lw["w1"].T) @ lw["w2"].T
        return (self._norm(x) @ self.head.T).float()

    def prefill(self, cache: StaticKVCache, prompts: Sequence[Sequence[int]],
                rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        rows = list(range(len(prompts))) if rows is None else list(rows)
        out = torch.empty(len(prompts), self.vocab_size)
        # one forward per run of consecutive equal-length prompts in consecutive rows
        i = 0
        while i < len(prompts):
            j = i + 1
            while j < len(prompts) and len(prompts[j]) == len(prompts[i]) and rows[j] == rows[j - 1] + 1:
                j += 1
            view = cache.rows(rows[i], rows[i] + (j - i))
            view.lens.zero_()
            T = len(prompts[i])
            t = torch.tensor([list(p) for p in prompts[i:j]], dtype=torch.int64)
            depths = torch.arange(T, dtype=torch.int32).expand(j - i, T)
            out[i:j] = self.forward(view, t, depths, None)[:, -1]
            view.lens.fill_(T)
            i = j
        return out

    # ------------------------------------------------------------------ oracle
    @torch.no_grad()
    def full_logits(self, seq: Sequence[int]) -> torch.Tensor:
        """[T, V] next-token logits after each prefix of seq: plain causal attention, no cache, no specdec ops."""
        T = len(seq)
        x = self.embed[torch.tensor(seq)][None]
        pos = torch.arange(T)[None]
        rep = self.num_heads // self.num_kv_heads
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for lw in self.layers:
            h = self._norm(x)
            q = self._rope((h @ lw["wq"].T).view(1, T, self.num_heads, self.head_dim), pos)
            k = self._rope((h @ lw["wk"].T).view(1, T, self.num_kv_heads, self.head_dim), pos)
            v = (h @ lw["wv"].T).view(1, T, self.num_kv_heads, self.head_dim)
            q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            a = torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v  # [1, H, T, D]
            x = x + a.transpose(1, 2).reshape(1, T, -1).to(x.dtype) @ lw["wo"].T
            x = x + torch.relu(self._norm(x) @ lw["w1"].T) @ lw["w2"].T
        return (self._norm(x) @ self.head.T).float()[0]

    def greedy(self, prompt: Sequence[int], n: int, eos: Optional[int] = None) -> List[int]:
        seq = list(prompt)
        out: List[int] = []
        for _ in range(n):
            t = int(self.full_logits(seq)[-1].argmax())
            out.append(t)
            seq.append(t)
            if eos is not None and t == eos:
                break
        return out
