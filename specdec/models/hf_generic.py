"""The generic fallback path of :class:`~specdec.models.hf.HFCausalLM`: a model whose attention the hooks do not
reach runs its own attention over the static cache through a transformers cache bridge and a 4-D mask (full and,
for sliding-window layers, windowed visibility)."""
from __future__ import annotations

import torch

from specdec.models.hf_attention import AttentionCall, StaticCacheBridge, additive_mask, selects_positions, visibility

__all__ = ["forward_generic"]


def forward_generic(lm, call: AttentionCall, tokens: torch.Tensor, depths: torch.Tensor,
                    logits_to_keep) -> torch.Tensor:
    """HFCausalLM.forward on the generic fallback path: the model's own attention with a 4-D additive mask over
    the static cache (a bridge of StaticCacheBridge); one host read per call sizes the mask and the K/V views."""
    cache = call.cache
    B, N = tokens.shape
    off = call.kv_offset
    total = int(cache.lens.max()) + off + N  # host read: the generic path sizes its mask and K/V views
    dtype = lm.model.get_input_embeddings().weight.dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        dtype = lm.dtype
    layout = lm._generic_windows
    window = layout["window"]
    if window is not None and total <= window:
        window = None  # every position inside the window: the plain mask is exact for all layers
    if window is not None and off:
        raise ValueError(f"HFCausalLM.forward: kv_offset > 0 past the sliding window ({window}) is not "
                         f"supported on the generic path; draft with a chain or spine tree")
    full = additive_mask(visibility(cache.lens, depths, call.tree_mask, total, None), dtype)
    if window is None:
        mask = full
    else:
        sliding = additive_mask(visibility(cache.lens, depths, call.tree_mask, total, window), dtype)
        mask = {"full_attention": full, "sliding_attention": sliding} if layout["mixed"] else sliding
    positions = cache.lens.to(torch.long).unsqueeze(1) + depths.to(torch.long)
    kwargs = {}
    if selects_positions(logits_to_keep) and lm._keep_logits:
        kwargs["logits_to_keep"] = logits_to_keep
    bridge = StaticCacheBridge(cache, total, off)
    out = lm.model(input_ids=tokens.clamp(min=0), position_ids=positions, attention_mask=mask,
                   use_cache=True, **{lm._cache_kwarg: bridge}, **kwargs)
    return lm._select_logits(out.logits, logits_to_keep).float()
