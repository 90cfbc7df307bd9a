"""Logits -> warped probabilities, and the random numbers of a generate call.

Warping is what plain sampling does (the order and the rules of transformers'
``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper``):

1. divide by the temperature;
2. top-k: keep the tokens whose logit is >= the k-th largest (ties at the boundary kept);
3. top-p: sort ascending, drop the tokens whose cumulative probability is <= 1 - top_p
   (the most likely token is always kept);
4. softmax.

The speculative loop applies exactly this function to the target logits (p) and, when a
draft model samples, to the draft logits (q), and plain decoding (``drafter=None``)
draws from the same p: plain and speculative sampling share one definition.

Everything runs in place on a float32 tensor the caller owns (the logits a forward
just returned, or a row of a preallocated buffer), so a decoding step allocates no
[B, N, V] temporaries beyond what top-p sorting needs. No Python loop touches the
vocabulary. Uniforms for ``rejection_sample`` are float64 (the op compares
``u * q(x) * Z < r(x)`` and scans an inverse CDF in float64; float32 uniforms would
quantise the draw to 2^-24 and bias tokens whose mass sits below that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec import ops
from specdec._check import is_number, require_int

__all__ = ["SamplingParams", "warp_", "warp", "make_generator", "draw_uniforms", "sample_tokens", "mix_seed",
           "coupled_noise", "coupled_tree_noise", "step_uniforms", "verify_rows"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature == 0 means greedy (argmax; top_k / top_p are ignored)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not is_number(self.temperature):
            raise TypeError(f"temperature must be a float, got {type(self.temperature).__name__}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        require_int("", "top_k", self.top_k, lo=0, hint=" (0 = off)")
        if not is_number(self.top_p):
            raise TypeError(f"top_p must be a float, got {type(self.top_p).__name__}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn float32 logits [..., V] into warped probabilities IN PLACE and return them.

    Rows are normalised (sum 1). ``params`` must be a sampling (non-greedy) setting.
    The tensor may be a non-contiguous view as long as its last dimension is dense.
    """
    if logits.dtype != torch.float32:
        raise TypeError(f"warp_: logits must be float32, got {logits.dtype}")
    if params.greedy:
        raise ValueError("warp_: temperature 0 is greedy decoding; there is nothing to warp")
    x = logits
    V = x.shape[-1]
    if params.temperature != 1.0:
        x.div_(params.temperature)
    top_k = params.top_k if 0 < params.top_k < V else 0
    if top_k:
        # [..., k] sorted descending; the k-th value is the threshold (ties kept, like transformers)
        vals, idx = torch.topk(x, top_k, dim=-1)
        x.masked_fill_(x < vals[..., -1:], -math.inf)
        if params.top_p < 1.0:
            # After top-k only these k logits are finite: top-p needs to sort just them.
            vals = vals.flip(-1)  # ascending
            idx = idx.flip(-1)
            _top_p_(x, vals, idx, params.top_p)
    elif params.top_p < 1.0:
        vals, idx = torch.sort(x, dim=-1)  # ascending
        _top_p_(x, vals, idx, params.top_p)
    # softmax in place: exp(x - max) / sum
    x.sub_(x.amax(dim=-1, keepdim=True)).exp_()
    x.div_(x.sum(dim=-1, keepdim=True))
    return x


