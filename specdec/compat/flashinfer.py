"""FlashInfer's chain speculative sampling call convention over specdec's ops.

A batch of B chains of N drafts each: ``draft_probs [B, N, V]`` (the distribution draft j was drawn
from), ``draft_token_ids [B, N]``, ``target_probs [B, N + 1, V]`` (row j: the target after the
prefix and drafts 0 .. j - 1; row N: after all drafts). The chain is a specdec tree of N + 1 nodes
(node 0 = root, node j + 1 = draft j) whose target rows are exactly ``target_probs``, so a single
:func:`specdec.ops.rejection_sample` decides it; the draw after N accepted drafts comes from row N
(FlashInfer's bonus token).

Semantics (FlashInfer), per request:

* draft j is accepted iff ``u_j * q_j(d_j) < p_j(d_j)``, scanning j = 0, 1, ... and stopping at the
  first rejection, at position ``pos`` (``pos = N`` when none is rejected);
* the token at ``pos`` is drawn by inverse CDF with ``u_{min(pos + 1, N)}`` from
  ``max(p_pos - q_pos, 0)`` normalised (from ``p_N`` when ``pos = N``);
* ``output_token_ids [B, N + 1]`` int32: drafts 0 .. pos - 1, the drawn token, then -1;
* ``emitted_draft_num[b] = pos`` (the bonus / recovered token is not counted);
* ``accepted_num[b]`` counts every j whose test passes ON ITS OWN, including those after the first
  rejection (an acceptance-rate metric, not the emitted length);
* when ``maybe_output_accepted_token_num`` / ``maybe_output_emitted_draft_token_num`` are given,
  the counts are ADDED to them in place and those tensors are returned.

Differences, documented: specdec's acceptance test runs in fixed point on the integer masses of the
target row (``specdec.ops.rejection_sample``) and also requires ``q_j(d_j) > 0``; FlashInfer's runs
in float32. The two agree except at exact ties (measure zero for continuous uniforms). The
``accepted_num`` count of the positions after ``pos`` uses FlashInfer's float32 test directly.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec import ops
from specdec.compat.common import workspace
from specdec.sampling import mix_seed

__all__ = ["chain_speculative_sampling", "chain_speculative_sampling_uniform", "PagedMetadata", "dense_as_paged",
           "to_block_table", "kv_lens_to_metadata", "tree_mask_from_custom", "verify_attention_paged",
           "append_paged_kv_cache", "commit_paged_kv"]

_FN = "specdec.compat.flashinfer.chain_speculative_sampling"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INTS = (torch.int32, torch.int64)


def _fail(fn, arg, expected, got, exc=ValueError):
    raise exc(f"{fn}: {arg} must be {expected}, got {got}")


def _check(fn, arg, t, dtypes, shape):
    if not isinstance(t, torch.Tensor):
        _fail(fn, arg, "a torch.Tensor", type(t).__name__, TypeError)
    exp = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if t.dim() != len(shape):
        _fail(fn, arg, f"{len(shape)}-D of shape {exp}", f"shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(fn, arg, " or ".join(str(d) for d in dtypes), str(t.dtype), TypeError)
    for want, have in zip(shape, t.shape):
        if want is not None and want != have:
            _fail(fn, arg, f"of shape {exp}", f"{tuple(t.shape)}")


def _validate(fn, draft_probs, draft_token_ids, target_probs):
    _check(fn, "draft_probs", draft_probs, _FLOATS, (None, None, None))
    B, N, V = draft_probs.shape
    _check(fn, "draft_token_ids", draft_token_ids, _INTS, (B, N))
    _check(fn, "target_probs", target_probs, _FLOATS, (B, N + 1, V))
    if V < 1:
        _fail(fn, "draft_probs", "of vocabulary size >= 1", f"shape {tuple(draft_probs.shape)}")
    if draft_token_ids.numel() and (int(draft_token_ids.min()) < 0 or int(draft_token_ids.max()) >= V):
        _fail(fn, "draft_token_ids", f"token ids in [0, {V})",
              f"values in [{int(draft_token_ids.min())}, {int(draft_token_ids.max())}]")
    for arg, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if t.device != draft_token_ids.device:
            _fail(fn, arg, f"on {draft_token_ids.device} (draft_token_ids' device)", str(t.device))
    return B, N, V


def _check_counter(fn, arg, t, B, dev):
    if t is None:
        return torch.zeros(B, dtype=torch.int32, device=dev)
    _check(fn, arg, t, _INTS, (B,))
    if t.device != dev:
        _fail(fn, arg, f"on {dev}", str(t.device))
    return t


def _run(fn, draft_probs, draft_token_ids, target_probs, uniform_samples, acc_buf, emit_buf):
    B, N, V = draft_probs.shape
    dev = target_probs.device
    acc_buf = _check_counter(fn, "maybe_output_accepted_token_num", acc_buf, B, dev)
    emit_buf = _check_counter(fn, "maybe_output_emitted_draft_token_num", emit_buf, B, dev)
    u_fi = uniform_samples.to(device=dev, dtype=torch.float64)
    d = draft_token_ids.to(torch.int64)
    # FlashInfer's independent test of every draft, in float32 (for accepted_num and for picking the
    # final uniform, which FlashInfer takes at index min(pos + 1, N)).
    q_d = torch.gather(draft_probs, 2, d[:, :, None])[:, :, 0].float()
    p_d = torch.gather(target_probs[:, :N], 2, d[:, :, None])[:, :, 0].float()
    passes = u_fi[:, :N].float() * q_d < p_d  # [B, N]
    fails = ~passes
    pos_fi = torch.where(fails.any(1), fails.to(torch.int8).argmax(1), torch.full((B,), N, device=dev))
    final_u = torch.gather(u_fi, 1, torch.clamp(pos_fi + 1, max=N)[:, None])  # [B, 1]

    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=dev), d], 1)
    parents = (torch.arange(N + 1, dtype=torch.int32, device=dev) - 1).expand(B, N + 1).contiguous()
    p = target_probs.to(torch.float32).contiguous()
    q = workspace("flashinfer.draft", (B, N + 1, V), torch.float32, dev)  # row 0 (the root) is unused
    q[:, 0] = 0.0
    q[:, 1:].copy_(draft_probs)
    u = torch.cat([final_u, u_fi[:, :N]], 1).contiguous()
    _, num, out = ops.rejection_sample(tokens, parents, p, q, u)

    pos = num.to(torch.int64)
    after = torch.arange(N, device=dev)[None, :] > pos[:, None]
    accepted = pos + (passes & after).sum(1)
    acc_buf.add_(accepted.to(acc_buf.dtype))
    emit_buf.add_(pos.to(emit_buf.dtype))
    return out.to(torch.int32), acc_buf, emit_buf


def chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                               maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
                               maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
                               deterministic: bool = True, generator: Optional[torch.Generator] = None,
                               seed: Optional[int] = None, offset: Optional[int] = None
                               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's ``chain_speculative_sampling`` (generator / seed form).

    Returns ``(output_token_ids [B, N + 1] int32, accepted_num [B], emitted_draft_num [B])`` as
    described in the module docstring. Randomness: ``B x (N + 1)`` float64 uniforms drawn with
    ``torch.rand`` from ``generator``; when ``seed`` is given instead, from a fresh generator on the
    inputs' device seeded with ``mix_seed(seed, offset or 0)`` (the same numbers for the same
    (seed, offset); not FlashInfer's Philox stream); with neither, from torch's default generator.
    ``deterministic`` is accepted for compatibility: specdec's op is always deterministic.
    The counters default to new int32 zeros; given tensors are added to in place and returned.
    """
    B, N, _ = _validate(_FN, draft_probs, draft_token_ids, target_probs)
    dev = target_probs.device
    if generator is not None and seed is not None:
        _fail(_FN, "generator / seed", "at most one of the two", "both")
    if seed is not None:
        generator = torch.Generator(device=dev)
        generator.manual_seed(mix_seed(int(seed), int(offset or 0)))
    gdev = generator.device if generator is not None else dev
    u = torch.rand(B, N + 1, dtype=torch.float64, device=gdev, generator=generator).to(dev)
    return _run(_FN, draft_probs, draft_token_ids, target_probs, u,
                maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num)


