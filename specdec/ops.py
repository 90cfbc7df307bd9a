"""Typed wrappers of the compiled ops: the ONLY Python door to ``torch.ops.specdec``.

Each op is registered by ``specdec._C`` (C++ CPU kernels, CUDA kernels when built) and has a fake
(meta) implementation here so that ``torch.compile(fullgraph=True)`` and CUDA-graph capture can trace it. The pure-torch
oracle of every op is ``specdec.reference``.

Shape letters: B requests, N tree nodes per request (node 0 = root), V vocabulary,
Hq / Hkv query / KV heads, D head dim, S cache capacity, L layers.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Tuple

import torch

from specdec import _C  # noqa: F401  (loads the library that registers torch.ops.specdec)

__all__ = [
    "verify_attention",
    "append_kv",
    "rejection_sample",
    "greedy_verify",
    "kv_commit",
    "linear",
    "qlinear",
    "linear_argmax",
    "qlinear_argmax",
    "quantize_q8",
    "pack_q8act",
    "rms_norm",
    "add_rms_norm",
    "rope",
    "silu_mul",
    "decoder_layer",
    "quantize_weight_int8",
    "GROUP_FORMATS",
    "set_strict_checks",
    "strict_checks",
    "build_info",
]

_ops = torch.ops.specdec

#: the group-quantized weight formats of :func:`quantize_weight_groups` / :func:`qlinear` (GGUF's blocks of 32)
GROUP_FORMATS = ("q8_0", "q4_0", "q4_1")


def build_info() -> dict:
    """What the compiled module holds: ``cuda`` (bool), ``cuda_archs``, ``cuda_version``, ``torch_version``."""
    return dict(_C.build_info())


def set_strict_checks(on: bool) -> None:
    """Strict value checks: also validate tensor VALUES of CUDA inputs, and probabilities everywhere.

    The small integer/uniform inputs (cache_lens, tokens, parents, accepted,
    num_accepted, uniforms) of CPU ops are always value-checked. On CUDA those checks
    cost a device -> host copy and a synchronization per op, so they run only in strict
    mode (the kernels stay memory-safe for any value). Probability rows (NaN, inf,
    negative entries) cost a full pass over [B, N, V] and are checked only in strict
    mode, on both backends. Turn it on while debugging an integration.
    """
    _C.set_strict_checks(bool(on))


def strict_checks() -> bool:
    """Whether strict value checks are on."""
    return bool(_C.strict_checks())


@contextlib.contextmanager
def prefill_rows() -> Iterator[None]:
    """Within this block, on the calling thread, the CPU ``linear`` / ``qlinear`` / ``decoder_layer``
    projections take the GEMM tiles (csrc/include/specdec/cpu_gemm.h) at EVERY row count, not only
    above 64 rows (float32 weights up to 256 rows; BLAS above, as outside the block).

    For prompt prefill: the tiles are faster than the few-row kernels on short prompts with
    quantized weights (docs/benchmarks.md), and a row's result then depends neither on the
    prompt's length nor on the batch it is prefilled with. It differs in rounding from the few-row
    kernels, which decode steps and verify passes keep outside the block (a verify row equals a
    decode step bit for bit, which keeps greedy speculation token-exact); plain and speculative
    decoding share the prefill.
    :meth:`specdec.HFCausalLM.prefill` uses it. CUDA ops ignore it. Nests; restores on exit."""
    was = _C.set_cpu_prefill(True)
    try:
        yield
    finally:
        _C.set_cpu_prefill(was)


def verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_lens: torch.Tensor, tree_mask: Optional[torch.Tensor] = None,
                     scale: Optional[float] = None) -> torch.Tensor:
    """Attention of new (tree) nodes over a KV cache.

    The step has ``Nkv`` new nodes per request whose K/V sit at ``cache_lens[b] + j``,
    j < Nkv; the ``Nq`` queries are the LAST Nq of them (query i is new node
    ``Nkv - Nq + i``). ``Nkv = Nq`` (every new node queries: target verification) unless
    ``tree_mask`` is [B, Nq, Nkv] with Nkv > Nq: a dynamic draft tree expands its
    frontier that way, attending to ancestors drafted earlier in the same step without
    recomputing them.

    Parameters
    ----------
    q : Tensor [B, Nq, Hq, D], float16 / bfloat16 / float32
        Queries of the last Nq new nodes of each request.
    k_cache, v_cache : Tensor [B, Hkv, S, D], q's dtype, contiguous
        The caches. The new nodes' K/V must already sit at positions
        ``cache_lens[b] + j``, j < Nkv (see :func:`append_kv` and its ``offset``).
        Hq % Hkv == 0 (GQA).
    cache_lens : Tensor [B], int32
        Committed prefix length of each request; 0 <= cache_lens[b] <= S - Nkv.
    tree_mask : Tensor [B, Nq, Nkv], bool, optional (Nkv >= Nq)
        ``tree_mask[b, i, j]``: query i sees new node j. None means a causal chain
        with Nkv = Nq (j <= i). The prefix (positions < cache_lens[b]) is always
        visible and never materialised as a mask.
    scale : float, optional
        Softmax scale, default ``D ** -0.5``.

    Returns
    -------
    Tensor [B, Nq, Hq, D] in q's dtype. fp32 accumulation and softmax. A query that
    sees no key at all (empty prefix, all-false mask row) gets zeros.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _ops.verify_attention(q, k_cache, v_cache, cache_lens, tree_mask, float(scale))


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
              cache_lens: torch.Tensor, offset: int = 0) -> None:
    """Write the new nodes' K/V into the caches, in place.

    k_cache, v_cache : [B, Hkv, S, D]; k_new, v_new : [B, Hkv, N, D] (cache dtype);
    cache_lens : [B] int32, unchanged; offset : int >= 0, new nodes of this step already
    written (a dynamic draft tree's earlier depths).
    ``cache[b, :, cache_lens[b] + offset + j] = new[b, :, j]``.
    Requires 0 <= cache_lens[b] <= S - offset - N.
    """
    _ops.append_kv(k_cache, v_cache, k_new, v_new, cache_lens, int(offset))


