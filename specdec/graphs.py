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
returned as a fresh tensor (a copy: see "the cloning invariant" in :meth:`GraphedForward.forward`).

Capture and replay run under ``torch.cuda.device(model's device)``: ``torch.cuda.graph`` captures
the CURRENT device's stream and ``CUDAGraph.replay`` launches on it, while the ops launch on their
tensors' device; a model on another device than the current one would otherwise give an empty
graph whose replays return the capture-time logits.

Nothing in the captured forward synchronises with the host (the ops' value checks on CUDA run only
in strict mode; positions are computed on the device). Where a forward does synchronise (strict
checks on, the generic forward fallback of :class:`~specdec.models.hf.HFCausalLM`, a sliding-window
model whose cache is longer than its window) the capture raises: that bucket then runs eager
forwards for good (a warning names the bucket and the exception, once; no capture is retried).
Verification (``greedy_verify`` / ``rejection_sample``) and ``kv_commit`` stay two launches after
the replay, as in the eager loop.

``capture=False`` runs the same bucket logic and static buffers with eager forwards instead of
replays (CPU models too): for debugging and for testing the plumbing without a GPU.
docs/gpu.md describes the buckets, the eviction and the fallback.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import torch

from specdec._check import check_int

__all__ = ["GraphedForward"]

_log = logging.getLogger(__name__)

# The torch.cuda API this module calls, looked up at call time through this name: the CPU tests
# replace it with a fake (tests/test_graphs.py) to check the device context and the fallbacks.
_cuda = torch.cuda


class _Bucket:
    __slots__ = ("tokens", "depths", "mask", "logits", "graph", "cache_tensors", "failure")

    def __init__(self) -> None:
        self.graph = None
        self.logits = None
        self.cache_tensors = None
        self.failure: Optional[str] = None  # why the capture failed (the bucket then runs eagerly)


class GraphedForward:
    """``lm.forward`` replayed from CUDA graphs, one per (cache storage, B, N, mask, kv_offset) bucket.

    Parameters
    ----------
    lm : HFCausalLM (or any model with its forward signature and ``device``)
    max_graphs : int, default 16
        The bucket limit: buckets (and their graphs) kept at once. One more bucket evicts the least
        recently used one (its graph freed; a later call of that shape captures again: ``warmup``
        eager forwards and a capture). A workload with more step shapes than this — calibration
        over many (rows, nodes) cells, tree sizes that vary per step, several caches — recaptures
        in a loop; the first eviction is logged once (logger ``specdec.graphs``, warning) and
        counted in ``evictions``. Raise the limit when that warning appears: each graph holds its
        bucket's static buffers and the temporaries of one forward (in one pool shared by all).
    warmup : int, default 2
        Eager forwards on a side stream before a bucket is captured.
    capture : bool, optional
        Capture CUDA graphs (default: True when the model is on a CUDA device). False: the same
        static-buffer path with eager forwards (any device).

    Attributes: ``captures`` (graphs captured), ``replays`` (calls served by a graph),
    ``eager_calls`` (calls run as eager forwards: capture=False, and the fallbacks listed in
    :meth:`forward`), ``capture_failures`` (buckets whose capture raised and that run eagerly),
    ``evictions`` (buckets evicted by the bucket limit).
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
        if capture and device.index is None:  # "cuda": the device that is current now, fixed from here on
            device = torch.device("cuda", _cuda.current_device())
        self.lm = lm
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.capture = bool(capture)
        self._device = device
        self._buckets: "OrderedDict[Tuple, _Bucket]" = OrderedDict()
        self._pool = _cuda.graph_pool_handle() if self.capture else None
        self.captures = 0
        self.replays = 0
        self.eager_calls = 0
        self.capture_failures = 0
        self.evictions = 0
        self._warned_eviction = False

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped model's
        if name == "lm":
            raise AttributeError(name)
        return getattr(self.lm, name)

    # The wrapper serves forward through its buckets: the wrapped model's headless and argmax forwards
    # (forward_hidden, forward_argmax) would bypass them, so the engine is told they are not there.
    lazy_head = False
    greedy_head = False

    def __repr__(self) -> str:
        return (f"GraphedForward({self.lm!r}, buckets={len(self._buckets)}/{self.max_graphs}, "
                f"capture={self.capture}, captures={self.captures}, replays={self.replays})")

    @property
    def calibration_tag(self) -> str:
        """Appended to :func:`specdec.scheduler.calibrate.calibration_key`: captured replays time
        unlike the wrapped model's eager forwards, so the two never share calibrated timings."""
        return f"GraphedForward(capture={self.capture})"

    @staticmethod
    def _key(cache, tokens: torch.Tensor, tree_mask: Optional[torch.Tensor], kv_offset: int) -> Tuple:
        tables = getattr(cache, "block_tables", None)  # a paged view: the graph reads its block-table rows too
        return (cache.k[0].data_ptr(), tuple(cache.k[0].shape), cache.lens.data_ptr(),
                None if tables is None else (tables.data_ptr(), tuple(tables.shape)), tuple(tokens.shape),
                tokens.dtype, None if tree_mask is None else tuple(tree_mask.shape), int(kv_offset))

    def _on_device(self):
        """The model's device made current (capture and replay use the current device's stream)."""
        return _cuda.device(self._device) if self.capture else contextlib.nullcontext()

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
        A bucket whose capture raised runs eager forwards on its static buffers.
        """
        if (not isinstance(tokens, torch.Tensor) or not isinstance(depths, torch.Tensor)
                or tokens.device != cache.lens.device or depths.shape != tokens.shape
                or (tree_mask is not None and (not isinstance(tree_mask, torch.Tensor)
                                               or tree_mask.dtype != torch.bool))):
            self.eager_calls += 1
            return self.lm.forward(cache, tokens, depths, tree_mask, kv_offset)
        key = self._key(cache, tokens, tree_mask, kv_offset)
        with self._on_device():
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
                # The cloning invariant: nothing returned aliases the graph pool. The static logits
                # are rewritten by this bucket's next replay, and every bucket's graph shares one
                # memory pool (self._pool): a graph captured later may have placed its static
                # logits in memory that an earlier graph uses for temporaries, so a bucket's
                # logits are valid only until the next replay of ANY bucket. The copy, queued on
                # the same stream right after the replay, reads them inside that window and is a
                # fresh allocation outside the pool. Sharing the pool is safe only because of it.
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
        bucket.cache_tensors = (list(cache.k), list(cache.v), cache.lens, getattr(cache, "block_tables", None))
        bucket.tokens.copy_(tokens)
        bucket.depths.copy_(depths)
        if bucket.mask is not None:
            bucket.mask.copy_(tree_mask)
        if self.capture:
            # Warm-up forwards write the step's K/V at lens + j (uncommitted positions, rewritten by
            # every replay): the cache's committed state is untouched. An error here is the call's
            # own (lm.forward's checks): it propagates and no bucket is stored.
            side = _cuda.Stream(device=self._device)
            side.wait_stream(_cuda.current_stream(self._device))
            with _cuda.stream(side):
                for _ in range(self.warmup):
                    self.lm.forward(cache, bucket.tokens, bucket.depths, bucket.mask, kv_offset)
            _cuda.current_stream(self._device).wait_stream(side)
            graph = _cuda.CUDAGraph()
            stream = _cuda.current_stream(self._device)
            try:
                with _cuda.graph(graph, pool=self._pool):
                    bucket.logits = self.lm.forward(cache, bucket.tokens, bucket.depths, bucket.mask, kv_offset)
            except Exception as e:  # whatever the capture raised: this bucket runs eagerly
                # A forward that synchronises with the host cannot be captured (strict checks, the
                # generic fallback path, a sliding window shorter than the cache): the warm-up ran
                # it fine, so it is the capture that failed. The bucket is stored without a graph
                # and never captured again; later calls of its shape run eager forwards.
                del graph
                # torch.cuda.graph's exit skips restoring the stream when capture_end raises
                _cuda.set_stream(stream)
                _cuda.synchronize(self._device)  # a sticky error (not a capture error) surfaces here
                bucket.logits = None
                bucket.failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self.capture_failures += 1
                _log.warning("GraphedForward: capture of bucket %s failed (%s); this bucket runs eager forwards "
                             "from now on (no capture is retried)", self._describe(key), bucket.failure)
            else:
                bucket.graph = graph
                self.captures += 1
        self._buckets[key] = bucket
        while len(self._buckets) > self.max_graphs:
            old, _ = self._buckets.popitem(last=False)
            self.evictions += 1
            if not self._warned_eviction:
                self._warned_eviction = True
                _log.warning("GraphedForward: more step shapes than max_graphs=%d buckets; evicting the least "
                             "recently used bucket %s (its graph is freed and recaptured on its next use). Logged "
                             "once; `evictions` counts them: raise max_graphs if this repeats",
                             self.max_graphs, self._describe(old))
        return bucket

    @staticmethod
    def _describe(key: Tuple) -> str:
        """A bucket key in words (the cache's shape, not its address)."""
        _, cache_shape, _, tables, shape, dtype, mask, kv_offset = key
        paged = "" if tables is None else f", block tables {list(tables[1])}"
        return (f"(tokens {list(shape)} {str(dtype).replace('torch.', '')}, mask "
                f"{'none' if mask is None else list(mask)}, kv_offset {kv_offset}, cache k[0] {list(cache_shape)}"
                f"{paged})")

    def buckets(self) -> Dict[Tuple, bool]:
        """{bucket key: captured?} (least recently used first)."""
        return {k: b.graph is not None for k, b in self._buckets.items()}

    def failures(self) -> Dict[Tuple, str]:
        """{bucket key: why its capture failed} for the buckets that run eagerly after a failed capture."""
        return {k: b.failure for k, b in self._buckets.items() if b.failure is not None}
