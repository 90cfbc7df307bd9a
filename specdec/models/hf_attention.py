"""The attention side of :class:`specdec.models.hf.HFCausalLM`: the "specdec" attention function,
the masks of the masked paths, the transformers ``Cache`` bridge of the generic fallback, and the
construction-time probes that decide which path a model takes.

Hooked path. At import this module registers one attention function, ``"specdec"``
(:func:`specdec_attention`), in transformers' ``AttentionInterface``. During an HFCausalLM call the
model's attention implementation is switched to it, the model runs with ``use_cache=False`` (HF
keeps no cache of its own) and, in every layer, the function receives the new nodes' query / key /
value (after RoPE) and does

    ops.append_kv(cache.k[l], cache.v[l], key, value, cache.lens)         # new K/V at lens[b] + j
    ops.verify_attention(query.transpose(1, 2), cache.k[l], cache.v[l], cache.lens, tree_mask, scaling)

Position ids are ``cache.lens[b] + depths[b, j]``. No attention mask is ever built: "specdec" is
deliberately NOT registered in ``AttentionMaskInterface``, and transformers 5.x returns from
``create_causal_mask`` / ``create_sliding_window_causal_mask`` before doing any work for an
implementation that has no mask function (``masking_utils._preprocess_mask_arguments``:
"For TGI/vLLM backends, or other custom attention without equivalent mask creation"). So a
step costs what the model's own layers cost plus the two ops: no host sync, no ``.item()``,
no O(prefix) work outside verify_attention.

The per-call state (:class:`AttentionCall`: cache, tree mask) reaches the attention function
through the model's forward kwargs (``specdec_call=...``) when the model forwards ``**kwargs``
down to its attention modules (checked once at construction), otherwise through the
:data:`ACTIVE_CALL` ``contextvars.ContextVar`` set for the duration of the call.

Sliding-window layers (Mistral, Gemma2/3, Qwen2 with ``use_sliding_window``): while every
position of the call is inside the window (always when ``cache.capacity <= window``: checked
with no host read) the window changes nothing and verify_attention is exact. Past the window
(one host read of ``max(cache.lens)`` per call, sliding models only) the sliding layers switch
for that call to a masked attention over the cache (:func:`masked_attention`: correct, slower).

Generic fallback (models that cannot be hooked: attention that bypasses the registry,
attention-logit softcapping (Gemma2), non-causal or sink / position-bias attention, or
``hook=False``): the model runs with its own attention implementation on a transformers ``Cache``
(:class:`StaticCacheBridge`) whose ``update`` writes into the same :class:`StaticKVCache`
(``append_kv``) and returns the first ``max(lens) + N`` positions, plus a 4-D additive float mask
(:func:`visibility`, :func:`additive_mask`: prefix < lens[b], tree_mask among the new nodes,
sliding windows per layer type). Same cache layout, same commit, same results; one host read per
call and O(N x (max_len + N)) mask work.
"""
from __future__ import annotations

import contextvars
import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from specdec import ops, paged_ops
from specdec.cache import StaticKVCache

try:
    from transformers.cache_utils import Cache
    from transformers.modeling_utils import AttentionInterface
except ImportError as exc:  # pragma: no cover - transformers is a dependency of this module
    raise ImportError("specdec.models.hf needs transformers (pip install 'transformers==5.24.0')") from exc

__all__ = ["ATTN_NAME", "CALL_KWARG", "UNSUPPORTED_ATTN_KWARGS", "ACTIVE_CALL", "FAST_LINEAR", "AttentionCall",
           "specdec_attention", "linear_forward", "install_fast_linear", "selects_positions", "probe_attention",
           "visibility", "additive_mask", "masked_attention", "StaticCacheBridge", "hook_blocker", "probe_tokens",
           "probe_generic", "config_windows"]

ATTN_NAME = "specdec"
CALL_KWARG = "specdec_call"
# kwargs of an attention call that change its math in ways verify_attention does not do
UNSUPPORTED_ATTN_KWARGS = ("softcap", "s_aux", "sinks", "position_bias", "attention_chunk_size")

# The state of the HFCausalLM call in flight (fallback route when the model drops **kwargs).
ACTIVE_CALL: contextvars.ContextVar[Optional["AttentionCall"]] = contextvars.ContextVar("specdec_active_call",
                                                                                        default=None)
# True while an HFCausalLM with fast_linear=True runs its model: nn.Linear layers then call ops.linear.
FAST_LINEAR: contextvars.ContextVar[bool] = contextvars.ContextVar("specdec_fast_linear", default=False)


def linear_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward, routed to specdec's weight-streaming ops.linear inside HFCausalLM calls."""
    if FAST_LINEAR.get() and input.dtype == self.weight.dtype and input.device == self.weight.device:
        return ops.linear(input, self.weight, self.bias)
    return F.linear(input, self.weight, self.bias)


