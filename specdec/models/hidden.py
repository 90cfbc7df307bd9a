"""Hidden states of the target, kept with its KV cache (for feature-level drafters such as EAGLE heads).

:meth:`specdec.models.HFCausalLM.capture_hidden` turns this on for one model: every forward then
also writes the chosen hidden states of every node it scores into the cache's ``hidden`` tensor, at
the node's K/V slot, and :class:`HiddenKVCache` moves them with the K/V on every commit (the
accepted path of a verified tree), row move and view. No extra forward runs: the states are the
ones the target computes anyway.

A capture spec is a tuple of indices: ``i`` in ``[0, num_layers)`` = the residual stream entering
decoder layer ``i`` (transformers' ``hidden_states[i]``), ``-1`` = the final normed state (the LM
head's input). The feature of a node is their concatenation, in the spec's order.

The lean forward (:mod:`specdec.models.fast_llama`) collects them itself; the other paths use
forward hooks on the model's decoder layers and final norm (:class:`HookCapture`).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from specdec import ops
from specdec.cache import StaticKVCache

__all__ = ["HiddenKVCache", "HookCapture", "check_spec", "write_hidden", "enable_capture", "TargetFeatures"]

_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


def check_spec(spec: Sequence[int], num_layers: int) -> Tuple[int, ...]:
    """A capture spec as a tuple of ints, each -1 or a layer index; a clear error otherwise."""
    out = []
    for i in spec:
        if isinstance(i, bool) or not isinstance(i, int) or not -1 <= i < num_layers:
            raise ValueError(f"HFCausalLM.capture_hidden: layers must hold -1 (the final normed state) or layer "
                             f"indices in [0, {num_layers}), got {list(spec)}")
        out.append(int(i))
    if not out:
        raise ValueError("HFCausalLM.capture_hidden: layers is empty (use (-1,) for the final normed state)")
    return tuple(out)


class HiddenKVCache(StaticKVCache):
    """A :class:`StaticKVCache` that also holds one feature vector per position: ``hidden``
    [B, 1, capacity, F] (the K/V layout with one head, so row moves treat it as another layer)."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 feature_dim: int, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        super().__init__(num_layers, batch, num_kv_heads, head_dim, capacity, dtype=dtype, device=device)
        self.feature_dim = int(feature_dim)
        self.hidden = torch.zeros(self.batch, 1, self.capacity, self.feature_dim, dtype=dtype, device=self.device)
        # kv_commit moves (K, V) pairs of [B, H, S, D] tensors whose H and D may differ per pair: the states
        # ride as one more pair's K beside a 16-byte-wide V that nothing reads (one op call per commit)
        self._pair = torch.zeros(self.batch, 1, self.capacity, 16 // self.hidden.element_size(), dtype=dtype,
                                 device=self.device)

    @property
    def extra(self) -> List[torch.Tensor]:
        """Per-position tensors beyond the K/V (laid out as a layer's K), moved with them."""
        return [self.hidden]

    def rows(self, start: int, stop: int) -> "HiddenKVCache":
        view = super().rows(start, stop)
        view.__class__ = HiddenKVCache
        view.hidden = self.hidden[start:stop]
        view._pair = self._pair[start:stop]
        return view

    def nbytes(self) -> int:
        return super().nbytes() + sum(t.numel() * t.element_size() for t in (self.hidden, self._pair))

    def commit(self, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keep the accepted path's K/V and hidden states; lens += num_accepted + 1 (one kv_commit call)."""
        ops.kv_commit(self.k + [self.hidden], self.v + [self._pair], self.lens, accepted, num_accepted)

    def features(self, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The hidden states [B, capacity, F] (a view)."""
        return self.hidden[:, 0] if rows is None else self.hidden[list(rows), 0]


def _segments(table: List[int], start: int, n: int, block_size: int, capacity: int, scratch: int):
    """Positions start .. start + n - 1 of a row with block-table row ``table`` as block-contiguous pieces
    (j0, page, offset, length); positions past the capacity go to the scratch page (never read)."""
    out = []
    j = 0
    while j < n:
        pos = start + j
        off = pos % block_size
        k = min(n - j, block_size - off)
        page = table[pos // block_size] if pos < capacity else scratch
        out.append((j, page if page >= 0 else scratch, off, k))
        j += k
    return out


class TargetFeatures:
    """What a feature drafter reads of the target's cache, dense (:class:`HiddenKVCache`) or paged (a
    :class:`~specdec.paged_cache.PagedKVCache` with ``feature_dim``): the committed lengths per row and the
    features at (row, position) pairs."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.feature_dim = int(getattr(cache, "feature_dim", 0))
        self.paged = not isinstance(cache, HiddenKVCache)
        if self.paged and getattr(cache, "hidden_pages", None) is None:
            raise ValueError(f"TargetFeatures: the cache keeps no features (HFCausalLM.capture_hidden), got "
                             f"{type(cache).__name__}")
        self.capacity = int(cache.capacity)
        #: committed positions per cache row (the tensor the cache updates in place)
        self.lens = cache.cache_lens if self.paged else cache.lens

    def gather(self, row0: int, positions: torch.Tensor) -> torch.Tensor:
        """Features [B, N, F] of rows row0 .. row0 + B - 1 at ``positions`` [B, N] (int64, in [0, capacity))."""
        B, N = positions.shape
        if self.paged:
            rows = torch.arange(row0, row0 + B, device=positions.device)
            slots = self.cache.feature_slots(rows, positions)
            return self.cache.hidden_pages.view(-1, self.feature_dim).index_select(0, slots.view(-1)).view(B, N, -1)
        return self.cache.hidden[row0:row0 + B, 0].gather(1, positions.unsqueeze(2).expand(B, N, self.feature_dim))

    def span(self, row: int, start: int, n: int) -> torch.Tensor:
        """Features [1, n, F] of ``row`` at positions start .. start + n - 1 (host integers, inside the row)."""
        if self.paged:
            c = self.cache
            if start + n > self.capacity:
                return self.gather(row, torch.arange(start, start + n).view(1, n))
            parts = [c.hidden_pages[page, off:off + k, 0]
                     for _, page, off, k in _segments(c.block_tables[row].tolist(), start, n, c.block_size,
                                                      self.capacity, max(c.pad, 0))]
            return (parts[0] if len(parts) == 1 else torch.cat(parts)).unsqueeze(0)
        return self.cache.hidden[row:row + 1, 0, start:start + n]


def enable_capture(lm, layers: Sequence[int]) -> int:
    """HFCausalLM.capture_hidden: set the spec on the lean runner, or hooks on the model's modules."""
    spec = check_spec(list(layers), lm.num_layers)
    if lm._capture is not None:
        lm._capture.remove()
    runner = lm._runner
    lm._capture = None if runner is not None else HookCapture(lm.model, spec)
    if runner is not None:
        runner.capture = spec
    lm.hidden_spec = spec
    lm.hidden_width = int(lm.model.get_input_embeddings().weight.shape[1]) * len(spec)
    return lm.hidden_width


#: False: write_hidden always takes its tensor form (the A/B of benchmarks/ab_capture_write.py)
HOST_FORM = True


def write_hidden(cache, feats, kv_offset: int) -> None:
    """Write features [B, N, F] (or a list of parts to concatenate) of a call's N nodes at their K/V
    slots lens[b] + kv_offset + j (a HiddenKVCache, or a PagedKVView whose cache keeps features).

    On the CPU with a few rows: slice copies from host integers (one per row or block segment). A decode
    step calls this right after the target's forward has streamed its weights through the caches, where
    each distinct tensor operation costs several times what it costs warm: one copy per row is cheaper
    than the slot arithmetic and a scatter."""
    if isinstance(feats, (list, tuple)):
        feats = feats[0] if len(feats) == 1 else torch.cat(list(feats), dim=-1)
    B, N, Fd = feats.shape
    few = HOST_FORM and feats.device.type == "cpu" and B * N <= 64
    if getattr(cache, "paged", False):  # a PagedKVView of a cache with features: through its block table
        pages = cache.pages
        if few:  # block-contiguous slices
            hp = pages.hidden_pages
            for b, (start, table) in enumerate(zip(cache.lens.tolist(), cache.block_tables.tolist())):
                for j0, page, off, n in _segments(table, start + kv_offset, N, pages.block_size, pages.capacity,
                                                  max(pages.pad, 0)):
                    hp[page, off:off + n, 0].copy_(feats[b, j0:j0 + n])
            return
        slots = _slots(cache, B, N, kv_offset, feats.device)
        rows = torch.arange(cache.start, cache.start + B, device=feats.device)
        flat = pages.hidden_pages.view(-1, Fd)
        flat.index_copy_(0, pages.feature_slots(rows, slots).view(-1), feats.reshape(B * N, Fd).to(flat.dtype))
        return
    if few:  # one slice per row; padding past the capacity (never read) is not written
        hid, cap = cache.hidden, cache.capacity
        for b, start in enumerate(cache.lens.tolist()):
            start += kv_offset
            n = max(0, min(N, cap - start))
            if n:
                hid[b, 0, start:start + n].copy_(feats[b, :n])
        return
    slots = _slots(cache, B, N, kv_offset, feats.device).clamp(max=cache.capacity - 1)  # padding stays in range
    cache.hidden[:, 0].scatter_(1, slots.unsqueeze(2).expand(B, N, Fd), feats.to(cache.hidden.dtype))


def _slots(cache, B: int, N: int, kv_offset: int, device) -> torch.Tensor:
    """[B, N] int64: the nodes' slots lens[b] + kv_offset + j."""
    return cache.lens.to(torch.int64).view(B, 1) + kv_offset + torch.arange(N, device=device).view(1, N)


class HookCapture:
    """Forward hooks that keep the chosen hidden states of a transformers model's call (the hooked and
    generic paths of HFCausalLM). ``active`` gates them; ``take()`` returns the concatenated features."""

    def __init__(self, model: torch.nn.Module, spec: Tuple[int, ...]) -> None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None) or getattr(decoder, "layer", None)
        norm = next((getattr(decoder, n) for n in _FINAL_NORMS if hasattr(decoder, n)), None)
        if layers is None or (-1 in spec and norm is None):
            raise ValueError(f"HFCausalLM.capture_hidden: cannot find the decoder layers / final norm of "
                             f"{type(model).__name__} (expected get_decoder().layers and one of {_FINAL_NORMS})")
        self.spec = spec
        self.active = False
        self.kept: dict = {}
        self.handles = []
        for i in set(spec) - {-1}:
            self.handles.append(layers[i].register_forward_pre_hook(self._pre(i), with_kwargs=True))
        if -1 in spec:
            self.handles.append(norm.register_forward_hook(self._post))

    def _pre(self, i: int):
        def hook(module, args, kwargs):
            if self.active:
                h = args[0] if args else kwargs["hidden_states"]
                self.kept[i] = h.detach().clone()
        return hook

    def _post(self, module, args, output):
        if self.active:
            self.kept[-1] = (output[0] if isinstance(output, tuple) else output).detach().clone()

    def take(self) -> torch.Tensor:
        feats = [self.kept[i] for i in self.spec]
        self.kept = {}
        return feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