def rejection_sample(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact speculative sampling over a token tree (SpecInfer multi-step sampling).

    Parameters
    ----------
    tokens : Tensor [B, N], int64
        Node tokens. Node 0 is the root (the last committed token, not checked).
        Padding nodes (parent -1 beyond the root) are ignored.
    parents : Tensor [B, N], int32
        ``parents[b, 0] == -1``; ``-1 <= parents[b, i] < i`` (topological order).
    target_probs : Tensor [B, N, V], float32, contiguous, V <= 2**20
        ``p`` after node i: the target's next-token distribution given the path to i,
        already warped (temperature / top-k / top-p). Rows need not be normalised.
        Entries that are NaN, infinite, zero or negative carry no mass (strict mode
        rejects NaN, inf and negative entries instead).
    draft_probs : Tensor [B, N, V], float32, optional
        ``q_i``: the distribution node i's token was drawn from (row 0 unused).
        Rows must be normalised (they are used as given: an unnormalised q skews
        the acceptance test). None: every node is a deterministic candidate (q
        one-hot on its token).
    uniforms : Tensor [B, N], float64 in [0, 1]
        ``uniforms[b, c]`` decides child c; ``uniforms[b, 0]`` the final draw.
        u = 1 is allowed: a child is then accepted only where p(x) > q(x), and the
        final draw returns the last token with positive mass.

    Semantics
    ---------
    A node's target row becomes integer masses (fixed point, exact): with M the row's
    largest entry and e its binary exponent (M = f * 2**e, 0.5 <= f < 1), entry x has
    mass m(x) = floor(x * 2**(42 - e)); Z = sum(m) is an exact integer (< 2**62). From
    the root, try the current node's children in index order: child c with token x
    is accepted iff ``q_c(x) > 0`` and ``(u_c * q_c(x)) * Z < m(x)`` in float64
    (i.e. u < p/q with p = m / Z); after a rejection m <- max(0, m - floor(Z * q_c))
    (deterministic candidates: m(x) <- 0). When no child is accepted (or the node is a
    leaf) one token is drawn by inverse CDF with ``u = uniforms[b, 0]``: the first
    index whose integer running sum of m exceeds ``min(floor(u * Z), Z - 1)`` (so
    u >= 1 gives the last token with mass). If the residual has zero mass (rounding
    only, as p == q accepts surely) the draw uses the node's own target row; if that
    too has zero mass, token 0. Sums are integers and every float64 operation is one
    correctly rounded product, so the reference, CPU and CUDA make the same decision
    on every input by construction (ties included), whatever order they add in.
    Scaling a target row by a power of two changes nothing. Resolution: 2**-41 of a
    row's largest entry.

    Returns
    -------
    accepted : Tensor [B, N], int32 — node indices of the accepted path, root first, -1 padded
    num_accepted : Tensor [B], int32 — accepted DRAFT nodes (root excluded)
    out_tokens : Tensor [B, N], int64 — accepted draft tokens then the drawn token, -1 padded
    """
    return _ops.rejection_sample(tokens, parents, target_probs, draft_probs, uniforms)


def greedy_verify(tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification.

    tokens [B, N] int64, parents [B, N] int32 as in :func:`rejection_sample`;
    target_logits [B, N, V] float32 / float16 / bfloat16 (any monotone transform of
    the target scores). From the root, accept the first child (index order) whose
    token equals the argmax at the current node (first maximal index; NaN counts as
    maximal, like ``torch.argmax``); stop when none does. Returns ``(accepted,
    num_accepted, out_tokens)`` as :func:`rejection_sample`; the last out token is
    the argmax at the last accepted node. target_logits may instead be int64 [B, N]: the
    argmax at each node already taken (e.g. by :func:`qlinear_argmax`), walked the same way.
    """
    return _ops.greedy_verify(tokens, parents, target_logits)


def kv_commit(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], cache_lens: torch.Tensor,
              accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Compact the accepted tree path in every layer's cache, in place.

    k_caches, v_caches : L tensors [B, Hkv, S, D] (same dtype, device, B and S);
    cache_lens : [B] int32, updated in place; accepted : [B, N] int32;
    num_accepted : [B] int32 (outputs of rejection_sample / greedy_verify).
    For every layer and request, position ``cache_lens[b] + i`` takes the K/V at
    ``cache_lens[b] + accepted[b, i]`` for i = 0..num_accepted[b] (root included),
    then ``cache_lens[b] += num_accepted[b] + 1``. Overlap-safe; identity moves
    (chains) cost nothing. Also rolls back a drafter's cache.
    """
    _ops.kv_commit(list(k_caches), list(v_caches), cache_lens, accepted, num_accepted)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           weight_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T (* weight_scale) (+ bias)`` for few-row activations (decode, tree verification).

    x : [..., K] float32 / float16 / bfloat16; weight : [N, K] of x's dtype, or int8 with
    weight_scale float32 [N] (weight-only quantisation, one scale per output row, see
    :func:`quantize_weight_int8`); bias : [N] of x's dtype. Returns [..., N] in x's dtype.
    Accumulates in float32 and rounds once. The kernels stream the weight from memory
    once for up to 32 rows of x (M = x.numel() / K): on CPU for M <= 64 (larger M with a
    float weight is compute-bound and goes to the BLAS GEMM; int8 weights always use the
    kernel), on CUDA for M <= 64 (larger M: cuBLAS, float32 accumulation whatever torch's TF32 /
    reduced-precision flags say; docs/ops.md). Up to 64 rows on both a row's bits do not depend
    on M (batch invariance, docs/gpu.md); cuBLAS above 64 rows on CUDA does not promise that.
    :func:`prefill_rows` takes the CPU GEMM tiles at every M.
    """
    return _ops.linear(x, weight, bias, weight_scale)


def qlinear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor] = None,
            bias: Optional[torch.Tensor] = None, bits: int = 4, act: Optional[str] = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with W group-quantized in groups of 32 inputs (the GGUF formats).

    x : [..., K] float32 / float16 / bfloat16, K % 32 == 0.
    bits = 8 (Q8_0): qweight int8 [N, K]; W[n, k] = d * q.
    bits = 4: qweight uint8 [N, K / 2], byte j of group g holding element 32 g + j in its low
    nibble and 32 g + j + 16 in its high nibble (GGUF order); with ``mins`` (Q4_1)
    W = d * q + m, without (Q4_0) W = d * (q - 8).
    scales, mins : float16 [N, K / 32] (d, m per output row and group); bias : [N], x's dtype.
    Returns [..., N] in x's dtype; float32 accumulation, one rounding. The weight is streamed
    once for all M = x.numel() / K rows (CPU: the kernel for every M, 32 rows per pass over the
    weight; CUDA: the kernel for M <= 64, batch-invariant like linear's, cuBLAS on the
    dequantized float32 weight above).
    See :func:`quantize_weight_groups`.

    act = "q8" (opt-in, a different model): x quantized per row and block of 32 to int8 (:func:`quantize_q8`),
    integer dots with the weight codes (llama.cpp's Q8 scheme); exact definition in docs/ops.md: every form
    and CPU tier gives the same bits, a row's result independent of M. On the CPU ``qweight`` may be
    :func:`pack_q8act`'s layout of the weight (the CPU tiers' own; the usual layout is packed per call).
    """
    if act is None:
        return _ops.qlinear(x, qweight, scales, mins, bias, int(bits))
    if act != "q8":
        raise ValueError(f"qlinear: act must be None (float activations) or 'q8' (quantized activations), got {act!r}")
    return _ops.qlinear_q8act(x, qweight, scales, mins, bias, int(bits))


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  weight_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.argmax(linear(x, weight, bias, weight_scale), dim=-1)``, int64 [...]: the first index of each
    row's maximum of :func:`linear`'s result (x's dtype; a NaN counts as the maximum, the first one wins), the
    same integers bit for bit. A greedy row needs only this: on the CPU, at decode / verify sizes (<= 64 rows),
    the vocabulary goes in slabs of 1,024 columns through linear's own kernel into a small buffer and the
    [M, N] logits are never written; CUDA materialises them and takes one block per row. N >= 1.
    """
    return _ops.linear_argmax(x, weight, bias, weight_scale)


