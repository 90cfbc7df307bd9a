"""The model's rotary cos / sin by table lookup: the same values as calling its rotary module.

A decode step of the lean forward calls the model's rotary embedding module for a handful of
positions: about ten small tensor operations, each a few microseconds of dispatch that the CPU
runs alone while its other threads wait, and more after the step's weights have streamed through
the caches. :class:`RotaryTable` computes the module's output once for positions ``0 .. n - 1``
(one call of the module itself) and then gathers rows by position.

Bit-identical by construction where it is used: the module's output at a position is an
elementwise function of that position (``cos(position * inv_freq) * attention_scaling`` and the
sine, in float32, then cast), the same whichever other positions share the call, provided every
element takes the same code path: on the CPU, torch's vectorised loops hand the last
``numel % (2 * vector width)`` elements of a call to the scalar function, which may round
differently, so the table is used only when the head dimension is a multiple of 32 (every call's
element count then is, for 8- and 16-lane vectors alike). Modules whose frequencies change with the
sequence length (``dynamic`` and ``longrope`` rope types) are always called. Building the table also
compares it with a direct call at a decode step's shape and at a chain's; any difference turns the
table off for good. CPU tensors only (a CUDA launch per operation is not what this saves).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


MAX_TABLE_BYTES = 32 << 20  # a larger cache (cos and sin for every position past this) calls the module


class RotaryTable:
    """``(h, positions [B, N]) -> (cos, sin)`` as ``rotary(h, positions)``; see the module docstring."""

    def __init__(self, rotary: torch.nn.Module, head_dim: int) -> None:
        self.rotary = rotary
        self.head_dim = int(head_dim)
        rope_type = str(getattr(rotary, "rope_type", "default"))
        self.enabled = head_dim % 32 == 0 and "dynamic" not in rope_type and "longrope" not in rope_type
        self._cos: Optional[torch.Tensor] = None  # [n, D]
        self._sin: Optional[torch.Tensor] = None

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, capacity: Optional[int]) -> Tuple[torch.Tensor,
                                                                                               torch.Tensor]:
        """``capacity``: an upper bound on every position of the cache being run (None: call the module)."""
        if not self.enabled or capacity is None or h.device.type != "cpu" or \
                2 * capacity * self.head_dim * h.element_size() > MAX_TABLE_BYTES:
            return self.rotary(h, positions)
        cos = self._cos
        if cos is None or cos.shape[0] < capacity or cos.dtype != h.dtype:
            self._build(h, int(capacity))
            if not self.enabled:
                return self.rotary(h, positions)
            cos = self._cos
        flat = positions.reshape(-1)
        try:
            out = (cos.index_select(0, flat), self._sin.index_select(0, flat))
        except IndexError:  # a position past the table (depths beyond the step's nodes): the module's values
            return self.rotary(h, positions)
        shape = (*positions.shape, cos.shape[1])
        return out[0].view(shape), out[1].view(shape)

    def span(self, h: torch.Tensor, start: int, n: int, capacity: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``self(h, [[start, .., start + n - 1]], capacity)`` for one request's consecutive positions: views of
        the table's rows (the same values, no gather) where the table serves them, else that call."""
        cos = self._cos
        if cos is not None and self.enabled and capacity is not None and h.device.type == "cpu" and \
                cos.dtype == h.dtype and cos.device == h.device and start >= 0 and start + n <= cos.shape[0]:
            return cos[start:start + n].unsqueeze(0), self._sin[start:start + n].unsqueeze(0)
        return self(h, torch.arange(start, start + n, device=h.device).view(1, n), capacity)

    @torch.no_grad()
    def _build(self, h: torch.Tensor, n: int) -> None:
        pos = torch.arange(n, device=h.device).unsqueeze(0)
        probe = h.new_zeros(1, 1, h.shape[-1])
        cos, sin = self.rotary(probe, pos)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        # the table against direct calls: one position (a decode step), and a chain of 5 at the end
        for p in (pos[:, n - 1:], pos[:, max(0, n - 5):]):
            c, s = self.rotary(probe, p)
            if not (torch.equal(c[0], cos[p[0]]) and torch.equal(s[0], sin[p[0]])):
                self.enabled = False
                self._cos = self._sin = None
                return
        self._cos, self._sin = cos, sin
