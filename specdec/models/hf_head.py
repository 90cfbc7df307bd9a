"""The LM head apart from the pass, for greedy verification (a mixin of :class:`specdec.models.hf.HFCausalLM`).

The lean forward's head is one of specdec's batch-invariant ops, so a pass may stop before it
(:meth:`HeadForwards.forward_hidden`) and the head then run on any subset of the rows
(:meth:`HeadForwards.head_logits`, the bits the whole pass gives them), or give only each row's argmax
(:meth:`HeadForwards.head_argmax`: ``ops.qlinear_argmax`` / ``ops.linear_argmax``, no logits written).
:mod:`specdec.lazy_verify` and the Engine's greedy steps use them.
"""
from __future__ import annotations

from typing import Optional

import torch

from specdec.cache import StaticKVCache


class HeadForwards:
    """Headless forwards and the LM head on chosen rows. The host class provides ``_runner`` (the lean forward or
    None), ``device``, ``lazy_verify`` / ``argmax_head`` (switches), ``_check_call`` and ``_forward``."""

    @property
    def lazy_head(self) -> bool:
        """Whether :meth:`forward_hidden` + :meth:`head_logits` may stand for :meth:`forward`: the lean forward on
        the CPU with a batch-invariant LM head (``ops.linear`` / ``ops.qlinear``), so the logits of any subset of a
        pass's rows (up to 64) are the bits the whole pass gives them. A greedy verification then computes the
        head only along the accepted path (:mod:`specdec.lazy_verify`); ``lazy_verify = False`` turns that off."""
        r = self._runner
        return self.lazy_verify and r is not None and r.head_batch_invariant and self.device.type == "cpu"

    @torch.no_grad()
    def forward_hidden(self, cache: StaticKVCache, tokens: torch.Tensor, depths: torch.Tensor,
                       tree_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`forward` without the LM head: the final normed hidden states [B, N, H] (model dtype), whose rows
        :meth:`head_logits` turns into the logits forward returns (needs :attr:`lazy_head`)."""
        if not self.lazy_head:
            raise ValueError("HFCausalLM.forward_hidden: needs the lean forward on the CPU with a batch-invariant LM "
                             "head and lazy_verify on (see HFCausalLM.lazy_head)")
        self._check_call(cache, tokens, depths, tree_mask, 0)
        return self._forward(cache, tokens, depths, tree_mask, logits_to_keep=0, head=False)

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [M, V] of hidden rows [M, H] from :meth:`forward_hidden` (the LM head, as forward runs it)."""
        return self._runner.lm_head(hidden).float()

    @torch.no_grad()
    def head_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """``torch.argmax(head_logits(hidden), -1)``, int64 [M], by the head's argmax op (needs :attr:`greedy_head`)."""
        if self._runner is None or self._runner.head_argmax is None:
            raise ValueError("HFCausalLM.head_argmax: needs the lean forward with an LM head that has an argmax op "
                             "(ops.linear_argmax / ops.qlinear_argmax; see HFCausalLM.greedy_head)")
        return self._runner.head_argmax(hidden)

    @property
    def greedy_head(self) -> bool:
        """Whether :meth:`forward_argmax` may run: :attr:`lazy_head` with an LM head that has an argmax op
        (``ops.linear_argmax`` / ``ops.qlinear_argmax``); ``argmax_head = False`` turns it off."""
        return self.argmax_head and self.lazy_head and self._runner.head_argmax is not None

    @torch.no_grad()
    def forward_argmax(self, cache: StaticKVCache, tokens: torch.Tensor, depths: torch.Tensor,
                       tree_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``torch.argmax(forward(...), -1)``, int64 [B, N], without the logits: the head's argmax op over the
        vocabulary in slabs (a greedy plain step, or a greedy tree verified whole; needs :attr:`greedy_head`)."""
        return self.head_argmax(self.forward_hidden(cache, tokens, depths, tree_mask))