def install_fast_linear(model: torch.nn.Module) -> int:
    """Route every plain nn.Linear of ``model`` through :func:`linear_forward`; returns how many.

    Outside an HFCausalLM call the routed forward is ``F.linear`` exactly as before, so the
    model object keeps working everywhere else (e.g. transformers' ``generate``).
    Subclasses of nn.Linear (quantized, LoRA, ...) keep their own forward.
    """
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dim() == 2 and \
                module.weight.dtype in (torch.float32, torch.float16, torch.bfloat16):
            if not getattr(module, "_specdec_fast_linear", False):
                module.forward = types.MethodType(linear_forward, module)
                module._specdec_fast_linear = True
            count += 1
    return count


@dataclass
class AttentionCall:
    """What the attention function needs for one forward: the cache, the tree mask, window info."""

    cache: Optional[StaticKVCache]
    tree_mask: Optional[torch.Tensor]            # [B, N, kv_offset + N] bool or None (causal chain)
    depths: Optional[torch.Tensor] = None        # [B, N] int64 (window masks only)
    window_ok: bool = True                       # every position of this call is inside every window
    total_len: int = 0                           # max(lens) + N, host value (window path only)
    masks: Dict[Optional[int], torch.Tensor] = field(default_factory=dict)  # window -> additive bias
    probe: Optional[dict] = None                 # construction-time probe record
    kwarg_seen: bool = False
    kv_offset: int = 0                           # new nodes of this step already in the cache (draft trees)


def specdec_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, sliding_window: Optional[int] = None, **kwargs):
    """The "specdec" attention function: query [B, Hq, N, D], key / value [B, Hkv, N, D] (after RoPE).

    Returns (out [B, N, Hq, D], None) as every transformers attention function does.
    """
    call = kwargs.get(CALL_KWARG)
    if call is not None:
        call.kwarg_seen = True
    else:
        call = ACTIVE_CALL.get()
    if call is None:
        raise RuntimeError("specdec attention was called outside HFCausalLM.forward/prefill; the model's attention "
                           "implementation is only switched to 'specdec' for the duration of those calls")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if call.probe is not None:
        return probe_attention(call.probe, module, query, key, value, scaling, sliding_window, kwargs)
    for name in UNSUPPORTED_ATTN_KWARGS:  # construction-time probe routes such models to the fallback
        if kwargs.get(name) is not None:
            raise RuntimeError(f"specdec attention: unsupported attention argument {name!r} at run time "
                               f"(use HFCausalLM(model, hook=False))")
    cache = call.cache
    layer = module.layer_idx
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    if getattr(cache, "paged", False):  # a PagedKVView (HFCausalLM sends no window-masked call here)
        paged_ops.append_kv_paged(k_cache, v_cache, key, value, cache.block_tables, cache.lens, call.kv_offset)
        return paged_ops.verify_attention_paged(query.transpose(1, 2), k_cache, v_cache, cache.block_tables,
                                                cache.lens, call.tree_mask, scaling), None
    ops.append_kv(k_cache, v_cache, key, value, cache.lens, call.kv_offset)
    if sliding_window is not None and not call.window_ok:
        return masked_attention(call, query, k_cache, v_cache, scaling, int(sliding_window)), None
    out = ops.verify_attention(query.transpose(1, 2), k_cache, v_cache, cache.lens, call.tree_mask, scaling)
    return out, None


# Registered once, at import: the registry is process-wide and keyed by name.
AttentionInterface.register(ATTN_NAME, specdec_attention)


def selects_positions(logits_to_keep) -> bool:
    """Whether a logits_to_keep value selects positions (0 keeps all of them)."""
    return isinstance(logits_to_keep, torch.Tensor) or logits_to_keep != 0


def probe_attention(record: dict, module, query, key, value, scaling, sliding_window, kwargs):
    """Construction-time probe: note what each layer passes, answer with plain causal attention."""
    layer = getattr(module, "layer_idx", None)
    unsupported = [n for n in UNSUPPORTED_ATTN_KWARGS if kwargs.get(n) is not None]
    if not getattr(module, "is_causal", True):
        unsupported.append("is_causal=False")
    record.setdefault("layers", []).append(
        dict(layer=layer, kv_shape=tuple(key.shape[1:2]) + tuple(key.shape[3:]), dtype=key.dtype,
             window=sliding_window, unsupported=unsupported))
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


def visibility(lens: torch.Tensor, depths: torch.Tensor, tree_mask: Optional[torch.Tensor], total_len: int,
               window: Optional[int]) -> torch.Tensor:
    """[B, N, T] bool: query i of request b sees cache position s (T = max(lens) + N).

    Prefix s < lens[b] (within ``window`` of the query position when given); new node j at
    lens[b] + j iff tree_mask[b, i, j] (causal chain when None). Positions are lens + depth.
    With a [B, N, Nkv] mask (Nkv > N: the queries are the last N of Nkv new nodes) ``window``
    must be None (the depths of the earlier nodes are not known here).
    """
    B, N = depths.shape
    Nkv = N if tree_mask is None else tree_mask.shape[2]
    dev = depths.device
    s = torch.arange(total_len, device=dev)                        # [T]
    start = lens.to(torch.long).view(B, 1, 1)                      # [B, 1, 1]
    depth = depths.to(torch.long)                                  # [B, N]
    vis = (s < start).expand(B, N, total_len)                      # prefix
    j = s - start                                                  # [B, 1, T] node index of s
    inside = (j >= 0) & (j < Nkv)
    jc = j.clamp(0, Nkv - 1).expand(B, N, total_len)
    if tree_mask is None:
        tree_mask = torch.ones(N, N, dtype=torch.bool, device=dev).tril().expand(B, N, N)
    tree = torch.gather(tree_mask.to(torch.bool), 2, jc) & inside  # [B, N, T]
    if window is not None:
        q_pos = start.view(B, 1) + depth                           # [B, N]
        vis = vis & (q_pos.unsqueeze(2) - s < window)
        k_depth = torch.gather(depth.unsqueeze(1).expand(B, N, N), 2, jc)
        tree = tree & (depth.unsqueeze(2) - k_depth < window)
    return vis | tree


