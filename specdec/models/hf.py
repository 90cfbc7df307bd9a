"""HFCausalLM: drive a Hugging Face ``transformers`` causal LM with specdec's static KV cache.

Three routes, chosen once at construction:

* Lean forward (Llama / SmolLM2, Qwen2, Mistral without an active sliding window):
  :mod:`specdec.models.fast_llama` runs the same math on the model's own parameters, without
  transformers' per-layer Python.
* Hooked path (every model whose attention goes through ``ALL_ATTENTION_FUNCTIONS``: Llama /
  SmolLM2, Qwen2, Mistral, Gemma / Gemma3, GPT-2, GPT-NeoX, OPT, Phi, ...): the model's own
  modules run with the "specdec" attention function (:mod:`specdec.models.hf_attention`), which
  appends each layer's new K/V to the cache and runs ``ops.verify_attention`` with the tree mask.
  Position ids are ``cache.lens[b] + depths[b, j]``; no attention mask is built.
* Generic fallback (attention that bypasses the registry, attention-logit softcapping, non-causal
  or sink / position-bias attention, or ``hook=False``): the model's own attention on a
  transformers ``Cache`` that writes into the same :class:`StaticKVCache`, with a 4-D additive mask.
  Same cache layout, same commit, same results; a ``warnings.warn`` says why it is used.

The switch of ``config._attn_implementation`` lasts for one call, so outside :meth:`forward` /
:meth:`prefill` the wrapped model behaves exactly as before (e.g. ``model.generate(assistant_model=...)``
for a baseline). Not thread-safe for concurrent use of one model object from several threads.
"""
from __future__ import annotations

import inspect
import warnings
from typing import List, Optional, Sequence

import torch

from specdec import ops
from specdec._check import check_int
from specdec.cache import StaticKVCache
from specdec.paged_cache import PagedKVCache, PagedKVView
from specdec.models.hf_generic import forward_generic
from specdec.models.hf_head import HeadForwards
from specdec.models.hf_prefill import check_prefill, prefill_group, prefill_groups
from specdec.models.hidden import HiddenKVCache, enable_capture, write_hidden
from specdec.models.hf_attention import (
    ACTIVE_CALL,
    ATTN_NAME,
    CALL_KWARG,
    FAST_LINEAR,
    AttentionCall,
    config_windows,
    hook_blocker,
    install_fast_linear,
    probe_generic,
    probe_tokens,
    selects_positions,
)

try:
    from transformers import PretrainedConfig
except ImportError as exc:  # pragma: no cover - transformers is a dependency of this module
    raise ImportError("specdec.models.hf needs transformers (pip install 'transformers==5.24.0')") from exc

__all__ = ["HFCausalLM"]


