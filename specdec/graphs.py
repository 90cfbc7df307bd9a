"""The target's forward captured in CUDA graphs: one graph per step shape, replayed.

Why: on a GPU a small model's step is bound by kernel launches (about a dozen per layer, each a few
microseconds of host time), not by streaming its weights (docs/design.md, "Where a small model's
time goes"). A CUDA graph records the launches once and replays them with one host call.

:class:`GraphedForward` wraps an :class:`~specdec.models.hf.HFCausalLM` (any object with its
``forward(cache, tokens, depths, tree_mask=None, kv_offset=0)``) and is used in its place, e.g.
``SpeculativeDecoder(GraphedForward(lm), drafter)``. Per bucket — the cache's storage, its rows B,
the nodes N, whether a tree mask is given, kv_offset — the first call runs ``warmup`` eager forwards
on a side stream (lazy initialisation must not be captured), captures one forward with its inputs
in static buffers, and every later call of that bucket copies tokens / depths / mask into the
static buffers and replays. What the graph reads at replay: the static inputs, the KV cache's
tensors and ``cache.lens`` (device tensors whose addresses never change: positions and attention
follow the committed lengths of the moment); what it writes: the step's K/V at lens + j (the
uncommitted part of the cache, exactly what the eager forward writes) and the static logits,
returned as a fresh tensor (a copy: the next replay overwrites the static buffer).

Nothing in the captured forward synchronises with the host (the ops' value checks on CUDA run only
in strict mode; positions are computed on the device). Verification (``greedy_verify`` /
``rejection_sample``) and ``kv_commit`` stay two launches after the replay, as in the eager loop.

``capture=False`` runs the same bucket logic and static buffers with eager forwards instead of
replays (CPU models too): for debugging and for testing the plumbing without a GPU.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import torch

from specdec._check import check_int

__all__ = ["GraphedForward"]


class _Bucket:
    __slots__ = ("tokens", "depths", "mask", "logits", "graph", "cache_tensors")

    def __init__(self) -> None:
        self.graph = None
        self.logits = None
        self.cache_tensors = None


class GraphedForward:
    """``lm.forward`` replayed from CUDA graphs, one per (cache storage, B, N, mask, kv_offset) bucket.

    Parameters
    ----------
    lm : HFCausalLM (or any model with its forward signature and ``device``)
    max_graphs : int, default 16
        Buckets kept (least recently used evicted, its graph freed). Calls beyond run eagerly.
    warmup : int, default 2
        Eager forwards on a side stream before a bucket is captured.
    capture : bool, optional
        Capture CUDA graphs (default: True when the model is on a CUDA device). False: the same
        static-buffer path with eager forwards (any device).

    Attributes: ``captures`` (graphs captured), ``replays`` (calls served by a graph),
    ``eager_calls`` (calls run as eager forwards: capture=False, and the fallbacks listed in
    :meth:`forward`).
    """

    def __init__(self, lm, max_graphs: int = 16, warmup: int = 2, capture: Optional[bool] = None) -> None:
        check_int("GraphedForward", "max_graphs", max_graphs, lo=1, type_error=False)
        check_int("GraphedForward", "warmup", warmup, lo=1, type_error=False)
        if not callable(getattr(lm, "forward", None)):
            raise TypeError(f"GraphedForward: lm must have a forward(cache, tokens, depths, tree_mask, kv_offset), "
                            f"got {type(lm).__name__}")
        device = torch.device(getattr(lm, "device", "cpu"))
        on_cuda = device.type == "cuda"
        if capture is None:
            capture = on_cuda
        if capture and not on_cuda:
            raise ValueError(f"GraphedForward: capture=True needs a model on a CUDA device, got {device} "
                             f"(capture=False runs the static-buffer path eagerly)")
        self.lm = lm
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.capture = bool(capture)
        self._buckets: "OrderedDict[Tuple, _Bucket]" = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = 0
        self.replays = 0
        self.eager_calls = 0

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped model's
        if name == "lm":
            raise AttributeError(name)
        return getattr(self.lm, name)

    def __repr__(self) -> str:
        return (f"GraphedForward({self.lm!r}, buckets={len(self._buckets)}/{self.max_graphs}, "
                f"capture={self.capture}, captures={self.captures}, replays={self.replays})")

    @staticmethod
    def _key(cache, tokens: torch.Tensor, tree_mask: Optional[torch.Tensor], kv_offset: int) -> Tuple:
        return (cache.k[0].data_ptr(), tuple(cache.k[0].shape), cache.lens.data_ptr(), tuple(tokens.shape),
                tokens.dtype, None if tree_mask is None else tuple(tree_mask.shape), int(kv_offset))

    def reset(self) -> None:
        """Drop every bucket and its graph. A bucket holds its cache's tensors (the graph replays on
        their addresses), so a cache that is no longer used is freed only after reset() or eviction."""
        self._buckets.clear()

    @torch.no_grad()
    def forward(self, cache, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: Optional[torch.Tensor] = None,
                kv_offset: int = 0) -> torch.Tensor:
        """``lm.forward(cache, tokens, depths, tree_mask, kv_offset)``: float32 logits [B, N, V].

        Eager (no bucket) when the inputs are on another device than the model, or the tree mask
        is not a bool tensor of the call's shape; those calls go to ``lm.forward`` unchanged (and
        its checks). The first call of a bucket is checked by ``lm.forward`` (the warm-up) too.
        """
        if (not isinstance(tokens, torch.Tensor) or not isinstance(depths, torch.Tensor)
                or tokens.device != cache.lens.device or depths.shape != tokens.shape
                or (tree_mask is not None and (not isinstance(tree_mask, torch.Tensor)
                                               or tree_mask.dtype != torch.bool))):
            self.eager_calls += 1
            return self.lm.forward(cache, tokens, depths, tree_mask, kv_offset)
        key = self._key(cache, tokens, tree_mask, kv_offset)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._build(key, cache, tokens, depths, tree_mask, kv_offset)
        else:
            self._buckets.move_to_end(key)
        bucket.tokens.copy_(tokens)
        bucket.depths.copy_(depths)
        if bucket.mask is not None:
            bucket.mask.copy_(tree_mask)
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
            return bucket.logits.clone()
        self.eager_calls += 1
        return self.lm.forward(cache, bucket.tokens, bucket.depths, bucket.mask, kv_offset)

    __call__ = forward

    def _build(self, key, cache, tokens, depths, tree_mask, kv_offset) -> _Bucket:
        bucket = _Bucket()
        bucket.tokens = torch.zeros_like(tokens)
        bucket.depths = torch.zeros_like(depths)
        bucket.mask = None if tree_mask is None else torch.zeros_like(tree_mask)
        # the graph holds the cache's addresses: keep its tensors alive (no other tensor can take them)
        bucket.cache_tensors = (list(cache.k), list(cache.v), cache.lens)
        bucket.tokens.copy_(tokens)
        bucket.depths.copy_(depths)
        if bucket.mask is not None:
            bucket.mask.copy_(tree_mask)
        if self.capture:
            # Warm-up forwards write the step's K/V at lens + j (uncommitted positions, rewritten by
            # every replay): the cache's committed state is untouched.
            side = torch.cuda.Stream(device=tokens.device)
            side.wait_stream(torch.cuda.current_stream(tokens.device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.lm.forward(cache, bucket.tokens, bucket.depths, bucket.mask, kv_offset)
            torch.cuda.current_stream(tokens.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                bucket.logits = self.lm.forward(cache, bucket.tokens, bucket.depths, bucket.mask, kv_offset)
            bucket.graph = graph
            self.captures += 1
        self._buckets[key] = bucket
        while len(self._buckets) > self.max_graphs:
            self._buckets.popitem(last=False)
        return bucket

    def buckets(self) -> Dict[Tuple, bool]:
        """{bucket key: captured?} (least recently used first)."""
        return {k: b.graph is not None for k, b in self._buckets.items()}
