"""HeadNet: the weights and math of an EAGLE-style feature draft head (one decoder layer).

Two layouts, as the published heads use them (``style``):

* ``"eagle"`` (EAGLE-1 / EAGLE-2): ``x = fc(cat(embed(token), feature))`` (bias), then one Llama
  decoder layer without its input norm (residual = x); the output ``o`` is both the next
  feature and the input of the LM head (no final norm). The target's features are its final
  normed hidden states (the LM head's input), so the head learns to predict them.
* ``"eagle3"``: the target's feature is the concatenation of three layers' residual streams
  (low / mid / high), brought to the hidden width by ``fc`` (no bias); a drafted node's feature is
  the head's own output. The layer attends over ``cat(input_layernorm(embed(token)),
  hidden_norm(feature))`` (q / k / v take 2 * hidden inputs), residual = feature; logits are
  ``lm_head(norm(o))`` over a reduced draft vocabulary, mapped to target ids by ``d2t``
  (``target = draft + d2t[draft]``; ``t2d`` marks the target ids that have a draft id).

Either layout may carry its own LM head over a reduced vocabulary (``draft_vocab``); without one
the target's LM head is used (passed in by the caller). The token embedding is the target's
(shared), unless the checkpoint brings its own.

The attention is the caller's (``attend(q, k, v) -> out``): a causal full-sequence attention for
training, the draft cache with :func:`specdec.ops.verify_attention` for drafting.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HeadConfig", "HeadNet", "rope_tables"]

STYLES = ("eagle", "eagle3")


@dataclass
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int                       # the target's vocabulary
    feature_size: int = 0                 # width of the target's feature (0: hidden_size)
    style: str = "eagle"
    draft_vocab: int = 0                  # > 0: own LM head over this many tokens (d2t map); 0: the target's
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    head_dim: int = 0                     # 0: hidden_size // num_heads
    feature_layers: tuple = (-1,)         # the target's hidden states the feature concatenates (capture spec)

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"HeadConfig: style must be one of {STYLES}, got {self.style!r}")
        for name in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"HeadConfig: {name} must be an int >= 1, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"HeadConfig: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        self.feature_size = int(self.feature_size or self.hidden_size)
        self.head_dim = int(self.head_dim or self.hidden_size // self.num_heads)
        self.feature_layers = tuple(int(i) for i in self.feature_layers)
        if not 0 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(f"HeadConfig: draft_vocab must lie in [0, vocab_size={self.vocab_size}], "
                             f"got {self.draft_vocab}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d


def rope_inverse_frequencies(head_dim: int, theta: float, device) -> torch.Tensor:
    """theta ** (-2i / head_dim), float32 [head_dim / 2]."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                inv: Optional[torch.Tensor] = None):
    """cos, sin [..., head_dim] (rotate-half layout) at integer ``positions``; ``inv``: the inverse
    frequencies when kept by the caller (:func:`rope_inverse_frequencies`)."""
    if inv is None:
        inv = rope_inverse_frequencies(head_dim, theta, positions.device)
    ang = positions.to(torch.float32).unsqueeze(-1) * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class HeadNet(nn.Module):
    """The head's parameters (names follow the published layouts; see the module docstring)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, D = cfg.hidden_size, cfg.head_dim
        e3 = cfg.style == "eagle3"
        att_in = 2 * H if e3 else H
        self.fc = nn.Linear(cfg.feature_size if e3 else 2 * H, H, bias=not e3)
        self.q_proj = nn.Linear(att_in, cfg.num_heads * D, bias=False)
        self.k_proj = nn.Linear(att_in, cfg.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(att_in, cfg.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=False)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        if e3:
            self.input_layernorm = nn.Parameter(torch.ones(H))
            self.hidden_norm = nn.Parameter(torch.ones(H))
            self.norm = nn.Parameter(torch.ones(H))
        self.embed: Optional[nn.Embedding] = None   # own embedding (a checkpoint's), else the target's
        self.lm_head: Optional[nn.Linear] = None
        if cfg.draft_vocab:
            self.lm_head = nn.Linear(H, cfg.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.int64))
        # small initial residual branches: a fresh head starts near "feature in, feature out"
        for lin in (self.o_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=0.02 / max(1, H) ** 0.5)

    # ------------------------------------------------------------------ math
    def input_feature(self, target_feature: torch.Tensor) -> torch.Tensor:
        """A target feature as the layer's feature input (EAGLE-3: fc to the hidden width)."""
        return self.fc(target_feature) if self.cfg.style == "eagle3" else target_feature

    def layer(self, emb: torch.Tensor, feat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One layer over nodes [B, N]: token embeddings and input features [B, N, H] -> output features."""
        cfg = self.cfg
        B, N, _ = emb.shape
        D = cfg.head_dim
        if cfg.style == "eagle3":
            eps = cfg.rms_eps
            residual = feat
            x = torch.cat((_rms(emb, self.input_layernorm, eps), _rms(feat, self.hidden_norm, eps)), dim=-1)
        else:
            x = residual = self.fc(torch.cat((emb, feat), dim=-1))
        q = _rotate(self.q_proj(x).view(B, N, cfg.num_heads, D), cos.unsqueeze(2), sin.unsqueeze(2))
        k = _rotate(self.k_proj(x).view(B, N, cfg.num_kv_heads, D), cos.unsqueeze(2), sin.unsqueeze(2))
        v = self.v_proj(x).view(B, N, cfg.num_kv_heads, D)
        h = residual + self.o_proj(attend(q, k, v).reshape(B, N, cfg.num_heads * D))
        y = _rms(h, self.post_attention_layernorm, cfg.rms_eps)
        return h + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def logits(self, out: torch.Tensor, target_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
               ) -> torch.Tensor:
        """Logits of output features: over the draft vocabulary with an own LM head, else the target's."""
        if self.cfg.style == "eagle3":
            out = _rms(out, self.norm, self.cfg.rms_eps)
        if self.lm_head is not None:
            return self.lm_head(out)
        if target_head is None:
            raise ValueError("HeadNet.logits: this head has no LM head of its own; pass the target's")
        return target_head(out)

    def draft_to_target(self) -> Optional[torch.Tensor]:
        """Target token id of every draft id [draft_vocab] (None: the full vocabulary)."""
        if self.lm_head is None:
            return None
        return torch.arange(self.cfg.draft_vocab, device=self.d2t.device) + self.d2t

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Set the draft vocabulary: draft id i stands for target id ``target_ids[i]`` (d2t offsets)."""
        ids = torch.as_tensor(target_ids, dtype=torch.int64).view(-1)
        if ids.numel() != self.cfg.draft_vocab:
            raise ValueError(f"HeadNet.set_vocab: expected {self.cfg.draft_vocab} target ids, got {ids.numel()}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size
                            or torch.unique(ids).numel() != ids.numel()):
            raise ValueError(f"HeadNet.set_vocab: target ids must be distinct and lie in [0, {self.cfg.vocab_size})")
        self.d2t.copy_(ids.to(self.d2t.device) - torch.arange(ids.numel(), device=self.d2t.device))


def causal_attention(num_heads: int, num_kv_heads: int):
    """A full-sequence causal attention for training (GQA by repetition)."""
    rep = num_heads // num_kv_heads

    def attend(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))             # [B, H, N, D]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    return attend