def additive_mask(vis: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, N, T] bool -> [B, 1, N, T] additive bias (0 / finfo.min: finite, so masked keys never yield NaN)."""
    bias = torch.zeros(vis.shape, dtype=dtype, device=vis.device)
    return bias.masked_fill_(~vis, torch.finfo(dtype).min).unsqueeze(1)


def masked_attention(call: AttentionCall, query, k_cache, v_cache, scaling: float, window: int) -> torch.Tensor:
    """Sliding-window layer past its window: masked attention over the first max(lens) + N positions."""
    bias = call.masks.get(window)
    if bias is None:  # built once per call and window, shared by all layers
        vis = visibility(call.cache.lens, call.depths, call.tree_mask, call.total_len, window)
        bias = call.masks[window] = additive_mask(vis, query.dtype)
    T = call.total_len
    k, v = k_cache[:, :, :T], v_cache[:, :, :T]
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=bias, scale=scaling,
                                         enable_gqa=query.shape[1] != k.shape[1])
    return out.transpose(1, 2)


class StaticCacheBridge(Cache):
    """A transformers ``Cache`` over a StaticKVCache, for the generic (unhooked) path.

    ``update`` writes the new K/V at lens[b] + j (append_kv, lens unchanged) and returns the
    first ``total_len`` positions; the caller's 4-D mask hides everything that is not visible.
    With ``cache=None`` it only records the per-layer K/V shapes (construction-time probe).
    """

    is_compileable = False

    def __init__(self, cache: Optional[StaticKVCache], total_len: int, kv_offset: int = 0) -> None:
        super().__init__(layers=[])
        self.static = cache
        self.total_len = total_len
        self.kv_offset = kv_offset
        self.seen: List[dict] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.static is None:
            self.seen.append(dict(layer=layer_idx, kv_shape=(key_states.shape[1], key_states.shape[3]),
                                  dtype=key_states.dtype))
            return key_states, value_states
        k_cache, v_cache = self.static.k[layer_idx], self.static.v[layer_idx]
        ops.append_kv(k_cache, v_cache, key_states, value_states, self.static.lens, self.kv_offset)
        return k_cache[:, :, :self.total_len], v_cache[:, :, :self.total_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.static is None else self.total_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return (query_length, 0) if self.static is None else (self.total_len, 0)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


# ---------------------------------------------------------------------- construction-time probes
def hook_blocker(config) -> Optional[str]:
    """Why the model's config rules out the "specdec" attention function (None: nothing does)."""
    text = config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return (f"attention logit softcapping ({text.attn_logit_softcapping}) is not supported by "
                f"verify_attention")
    if not getattr(text, "is_causal", True) or getattr(text, "use_bidirectional_attention", False):
        return "the model's attention is not causal"
    return None


def probe_tokens(device) -> torch.Tensor:
    """The 3-token input every probe forward runs."""
    return torch.tensor([[1, 2, 3]], dtype=torch.long, device=device)


def probe_generic(model: torch.nn.Module, cache_kwarg: str, device) -> List[dict]:
    """Run 3 tokens through the model's own attention on a recording :class:`StaticCacheBridge`:
    one record (layer, kv_shape, dtype) per layer that writes the cache, in layer order."""
    bridge = StaticCacheBridge(None, 0)
    ids = probe_tokens(device)
    mask = additive_mask(torch.ones(1, 3, 3, dtype=torch.bool, device=device).tril(),
                         model.get_input_embeddings().weight.dtype)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(3, device=device).unsqueeze(0),
              attention_mask=mask, use_cache=True, **{cache_kwarg: bridge})
    if not bridge.seen:
        raise TypeError(f"HFCausalLM: {type(model).__name__} neither routes attention through "
                        f"ALL_ATTENTION_FUNCTIONS nor uses the transformers Cache API; it cannot be driven")
    return sorted(bridge.seen, key=lambda s: s["layer"])


def config_windows(config) -> dict:
    """Sliding-window layout from the config, for the generic path's masks."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return {"window": None, "mixed": False}
    if layer_types is not None and set(layer_types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"HFCausalLM: layer types {sorted(set(layer_types))} are not supported by the generic path")
    mixed = layer_types is not None and "full_attention" in layer_types
    return {"window": int(window), "mixed": mixed}
