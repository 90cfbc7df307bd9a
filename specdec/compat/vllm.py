"""vLLM v1's rejection-sampler call convention over specdec's ops (chains).

vLLM v1 keeps the drafts of a step RAGGED: request b proposed ``num_draft_tokens[b]`` tokens, laid
out back to back in ``draft_token_ids [num_tokens]``; ``cu_num_draft_tokens [B]`` is the inclusive
cumulative sum of those counts. Target (and draft) distributions come one row per draft token. The
sampler returns ``[B, max_spec_len + 1]`` int32: the accepted drafts of each request, then one more
token (the recovered token drawn from the residual at the first rejection, or, when every draft
passed, the bonus token the caller sampled from the target at the position after the last draft),
then ``PLACEHOLDER_TOKEN_ID`` (-1).

:func:`rejection_sample` pads the chains into a ``[B, max_spec_len + 1]`` specdec tree batch
(node 0 = root, node j + 1 = draft j, each node's parent the one before it, padding nodes parent
-1) and runs :func:`specdec.ops.greedy_verify` for the greedy rows and
:func:`specdec.ops.rejection_sample` for the sampled rows. The target row after the last draft is
a one-hot row on the bonus token, so the op's final draw after a fully accepted chain IS the bonus
token, as in vLLM.

Semantics (vLLM v1, per request with drafts d_0 .. d_{n-1}):

* greedy (temperature 0): draft j is accepted iff it equals ``argmax target_probs[j]`` (first
  maximal index) and every earlier draft was accepted; at the first mismatch the argmax is emitted
  and the row ends; after n accepted drafts the bonus token is emitted.
* random: draft j is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))`` (q one-hot on d_j
  when ``draft_probs`` is None); at the first rejection a token is drawn from
  ``max(p_j - q_j, 0)`` normalised (``p_j`` with ``d_j`` removed when ``draft_probs`` is None),
  which makes the emitted sequence exactly distributed as the target's; after n accepted drafts
  the bonus token is emitted. Draws here come from specdec's inverse-CDF rule with float64
  uniforms (vLLM draws its recovered tokens with exponential noise): the same distribution,
  not the same random stream.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from specdec import ops

__all__ = ["PLACEHOLDER_TOKEN_ID", "rejection_sample", "pad_chains"]

PLACEHOLDER_TOKEN_ID = -1

_FN = "specdec.compat.vllm.rejection_sample"


def _fail(arg: str, expected: str, got: str, exc=ValueError):
    raise exc(f"{_FN}: {arg} must be {expected}, got {got}")


def _check_tensor(arg, t, ndim, dtypes, shape=None):
    if not isinstance(t, torch.Tensor):
        _fail(arg, "a torch.Tensor", type(t).__name__, TypeError)
    if t.dim() != ndim:
        _fail(arg, f"{ndim}-D", f"shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(arg, " or ".join(str(d) for d in dtypes), str(t.dtype), TypeError)
    if shape is not None:
        for i, (want, have) in enumerate(zip(shape, t.shape)):
            if want is not None and want != have:
                exp = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                _fail(arg, f"of shape {exp}", f"{tuple(t.shape)} (dim {i})")


_INT = (torch.int32, torch.int64)


def pad_chains(draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int], target_probs: torch.Tensor,
               bonus_token_ids: torch.Tensor, draft_probs: Optional[torch.Tensor] = None):
    """Ragged chains -> a padded specdec tree batch ``(tokens [B, N] int64, parents [B, N] int32,
    p [B, N, V] float32, q [B, N, V] float32 or None)`` with N = max(num_draft_tokens) + 1.

    Node 0 is the root (token 0, never checked), node j + 1 is draft j with parent j, padding nodes
    have parent -1. ``p[b, j]`` = target row of draft j for j < n_b, ``p[b, n_b]`` = one-hot on the
    bonus token, padding rows zero; ``q[b, j + 1]`` = draft row of draft j, other rows zero.
    """
    dev = target_probs.device
    n = torch.tensor([int(x) for x in num_draft_tokens], dtype=torch.int64, device=dev)
    B = n.numel()
    S = int(n.max().item()) if B else 0
    N = S + 1
    V = target_probs.shape[1]
    pos = torch.arange(S, device=dev)
    valid = pos[None, :] < n[:, None]  # [B, S]; row-major order matches the ragged layout
    tokens = torch.zeros(B, N, dtype=torch.int64, device=dev)
    tokens[:, 1:][valid] = draft_token_ids.to(torch.int64)
    node = torch.arange(N, dtype=torch.int32, device=dev)
    parents = torch.where(node[None, :] <= n[:, None].to(torch.int32), node - 1, torch.full_like(node, -1)[None, :])
    parents = parents.to(torch.int32).contiguous()
    p = torch.zeros(B, N, V, dtype=torch.float32, device=dev)
    p[:, :S][valid] = target_probs.to(torch.float32)
    rows = torch.arange(B, device=dev)
    p[rows, n, bonus_token_ids.reshape(B).to(torch.int64)] = 1.0
    q = None
    if draft_probs is not None:
        q = torch.zeros(B, N, V, dtype=torch.float32, device=dev)
        q[:, 1:][valid] = draft_probs.to(torch.float32)
    return tokens, parents, p, q


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int],
                     cu_num_draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                     target_probs: torch.Tensor, bonus_token_ids: torch.Tensor, temperature: torch.Tensor,
                     generator: Optional[torch.Generator] = None,
                     generators: Optional[Dict[int, torch.Generator]] = None,
                     uniforms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """vLLM v1 rejection sampling of ragged draft chains -> ``[B, max_spec_len + 1]`` int32.

    Parameters
    ----------
    draft_token_ids : Tensor [num_tokens], int32 / int64 — all requests' drafts, back to back.
    num_draft_tokens : list[int] [B] — drafts per request (0 allowed).
    cu_num_draft_tokens : Tensor [B], int32 / int64 — inclusive cumsum of ``num_draft_tokens``.
    draft_probs : Tensor [num_tokens, V] float or None — the distribution each draft was drawn from;
        None = one-hot proposals (n-gram, EAGLE greedy drafts).
    target_probs : Tensor [num_tokens, V] float — the target's (warped) distribution at each draft.
    bonus_token_ids : Tensor [B, 1] int — the target's sample after the last draft; emitted when
        every draft of the request is accepted.
    temperature : Tensor [B] float — 0 (or negative, vLLM's greedy sentinel) marks a greedy row.
    generator : torch.Generator, optional — draws the uniforms of the sampled rows (on its device).
    generators : dict[int, torch.Generator], optional — per-request generators (vLLM's seeded
        requests): row b draws its own ``max_spec_len + 1`` uniforms from ``generators[b]``.
    uniforms : Tensor [B, max_spec_len + 1] float64 in [0, 1], optional — the randomness given
        explicitly, in specdec's layout: ``uniforms[b, j + 1]`` decides draft j, ``uniforms[b, 0]``
        drives the recovered-token draw. Overrides ``generator`` / ``generators``.

    Returns
    -------
    Tensor [B, max_spec_len + 1] int32: accepted drafts, then the recovered or bonus token, then -1.
    """
    _check_tensor("draft_token_ids", draft_token_ids, 1, _INT)
    T = draft_token_ids.shape[0]
    if isinstance(num_draft_tokens, torch.Tensor):
        num_draft_tokens = num_draft_tokens.tolist()
    if not isinstance(num_draft_tokens, (list, tuple)):
        _fail("num_draft_tokens", "a list of ints", type(num_draft_tokens).__name__, TypeError)
    if any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in num_draft_tokens):
        _fail("num_draft_tokens", "non-negative ints", repr(list(num_draft_tokens)))
    B = len(num_draft_tokens)
    if sum(num_draft_tokens) != T:
        _fail("num_draft_tokens", f"summing to num_tokens = {T} (draft_token_ids' length)",
              f"sum {sum(num_draft_tokens)}")
    _check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, 1, _INT, (B,))
    want_cu = torch.tensor(num_draft_tokens, dtype=torch.int64).cumsum(0)
    if not torch.equal(cu_num_draft_tokens.cpu().to(torch.int64), want_cu):
        _fail("cu_num_draft_tokens", f"the inclusive cumsum of num_draft_tokens {want_cu.tolist()}",
              str(cu_num_draft_tokens.tolist()))
    floats = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    _check_tensor("target_probs", target_probs, 2, floats, (T, None))
    V = target_probs.shape[1]
    if V < 1:
        _fail("target_probs", "of vocabulary size >= 1", f"shape {tuple(target_probs.shape)}")
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, 2, floats, (T, V))
    _check_tensor("bonus_token_ids", bonus_token_ids, 2, _INT, (B, 1))
    _check_tensor("temperature", temperature, 1, floats, (B,))
    for name, t in (("draft_token_ids", draft_token_ids), ("bonus_token_ids", bonus_token_ids)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= V):
            _fail(name, f"token ids in [0, {V})", f"values in [{int(t.min())}, {int(t.max())}]")
    S = max(num_draft_tokens) if B else 0
    N = S + 1
    if uniforms is not None:
        _check_tensor("uniforms", uniforms, 2, (torch.float64,), (B, N))
    if B == 0:
        return torch.empty(0, N, dtype=torch.int32, device=target_probs.device)

    dev = target_probs.device
    tokens, parents, p, q = pad_chains(draft_token_ids, num_draft_tokens, target_probs, bonus_token_ids, draft_probs)
    out = torch.full((B, N), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=dev)
    greedy = (temperature <= 0).to(dev)
    g_idx = greedy.nonzero().flatten()
    r_idx = (~greedy).nonzero().flatten()
    if g_idx.numel():
        if g_idx.numel() == B:
            _, _, o = ops.greedy_verify(tokens, parents, p)
        else:
            _, _, o = ops.greedy_verify(tokens[g_idx], parents[g_idx], p[g_idx])
        out[g_idx] = o.to(torch.int32)
    if r_idx.numel():
        if uniforms is None:
            uniforms = _draw(B, N, dev, generator, generators)
        u = uniforms.to(dev)
        if r_idx.numel() == B:
            _, _, o = ops.rejection_sample(tokens, parents, p, q, u.contiguous())
        else:
            _, _, o = ops.rejection_sample(tokens[r_idx], parents[r_idx], p[r_idx],
                                           None if q is None else q[r_idx], u[r_idx].contiguous())
        out[r_idx] = o.to(torch.int32)
    return out


def _draw(B: int, N: int, dev: torch.device, generator: Optional[torch.Generator],
          generators: Optional[Dict[int, torch.Generator]]) -> torch.Tensor:
    gdev = generator.device if generator is not None else dev
    u = torch.rand(B, N, dtype=torch.float64, device=gdev, generator=generator).to(dev)
    for b, g in (generators or {}).items():
        if not 0 <= int(b) < B:
            _fail("generators", f"keyed by request indices in [0, {B})", f"key {b}")
        u[int(b)] = torch.rand(N, dtype=torch.float64, device=g.device, generator=g).to(dev)
    return u

