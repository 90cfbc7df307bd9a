"""EagleHead: a feature draft head (EAGLE-style) as a drafter: chains, spine / dynamic / planned trees
through DraftModel's builders, over the target's own hidden states (docs/drafters.md, "Feature heads")."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specdec.drafters.draft_model.model import DraftModel
from specdec.drafters.eagle.lm import HeadLM
from specdec.drafters.eagle.net import HeadNet
from specdec.ops import GROUP_FORMATS

__all__ = ["EagleHead"]



class EagleHead(DraftModel):
    """Draft with a feature head (:class:`~specdec.drafters.eagle.net.HeadNet`) over the target's hidden states.

    The target must be an :class:`~specdec.HFCausalLM` (any precision): binding turns on its
    :meth:`~specdec.HFCausalLM.capture_hidden` with the head's ``feature_layers``, so every verified
    node's hidden state is kept in the target's cache at no extra pass. The head keeps its own
    one-layer K/V cache; after each verification the accepted path is fed to the head again with
    the target's states (as EAGLE does), not kept with the head's own predicted ones.

    Parameters: ``net`` (a HeadNet, trained here or loaded by :func:`~specdec.drafters.eagle.load_head`),
    ``precision`` ("fp32", or "q8_0" / "q4_1" / "q4_0": the head's linear layers group-quantized), ``act``
    (None, or "q8" with a quantized precision: their activations quantized per block of 32 too, the
    integer kernels; a draft need
    not be exact, only cheap and close), then DraftModel's ``k``, ``top_k``, ``node_budget``,
    ``stop_threshold``, ``tree``, ``sampled_children``, ``calibrate``, ``learn_plan``.
    """

    changes_target = True   # bind() turns on the target's capture_hidden (a dense cache of states)


    def __init__(self, net: HeadNet, k: int = 4, top_k: int = 1, precision: str = "fp32",
                 act: Optional[str] = None, **kwargs) -> None:
        if not isinstance(net, HeadNet):
            raise TypeError(f"EagleHead: net must be a HeadNet, got {type(net).__name__}")
        if precision != "fp32" and precision not in GROUP_FORMATS:
            raise ValueError(f"EagleHead: precision must be 'fp32' or one of {GROUP_FORMATS}, got {precision!r}")
        if act not in (None, "q8") or (act == "q8" and precision == "fp32"):
            raise ValueError(f"EagleHead: act must be None, or 'q8' with a quantized precision (the head's "
                             f"activations quantized per block of 32, as qlinear(..., act='q8')), got act={act!r} "
                             f"with precision={precision!r}")
        super().__init__(None, k=k, top_k=top_k, **kwargs)
        if precision != "fp32":  # the head's linear layers group-quantized (a copy: ``net`` stays trainable)
            import copy

            from specdec.models.quant import quantize_linear_groups, set_activation_quant

            net = set_activation_quant(quantize_linear_groups(copy.deepcopy(net), precision), act)
        self.net = net
        self.precision = precision
        self.act = act
        self.target = None
        self._extra_foreign = 0  # room for other drafters' tokens (reserve_foreign, a MultiDraft member)

    def __repr__(self) -> str:
        return "EagleHead" + super().__repr__()[len("DraftModel"):]

    def reserve_foreign(self, n: int) -> None:
        """Room for tokens accepted from other drafters' subtrees (a MultiDraft member): they are committed,
        so the target holds their states, and the next step's first head forward feeds them with the
        head's own accepted path, as the EAGLE catch-up does."""
        self._extra_foreign = max(self._extra_foreign, int(n))

    def bind(self, target, max_batch: int, max_len: int) -> None:
        if not hasattr(target, "capture_hidden"):
            raise TypeError(f"EagleHead: the target must be an HFCausalLM (capture_hidden), got "
                            f"{type(target).__name__}")
        cfg = self.net.cfg
        if not cfg.feature_layers:  # an EAGLE-3 checkpoint: its low / mid / high layers of this target
            from specdec.drafters.eagle.checkpoint import eagle3_layers

            cfg.feature_layers = eagle3_layers(int(target.num_layers))
        width = target.capture_hidden(cfg.feature_layers)
        if width != self.net.cfg.feature_size:
            raise ValueError(f"EagleHead: the head reads features of width {self.net.cfg.feature_size} from layers "
                             f"{list(self.net.cfg.feature_layers)}, the target gives {width}")
        self.target = target
        self.net.to(target.device)
        self.lm = HeadLM(self.net, target)
        # pending-token room: the accepted path is fed again after each step, then other drafters' tokens
        self._foreign = self.k + self._extra_foreign
        super().bind(target, max_batch, max_len)

    def start(self, prompts, params, generator) -> None:
        self._attach()
        super().start(prompts, params, generator)

    def admit(self, rows, prompts) -> None:
        self._attach()
        super().admit(rows, prompts)

    def _attach(self) -> None:
        cache = getattr(self.target, "feature_cache", None) if self.target is not None else None
        if cache is None:
            raise RuntimeError("EagleHead: not bound to a decoder (SpeculativeDecoder(target, drafter) binds it)")
        self.lm.attach(cache)

    def _keeps_counts(self) -> bool:
        """Whether accept() runs DraftModel's rollback first: for the learners' counts of dynamic trees
        (calibration, rank acceptance). A chain or spine tree has none, and everything else that rollback
        does (the draft cache's lengths and moves, the pending tokens) is replaced here: skipped."""
        return self.dynamic

    def accept(self, accepted: torch.Tensor, num_accepted: torch.Tensor, num_host: Sequence[int],
               foreign: Optional[Sequence[Sequence[int]]] = None) -> None:
        rec = self._last
        if rec is None or rec.k <= 0 or rec.base is None:
            super().accept(accepted, num_accepted, num_host, foreign)
            return
        b = rec.b
        root_end = rec.base + self._pend_n[:b] + 1                      # the head cache up to and with the root
        if self._keeps_counts():
            super().accept(accepted, num_accepted, num_host, None)      # learners, counts (foreign: below)
        self._view(b).lens.copy_(root_end)                              # drop the drafted nodes' K/V
        width = max((int(a) for a in num_host), default=0)
        if width:
            path = accepted[:, 1:1 + width].to(torch.int64).clamp(min=0)
            self._pend_tok[:b, :width] = rec.tokens.gather(1, path)
        self._pend_n[:b] = num_accepted
        self._pend_width = width
        self._take_foreign(b, foreign, own=num_accepted)
