"""Argument checks and sampling-metadata handling shared by the compat modules.

Every error names the calling function, the argument, what was expected and what came.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["fail", "check_tensor", "check_token_range", "FLOATS", "INTS", "resolve_sampling", "ragged_counts",
           "ragged_drafts", "draw_uniforms", "workspace", "chain_parents"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTS = (torch.int32, torch.int64)


def fail(fn: str, arg: str, expected: str, got: str, exc=ValueError):
    raise exc(f"{fn}: {arg} must be {expected}, got {got}")


def check_tensor(fn: str, arg: str, t, ndim: int, dtypes, shape: Optional[Sequence[Optional[int]]] = None) -> None:
    """``t`` is a tensor of ``ndim`` dims, one of ``dtypes``, and matches ``shape`` (None = any size)."""
    if not isinstance(t, torch.Tensor):
        fail(fn, arg, "a torch.Tensor", type(t).__name__, TypeError)
    got = t.shape  # each tensor attribute read is a call: the shape is read once
    if len(got) != ndim:
        fail(fn, arg, f"{ndim}-D", f"shape {tuple(got)}")
    if t.dtype not in dtypes:
        fail(fn, arg, " or ".join(str(d) for d in dtypes), str(t.dtype), TypeError)
    if shape is not None:
        for i, (want, have) in enumerate(zip(shape, got)):
            if want is not None and want != have:
                exp = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                fail(fn, arg, f"of shape {exp}", f"{tuple(got)} (dim {i})")


def ragged_counts(fn: str, num_draft_tokens, cu_num_draft_tokens: torch.Tensor, num_tokens: int) -> list:
    """Validate vLLM's ragged bookkeeping; returns ``num_draft_tokens`` as a list of ints."""
    if isinstance(num_draft_tokens, torch.Tensor):
        num_draft_tokens = num_draft_tokens.tolist()
    if not isinstance(num_draft_tokens, (list, tuple)):
        fail(fn, "num_draft_tokens", "a list of ints", type(num_draft_tokens).__name__, TypeError)
    n = list(num_draft_tokens)
    want, total = [], 0  # the inclusive cumsum, and the checks, in one pass of plain bytecode
    for x in n:
        if type(x) is not int or x < 0:
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                fail(fn, "num_draft_tokens", "non-negative ints", repr(n))
            x = int(x)  # an int subclass: counted by value
        total += x
        want.append(total)
    if total != num_tokens:
        fail(fn, "num_draft_tokens", f"summing to num_tokens = {num_tokens} (draft_token_ids' length)",
             f"sum {total}")
    check_tensor(fn, "cu_num_draft_tokens", cu_num_draft_tokens, 1, INTS, (len(n),))
    got = cu_num_draft_tokens.tolist()  # one host read, compared in Python
    if got != want:
        fail(fn, "cu_num_draft_tokens", f"the inclusive cumsum of num_draft_tokens {want}", str(got))
    return n


def ragged_drafts(fn: str, draft_token_ids: torch.Tensor, num_draft_tokens, cu_num_draft_tokens: torch.Tensor,
                  max_spec_len) -> tuple:
    """vLLM's ragged draft arguments checked: (num_tokens, per-request counts, batch, most drafts, output width
    ``max_spec_len + 1``)."""
    check_tensor(fn, "draft_token_ids", draft_token_ids, 1, INTS)
    T = draft_token_ids.shape[0]
    n = ragged_counts(fn, num_draft_tokens, cu_num_draft_tokens, T)
    S = max(n) if n else 0
    if isinstance(max_spec_len, bool) or not isinstance(max_spec_len, int) or max_spec_len < S:
        fail(fn, "max_spec_len", f"an int >= max(num_draft_tokens) = {S}", repr(max_spec_len))
    return T, n, len(n), S, max_spec_len + 1


HOST_MAX = 2048  # a CPU tensor up to this size is checked as a Python list (cheaper than a tensor op)


