"""FlashInfer's chain speculative sampling call convention over specdec's ops.

A batch of B chains of N drafts each: ``draft_probs [B, N, V]`` (the distribution draft j was drawn
from), ``draft_token_ids [B, N]``, ``target_probs [B, N + 1, V]`` (row j: the target after the
prefix and drafts 0 .. j - 1; row N: after all drafts). The chain is a specdec tree of N + 1 nodes
(node 0 = root, node j + 1 = draft j) whose target rows are exactly ``target_probs``, so a single
:func:`specdec.ops.rejection_sample` decides it (a second one in the rare case described in
:func:`_stage_read_rows`); the draw after N accepted drafts comes from row N (FlashInfer's bonus
token). The draft rows are staged into the op's layout, which has a root row in front: only the
entries and the row the op reads.

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

import numpy as np
import torch

from specdec import ops
from specdec.compat.common import HOST_MAX, chain_parents, check_token_range, workspace
from specdec.sampling import mix_seed

__all__ = ["chain_speculative_sampling", "chain_speculative_sampling_uniform", "PagedMetadata", "dense_as_paged",
           "to_block_table", "kv_lens_to_metadata", "tree_mask_from_custom", "verify_attention_paged",
           "append_paged_kv_cache", "commit_paged_kv", "unpack_custom_mask", "BatchPrefillWithPagedKVCacheWrapper"]

_FN = "specdec.compat.flashinfer.chain_speculative_sampling"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INTS = (torch.int32, torch.int64)


def _fail(fn, arg, expected, got, exc=ValueError):
    raise exc(f"{fn}: {arg} must be {expected}, got {got}")


def _check(fn, arg, t, dtypes, shape):
    if not isinstance(t, torch.Tensor):
        _fail(fn, arg, "a torch.Tensor", type(t).__name__, TypeError)
    have = t.shape
    if len(have) != len(shape):
        _fail(fn, arg, f"{len(shape)}-D of shape {_shape(shape)}", f"shape {tuple(have)}")
    if t.dtype not in dtypes:
        _fail(fn, arg, " or ".join(str(d) for d in dtypes), str(t.dtype), TypeError)
    for want, got in zip(shape, have):
        if want is not None and want != got:
            _fail(fn, arg, f"of shape {_shape(shape)}", f"{tuple(have)}")


def _shape(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def _validate(fn, draft_probs, draft_token_ids, target_probs):
    _check(fn, "draft_probs", draft_probs, _FLOATS, (None, None, None))
    B, N, V = draft_probs.shape
    _check(fn, "draft_token_ids", draft_token_ids, _INTS, (B, N))
    _check(fn, "target_probs", target_probs, _FLOATS, (B, N + 1, V))
    if V < 1:
        _fail(fn, "draft_probs", "of vocabulary size >= 1", f"shape {tuple(draft_probs.shape)}")
    check_token_range(fn, "draft_token_ids", draft_token_ids, V)
    dev = draft_token_ids.device
    for arg, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if t.device != dev:
            _fail(fn, arg, f"on {dev} (draft_token_ids' device)", str(t.device))
    return B, N, V


def _in_unit(t):
    if t.is_cpu and t.numel() <= HOST_MAX:  # one host read and a bytecode scan cost less than a reduction
        return all(0.0 <= x <= 1.0 for row in t.tolist() for x in row)  # False for NaN
    lo, hi = (float(x) for x in torch.aminmax(t))
    return lo >= 0 and hi <= 1  # False for NaN


def _check_counter(fn, arg, t, B, dev):
    if t is None:
        return None
    _check(fn, arg, t, _INTS, (B,))
    if t.device != dev:
        _fail(fn, arg, f"on {dev}", str(t.device))
    return t


def _run(fn, draft_probs, draft_token_ids, target_probs, uniform_samples, acc_buf, emit_buf):
    B, N, V = draft_probs.shape
    dev = target_probs.device
    acc_buf = _check_counter(fn, "maybe_output_accepted_token_num", acc_buf, B, dev)
    emit_buf = _check_counter(fn, "maybe_output_emitted_draft_token_num", emit_buf, B, dev)
    if HOST_FORM and B and draft_token_ids.is_cpu and _host_ok(draft_probs, target_probs, uniform_samples):
        out, num, accepted = _decide_host(draft_probs, draft_token_ids.numpy(), target_probs, uniform_samples)
    else:
        out, num, accepted = _decide(draft_probs, draft_token_ids, target_probs, uniform_samples)
    if acc_buf is None:
        acc_buf = accepted if accepted.dtype == torch.int32 else accepted.to(torch.int32)
    else:
        acc_buf.add_(accepted.to(acc_buf.dtype))
    if emit_buf is None:
        emit_buf = num  # the op's own new tensor
    else:
        emit_buf.add_(num.to(emit_buf.dtype))
    return out.to(torch.int32), acc_buf, emit_buf


def _decide(draft_probs, draft_token_ids, target_probs, uniform_samples):
    """(out_tokens, num_accepted, accepted_num) by tensor operations (any device)."""
    B, N, V = draft_probs.shape
    dev = target_probs.device
    u_fi = uniform_samples.to(device=dev, dtype=torch.float64)
    d = draft_token_ids.to(torch.int64)
    # FlashInfer's independent test of every draft, in float32 (for accepted_num and for picking the
    # final uniform, which FlashInfer takes at index min(pos + 1, N)).
    q_d = torch.gather(draft_probs, 2, d[:, :, None])[:, :, 0].float()
    p_d = torch.gather(target_probs[:, :N], 2, d[:, :, None])[:, :, 0].float()
    passes = u_fi[:, :N].float() * q_d < p_d  # [B, N]
    pos_fi = passes.to(torch.int32).cumprod(1).sum(1)  # the first failing position, N if none fails
    final_u = torch.gather(u_fi, 1, torch.clamp(pos_fi + 1, max=N)[:, None])  # [B, 1]

    tokens = torch.empty(B, N + 1, dtype=torch.int64, device=dev)
    tokens[:, 0] = 0
    tokens[:, 1:] = d
    parents = chain_parents(B, N + 1, dev)
    p = target_probs.to(torch.float32).contiguous()
    u = torch.cat([final_u, u_fi[:, :N]], 1).contiguous()
    equal = False
    if not ops.strict_checks():
        q = _stage_read_rows(draft_probs, d, q_d, pos_fi)
        _, num, out = ops.rejection_sample(tokens, parents, p, q, u)
        equal = torch.equal(num.to(torch.int64), pos_fi)  # False: a decision at a float32 tie
    if not equal:  # stage every row
        q = _stage_all_rows(draft_probs)
        _, num, out = ops.rejection_sample(tokens, parents, p, q, u)

    pos = num.to(torch.int64)
    if equal:  # every position before pos passes and pos itself fails: the passes are the count
        accepted = passes.sum(1)
    else:
        accepted = pos + (passes & (torch.arange(N, device=dev)[None, :] > pos[:, None])).sum(1)
    return out, num, accepted


def _stage_all_rows(draft_probs):
    B, N, V = draft_probs.shape
    q = workspace("flashinfer.draft", (B, N + 1, V), torch.float32, draft_probs.device)  # row 0 (the root) unused
    q[:, 0] = 0.0
    q[:, 1:].copy_(draft_probs)
    return q


HOST_FORM = True  # CPU batches decided and staged through NumPy views (_decide_host); False: tensor form
_NUMPY_FLOATS = (torch.float32, torch.float16, torch.float64)


def _host_ok(*ts) -> bool:
    return all(t.is_cpu and t.dtype in _NUMPY_FLOATS and not t.requires_grad for t in ts)


def _decide_host(draft_probs, d, target_probs, uniform_samples):
    """:func:`_decide` for CPU tensors, with the same float32 test and the same staging done on NumPy
    views of the caller's tensors and of kept buffers: on a batch of a few requests each tensor
    operation costs several microseconds, most of them after the op has streamed its rows through
    the caches. ``d``: a NumPy view of the drafts [B, N]."""
    B, N, V = draft_probs.shape
    cpu = target_probs.device
    qv, uv = draft_probs.numpy(), uniform_samples.numpy()
    rows, cols, tok_t, tok, u_t, u = _host_buffers(B, N)
    q_d = qv[rows, cols, d].astype(np.float32, copy=False)
    p_d = target_probs.numpy()[rows, cols, d].astype(np.float32, copy=False)
    passes = uv[:, :N].astype(np.float32) * q_d < p_d  # FlashInfer's test, float32 as in _decide
    pl = [row.index(False) if False in row else N for row in passes.tolist()]  # the first failing position
    tok[:, 1:] = d
    u[:, 0] = [row[min(j + 1, N)] for row, j in zip(uv.tolist(), pl)]  # exact: float64 holds every value
    u[:, 1:] = uv[:, :N]
    p = target_probs if target_probs.dtype == torch.float32 and target_probs.is_contiguous() \
        else target_probs.to(torch.float32).contiguous()
    parents = chain_parents(B, N + 1, cpu)
    if not ops.strict_checks():  # the entries and rows the op reads, as _stage_read_rows
        q = workspace("flashinfer.draft_rows", (B, N + 1, V), torch.float32, cpu)
        qn = q.numpy()
        qn[rows, cols + 1, d] = q_d
        for b, j in enumerate(pl):
            if j < N:
                qn[b, j + 1] = qv[b, j]
        _, num, out = ops.rejection_sample(tok_t, parents, p, q, u_t)
        if num.tolist() == pl:  # the op stopped where FlashInfer's test did
            return out, num, torch.from_numpy(passes.sum(1, dtype=np.int32))
    _, num, out = ops.rejection_sample(tok_t, parents, p, _stage_all_rows(draft_probs), u_t)
    k = num.numpy().astype(np.int64)
    return out, num, torch.from_numpy(k + (passes & (np.arange(N)[None, :] > k[:, None])).sum(1))


_HOST: dict = {}


def _host_buffers(B: int, N: int):
    """Kept per (B, N): request and draft indices for NumPy gathers, and the op's tokens [B, N + 1]
    int64 (column 0, the root, 0) and uniforms [B, N + 1] float64 as tensors and NumPy views. Their
    contents are valid during one call: not for concurrent calls from several threads (like
    :func:`specdec.compat.common.workspace`)."""
    got = _HOST.get((B, N))
    if got is None:
        if len(_HOST) >= 64:
            _HOST.clear()
        tok_t = torch.zeros(B, N + 1, dtype=torch.int64)
        u_t = torch.zeros(B, N + 1, dtype=torch.float64)
        got = _HOST[(B, N)] = (np.arange(B)[:, None], np.arange(N)[None, :], tok_t, tok_t.numpy(), u_t, u_t.numpy())
    return got


def _stage_read_rows(draft_probs, d, q_d, pos_fi):
    """The draft rows the op reads when its decisions are FlashInfer's float32 ones, in the op's
    [B, N + 1, V] layout (node j + 1 = draft j): an accepted draft's test reads only its own entry
    ``q_j(d_j)``, and only the first rejected draft's whole row enters the residual. So those
    entries and that one row per request are staged (the other entries hold stale values and are
    never read); the caller checks that the op stopped where FlashInfer's test did, which proves
    the op read nothing else."""
    B, N, V = draft_probs.shape
    q = workspace("flashinfer.draft_rows", (B, N + 1, V), torch.float32, draft_probs.device)
    q[:, 1:].scatter_(2, d[:, :, None], q_d[:, :, None])
    rej = (pos_fi < N).nonzero().flatten()  # the requests whose chain stops at a rejection
    if rej.numel():  # one gather and one scatter of their rejected rows (no host read, no loop)
        j = pos_fi[rej].to(torch.int64)
        rows = draft_probs.reshape(B * N, V).index_select(0, rej * N + j)
        q.view(B * (N + 1), V).index_copy_(0, rej * (N + 1) + j + 1, rows.to(torch.float32))
    return q


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
    if uniform_samples.numel() and not _in_unit(uniform_samples):
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
                                             to_block_table, tree_mask_from_custom, unpack_custom_mask,
                                             verify_attention_paged)
from specdec.compat.flashinfer_wrapper import BatchPrefillWithPagedKVCacheWrapper  # noqa: E402  (re-exported)
