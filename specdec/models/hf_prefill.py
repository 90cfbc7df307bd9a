"""HFCausalLM.prefill's machinery: argument checks, grouping ragged prompts by consecutive rows, and
one group's chunked forward (from a cached prefix when ``starts`` says so)."""
from __future__ import annotations

from typing import List

import torch

from specdec._check import out_of_vocab

__all__ = ["check_prefill", "prefill_groups", "prefill_group"]


def check_prefill(cache, prompts, rows, starts, vocab_size: int) -> None:
    if len(rows) != len(prompts) or len(starts) != len(prompts):
        raise ValueError(f"HFCausalLM.prefill: {len(prompts)} prompts but {len(rows)} rows and "
                         f"{len(starts)} starts")
    if len(set(rows)) != len(rows):
        raise ValueError(f"HFCausalLM.prefill: rows must be distinct, got {rows}")
    for i, (p, r) in enumerate(zip(prompts, rows)):
        if not 0 <= r < cache.batch:
            raise ValueError(f"HFCausalLM.prefill: row {r} of prompt {i} is outside the cache's {cache.batch} rows")
        if len(p) == 0:
            raise ValueError(f"HFCausalLM.prefill: prompt {i} is empty")
        if starts[i] < 0 or starts[i] + len(p) > cache.capacity:
            raise ValueError(f"HFCausalLM.prefill: prompt {i} has {len(p)} tokens after a start of {starts[i]}, "
                             f"outside the cache capacity {cache.capacity}")
        bad = out_of_vocab(p, vocab_size)
        if bad is not None:
            raise ValueError(f"HFCausalLM.prefill: prompt {i} holds token {bad}, outside [0, {vocab_size})")


def prefill_groups(prompts, rows) -> List[List[int]]:
    """Prompt indices grouped by consecutive cache rows, padding <= 25 % of the group's tokens."""
    groups: List[List[int]] = []
    for i in sorted(range(len(prompts)), key=lambda i: rows[i]):
        if groups:
            g = groups[-1]
            if rows[g[-1]] + 1 == rows[i]:
                lengths = [len(prompts[k]) for k in g] + [len(prompts[i])]
                if max(lengths) * len(lengths) <= 1.25 * sum(lengths):
                    g.append(i)
                    continue
        groups.append([i])
    return groups


def prefill_group(lm, cache, prompts, rows, starts, group, out) -> None:
    view = cache.rows(rows[group[0]], rows[group[-1]] + 1)
    lengths = [len(prompts[i]) for i in group]
    T = max(lengths)
    ids = torch.zeros(len(group), T, dtype=torch.long)
    for k, i in enumerate(group):
        ids[k, :lengths[k]] = torch.tensor(prompts[i], dtype=torch.long)
    ids = ids.to(lm.device)
    first = torch.tensor([starts[i] for i in group], dtype=torch.int32)
    view.lens.copy_(first)
    depths_all = torch.arange(T, device=lm.device).expand(len(group), T)
    for c0 in range(0, T, lm.prefill_chunk):
        c1 = min(T, c0 + lm.prefill_chunk)
        ending = [k for k, n in enumerate(lengths) if c0 < n <= c1]
        if ending:
            last = torch.tensor([[min(max(n - 1 - c0, 0), c1 - c0 - 1)] for n in lengths], dtype=torch.long,
                                device=lm.device)  # [g, 1] position whose logits we keep
            logits = lm._forward(view, ids[:, c0:c1], depths_all[:, : c1 - c0], None, logits_to_keep=last)
            idx = torch.tensor([group[k] for k in ending], device=lm.device)
            out[idx] = logits[ending, 0]
        else:
            lm._forward(view, ids[:, c0:c1], depths_all[:, : c1 - c0], None, logits_to_keep=1)
        view.lens.add_(c1 - c0)
    view.lens.copy_(first + torch.tensor(lengths, dtype=torch.int32))
