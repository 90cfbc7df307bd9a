"""Bad input: one test per TORCH_CHECK of csrc/checks.cpp (and the CUDA-only head-dim check).

Each case builds valid inputs, breaks exactly one thing, and asserts
* a RuntimeError whose message contains the exact text of the check (op name,
  argument name, what was expected and what came), and
* that every input, caches and cache_lens included, is bitwise unchanged afterwards
  (checks.h: "All checks run before an op writes anything").

Value checks (lengths, parents, tokens, accepted paths, uniforms) run on CPU tensors
always (strict mode OFF here, proving that claim) and on CUDA tensors in strict mode.
NaN / inf / negative probabilities are detected in strict mode only, on both devices.
Device-mismatch checks need two devices, so they run only with CUDA.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import pytest
import torch

from specdec import ops

from conftest import DEVICES, HAS_CUDA, assert_unchanged, gen, snapshot, strict_checks, to_device

OPS = {
    "verify_attention": ops.verify_attention,
    "append_kv": ops.append_kv,
    "rejection_sample": ops.rejection_sample,
    "greedy_verify": ops.greedy_verify,
    "kv_commit": ops.kv_commit,
}


# --------------------------------------------------------------------------- valid inputs
def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, last two dims transposed in memory."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def base_verify_attention():  # B=2, N=3, Hq=4, Hkv=2, D=64, S=16
    g = gen(0)
    return dict(q=torch.randn(2, 3, 4, 64, generator=g), k_cache=torch.randn(2, 2, 16, 64, generator=g),
                v_cache=torch.randn(2, 2, 16, 64, generator=g), cache_lens=torch.tensor([0, 5], dtype=torch.int32),
                tree_mask=None, scale=None)


def base_append_kv():  # B=2, Hkv=2, S=16, D=64, N=3
    g = gen(1)
    return dict(k_cache=torch.randn(2, 2, 16, 64, generator=g), v_cache=torch.randn(2, 2, 16, 64, generator=g),
                k_new=torch.randn(2, 2, 3, 64, generator=g), v_new=torch.randn(2, 2, 3, 64, generator=g),
                cache_lens=torch.tensor([0, 13], dtype=torch.int32))


def _tree():  # B=2, N=4, V=7
    tokens = torch.tensor([[5, 1, 2, 3], [0, 6, 4, -1]])
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -1]], dtype=torch.int32)
    return tokens, parents


def base_rejection_sample():
    g = gen(2)
    tokens, parents = _tree()
    return dict(tokens=tokens, parents=parents, target_probs=torch.rand(2, 4, 7, generator=g),
                draft_probs=torch.softmax(torch.randn(2, 4, 7, generator=g), -1),
                uniforms=torch.rand(2, 4, generator=g, dtype=torch.float64))


def base_greedy_verify():
    tokens, parents = _tree()
    return dict(tokens=tokens, parents=parents, target_logits=torch.randn(2, 4, 7, generator=gen(3)))


def base_kv_commit():  # L=2, B=2, Hkv=2, S=16, D=64, N=4
    g = gen(4)
    return dict(k_caches=[torch.randn(2, 2, 16, 64, generator=g) for _ in range(2)],
                v_caches=[torch.randn(2, 2, 16, 64, generator=g) for _ in range(2)],
                cache_lens=torch.tensor([0, 5], dtype=torch.int32),
                accepted=torch.tensor([[0, 1, 3, -1], [0, 2, -1, -1]], dtype=torch.int32),
                num_accepted=torch.tensor([2, 1], dtype=torch.int32))


BASE = {"verify_attention": base_verify_attention, "append_kv": base_append_kv,
        "rejection_sample": base_rejection_sample, "greedy_verify": base_greedy_verify,
        "kv_commit": base_kv_commit}


# --------------------------------------------------------------------------- cases
@dataclass
class Case:
    id: str
    op: str
    mutate: Callable[[dict], None]
    message: str
    kind: str = "meta"  # meta: shapes / dtypes; value: tensor contents; strict: strict-mode only
    cpu_arg: Optional[Tuple] = None  # device cases: the argument left on the CPU


def _set(**kw):
    def f(a):
        a.update({k: (v() if callable(v) else v) for k, v in kw.items()})
    return f


def _edit(name, fn):
    def f(a):
        a[name] = fn(a[name])
    return f


def _put(name, index, value):
    def f(a):
        t = a[name].clone()
        t[index] = value
        a[name] = t
    return f


def _layer(name, i, fn):
    def f(a):
        a[name] = list(a[name])
        a[name][i] = fn(a[name][i])
    return f


def _both(*fs):
    def f(a):
        for fn in fs:
            fn(a)
    return f


NOROOM = " leaves no room for N = {n} new nodes in a cache of capacity S = 16 (expected 0 <= cache_lens <= S - N)"

CASES = [
    # ---------------------------------------------------------------- verify_attention
    Case("q_rank", "verify_attention", _edit("q", lambda t: t[0]),
         "verify_attention: q must be [B, N, Hq, D], got [3, 4, 64]"),
    Case("q_dtype", "verify_attention", _edit("q", lambda t: t.double()),
         "verify_attention: q must be float32, float16 or bfloat16, got Double"),
    Case("k_cache_rank", "verify_attention", _edit("k_cache", lambda t: t[0]),
         "verify_attention: k_cache must be [B, Hkv, S, D], got [2, 16, 64]"),
    Case("k_cache_dtype", "verify_attention", _edit("k_cache", lambda t: t.double()),
         "verify_attention: k_cache must be float32, float16 or bfloat16, got Double"),
    Case("k_cache_noncontig", "verify_attention", _edit("k_cache", _noncontig),
         "verify_attention: k_cache must be contiguous, got strides [2048, 1024, 1, 16]"),
    Case("v_cache_rank", "verify_attention", _edit("v_cache", lambda t: t[:, :, :, :, None]),
         "verify_attention: v_cache must be [B, Hkv, S, D], got [2, 2, 16, 64, 1]"),
    Case("v_cache_dtype", "verify_attention", _edit("v_cache", lambda t: t.to(torch.int32)),
         "verify_attention: v_cache must be float32, float16 or bfloat16, got Int"),
    Case("v_cache_noncontig", "verify_attention", _edit("v_cache", _noncontig),
         "verify_attention: v_cache must be contiguous, got strides [2048, 1024, 1, 16]"),
    Case("v_cache_shape", "verify_attention", _set(v_cache=lambda: torch.randn(2, 2, 17, 64)),
         "verify_attention: v_cache must have the shape of k_cache [2, 2, 16, 64], got [2, 2, 17, 64]"),
    Case("kv_dtype_vs_q", "verify_attention", _both(_edit("k_cache", lambda t: t.half()),
                                                    _edit("v_cache", lambda t: t.half())),
         "verify_attention: k_cache and v_cache must have q's dtype Float, got Half and Half"),
    Case("v_dtype_vs_q", "verify_attention", _edit("v_cache", lambda t: t.bfloat16()),
         "verify_attention: k_cache and v_cache must have q's dtype Float, got Float and BFloat16"),
    Case("n_zero", "verify_attention", _set(q=lambda: torch.randn(2, 0, 4, 64)),
         "verify_attention: q must hold at least one node (N >= 1), got [2, 0, 4, 64]"),
    Case("cache_batch", "verify_attention", _set(k_cache=lambda: torch.randn(3, 2, 16, 64),
                                                 v_cache=lambda: torch.randn(3, 2, 16, 64)),
         "verify_attention: k_cache batch must equal q's B = 2, got [3, 2, 16, 64]"),
    Case("cache_head_dim", "verify_attention", _set(k_cache=lambda: torch.randn(2, 2, 16, 32),
                                                    v_cache=lambda: torch.randn(2, 2, 16, 32)),
         "verify_attention: k_cache head dim must equal q's D = 64, got [2, 2, 16, 32]"),
    Case("gqa_ratio", "verify_attention", _set(k_cache=lambda: torch.randn(2, 3, 16, 64),
                                               v_cache=lambda: torch.randn(2, 3, 16, 64)),
         "verify_attention: q heads Hq = 4 must be a multiple of the KV heads Hkv = 3"),
    Case("zero_kv_heads", "verify_attention", _set(k_cache=lambda: torch.randn(2, 0, 16, 64),
                                                   v_cache=lambda: torch.randn(2, 0, 16, 64)),
         "verify_attention: q heads Hq = 4 must be a multiple of the KV heads Hkv = 0"),
    Case("n_exceeds_capacity", "verify_attention", _set(q=lambda: torch.randn(2, 17, 4, 64)),
         "verify_attention: N = 17 new nodes exceed the cache capacity S = 16"),
    Case("scale_nan", "verify_attention", _set(scale=math.nan), "verify_attention: scale must be finite, got nan"),
    Case("scale_inf", "verify_attention", _set(scale=math.inf), "verify_attention: scale must be finite, got inf"),
    Case("cache_lens_dtype", "verify_attention", _edit("cache_lens", lambda t: t.long()),
         "verify_attention: cache_lens must be Int [2], got Long [2]"),
    Case("cache_lens_shape", "verify_attention", _set(cache_lens=lambda: torch.zeros(3, dtype=torch.int32)),
         "verify_attention: cache_lens must be Int [2], got Int [3]"),
    Case("tree_mask_dtype", "verify_attention", _set(tree_mask=lambda: torch.ones(2, 3, 3, dtype=torch.uint8)),
         "verify_attention: tree_mask must be bool [B, Nq, Nkv] = [2, 3, Nkv >= 3] (queries = the last Nq of Nkv "
         "new nodes), got Byte [2, 3, 3]"),
    Case("tree_mask_shape", "verify_attention", _set(tree_mask=lambda: torch.ones(2, 3, 2, dtype=torch.bool)),
         "verify_attention: tree_mask must be bool [B, Nq, Nkv] = [2, 3, Nkv >= 3] (queries = the last Nq of Nkv "
         "new nodes), got Bool [2, 3, 2]"),
    Case("tree_mask_rows", "verify_attention", _set(tree_mask=lambda: torch.ones(2, 4, 5, dtype=torch.bool)),
         "verify_attention: tree_mask must be bool [B, Nq, Nkv] = [2, 3, Nkv >= 3] (queries = the last Nq of Nkv "
         "new nodes), got Bool [2, 4, 5]"),
    Case("tree_mask_nkv_exceeds_capacity", "verify_attention",
         _set(tree_mask=lambda: torch.ones(2, 3, 17, dtype=torch.bool)),
         "verify_attention: tree_mask has Nkv = 17 new nodes, more than the cache capacity S = 16"),
    Case("cache_lens_no_room_for_nkv", "verify_attention",
         _set(tree_mask=lambda: torch.ones(2, 3, 12, dtype=torch.bool)),
         "verify_attention: cache_lens[1] = 5" + NOROOM.format(n=12), "value"),
    Case("cache_lens_negative", "verify_attention", _put("cache_lens", 0, -1),
         "verify_attention: cache_lens[0] = -1" + NOROOM.format(n=3), "value"),
    Case("cache_lens_past_capacity", "verify_attention", _put("cache_lens", 1, 14),
         "verify_attention: cache_lens[1] = 14" + NOROOM.format(n=3), "value"),
    # ---------------------------------------------------------------- append_kv
    Case("k_cache_rank", "append_kv", _edit("k_cache", lambda t: t[0]),
         "append_kv: k_cache must be [B, Hkv, S, D], got [2, 16, 64]"),
    Case("k_cache_dtype", "append_kv", _edit("k_cache", lambda t: t.double()),
         "append_kv: k_cache must be float32, float16 or bfloat16, got Double"),
    Case("k_cache_noncontig", "append_kv", _edit("k_cache", _noncontig),
         "append_kv: k_cache must be contiguous, got strides [2048, 1024, 1, 16]"),
    Case("v_cache_rank", "append_kv", _edit("v_cache", lambda t: t[0]),
         "append_kv: v_cache must be [B, Hkv, S, D], got [2, 16, 64]"),
    Case("v_cache_dtype", "append_kv", _edit("v_cache", lambda t: t.double()),
         "append_kv: v_cache must be float32, float16 or bfloat16, got Double"),
    Case("v_cache_noncontig", "append_kv", _edit("v_cache", _noncontig),
         "append_kv: v_cache must be contiguous, got strides [2048, 1024, 1, 16]"),
    Case("v_cache_shape", "append_kv", _set(v_cache=lambda: torch.randn(2, 2, 17, 64)),
         "append_kv: v_cache must match k_cache Float [2, 2, 16, 64], got Float [2, 2, 17, 64]"),
    Case("v_cache_dtype_vs_k", "append_kv", _edit("v_cache", lambda t: t.half()),
         "append_kv: v_cache must match k_cache Float [2, 2, 16, 64], got Half [2, 2, 16, 64]"),
    Case("k_new_shape", "append_kv", _set(k_new=lambda: torch.randn(2, 1, 3, 64)),
         "append_kv: k_new must be [B, Hkv, N, D] = [2, 2, N, 64], got [2, 1, 3, 64]"),
    Case("k_new_rank", "append_kv", _set(k_new=lambda: torch.randn(2, 3, 64)),
         "append_kv: k_new must be [B, Hkv, N, D] = [2, 2, N, 64], got [2, 3, 64]"),
    Case("v_new_shape", "append_kv", _set(v_new=lambda: torch.randn(2, 2, 4, 64)),
         "append_kv: v_new must have the shape of k_new [2, 2, 3, 64], got [2, 2, 4, 64]"),
    Case("new_dtype", "append_kv", _edit("k_new", lambda t: t.half()),
         "append_kv: k_new and v_new must have the cache dtype Float, got Half and Float"),
    Case("n_zero", "append_kv", _set(k_new=lambda: torch.randn(2, 2, 0, 64), v_new=lambda: torch.randn(2, 2, 0, 64)),
         "append_kv: k_new must hold 1 <= N <= S = 16 nodes, got N = 0"),
    Case("n_exceeds_capacity", "append_kv", _set(k_new=lambda: torch.randn(2, 2, 17, 64),
                                                 v_new=lambda: torch.randn(2, 2, 17, 64)),
         "append_kv: k_new must hold 1 <= N <= S = 16 nodes, got N = 17"),
    Case("cache_lens_dtype", "append_kv", _edit("cache_lens", lambda t: t.long()),
         "append_kv: cache_lens must be Int [2], got Long [2]"),
    Case("cache_lens_shape", "append_kv", _edit("cache_lens", lambda t: t[:, None]),
         "append_kv: cache_lens must be Int [2], got Int [2, 1]"),
    Case("cache_lens_negative", "append_kv", _put("cache_lens", 0, -3),
         "append_kv: cache_lens[0] = -3" + NOROOM.format(n=3), "value"),
    Case("cache_lens_past_capacity", "append_kv", _put("cache_lens", 1, 14),
         "append_kv: cache_lens[1] = 14" + NOROOM.format(n=3), "value"),
    Case("offset_negative", "append_kv", _set(offset=-1),
         "append_kv: offset must lie in [0, S - N] = [0, 13] (the new nodes go to cache_lens[b] + offset + j), got -1"),
    Case("offset_past_capacity", "append_kv", _set(offset=14),
         "append_kv: offset must lie in [0, S - N] = [0, 13] (the new nodes go to cache_lens[b] + offset + j), got 14"),
    Case("offset_no_room", "append_kv", _set(offset=1),
         "append_kv: cache_lens[1] = 13" + NOROOM.format(n=4), "value"),
    # ---------------------------------------------------------------- rejection_sample
    Case("target_probs_rank", "rejection_sample", _edit("target_probs", lambda t: t[:, :, 0]),
         "rejection_sample: target_probs must be float32 [B, N, V], got [2, 4]"),
    Case("target_probs_dtype", "rejection_sample", _edit("target_probs", lambda t: t.double()),
         "rejection_sample: target_probs must be float32 [B, N, V] with B = 2, N = 4, got Double [2, 4, 7]"),
    Case("target_probs_shape", "rejection_sample", _set(target_probs=lambda: torch.rand(2, 5, 7)),
         "rejection_sample: target_probs must be float32 [B, N, V] with B = 2, N = 4, got Float [2, 5, 7]"),
    Case("target_probs_empty_vocab", "rejection_sample",
         _set(tokens=lambda: torch.tensor([[3], [1]]), parents=lambda: torch.tensor([[-1], [-1]], dtype=torch.int32),
              target_probs=lambda: torch.rand(2, 1, 0), draft_probs=None,
              uniforms=lambda: torch.rand(2, 1, dtype=torch.float64)),
         "rejection_sample: target_probs must have a vocabulary of at least 1, got [2, 1, 0]"),
    Case("target_probs_noncontig", "rejection_sample", _edit("target_probs", _noncontig),
         "rejection_sample: target_probs must be contiguous, got strides [28, 1, 4]"),
    Case("target_probs_nan", "rejection_sample", _put("target_probs", (0, 1, 3), math.nan),
         "rejection_sample: target_probs must hold finite, non-negative probabilities "
         "(found NaN, inf or a negative value)", "strict"),
    Case("target_probs_inf", "rejection_sample", _put("target_probs", (1, 0, 0), math.inf),
         "rejection_sample: target_probs must hold finite, non-negative probabilities "
         "(found NaN, inf or a negative value)", "strict"),
    Case("target_probs_negative", "rejection_sample", _put("target_probs", (1, 3, 6), -0.125),
         "rejection_sample: target_probs must hold finite, non-negative probabilities "
         "(found NaN, inf or a negative value)", "strict"),
    Case("draft_probs_dtype", "rejection_sample", _edit("draft_probs", lambda t: t.half()),
         "rejection_sample: draft_probs must be float32 [B, N, V] with B = 2, N = 4, got Half [2, 4, 7]"),
    Case("draft_probs_shape", "rejection_sample", _edit("draft_probs", lambda t: t[:1]),
         "rejection_sample: draft_probs must be float32 [B, N, V] with B = 2, N = 4, got Float [1, 4, 7]"),
    Case("draft_probs_empty_vocab", "rejection_sample", _set(draft_probs=lambda: torch.rand(2, 4, 0)),
         "rejection_sample: draft_probs must have a vocabulary of at least 1, got [2, 4, 0]"),
    Case("draft_probs_noncontig", "rejection_sample", _edit("draft_probs", _noncontig),
         "rejection_sample: draft_probs must be contiguous, got strides [28, 1, 4]"),
    Case("draft_probs_nan", "rejection_sample", _put("draft_probs", (1, 2, 0), math.nan),
         "rejection_sample: draft_probs must hold finite, non-negative probabilities "
         "(found NaN, inf or a negative value)", "strict"),
    Case("draft_probs_vocab", "rejection_sample", _set(draft_probs=lambda: torch.rand(2, 4, 8)),
         "rejection_sample: draft_probs vocabulary must equal target_probs' V = 7, got [2, 4, 8]"),
    Case("uniforms_dtype", "rejection_sample", _edit("uniforms", lambda t: t.float()),
         "rejection_sample: uniforms must be float64 [B, N] = [2, 4], got Float [2, 4]"),
    Case("uniforms_shape", "rejection_sample", _set(uniforms=lambda: torch.rand(2, 5, dtype=torch.float64)),
         "rejection_sample: uniforms must be float64 [B, N] = [2, 4], got Double [2, 5]"),
    Case("uniform_above_one", "rejection_sample", _put("uniforms", (1, 2), 1.5),
         "rejection_sample: uniforms[1, 2] = 1.5 must lie in [0, 1]", "value"),
    Case("uniform_negative", "rejection_sample", _put("uniforms", (0, 0), -0.25),
         "rejection_sample: uniforms[0, 0] = -0.25 must lie in [0, 1]", "value"),
    Case("uniform_nan", "rejection_sample", _put("uniforms", (0, 3), math.nan),
         "rejection_sample: uniforms[0, 3] = nan must lie in [0, 1]", "value"),
    # ---------------------------------------------------------------- greedy_verify
    Case("target_logits_rank", "greedy_verify", _edit("target_logits", lambda t: t[:, :, 0]),
         "greedy_verify: target_logits must be [B, N, V] (or int64 [B, N]: the argmax at each node), got [2, 4]"),
    Case("target_logits_shape", "greedy_verify", _set(target_logits=lambda: torch.randn(2, 5, 7)),
         "greedy_verify: target_logits must be [B, N, V] with B = 2, N = 4, got [2, 5, 7]"),
    Case("target_logits_empty_vocab", "greedy_verify",
         _set(tokens=lambda: torch.tensor([[3], [1]]), parents=lambda: torch.tensor([[-1], [-1]], dtype=torch.int32),
              target_logits=lambda: torch.randn(2, 1, 0)),
         "greedy_verify: target_logits must be [B, N, V] with B = 2, N = 1, got [2, 1, 0]"),
    Case("target_logits_dtype", "greedy_verify", _edit("target_logits", lambda t: t.double()),
         "greedy_verify: target_logits must be float32, float16 or bfloat16 (or int64 [B, N]: the argmax at each "
         "node), got Double"),
    Case("target_logits_noncontig", "greedy_verify", _edit("target_logits", _noncontig),
         "greedy_verify: target_logits must be contiguous, got strides [28, 1, 4]"),
    # ---------------------------------------------------------------- kv_commit
    Case("no_layers", "kv_commit", _set(k_caches=[], v_caches=[]),
         "kv_commit: k_caches must hold at least one layer, got an empty list"),
    Case("layer_count", "kv_commit", _edit("v_caches", lambda l: l[:1]),
         "kv_commit: v_caches must hold as many layers as k_caches (2), got 1"),
    Case("k_caches0_rank", "kv_commit", _layer("k_caches", 0, lambda t: t[0]),
         "kv_commit: k_caches[0] must be [B, Hkv, S, D], got [2, 16, 64]"),
    Case("k_caches0_dtype", "kv_commit", _layer("k_caches", 0, lambda t: t.double()),
         "kv_commit: k_caches[0] must be float32, float16 or bfloat16, got Double"),
    Case("k_caches0_noncontig", "kv_commit", _layer("k_caches", 0, _noncontig),
         "kv_commit: k_caches[0] must be contiguous, got strides [2048, 1024, 1, 16]"),
    Case("v_caches1_rank", "kv_commit", _layer("v_caches", 1, lambda t: t[0]),
         "kv_commit: v_caches[1] must be [B, Hkv, S, D], got [2, 16, 64]"),
    Case("v_caches1_dtype", "kv_commit", _layer("v_caches", 1, lambda t: t.double()),
         "kv_commit: v_caches[1] must be float32, float16 or bfloat16, got Double"),
    Case("k_caches1_noncontig", "kv_commit", _layer("k_caches", 1, _noncontig),
         "kv_commit: k_caches[1] must be contiguous, got strides [2048, 1024, 1, 16]"),
    Case("k_caches1_capacity", "kv_commit", _layer("k_caches", 1, lambda t: torch.randn(2, 2, 17, 64)),
         "kv_commit: k_caches[1] must have batch 2 and capacity 16 like k_caches[0], got [2, 2, 17, 64]"),
    Case("v_caches0_batch", "kv_commit", _layer("v_caches", 0, lambda t: torch.randn(3, 2, 16, 64)),
         "kv_commit: v_caches[0] must have batch 2 and capacity 16 like k_caches[0], got [3, 2, 16, 64]"),
    Case("v_caches1_dtype_vs_k0", "kv_commit", _layer("v_caches", 1, lambda t: t.half()),
         "kv_commit: v_caches[1] must have dtype Float like k_caches[0], got Half"),
    Case("cache_lens_dtype", "kv_commit", _edit("cache_lens", lambda t: t.long()),
         "kv_commit: cache_lens must be Int [2], got Long [2]"),
    Case("cache_lens_shape", "kv_commit", _set(cache_lens=lambda: torch.zeros(3, dtype=torch.int32)),
         "kv_commit: cache_lens must be Int [2], got Int [3]"),
    Case("num_accepted_dtype", "kv_commit", _edit("num_accepted", lambda t: t.long()),
         "kv_commit: num_accepted must be Int [2], got Long [2]"),
    Case("num_accepted_shape", "kv_commit", _edit("num_accepted", lambda t: t[:1]),
         "kv_commit: num_accepted must be Int [2], got Int [1]"),
    Case("accepted_dtype", "kv_commit", _edit("accepted", lambda t: t.long()),
         "kv_commit: accepted must be int32 [B, N] with B = 2, got Long [2, 4]"),
    Case("accepted_shape", "kv_commit", _set(accepted=lambda: torch.zeros(3, 4, dtype=torch.int32)),
         "kv_commit: accepted must be int32 [B, N] with B = 2, got Int [3, 4]"),
    Case("accepted_no_columns", "kv_commit", _set(accepted=lambda: torch.zeros(2, 0, dtype=torch.int32)),
         "kv_commit: accepted must have 1 <= N <= S = 16 columns, got [2, 0]"),
    Case("accepted_too_many_columns", "kv_commit",
         _edit("accepted", lambda t: torch.cat([t, torch.full((2, 13), -1, dtype=torch.int32)], 1)),
         "kv_commit: accepted must have 1 <= N <= S = 16 columns, got [2, 17]"),
    Case("num_accepted_too_big", "kv_commit", _put("num_accepted", 1, 4),
         "kv_commit: num_accepted[1] = 4 must lie in [0, N - 1] = [0, 3]", "value"),
    Case("num_accepted_negative", "kv_commit", _put("num_accepted", 0, -1),
         "kv_commit: num_accepted[0] = -1 must lie in [0, N - 1] = [0, 3]", "value"),
    Case("accepted_root", "kv_commit", _put("accepted", (0, 0), 1),
         "kv_commit: accepted[0, 0] must be 0 (the root), got 1", "value"),
    Case("accepted_not_increasing", "kv_commit", _put("accepted", (0, slice(1, 3)), torch.tensor([3, 1])),
         "kv_commit: accepted[0, 2] = 1 must be a node index in (accepted[0, 1] = 3, N) "
         "(a root path in topological order)", "value"),
    Case("accepted_past_n", "kv_commit", _put("accepted", (0, 2), 4),
         "kv_commit: accepted[0, 2] = 4 must be a node index in (accepted[0, 1] = 1, N) "
         "(a root path in topological order)", "value"),
    Case("accepted_padding_in_path", "kv_commit", _put("accepted", (1, 1), -1),
         "kv_commit: accepted[1, 1] = -1 must be a node index in (accepted[1, 0] = 0, N) "
         "(a root path in topological order)", "value"),
    Case("cache_lens_past_capacity", "kv_commit", _put("cache_lens", 1, 14),
         "kv_commit: cache_lens[1] = 14 + accepted node 2 lies past the cache capacity S = 16", "value"),
    Case("cache_lens_negative", "kv_commit", _put("cache_lens", 0, -1),
         "kv_commit: cache_lens[0] = -1 + accepted node 3 lies past the cache capacity S = 16", "value"),
]

# aliasing: a tensor an op writes may not share memory with another argument
def _alias(dst, src, i=None, j=None):
    """dst (or dst[i]) becomes the very tensor src (or src[j]) — the same memory twice."""
    def f(a):
        value = a[src] if j is None else a[src][j]
        if i is None:
            a[dst] = value
        else:
            a[dst] = list(a[dst])
            a[dst][i] = value
    return f


CASES += [
    Case("k_aliases_v", "kv_commit", _alias("v_caches", "k_caches", 0, 0),
         "kv_commit: k_caches[0] and v_caches[0] share memory (the same tensor passed twice, or overlapping "
         "views); every tensor this op writes must be memory of its own"),
    Case("layer_listed_twice", "kv_commit", _alias("k_caches", "k_caches", 1, 0),
         "kv_commit: k_caches[0] and k_caches[1] share memory"),
    Case("overlapping_views", "kv_commit",
         _set(k_caches=lambda: (lambda big: [big[:2], big[1:3]])(torch.randn(3, 2, 16, 64))),
         "kv_commit: k_caches[0] and k_caches[1] share memory"),
    Case("lens_alias_num_accepted", "kv_commit", _alias("num_accepted", "cache_lens"),
         "kv_commit: cache_lens and num_accepted share memory"),
    Case("k_cache_aliases_v_cache", "append_kv", _alias("v_cache", "k_cache"),
         "append_kv: k_cache and v_cache share memory"),
    Case("k_new_inside_cache", "append_kv",
         _both(_set(k_cache=lambda: torch.randn(2, 2, 16, 64)),
               lambda a: a.update(k_new=a["k_cache"][:, :, 1:4])),
         "append_kv: k_cache and k_new share memory"),
    Case("vocab_too_large", "rejection_sample",
         _set(target_probs=lambda: torch.zeros(2, 4, (1 << 20) + 1), draft_probs=None),
         "rejection_sample: target_probs vocabulary V = 1048577 exceeds the largest the sampler supports "
         "(1048576: a row's integer mass must stay below 2^62)"),
]

# check_tree is shared by rejection_sample and greedy_verify: every condition for both ops
for _op in ("rejection_sample", "greedy_verify"):
    CASES += [
        Case("tokens_dtype", _op, _edit("tokens", lambda t: t.int()),
             f"{_op}: tokens must be int64 [B, N], got Int [2, 4]"),
        Case("tokens_rank", _op, _edit("tokens", lambda t: t.flatten()),
             f"{_op}: tokens must be int64 [B, N], got Long [8]"),
        Case("no_root", _op,
             _set(tokens=lambda: torch.zeros(2, 0, dtype=torch.int64),
                  parents=lambda: torch.zeros(2, 0, dtype=torch.int32),
                  **({"target_probs": lambda: torch.rand(2, 0, 7), "draft_probs": None,
                      "uniforms": lambda: torch.rand(2, 0, dtype=torch.float64)} if _op == "rejection_sample"
                     else {"target_logits": lambda: torch.randn(2, 0, 7)})),
             f"{_op}: tokens must hold at least the root node (N >= 1), got [2, 0]"),
        Case("parents_dtype", _op, _edit("parents", lambda t: t.long()),
             f"{_op}: parents must be int32 [B, N] = [2, 4], got Long [2, 4]"),
        Case("parents_shape", _op, _edit("parents", lambda t: t[:, :3]),
             f"{_op}: parents must be int32 [B, N] = [2, 4], got Int [2, 3]"),
        Case("root_parent", _op, _put("parents", (1, 0), 0),
             f"{_op}: parents[1, 0] must be -1 (node 0 is the root), got 0", "value"),
        Case("parent_not_before_child", _op, _put("parents", (0, 2), 2),
             f"{_op}: parents[0, 2] = 2 must be -1 (padding) or a node index < 2 (topological order)", "value"),
        Case("parent_below_minus_one", _op, _put("parents", (1, 3), -2),
             f"{_op}: parents[1, 3] = -2 must be -1 (padding) or a node index < 3 (topological order)", "value"),
        Case("token_past_vocab", _op, _put("tokens", (1, 2), 7),
             f"{_op}: tokens[1, 2] = 7 is out of range [0, 7) for vocabulary size V = 7", "value"),
        Case("token_negative", _op, _put("tokens", (0, 3), -1),
             f"{_op}: tokens[0, 3] = -1 is out of range [0, 7) for vocabulary size V = 7", "value"),
    ]

# device mismatch: (op, argument left on the CPU, its name in the message)
DEVICE_CASES = [
    ("verify_attention", ("k_cache",), "k_cache"), ("verify_attention", ("v_cache",), "v_cache"),
    ("verify_attention", ("cache_lens",), "cache_lens"), ("verify_attention", ("tree_mask",), "tree_mask"),
    ("append_kv", ("v_cache",), "v_cache"), ("append_kv", ("k_new",), "k_new"), ("append_kv", ("v_new",), "v_new"),
    ("append_kv", ("cache_lens",), "cache_lens"),
    ("rejection_sample", ("parents",), "parents"), ("rejection_sample", ("target_probs",), "target_probs"),
    ("rejection_sample", ("draft_probs",), "draft_probs"), ("rejection_sample", ("uniforms",), "uniforms"),
    ("greedy_verify", ("parents",), "parents"), ("greedy_verify", ("target_logits",), "target_logits"),
    ("kv_commit", ("v_caches", 0), "v_caches[0]"), ("kv_commit", ("k_caches", 1), "k_caches[1]"),
    ("kv_commit", ("cache_lens",), "cache_lens"), ("kv_commit", ("accepted",), "accepted"),
    ("kv_commit", ("num_accepted",), "num_accepted"),
]


def _call_and_check(op: str, args: dict, message: str, strict: bool) -> None:
    before = snapshot(args)
    with strict_checks(strict):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            OPS[op](**args)
    assert_unchanged(before, args)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.op}-{c.id}" for c in CASES])
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_raises(device, case):
    args = BASE[case.op]()
    case.mutate(args)
    args = to_device(args, device)
    strict = case.kind == "strict" or (device == "cuda" and case.kind == "value")
    _call_and_check(case.op, args, case.message, strict)


def test_every_op_has_error_cases():
    assert {c.op for c in CASES} == set(OPS)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (two devices to mismatch)")
@pytest.mark.parametrize("op,where,name", DEVICE_CASES, ids=[f"{o}-{n}" for o, _, n in DEVICE_CASES])
def test_cuda_device_mismatch_raises(op, where, name):
    args = to_device(BASE[op](), "cuda")
    if op == "verify_attention" and name == "tree_mask":
        args["tree_mask"] = torch.ones(2, 3, 3, dtype=torch.bool)
    if len(where) == 1:
        args[where[0]] = args[where[0]].cpu()
    else:
        args[where[0]] = list(args[where[0]])
        args[where[0]][where[1]] = args[where[0]][where[1]].cpu()
    _call_and_check(op, args, f"{op}: {name} must be on cuda:0 like the other inputs, got cpu", strict=False)


@pytest.mark.skipif(not HAS_CUDA, reason="the head-dim restriction is the CUDA kernel's")
def test_cuda_unsupported_head_dim_raises():
    """The CUDA attention kernel is instantiated for a fixed set of head dims (DESIGN.md:
    64, 80, 96, 128, 256 at least); any other D must raise, naming the op and the D,
    with the inputs unchanged."""
    g = gen(5)
    args = dict(q=torch.randn(2, 3, 4, 72, generator=g), k_cache=torch.randn(2, 2, 16, 72, generator=g),
                v_cache=torch.randn(2, 2, 16, 72, generator=g), cache_lens=torch.tensor([0, 5], dtype=torch.int32),
                tree_mask=None, scale=None)
    args = to_device(args, "cuda")
    before = snapshot(args)
    with pytest.raises(RuntimeError, match=re.escape(
            "verify_attention: head dim D must be one of 64, 80, 96, 128, 256 on CUDA, got 72")):
        ops.verify_attention(**args)
    assert_unchanged(before, args)
