"""A lean forward for Llama-style decoders (Llama / SmolLM2, Qwen2, Mistral without an active window).

Why: on a CPU a small model spends as much time per forward in transformers' per-layer Python
(module calls, kwargs plumbing, mask / cache bookkeeping, dozens of small torch ops per layer)
as its weights take to stream, and a draft model pays that on every drafted token. This runner
reads the model's own parameters and runs the same math with 11 op calls per layer
(fused_ops=True, the default: specdec's fused small ops, transformers' rounding steps):

    h = embed(ids);  x = rms_norm(h)
    per layer:  q, k, v = linear(x)  (+ bias: Qwen2);  q, k = rope(q, k, cos, sin) with the
                model's own rotary tables (any rope_type);  append_kv + verify_attention on the
                StaticKVCache;  x, h = add_rms_norm(o_proj(attn), h);
                x, h = add_rms_norm(down(silu_mul(gate(x), up(x))), h)  (the next layer's norm,
                or the final one)
    logits = lm_head(x[positions kept])

With fused_layers=True (the default) a layer whose projections are all known layer types runs
as ONE ops.decoder_layer call: the same kernels in the same order, called from C++ (on the CPU
with float32 activations, on raw pointers with one workspace): bit-identical.

fused_ops=False runs transformers' expressions with torch's ops (RMSNorm in float32, rotate-half
RoPE, SiLU times up): the path a model whose norm weights are not in the activations' dtype
takes, since the fused ops take norm weights of that dtype.

Linear layers are called as specdec.ops.linear on their weight (nn.Linear, Int8Linear);
any other module type is called as a module (e.g. torch.ao dynamic-quantized layers).
Support is decided once from the model's classes and config (:func:`build`); anything
unrecognised returns a reason and HFCausalLM keeps transformers' modules. Equality with
transformers' own forward is tested (tests/test_models.py).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from transformers.modeling_utils import slice_logits_to_keep

from specdec import ops, paged_ops
from specdec.models.lean_linear import Q8ACT, Spec, as_dtype, linear_fn, linear_spec, quant_bits
from specdec.models.rotary_table import RotaryTable

__all__ = ["LlamaRunner", "build"]

_SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class _Layer:
    __slots__ = ("ln1_w", "ln1_eps", "ln2_w", "ln2_eps", "q", "k", "v", "o", "gate", "up", "down", "scale",
                 "qkv", "gate_up", "fused")


def _adjacent(parts: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor spanning ``parts`` when they are consecutive row blocks of one contiguous storage."""
    first = parts[0]
    if not all(t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for t in parts):
        return None
    for a, b in zip(parts, parts[1:]):
        if b.storage_offset() != a.storage_offset() + a.numel():
            return None
    rows = sum(t.shape[0] for t in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]),
                                   first.stride())


def _merged_spec(modules) -> Optional[Spec]:
    """One projection for several quantized linears of the same input (q / k / v, gate / up): their
    buffers are concatenated along N once and each module's buffers become views of the merged
    ones (no extra memory; the modules compute what they did). None when they are not all
    specdec-quantized layers of one format (float nn.Linear weights stay the user's tensors)."""
    from specdec.models.quant import GroupQuantLinear, Int8Linear, q8act_forget, q8act_weight

    kind = type(modules[0])
    if kind not in (GroupQuantLinear, Int8Linear) or any(type(m) is not kind for m in modules):
        return None
    if kind is GroupQuantLinear:
        names = ("qweight", "scales", "mins", "bias")
        if len({(quant_bits(m), m.in_features, m.mins is None, m.bias is None) for m in modules}) != 1:
            return None
    else:
        names = ("qweight", "scale", "bias")
        if len({(m.in_features, m.bias is None) for m in modules}) != 1:
            return None
    merged = {}
    for name in names:
        parts = [getattr(m, name) for m in modules]
        if parts[0] is None:
            merged[name] = None
            continue
        whole = _adjacent(parts)
        if whole is not None:  # merged before (another adapter on this model): share it
            merged[name] = whole
            continue
        whole = torch.cat(parts, 0)
        merged[name] = whole
        start = 0
        for m, t in zip(modules, parts):
            setattr(m, name, whole[start:start + t.shape[0]])  # a view: the model keeps working unchanged
            start += t.shape[0]
    if kind is GroupQuantLinear:
        bits, qw = quant_bits(modules[0]), merged["qweight"]
        if bits & Q8ACT:  # the CPU's packed layout of the merged weight, kept on the first module
            qw = q8act_weight(modules[0], qw, merged["scales"], merged["mins"], bits & ~Q8ACT, slot="merged")
            for m in modules:  # their own packed copies (a module forward made them) would only take memory
                q8act_forget(m)
        return (qw, merged["scales"], merged["mins"], merged["bias"], bits)
    return (merged["qweight"], merged["scale"], None, merged["bias"], 0)