def _top_p_(x: torch.Tensor, sorted_vals: torch.Tensor, sorted_idx: torch.Tensor, top_p: float) -> None:
    """transformers' TopPLogitsWarper on ascending (values, indices); writes -inf into x."""
    cum = torch.softmax(sorted_vals, dim=-1).cumsum_(dim=-1)
    remove = cum <= (1.0 - top_p)
    remove[..., -1] = False  # keep at least the most likely token
    x.scatter_(-1, sorted_idx, sorted_vals.masked_fill(remove, -math.inf))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Out-of-place :func:`warp_` (float32 copy of the logits)."""
    return warp_(logits.to(torch.float32, copy=True), params)


def make_generator(seed: Optional[int], device: torch.device | str) -> torch.Generator:
    """A torch.Generator on ``device`` seeded with ``seed`` (None: a fresh nondeterministic seed)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def draw_uniforms(batch: int, nodes: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[batch, nodes] float64 uniforms in [0, 1) for ``rejection_sample``."""
    return torch.rand(batch, nodes, dtype=torch.float64, device=device, generator=generator)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs [b, V] (normalised) -> int64 [b]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def mix_seed(seed: int, salt: int) -> int:
    """A 63-bit seed derived from (seed, salt) by splitmix64: request i of a seeded generate call, the
    noise of sequence position t of a seed-coupled engine request."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(salt) * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


# ---------------------------------------------------------------------- verification of a step


def coupled_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """[V] float32 Gumbel noise of a seed-coupled request at one sequence position: a function of
    (seed, position) only, so the Gumbel-max draw argmax(log p + noise) is the same token whatever
    drafted it and whatever else shared the batch."""
    g = torch.Generator()
    g.manual_seed(mix_seed(seed, position))
    u = torch.rand(vocab_size, dtype=torch.float64, generator=g).clamp_(min=1e-300)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def coupled_tree_noise(depths: Sequence[Sequence[int]], coupled: Sequence[Tuple[int, int]],
                       vocab_size: int) -> torch.Tensor:
    """[rows, N, V] float32 noise for seed-coupled rows: node i of row j (at depth ``depths[j][i]``)
    gets the noise of the sequence position it predicts, ``coupled[j] = (seed, length)`` giving
    the row's seed and its current length (the root's prediction is position ``length``)."""
    N = len(depths[0]) if depths else 0
    out = torch.empty(len(depths), N, vocab_size, dtype=torch.float32)
    for j, (seed, base) in enumerate(coupled):
        seen: Dict[int, torch.Tensor] = {}
        for i, d in enumerate(depths[j]):
            noise = seen.get(d)
            if noise is None:
                noise = seen[d] = coupled_noise(seed, base + d, vocab_size)
            out[j, i] = noise
    return out


def step_uniforms(generators: Sequence[Optional[torch.Generator]], nodes: int, draws: int,
                  device: torch.device) -> torch.Tensor:
    """[b, nodes] float64 uniforms for ``rejection_sample``: each sampled row draws ``draws`` (>= nodes)
    uniforms from its own generator every step, whatever the tree's size, so a request's random
    stream does not depend on the rest of the batch; rows without a generator get zeros."""
    M = max(draws, nodes)
    rows = [torch.rand(M, dtype=torch.float64, generator=g) if g is not None else torch.zeros(M, dtype=torch.float64)
            for g in generators]
    return torch.stack(rows)[:, :nodes].to(device)


def verify_rows(tree, logits: torch.Tensor, q: Optional[torch.Tensor], settings: Sequence[SamplingParams],
                coupled: Sequence[Optional[Tuple[int, int]]], generators: Sequence[Optional[torch.Generator]],
                draws: int):
    """Verify a step's tree with each row under its own setting -> ``(accepted, num_accepted, out)``.

    ``settings[r]``: row r's sampling setting; ``coupled[r]``: ``(seed, length)`` for a seed-coupled
    row, else None; ``generators[r]``: the CPU generator of a sampled, uncoupled row; ``draws``: the
    uniforms each sampled row consumes per step (:func:`step_uniforms`).

    When every row shares one uncoupled setting, the op of that setting runs: ``greedy_verify``, or
    ``warp_`` + ``rejection_sample``. Otherwise each sampled setting's rows are warped with their own
    temperature / top-k / top-p, greedy and seed-coupled rows get the one-hot row of their argmax
    (seed-coupled: of the Gumbel-max draw of the node's position), and one ``rejection_sample``
    decides every row; on a one-hot target row it accepts exactly the matching child and draws the
    argmax, the decisions of ``greedy_verify``. ``logits`` is overwritten (warped in place).
    """
    first = settings[0]
    same = all(s == first for s in settings) and not any(c is not None for c in coupled)
    if same and first.greedy:
        return ops.greedy_verify(tree.tokens, tree.parents, logits)
    if same:
        p = warp_(logits, first)  # [b, N, V], in place on the logits the forward returned
    else:
        p = logits
        groups: Dict[Tuple[SamplingParams, bool], List[int]] = {}
        for r, (s, c) in enumerate(zip(settings, coupled)):
            groups.setdefault((s, c is not None), []).append(r)
        for (sp, is_coupled), rows in groups.items():
            idx = torch.tensor(rows, dtype=torch.int64, device=p.device)
            part = p.index_select(0, idx)
            if is_coupled:  # the Gumbel-max draw of every node's position, as a one-hot row
                warp_(part, sp)
                depths = tree.depths.index_select(0, torch.tensor(rows, dtype=torch.int64,
                                                                  device=tree.depths.device)).tolist()
                noise = coupled_tree_noise(depths, [coupled[r] for r in rows], p.shape[-1])
                part = part.log_().add_(noise.to(p.device))
            if sp.greedy or is_coupled:  # one-hot at the argmax (first max; NaN counts as max, like greedy_verify)
                arg = part.argmax(dim=-1, keepdim=True)
                part = torch.zeros_like(part).scatter_(-1, arg, 1.0)
            else:
                warp_(part, sp)
            p.index_copy_(0, idx, part)
    u = step_uniforms(generators, tree.size, draws, p.device)
    return ops.rejection_sample(tree.tokens, tree.parents, p, q, u)