def check_token_range(fn: str, arg: str, t: torch.Tensor, V: int) -> Optional[list]:
    """Every entry of the integer tensor ``t`` is a token id in [0, V).

    A non-empty CPU tensor of at most ``HOST_MAX`` entries is read once as a Python list and checked
    there (right after an op has streamed its rows through the caches, each tensor or NumPy
    operation costs microseconds; one host read and two list scans cost less); the flat list is
    returned for the caller to reuse. Otherwise one reduction (NumPy on the CPU, torch elsewhere)
    and None."""
    shape = t.shape
    n = shape.numel()
    if not n:
        return None
    if t.is_cpu:
        if n <= HOST_MAX:
            dim = len(shape)
            vals = t.tolist() if dim == 1 else [x for row in t.tolist() for x in row] if dim == 2 \
                else t.reshape(-1).tolist()
            if min(vals) >= 0 and max(vals) < V:
                return vals
            fail(fn, arg, f"token ids in [0, {V})", f"values in [{min(vals)}, {max(vals)}]")
        vals = t.numpy()
        unsigned = _UNSIGNED.get(vals.dtype.itemsize) if vals.dtype.kind == "i" else None
        if unsigned is not None and int(vals.view(unsigned).max()) < V:  # one reduction: negatives wrap high
            return None
        lo, hi = int(vals.min()), int(vals.max())
    else:
        lo, hi = (int(x) for x in torch.aminmax(t))
    if lo < 0 or hi >= V:
        fail(fn, arg, f"token ids in [0, {V})", f"values in [{lo}, {hi}]")
    return None


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def resolve_sampling(fn: str, sampling_metadata, B: int, device: torch.device
                     ) -> Tuple[torch.Tensor, Dict[int, torch.Generator], int]:
    """vLLM's ``SamplingMetadata`` (or a bare temperature tensor) -> (greedy mask [B] bool,
    generators, number of greedy rows). A batch of one kind of row gets a kept constant mask:
    callers only read it.

    Accepts an object with vLLM's attributes ``temperature`` ([B] float or None), ``all_greedy``,
    ``all_random`` and ``generators`` (dict: batch index -> torch.Generator), or a [B] float
    temperature tensor. A row is greedy when its temperature is <= 0: vLLM marks greedy rows with
    ``GREEDY_TEMPERATURE``, -1 in older v1 releases and 0 in newer ones; both are <= 0.
    """
    if isinstance(sampling_metadata, torch.Tensor):
        temperature, generators, all_greedy, all_random = sampling_metadata, {}, False, False
    else:
        for attr in ("temperature", "all_greedy", "all_random"):
            if not hasattr(sampling_metadata, attr):
                fail(fn, "sampling_metadata", "a temperature tensor or an object with vLLM's temperature / "
                     "all_greedy / all_random / generators attributes", f"{type(sampling_metadata).__name__} "
                     f"without {attr!r}", TypeError)
        temperature = sampling_metadata.temperature
        generators = dict(getattr(sampling_metadata, "generators", None) or {})
        all_greedy, all_random = bool(sampling_metadata.all_greedy), bool(sampling_metadata.all_random)
    if all_greedy:
        return _const_mask(B, True, device), generators, B
    if all_random and temperature is None:
        return _const_mask(B, False, device), generators, 0
    check_tensor(fn, "temperature", temperature, 1, FLOATS, (B,))
    for b in generators:
        if not isinstance(b, int) or not 0 <= b < B:
            fail(fn, "generators", f"keyed by batch indices in [0, {B})", f"key {b!r}")
    if B == 0:
        return _const_mask(B, False, device), generators, 0
    if temperature.is_cpu and B <= HOST_MAX:
        n_greedy = 0
        for x in temperature.tolist():
            if x <= 0:  # NaN: not greedy (NaN <= 0 is False)
                n_greedy += 1
    else:
        lo, hi = (float(x) for x in torch.aminmax(temperature))  # one reduction tells the common one-kind batches
        n_greedy = B if hi <= 0 else 0 if lo > 0 else -1
    if n_greedy in (0, B):  # one kind of row: the mask is a constant
        return _const_mask(B, n_greedy == B, device), generators, n_greedy
    greedy = (temperature <= 0).to(device)
    return greedy, generators, n_greedy if n_greedy >= 0 else int(greedy.sum())


_MASKS: Dict[Tuple[int, bool, torch.device], torch.Tensor] = {}


def _const_mask(B: int, value: bool, device: torch.device) -> torch.Tensor:
    """A kept ``[B]`` bool tensor of ``value`` (callers only read it)."""
    key = (B, value, device)
    t = _MASKS.get(key)
    if t is None:
        if len(_MASKS) >= 256:
            _MASKS.clear()
        t = _MASKS[key] = torch.full((B,), bool(value), dtype=torch.bool, device=device)
    return t


def draw_uniforms(B: int, N: int, counts: Sequence[int], device: torch.device,
                  generator: Optional[torch.Generator], generators: Dict[int, torch.Generator]) -> torch.Tensor:
    """[B, N] float64 uniforms: from ``generator`` (or torch's default); a row with its own
    generator draws its N values from it, and only when it has drafts (``counts[b] > 0``), so a
    seeded request's stream does not move on steps without drafts (as in vLLM)."""
    gdev = generator.device if generator is not None else device
    u = torch.rand(B, N, dtype=torch.float64, device=gdev, generator=generator).to(device)
    for b, g in generators.items():
        if counts[b] > 0:
            u[b] = torch.rand(N, dtype=torch.float64, device=g.device, generator=g).to(device)
    return u


_PARENTS: Dict[Tuple[int, int, torch.device], torch.Tensor] = {}


def chain_parents(B: int, N: int, device: torch.device) -> torch.Tensor:
    """``[B, N]`` int32 parents of B chains of N nodes (node i's parent i - 1, the root's -1), kept per
    (B, N, device): the ops only read it. Callers must not write to it."""
    key = (B, N, device)
    t = _PARENTS.get(key)
    if t is None:
        if len(_PARENTS) >= 256:  # shapes vary with the batch; keep the cache bounded
            _PARENTS.clear()
        t = (torch.arange(N, dtype=torch.int32, device=device) - 1).expand(B, N).contiguous()
        _PARENTS[key] = t
    return t


_WORKSPACES: Dict[tuple, list] = {}


def workspace(name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable scratch tensor of ``shape`` (contents undefined), kept per (name, device, dtype).

    The adapters stage padded copies of a stack's tensors here instead of allocating them per call:
    a fresh multi-megabyte allocation costs its page faults on every call, a kept one does not
    (FlashInfer keeps its workspaces the same way). The view of each shape asked for is kept too,
    so a repeated shape costs a dictionary lookup (no tensor operation). A new buffer starts zeroed;
    afterwards it holds whatever its last user wrote. Not for concurrent calls from several threads.
    """
    shape = tuple(shape)
    key = (name, device, dtype)
    entry = _WORKSPACES.get(key)  # [buffer, {shape: view of it}]
    if entry is not None:
        view = entry[1].get(shape)
        if view is not None:
            return view
    numel = 1
    for s in shape:
        numel *= int(s)
    if entry is None or entry[0].numel() < numel:
        entry = _WORKSPACES[key] = [torch.zeros(max(numel, 1), dtype=dtype, device=device), {}]
    views = entry[1]
    if len(views) >= 16:  # shapes vary with the batch; keep the views bounded
        views.clear()
    view = views[shape] = entry[0][:numel].view(*shape)
    return view