def _spec_fn(spec: Optional[Spec]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """A call of one projection (the bias in the input's dtype, as the modules do)."""
    if spec is None:
        return None
    w, s, m, b, bits = spec
    if bits:
        act = "q8" if bits & Q8ACT else None
        return lambda x: ops.qlinear(x, w, s, m, b if b is None or b.dtype == x.dtype else b.to(x.dtype),
                                     bits & ~Q8ACT, act=act)
    return lambda x: ops.linear(x, w, b if b is None or b.dtype == x.dtype else b.to(x.dtype), s)


def _attend(cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask, kv_offset: int,
            scale: float) -> torch.Tensor:
    """append_kv + verify_attention of one layer (q [B, N, Hq, D], k / v [B, N, Hkv, D]) on a dense
    StaticKVCache or, through its block tables, a PagedKVView."""
    kc, vc = cache.k[layer], cache.v[layer]
    if getattr(cache, "paged", False):
        paged_ops.append_kv_paged(kc, vc, k.transpose(1, 2), v.transpose(1, 2), cache.block_tables, cache.lens,
                                  kv_offset)
        return paged_ops.verify_attention_paged(q, kc, vc, cache.block_tables, cache.lens, tree_mask, scale)
    ops.append_kv(kc, vc, k.transpose(1, 2), v.transpose(1, 2), cache.lens, kv_offset)
    return ops.verify_attention(q, kc, vc, cache.lens, tree_mask, scale)


class LlamaRunner:
    """Callable ``(cache, ids [B, N], positions [B, N], tree_mask, logits_to_keep) -> logits``."""

    def __init__(self, model: torch.nn.Module, layers: List[_Layer], heads: Tuple[int, int, int],
                 fast_linear: bool, fused_ops: bool = True) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm_w, self.norm_eps = inner.norm.weight, float(inner.norm.variance_epsilon)
        self.lm_head = linear_fn(model.lm_head, fast_linear)
        #: whether lm_head is one of specdec's batch-invariant ops (a row's logits the same bits whatever rows
        #: share the call, up to 64): then the head may run on any subset of a pass's rows (HFCausalLM.head_logits)
        self.head_batch_invariant = getattr(self.lm_head, "batch_invariant", False)
        #: torch.argmax(lm_head(x), -1) without the logits (None: the head is not one of specdec's ops)
        self.head_argmax: Optional[Callable[[torch.Tensor], torch.Tensor]] = getattr(self.lm_head, "argmax", None)
        self.layers = layers
        self.hq, self.hkv, self.head_dim = heads
        self.rope = RotaryTable(self.rotary, self.head_dim)  # the rotary module's values, by table lookup
        self.embed_fn = self._embedding()  # the token embedding: F.embedding for a plain nn.Embedding, else the module
        dtype = self.embed.weight.dtype
        norms = [self.norm_w] + [w for L in layers for w in (L.ln1_w, L.ln2_w)]
        # the fused ops take norm weights of the activations' dtype (transformers keeps them so)
        self.fused_ops = bool(fused_ops) and all(w.dtype == dtype for w in norms)
        if not self.fused_ops:
            for L in layers:
                L.fused = None
        self.fused_layers = sum(L.fused is not None for L in layers)  # layers run as one ops.decoder_layer call
        #: hidden states to keep from each call (see HFCausalLM.capture_hidden): indices i < L = the
        #: residual stream entering layer i, -1 = the final normed state; the call leaves them in ``captured``
        self.capture: Optional[Tuple[int, ...]] = None
        self.captured: Optional[List[torch.Tensor]] = None
        #: every layer fused: one torch.classes.specdec.DecoderStack call per forward runs them all (the
        #: same decoder_layer calls from C++); set to None to run the per-layer Python loop instead
        self.stack = self._make_stack() if self.fused_ops and self.fused_layers == len(layers) and layers else None

    def _make_stack(self):
        st = torch.classes.specdec.DecoderStack(self.hq, self.hkv)
        for l, L in enumerate(self.layers):
            nw, ne = (self.layers[l + 1].ln1_w, self.layers[l + 1].ln1_eps) if l + 1 < len(self.layers) else (
                self.norm_w, self.norm_eps)
            w, sc, mn, b, bits = L.fused
            st.add_layer(list(w), list(sc), list(mn), list(b), [int(x) for x in bits], L.ln2_w, float(L.ln2_eps), nw,
                         float(ne), float(L.scale))
        return st

    def _embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The token embedding as one call: F.embedding on the weight for a plain nn.Embedding (its
        forward's values; no module dispatch), else the module."""
        e = self.embed
        if type(e) is torch.nn.Embedding and e.max_norm is None:
            return lambda ids: F.embedding(ids, e.weight)
        return e

    @staticmethod
    def _rms(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # transformers' RMSNorm: in float32, back to the input dtype, then times the weight
        return w * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def __call__(self, cache, ids: torch.Tensor, positions: torch.Tensor, tree_mask: Optional[torch.Tensor],
                 logits_to_keep, kv_offset: int = 0, head: bool = True) -> torch.Tensor:
        """Logits of the kept rows; ``head=False``: their final normed hidden states instead (the LM head's
        input: :meth:`lm_head` on any subset of them gives those rows' logits, the head being batch invariant)."""
        if self.fused_ops:
            return self._fused(cache, ids, positions, tree_mask, logits_to_keep, kv_offset, head)
        B, N = ids.shape
        h = self.embed_fn(ids)
        cos, sin = self.rope(h, positions, getattr(cache, "capacity", None))  # [B, N, D] in h's dtype
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, N, 1, D]: broadcast over heads
        D = self.head_dim
        keep = self._keep_start()
        for l, L in enumerate(self.layers):
            if keep is not None and l in keep:
                keep[l] = h.clone()
            x = self._rms(h, L.ln1_w, L.ln1_eps)
            q = self._rope(L.q(x).view(B, N, self.hq, D), cos, sin)
            k = self._rope(L.k(x).view(B, N, self.hkv, D), cos, sin)
            v = L.v(x).view(B, N, self.hkv, D)
            a = _attend(cache, l, q, k, v, tree_mask, kv_offset, L.scale)
            h = h + L.o(a.reshape(B, N, self.hq * D))
            x = self._rms(h, L.ln2_w, L.ln2_eps)
            h = h + L.down(F.silu(L.gate(x)) * L.up(x))
        x = self._rms(h, self.norm_w, self.norm_eps)
        self._keep_end(keep, x)
        if isinstance(logits_to_keep, torch.Tensor) or logits_to_keep != 0:
            x = slice_logits_to_keep(x, logits_to_keep)  # the norm is per row: slicing after it is the same
        return self.lm_head(x) if head else x

    def _keep_start(self) -> Optional[dict]:
        self.captured = None
        return None if self.capture is None else {i: None for i in self.capture}

    def _keep_end(self, keep: Optional[dict], final: torch.Tensor) -> None:
        if keep is not None:  # clones: the fused ops may reuse their buffers on the next call
            self.captured = [final.clone() if i == -1 else keep[i] for i in self.capture]


    def _fused(self, cache, ids, positions, tree_mask, logits_to_keep, kv_offset, head=True):
        B, N = ids.shape
        D, hq, hkv = self.head_dim, self.hq, self.hkv
        h = self.embed_fn(ids)
        cos, sin = self.rope(h, positions, getattr(cache, "capacity", None))  # [B or 1, N, D] in h's dtype
        if cos.shape[0] != B:
            cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
        layers = self.layers
        paged = getattr(cache, "paged", False)  # a PagedKVView: the paged layer op / paged attention
        x = ops.rms_norm(h, layers[0].ln1_w, layers[0].ln1_eps)
        nq, nkv = hq * D, hkv * D
        keep = self._keep_start()
        if self.stack is not None and h.device.type == "cpu":  # every layer in one call: decoder_layer from C++
            want = [i for i in keep or () if i != -1]
            out = self.stack.forward(x, h, cache.k, cache.v, cache.lens, cos, sin, tree_mask, kv_offset, want,
                                     cache.block_tables if paged else None)
            x = out[0]
            if keep is not None:
                keep.update(zip(want, out[2:]))
        else:
            for l, L in enumerate(layers):
                if keep is not None and l in keep:
                    keep[l] = h.clone()
                nw, ne = (layers[l + 1].ln1_w, layers[l + 1].ln1_eps) if l + 1 < len(layers) else (
                    self.norm_w, self.norm_eps)
                if L.fused is not None:
                    if paged:
                        x, h = paged_ops.decoder_layer_paged(x, h, *L.fused, L.ln2_w, L.ln2_eps, nw, ne, cache.k[l],
                                                             cache.v[l], cache.block_tables, cache.lens, cos, sin,
                                                             tree_mask, kv_offset, L.scale, hq, hkv)
                    else:
                        x, h = ops.decoder_layer(x, h, *L.fused, L.ln2_w, L.ln2_eps, nw, ne, cache.k[l], cache.v[l],
                                                 cache.lens, cos, sin, tree_mask, kv_offset, L.scale, hq, hkv)
                    continue
                if L.qkv is not None:
                    q, k, v = L.qkv(x).split([nq, nkv, nkv], dim=-1)
                else:
                    q, k, v = L.q(x), L.k(x), L.v(x)
                q, k = ops.rope(q.view(B, N, hq, D), k.view(B, N, hkv, D), cos, sin)
                a = _attend(cache, l, q, k, v.view(B, N, hkv, D), tree_mask, kv_offset, L.scale)
                x, h = ops.add_rms_norm(L.o(a.reshape(B, N, hq * D)), h, L.ln2_w, L.ln2_eps)
                if L.gate_up is not None:
                    g, u = L.gate_up(x).chunk(2, dim=-1)
                else:
                    g, u = L.gate(x), L.up(x)
                x, h = ops.add_rms_norm(L.down(ops.silu_mul(g, u)), h, nw, ne)
        self._keep_end(keep, x)
        if isinstance(logits_to_keep, torch.Tensor) or logits_to_keep != 0:
            x = slice_logits_to_keep(x, logits_to_keep)  # the norm is per row: slicing after it is the same
        return self.lm_head(x) if head else x


def build(model: torch.nn.Module, fast_linear: bool = True, fused_ops: bool = True,
          fused_layers: bool = True) -> Tuple[Optional[LlamaRunner], str]:
    """(runner, "") when the model is a supported Llama-style decoder, else (None, why not).

    fast_linear: run plain nn.Linear weights through specdec.ops.linear (else F.linear).
    fused_ops: the fused small ops (rms_norm, add_rms_norm, rope, silu_mul); else torch's.
    fused_layers (with fused_ops): each layer whose projections are all known layer types
    (nn.Linear with fast_linear, specdec's Int8Linear / GroupQuantLinear) runs as ONE
    ops.decoder_layer call (the same kernels in the same order, from C++)."""
    name = type(model).__name__
    if name not in _SUPPORTED:
        return None, f"{name} is not one of {_SUPPORTED}"
    cfg = model.config
    if getattr(cfg, "hidden_act", None) != "silu":
        return None, f"hidden_act {getattr(cfg, 'hidden_act', None)!r} (silu expected)"
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        return None, "pretraining_tp > 1"
    if getattr(cfg, "sliding_window", None) is not None and (
            name == "MistralForCausalLM" or getattr(cfg, "use_sliding_window", False)):
        return None, "sliding-window attention"
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return None, f"layer types {sorted(set(layer_types))}"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "rotary_emb", "norm", "layers")
    if inner is None or any(not hasattr(inner, a) for a in needed) or not hasattr(model, "lm_head"):
        return None, "unexpected module layout"
    if type(inner.embed_tokens) is not torch.nn.Embedding:
        return None, f"embedding {type(inner.embed_tokens).__name__}"
    layers: List[_Layer] = []
    heads = None
    for i, layer in enumerate(inner.layers):
        shape, why = _layer_heads(i, layer)
        if shape is None:
            return None, why
        if heads is not None and heads != shape:
            return None, "layers differ in head layout"
        heads = shape
        layers.append(_make_layer(model, layer, shape[2], fast_linear, fused_ops, fused_layers))
    if not layers:
        return None, "no layers"
    return LlamaRunner(model, layers, heads, fast_linear, fused_ops), ""


def _layer_heads(i: int, layer: torch.nn.Module) -> Tuple[Optional[Tuple[int, int, int]], str]:
    """((query heads, KV heads, head dim), "") when decoder layer ``i`` has the supported layout,
    else (None, why not)."""
    att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if att is None or mlp is None:
        return None, f"layer {i}: no self_attn / mlp"
    extra = [n for n, _ in att.named_children() if n not in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if extra:
        return None, f"layer {i}: attention has extra modules {extra}"
    extra = [n for n, _ in mlp.named_children() if n not in ("gate_proj", "up_proj", "down_proj", "act_fn")]
    if extra or type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return None, f"layer {i}: MLP is not gate/up/down with SiLU"
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if any(n is None or not type(n).__name__.endswith("RMSNorm") or not hasattr(n, "variance_epsilon")
           for n in norms):
        return None, f"layer {i}: norms are not RMSNorm"
    hd = int(att.head_dim)
    hq = int(att.q_proj.out_features) // hd if hasattr(att.q_proj, "out_features") else None
    hkv = int(att.k_proj.out_features) // hd if hasattr(att.k_proj, "out_features") else None
    if hq is None or hkv is None:
        return None, f"layer {i}: cannot read head counts"
    return (hq, hkv, hd), ""


def _make_layer(model: torch.nn.Module, layer: torch.nn.Module, hd: int, fast_linear: bool, fused_ops: bool,
                fused_layers: bool) -> _Layer:
    """The runner's view of one supported decoder layer (merges its quantized projections, see
    :func:`_merged_spec`)."""
    att, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    L = _Layer()
    L.ln1_w, L.ln1_eps = norms[0].weight, float(norms[0].variance_epsilon)
    L.ln2_w, L.ln2_eps = norms[1].weight, float(norms[1].variance_epsilon)
    L.q, L.k, L.v, L.o = (linear_fn(m, fast_linear) for m in (att.q_proj, att.k_proj, att.v_proj, att.o_proj))
    L.gate, L.up, L.down = (linear_fn(m, fast_linear) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    qkv = _merged_spec([att.q_proj, att.k_proj, att.v_proj]) if fused_ops else None
    gate_up = _merged_spec([mlp.gate_proj, mlp.up_proj]) if fused_ops else None
    L.qkv, L.gate_up = _spec_fn(qkv), _spec_fn(gate_up)
    L.fused = None
    if fused_ops and fused_layers:  # the whole layer as one ops.decoder_layer call, when every projection is known
        dtype = model.get_input_embeddings().weight.dtype
        if qkv is not None and gate_up is not None:
            specs = [qkv, linear_spec(att.o_proj, fast_linear, dtype), gate_up,
                     linear_spec(mlp.down_proj, fast_linear, dtype)]
        else:
            specs = [linear_spec(m, fast_linear, dtype) for m in (att.q_proj, att.k_proj, att.v_proj,
                                                                    att.o_proj, mlp.gate_proj, mlp.up_proj,
                                                                    mlp.down_proj)]
        if all(sp is not None for sp in specs):
            specs = [(w, sc, mn, as_dtype(b, dtype), bits) for w, sc, mn, b, bits in specs]
            L.fused = tuple(list(col) for col in zip(*specs))  # weights, scales, mins, biases, bits
    L.scale = float(getattr(att, "scaling", hd ** -0.5))
    return L