def qlinear_argmax(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None, bits: int = 4, act: Optional[str] = None) -> torch.Tensor:
    """``torch.argmax(qlinear(x, qweight, scales, mins, bias, bits, act), dim=-1)``, int64 [...], as
    :func:`linear_argmax` does for :func:`linear` (act="q8": the quantized-activation product, the CPU's packed
    weight taking the slabs up to 64 rows)."""
    if act not in (None, "q8"):
        raise ValueError(f"qlinear_argmax: act must be None (float activations) or 'q8' (quantized activations), "
                         f"got {act!r}")
    return _ops.qlinear_argmax(x, qweight, scales, mins, bias, int(bits), act == "q8")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as transformers' LlamaRMSNorm computes it:
    ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` with x32 = x in float32.

    x : [..., H] float32 / float16 / bfloat16; weight : [H] of x's dtype; eps >= 0.
    One call instead of ~6 torch calls; float32 within rounding of the reference.
    """
    return _ops.rms_norm(x, weight, float(eps))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one call: ``s = x + residual`` (rounded to x's dtype,
    as torch's add), returns ``(rms_norm(s, weight, eps), s)``. residual : like x."""
    return _ops.add_rms_norm(x, residual, weight, float(eps))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q and k in one call: ``x * cos + rotate_half(x) * sin``.

    q : [B, N, Hq, D], k : [B, N, Hkv, D], cos / sin : [B, N, D] (the model's own rotary
    tables at each token's position, any rope_type), one float dtype, D even. Each product
    and the sum round to the dtype as torch's do: the result is bit-identical to
    :func:`specdec.reference.rope` on every backend. Returns new (q, k).
    """
    return _ops.rope(q, k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU), one call; silu rounds to the dtype before the product, as torch's."""
    return _ops.silu_mul(gate, up)


def decoder_layer(x: torch.Tensor, h: torch.Tensor, weights: Sequence[torch.Tensor],
                  scales: Sequence[Optional[torch.Tensor]], mins: Sequence[Optional[torch.Tensor]],
                  biases: Sequence[Optional[torch.Tensor]], bits: Sequence[int], post_norm_weight: torch.Tensor,
                  post_norm_eps: float, next_norm_weight: torch.Tensor, next_norm_eps: float,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, tree_mask: Optional[torch.Tensor], kv_offset: int, scale: float,
                  num_heads: int, num_kv_heads: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """One Llama-style decoder layer in one call: the sequence of the ops above, run from C++.

    x : [B, N, H] the layer's normed input (its input_layernorm already applied); h : [B, N, H]
    the residual stream, x's dtype. Projections: 7 slots (q, k, v, o, gate, up, down) or 4
    (qkv, o, gate_up, down: q / k / v and gate / up concatenated along the output features,
    in that order). Slot i is ``linear(x, weights[i], biases[i], scales[i])`` when
    ``bits[i] == 0`` (float weight, or int8 with a per-row scale) and
    ``qlinear(x, weights[i], scales[i], mins[i], biases[i], bits[i])`` for bits 4 / 8 (36 / 40: act="q8").
    The layer::

        q, k, v = proj(x);  q, k = rope(q, k, cos, sin)          (heads of D = k_cache.shape[-1])
        append_kv(k_cache, v_cache, k, v, cache_lens, kv_offset)
        a = verify_attention(q, k_cache, v_cache, cache_lens, tree_mask, scale)
        x, h = add_rms_norm(o(a), h, post_norm_weight, post_norm_eps)
        x, h = add_rms_norm(down(silu_mul(gate(x), up(x))), h, next_norm_weight, next_norm_eps)

    Returns ``(x, h)``: the NEXT layer's normed input (``next_norm_weight`` is its
    input_layernorm, or the model's final norm) and the residual stream. The results are those
    of the separate ops, bit for bit (same kernels, same order). Every argument is checked
    before the caches are written; errors name the projection slot. The five projection
    arguments are sequences (lists or tuples) of one entry per slot.
    """
    return _decoder_layer(x, h, weights, scales, mins, biases, bits, post_norm_weight, float(post_norm_eps),
                          next_norm_weight, float(next_norm_eps), k_cache, v_cache, cache_lens, cos, sin, tree_mask,
                          int(kv_offset), float(scale), int(num_heads), int(num_kv_heads))


# the overload itself, not the packet: it skips the overload resolution on every call (once per layer and forward)
_decoder_layer = _ops.decoder_layer.default


def quantize_weight_groups(weight: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Group-quantize a float [N, K] weight (K % 32 == 0) for :func:`qlinear`, llama.cpp's rules.

    fmt "q8_0": d = max|w| / 127 per group (stored as float16), q = round(w / d) in [-127, 127].
    fmt "q4_1": m = min(w), d = (max(w) - m) / 15 (float16 both), q = round((w - m) / d) in [0, 15].
    fmt "q4_0": d = w_absmax_signed / -8 (the signed value of largest magnitude), q = round(w / d) + 8
    clamped to [0, 15]. The rounding uses the float16-rounded d and m, so that the stored
    format reproduces its own dequantization. Returns (qweight, scales, mins or None).
    """
    if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[1] % 32:
        raise ValueError(f"quantize_weight_groups: weight must be a floating [N, K] tensor with K % 32 == 0, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if fmt not in GROUP_FORMATS:
        raise ValueError(f"quantize_weight_groups: fmt must be 'q8_0', 'q4_0' or 'q4_1', got {fmt!r}")
    N, K = weight.shape
    w = weight.detach().float().reshape(N, K // 32, 32)
    safe = lambda d: torch.where(d == 0, torch.ones_like(d), d)  # noqa: E731
    if fmt == "q8_0":
        d = (w.abs().amax(-1) / 127.0).half()
        q = torch.round(w / safe(d.float())[..., None]).clamp_(-127, 127).to(torch.int8)
        return q.reshape(N, K).contiguous(), d.contiguous(), None
    if fmt == "q4_1":
        lo, hi = w.amin(-1), w.amax(-1)
        m = lo.half()
        d = ((hi - m.float()) / 15.0).half()
        q = torch.round((w - m.float()[..., None]) / safe(d.float())[..., None]).clamp_(0, 15)
        mins = m.contiguous()
    else:
        idx = w.abs().argmax(-1, keepdim=True)
        d = (torch.gather(w, -1, idx)[..., 0] / -8.0).half()
        q = (torch.round(w / safe(d.float())[..., None]) + 8).clamp_(0, 15)
        mins = None
    q = q.to(torch.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(N, K // 2).contiguous()
    return packed, d.contiguous(), mins


def quantize_weight_int8(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8 quantisation of a [N, K] weight for :func:`linear`.

    scale[n] = max|W[n]| / 127 (1 where the row is all zeros); q = round(W / scale)
    clamped to [-127, 127]. Returns (q int8 [N, K], scale float32 [N]).
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight_int8: weight must be a floating [N, K] tensor, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


from specdec import ops_fake  # noqa: E402,F401  (the fake impls of the ops above, for torch.compile / meta)
from specdec.ops_q8act import pack_q8act, quantize_q8  # noqa: E402  (the act="q8" helpers and their fake impls)