class HFCausalLM(HeadForwards):
    """Adapter of a transformers causal LM to specdec's cache and tree verification.

    Parameters
    ----------
    model : transformers ``PreTrainedModel`` with a causal-LM head (``...ForCausalLM``), any
        dtype / device, int8 dynamic-quantized Linear layers included. Put in eval mode here.
    hook : bool, default True
        False forces the generic fallback path (for comparison and debugging).
    prefill_chunk : int, default 512
        Prompt positions per forward during :meth:`prefill` (bounds activation memory).
    fast_linear : bool, default True
        Run the model's plain ``nn.Linear`` layers through :func:`specdec.ops.linear` during
        this adapter's calls (the weight is streamed once for all rows of a decode / verify
        step; the BLAS GEMM keeps larger row counts). The layers' forward is replaced by one
        that is ``F.linear`` outside those calls.
    fast_path : bool, default True
        For Llama-style decoders (Llama / SmolLM2, Qwen2, Mistral without an active sliding
        window; see :mod:`specdec.models.fast_llama`) run the same math on the model's own
        parameters without transformers' per-layer Python. Other models, and hook=False, use
        transformers' modules. ``fast_path`` (the attribute) says whether it is in use.
    fused_ops : bool, default True
        On the fast path, run each layer's small steps as specdec's fused ops (rms_norm,
        add_rms_norm, rope, silu_mul: 11 op calls per layer); False runs torch's unfused
        expressions, which are also what a model whose norm weights are not in the activations'
        dtype gets.
    fused_layers : bool, default True
        With ``fused_ops``, run each decoder layer whose projections are all known layer types
        (``nn.Linear`` with fast_linear, specdec's ``Int8Linear`` / ``GroupQuantLinear``) as one
        :func:`specdec.ops.decoder_layer` call: the same kernels in the same order, called from
        C++ (one Python-level call per layer). Same results, bit for bit.

    Attributes: ``model, config, vocab_size, device, dtype, num_layers, num_kv_heads, head_dim,
    hooked`` (True: "specdec" attention path; False: generic fallback, warned).
    """

    def __init__(self, model: torch.nn.Module, hook: bool = True, prefill_chunk: int = 512,
                 fast_linear: bool = True, fast_path: bool = True, fused_ops: bool = True,
                 fused_layers: bool = True) -> None:
        if not isinstance(getattr(model, "config", None), PretrainedConfig):
            raise TypeError(f"HFCausalLM: expected a transformers PreTrainedModel, got {type(model).__name__}")
        if int(prefill_chunk) < 1:
            raise ValueError(f"HFCausalLM: prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model.eval()
        self.config = model.config
        self.prefill_chunk = int(prefill_chunk)
        self.fast_linear = bool(fast_linear) and install_fast_linear(model) > 0
        self.device = model.get_input_embeddings().weight.device
        params = inspect.signature(model.forward).parameters
        self._keep_logits = "logits_to_keep" in params
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # Every config object the model's modules read (a multimodal model has text / vision sub-configs).
        configs = {id(model.config): model.config}
        for module in model.modules():
            cfg = getattr(module, "config", None)
            if isinstance(cfg, PretrainedConfig):
                configs.setdefault(id(cfg), cfg)
        self._configs = list(configs.values())
        self._pass_kwarg = False
        self._windows: List[Optional[int]] = []
        self._warned_window = False

        reason = hook_blocker(self.config) if hook else "hook=False was requested"
        layers = None
        if reason is None:
            layers, reason = self._probe_hooked()
        self.hooked = reason is None
        if not self.hooked:
            warnings.warn(f"HFCausalLM: {type(model).__name__} runs on the generic fallback path (its own attention "
                          f"with a 4-D mask over the static cache; slower, one host sync per call): {reason}",
                          stacklevel=2)
            layers = probe_generic(model, self._cache_kwarg, self.device)
            self._generic_windows = config_windows(self.config)
        self._init_shapes(layers)
        self._runner = None
        if self.hooked and fast_path:
            from specdec.models.fast_llama import build

            self._runner, _ = build(model, fast_linear=self.fast_linear, fused_ops=fused_ops,
                                    fused_layers=fused_layers)
        self.fast_path = self._runner is not None
        self.hidden_spec = None  # capture_hidden(): which hidden states every forward keeps in the cache
        self._capture = None
        #: greedy verification may run the LM head along the accepted path only (see :attr:`lazy_head`)
        self.lazy_verify = True
        #: greedy steps (plain ones, trees verified whole, the lazy walk) take the head's argmax op where
        #: greedy_head allows (forward_argmax / head_argmax: no logits)
        self.argmax_head = True

    # ------------------------------------------------------------------ construction
    def _probe_hooked(self):
        """Run 3 tokens with the "specdec" function in probe mode; see which layers reach it."""
        expected = getattr(self.config.get_text_config(), "num_hidden_layers", None)
        call = AttentionCall(cache=None, tree_mask=None, probe={})
        try:
            with torch.no_grad():
                try:
                    self._call_model(call, probe_tokens(self.device), None, pass_kwarg=True, logits_to_keep=1)
                    self._pass_kwarg = call.kwarg_seen
                except TypeError:  # the model rejects unknown kwargs: ContextVar route
                    call.probe = {}
                    self._call_model(call, probe_tokens(self.device), None, pass_kwarg=False, logits_to_keep=1)
        except Exception as exc:  # noqa: BLE001 - any failure means "cannot hook", reported in the warning
            return None, f"the hooked probe forward failed ({type(exc).__name__}: {exc})"
        seen = call.probe.get("layers", [])
        if not seen:
            return None, "its attention does not go through transformers' ALL_ATTENTION_FUNCTIONS"
        bad = sorted({u for s in seen for u in s["unsupported"]})
        if bad:
            return None, f"its attention uses {', '.join(bad)}, which verify_attention does not implement"
        idx = [s["layer"] for s in seen]
        if None in idx or sorted(idx) != list(range(len(idx))) or (expected is not None and len(idx) != expected):
            return None, (f"only some attention layers go through ALL_ATTENTION_FUNCTIONS (saw layer_idx {idx}, "
                          f"expected {expected} layers)")
        seen = sorted(seen, key=lambda s: s["layer"])
        self._windows = [s["window"] for s in seen]
        return seen, None

    def _init_shapes(self, layers: List[dict]) -> None:
        shapes = {s["kv_shape"] for s in layers}
        if len(shapes) != 1:
            raise ValueError(f"HFCausalLM: layers have different (KV heads, head dim) {sorted(shapes)}; "
                             f"StaticKVCache needs one shape for all layers")
        self.num_layers = len(layers)
        self.num_kv_heads, self.head_dim = shapes.pop()
        self.dtype = layers[0]["dtype"]
        with torch.no_grad():
            emb = self.model.get_output_embeddings()
            weight = getattr(emb, "weight", None)
            weight = weight() if callable(weight) else weight  # int8 dynamic-quantized Linear: weight()
            if weight is not None:
                self.vocab_size = int(weight.shape[0])
            else:
                self.vocab_size = int(self.config.get_text_config().vocab_size)
        windows = [w for w in self._windows if w is not None]
        self._min_window = min(windows) if windows else None

    # ------------------------------------------------------------------ public
    def capture_hidden(self, layers: Sequence[int] = (-1,)) -> int:
        """Later forwards also keep the hidden states ``layers`` of every node they score in the cache
        (:mod:`specdec.models.hidden`), which :meth:`new_cache` builds as a HiddenKVCache. Returns the width."""
        return enable_capture(self, layers)

    def new_cache(self, batch: int, capacity: int) -> StaticKVCache:
        """A StaticKVCache sized for this model: [batch, Hkv, capacity, D] per layer, the model's dtype / device
        (a HiddenKVCache with :meth:`capture_hidden` on)."""
        if self.hidden_spec is not None:  # the newest one is ``feature_cache`` (a feature drafter reads it)
            self.feature_cache = HiddenKVCache(self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity,
                                               self.hidden_width, dtype=self.dtype, device=self.device)
            return self.feature_cache
        return StaticKVCache(self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity,
                             dtype=self.dtype, device=self.device)

    @property
    def supports_paged(self) -> bool:
        """Whether forward / prefill take a :class:`~specdec.paged_cache.PagedKVView` (the lean forward, and
        the hooked path without sliding-window layers; the generic path reads the cache densely). With
        :meth:`capture_hidden` on, the paged cache keeps the hidden states in its blocks too."""
        return self._runner is not None or (self.hooked and self._min_window is None)

    def new_paged_cache(self, num_blocks: int, block_size: int = 16, max_requests: int = 8,
                        max_blocks_per_request: Optional[int] = None) -> PagedKVCache:
        """A PagedKVCache sized for this model (its dtype / device) with a scratch page (see PagedKVCache)."""
        if not self.supports_paged:
            raise ValueError(f"HFCausalLM.new_paged_cache: {type(self.model).__name__} runs on a path that reads "
                             f"the cache densely (generic fallback or sliding-window layers); use new_cache()")
        cache = PagedKVCache(self.num_layers, self.num_kv_heads, self.head_dim, num_blocks, block_size,
                             max_requests, max_blocks_per_request, dtype=self.dtype, device=self.device,
                             scratch_page=True, feature_dim=self.hidden_width if self.hidden_spec is not None else 0)
        if self.hidden_spec is not None:  # the newest one is ``feature_cache`` (a feature drafter reads it)
            self.feature_cache = cache
        return cache

    @torch.no_grad()
    def forward(self, cache: StaticKVCache, tokens: torch.Tensor, depths: torch.Tensor,
                tree_mask: Optional[torch.Tensor] = None, kv_offset: int = 0) -> torch.Tensor:
        """Score N new nodes per request: logits float32 [B, N, V].

        tokens [B, N] (-1 = padding, fed as token 0, output garbage); depths [B, N] int, depth below
        the root (root 0); tree_mask [B, N, N] bool (node i sees node j) or None (causal chain).
        The nodes' K/V are written at cache.lens[b] + j; cache.lens is NOT advanced (the caller
        commits). Position ids are cache.lens[b] + depths[b, j].

        ``kv_offset > 0``: this call continues a step whose first ``kv_offset`` new nodes are already
        in the cache (at lens[b] + j, j < kv_offset, e.g. a draft tree's earlier depths). The N nodes
        go to lens[b] + kv_offset + j and tree_mask is [B, N, kv_offset + N] over all the step's new
        nodes (None: each sees every earlier new node and itself, a chain). Nothing is recomputed.
        """
        kv_offset = self._check_call(cache, tokens, depths, tree_mask, kv_offset)
        if kv_offset and tree_mask is None:
            B, N = tokens.shape
            tree_mask = torch.ones(N, kv_offset + N, dtype=torch.bool, device=tokens.device).tril(kv_offset)
            tree_mask = tree_mask.expand(B, N, kv_offset + N)
        return self._forward(cache, tokens, depths, tree_mask, logits_to_keep=0, kv_offset=kv_offset)

    __call__ = forward

    @torch.no_grad()
    def forward_last(self, cache: StaticKVCache, tokens: torch.Tensor, depths: torch.Tensor,
                     last: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` of a causal chain per request (no tree mask) that returns only the logits
        at one node per request, ``last`` [B] (node index): float32 [B, V]. The LM head runs on B
        rows instead of B * N (a drafter catching up on many tokens needs the logits after the last)."""
        self._check_call(cache, tokens, depths, None, 0)
        B, N = tokens.shape
        last = torch.as_tensor(last, device=tokens.device).to(torch.long).view(B, 1)
        if self._runner is not None:  # the lean forward slices the hidden states per row (2-D positions)
            return self._forward(cache, tokens, depths, None, logits_to_keep=last)[:, 0]
        logits = self._forward(cache, tokens, depths, None, logits_to_keep=0)
        return logits[torch.arange(B, device=logits.device), last[:, 0]]

    @torch.no_grad()
    def prefill(self, cache: StaticKVCache, prompts: Sequence[Sequence[int]],
                rows: Optional[Sequence[int]] = None, starts: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Write each prompt's K/V into its cache row and return float32 logits [len(prompts), V] after its last token.

        rows[i] is the cache row of prompts[i] (default 0..len-1); each row is reset first and
        ends with cache.lens[row] = len(prompt). Ragged prompts: prompts whose rows are
        consecutive are run together, right-padded to the longest (padding sits after every real
        token, so the causal mask hides it; its K/V lands past lens and is overwritten later)
        while padding stays <= 25 % of the tokens, else one request at a time; each group in
        chunks of ``prefill_chunk`` positions. Logits are computed only at each prompt's last
        position. Prompt lengths are host values: no device sync.

        ``starts[i] > 0``: row ``rows[i]`` already holds the K/V of ``starts[i]`` earlier tokens (a
        cached prefix); ``prompts[i]`` continues it at positions ``starts[i]..`` and the row ends
        with ``cache.lens[row] = starts[i] + len(prompts[i])``.
        """
        prompts = [list(p) for p in prompts]
        rows = list(range(len(prompts))) if rows is None else [int(r) for r in rows]
        starts = [0] * len(prompts) if starts is None else [int(s) for s in starts]
        self._check_cache(cache, "prefill")
        check_prefill(cache, prompts, rows, starts, self.vocab_size)
        out = torch.empty(len(prompts), self.vocab_size, dtype=torch.float32, device=self.device)
        with ops.prefill_rows():  # the CPU GEMM tiles at every row count (see ops.prefill_rows)
            for group in prefill_groups(prompts, rows):
                prefill_group(self, cache, prompts, rows, starts, group, out)
        return out

    # ------------------------------------------------------------------ internals
    def _check_cache(self, cache, what: str) -> None:
        if isinstance(cache, PagedKVView):
            if not self.supports_paged:
                raise TypeError(f"HFCausalLM.{what}: {type(self.model).__name__} cannot run on a paged cache "
                                f"(generic fallback or sliding-window layers); use new_cache()")
        elif not isinstance(cache, StaticKVCache):
            raise TypeError(f"HFCausalLM.{what}: cache must be a StaticKVCache or a PagedKVView, "
                            f"got {type(cache).__name__}")

    def _check_call(self, cache, tokens, depths, tree_mask, kv_offset: int = 0) -> int:
        self._check_cache(cache, "forward")
        if cache.num_layers != self.num_layers or cache.num_kv_heads != self.num_kv_heads or \
                cache.head_dim != self.head_dim or cache.dtype != self.dtype:
            raise ValueError(f"HFCausalLM.forward: cache (layers {cache.num_layers}, KV heads {cache.num_kv_heads}, "
                             f"head dim {cache.head_dim}, {cache.dtype}) does not match the model (layers "
                             f"{self.num_layers}, KV heads {self.num_kv_heads}, head dim {self.head_dim}, "
                             f"{self.dtype}); build it with new_cache()")
        if tokens.dim() != 2 or tokens.shape[0] != cache.batch:
            raise ValueError(f"HFCausalLM.forward: tokens must be [B, N] with B = cache.batch = {cache.batch}, "
                             f"got {tuple(tokens.shape)}")
        if depths.shape != tokens.shape:
            raise ValueError(f"HFCausalLM.forward: depths must have the shape of tokens {tuple(tokens.shape)}, "
                             f"got {tuple(depths.shape)}")
        B, N = tokens.shape
        check_int("HFCausalLM.forward", "kv_offset", kv_offset, lo=0, type_error=False)
        nkv = kv_offset + N
        if tree_mask is not None and (tree_mask.shape != (B, N, nkv) or tree_mask.dtype != torch.bool):
            raise ValueError(f"HFCausalLM.forward: tree_mask must be bool [B, N, kv_offset + N] = [{B}, {N}, {nkv}], "
                             f"got {tree_mask.dtype} {tuple(tree_mask.shape)}")
        if nkv > cache.capacity:
            raise ValueError(f"HFCausalLM.forward: kv_offset + N = {nkv} nodes exceed the cache capacity "
                             f"{cache.capacity}")
        return kv_offset

    def _forward(self, cache, tokens, depths, tree_mask, logits_to_keep, kv_offset: int = 0,
                 head: bool = True) -> torch.Tensor:
        """Shared by forward and prefill; logits_to_keep as transformers' slice_logits_to_keep; ``head=False``
        (the lean forward only): the LM head's input instead of the logits."""
        token = FAST_LINEAR.set(self.fast_linear)
        hooks = self._capture  # capture_hidden() on the hooked / generic paths
        if hooks is not None:
            hooks.active = True
        try:
            logits = self._forward_impl(cache, tokens, depths, tree_mask, logits_to_keep, kv_offset, head)
        finally:
            FAST_LINEAR.reset(token)
            if hooks is not None:
                hooks.active = False
        if self.hidden_spec is not None and getattr(cache, "feature_dim", 0):
            write_hidden(cache, self._runner.captured if hooks is None else hooks.take(), kv_offset)
        return logits

    def _forward_impl(self, cache, tokens, depths, tree_mask, logits_to_keep, kv_offset: int = 0,
                      head: bool = True) -> torch.Tensor:
        if self._runner is not None:
            positions = cache.lens.unsqueeze(1) + depths  # [B, N], int32 or int64 (the runner's rope takes either)
            out = self._runner(cache, tokens.clamp(min=0), positions, tree_mask, logits_to_keep, kv_offset=kv_offset,
                               head=head)
            return out.float() if head else out
        B, N = tokens.shape
        call = AttentionCall(cache=cache, tree_mask=tree_mask, kv_offset=kv_offset)
        if not self.hooked:
            return forward_generic(self, call, tokens, depths, logits_to_keep)
        if self._min_window is not None and cache.capacity > self._min_window:
            # Sliding-window model whose cache can outgrow the window: one host read per call.
            max_len = int(cache.lens.max())
            if max_len + kv_offset + N > self._min_window:
                if kv_offset:
                    raise ValueError(f"HFCausalLM.forward: kv_offset > 0 past the sliding window "
                                     f"({self._min_window}) is not supported (the masked window path needs the "
                                     f"depths of the step's earlier nodes); draft with a chain or spine tree")
                if not self._warned_window:
                    warnings.warn(f"HFCausalLM: positions past the sliding window ({self._min_window}); "
                                  f"sliding layers use a masked attention path (correct, slower)", stacklevel=3)
                    self._warned_window = True
                call.window_ok = False
                call.total_len = max_len + N
                call.depths = depths
        logits = self._call_model(call, tokens, depths, pass_kwarg=self._pass_kwarg, logits_to_keep=logits_to_keep)
        return logits.float()

    def _call_model(self, call: AttentionCall, tokens, depths, pass_kwarg: bool, logits_to_keep) -> torch.Tensor:
        """Run the model with the "specdec" attention implementation for this call only."""
        ids = tokens.clamp(min=0)
        if call.cache is None:  # probe
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        else:
            positions = call.cache.lens.to(torch.long).unsqueeze(1) + depths.to(torch.long)  # [B, N]
        kwargs = {}
        if selects_positions(logits_to_keep) and self._keep_logits:
            kwargs["logits_to_keep"] = logits_to_keep
        if pass_kwarg:
            kwargs[CALL_KWARG] = call
        saved = [cfg._attn_implementation_internal for cfg in self._configs]
        token = ACTIVE_CALL.set(call)
        try:
            for cfg in self._configs:
                cfg._attn_implementation_internal = ATTN_NAME
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False, **kwargs)
        finally:
            for cfg, impl in zip(self._configs, saved):
                cfg._attn_implementation_internal = impl
            ACTIVE_CALL.reset(token)
        return self._select_logits(out.logits, logits_to_keep)

    def _select_logits(self, logits: torch.Tensor, logits_to_keep) -> torch.Tensor:
        if self._keep_logits or not selects_positions(logits_to_keep):
            return logits
        from transformers.modeling_utils import slice_logits_to_keep
        return slice_logits_to_keep(logits, logits_to_keep)

    def __repr__(self) -> str:
        path = "hooked" if self.hooked else "generic fallback"
        return (f"HFCausalLM({type(self.model).__name__}, {path}, layers={self.num_layers}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, vocab={self.vocab_size}, {self.dtype})")