def chain_speculative_sampling_uniform(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                                       uniform_samples: torch.Tensor, target_probs: torch.Tensor,
                                       maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
                                       maybe_output_emitted_token_num: Optional[torch.Tensor] = None,
                                       deterministic: bool = True, *,
                                       maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None
                                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's older ``chain_speculative_sampling(draft_probs, draft_token_ids, uniform_samples,
    target_probs, ...)`` (argument order as there): the randomness is given as
    ``uniform_samples [B, N + 1]`` float in [0, 1]. ``uniform_samples[b, j]`` decides draft j
    (``u * q < p``); ``uniform_samples[b, min(pos + 1, N)]`` drives the final draw (inverse CDF of
    the residual, or of ``target_probs[b, N]`` when every draft passed). Same outputs and counter
    semantics as :func:`chain_speculative_sampling`. The older API named the emitted counter
    ``maybe_output_emitted_token_num`` (same meaning: drafts emitted, the final token excluded); the
    newer name is accepted as a keyword too.
    """
    fn = "specdec.compat.flashinfer.chain_speculative_sampling_uniform"
    B, N, _ = _validate(fn, draft_probs, draft_token_ids, target_probs)
    _check(fn, "uniform_samples", uniform_samples, _FLOATS, (B, N + 1))
    if uniform_samples.numel() and not bool(((uniform_samples >= 0) & (uniform_samples <= 1)).all()):
        _fail(fn, "uniform_samples", "values in [0, 1]",
              f"values in [{float(uniform_samples.min())}, {float(uniform_samples.max())}]")
    if maybe_output_emitted_token_num is not None and maybe_output_emitted_draft_token_num is not None:
        _fail(fn, "maybe_output_emitted_token_num / maybe_output_emitted_draft_token_num", "at most one of the two",
              "both")
    emitted = maybe_output_emitted_token_num if maybe_output_emitted_token_num is not None \
        else maybe_output_emitted_draft_token_num
    return _run(fn, draft_probs, draft_token_ids, target_probs, uniform_samples,
                maybe_output_accepted_token_num, emitted)


from specdec.compat.flashinfer_paged import (PagedMetadata, append_paged_kv_cache,  # noqa: E402  (re-exported)
                                             commit_paged_kv, dense_as_paged, kv_lens_to_metadata,
                                             to_block_table, tree_mask_from_custom, verify_attention_paged)
