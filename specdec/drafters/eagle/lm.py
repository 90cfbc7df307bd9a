"""HeadLM: a feature head driven like a draft LM (the ``HFCausalLM`` protocol DraftModel's tree
builders call: ``vocab_size``, ``device``, ``new_cache``, ``forward``, ``forward_last``, ``prefill``).

The head's input at a node of position ``p`` is its token and the feature of position ``p - 1``:

* the TARGET's hidden state there when the target has scored and committed that position (the
  target's :class:`~specdec.models.hidden.HiddenKVCache` holds it: positions below its ``lens``);
  every committed token the head is fed (a step's root, pending tokens, a catch-up, a prompt) sees
  such a parent;
* else the head's own output at the parent node (a drafted node's parent is the root or a node
  drafted earlier in the step). The head's cache is a HiddenKVCache too: each slot keeps the head's
  output and the slot's absolute position (last column), so a node finds its parent among the
  step's visible slots by position.

Position 0 (no parent) gets a zero feature. Nodes whose parent is drafted must come one level per
call (as the chain, dynamic and planned builders do); a call's chain of several nodes is always
committed text.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specdec import ops
from specdec.drafters.eagle.net import HeadNet, rope_inverse_frequencies, rope_tables
from specdec.models.hidden import HiddenKVCache, TargetFeatures, write_hidden
from specdec.models.rotary_table import RotaryTable

__all__ = ["HeadLM"]


class HeadLM:
    def __init__(self, net: HeadNet, target) -> None:
        self.net = net.eval()
        self.target = target
        cfg = net.cfg
        self.cfg = cfg
        self.vocab_size = int(target.vocab_size)
        if cfg.vocab_size != self.vocab_size:
            raise ValueError(f"EagleHead: the head was made for a vocabulary of {cfg.vocab_size} tokens, the target "
                             f"has {self.vocab_size}")
        self.device = torch.device(target.device)
        emb = net.embed if net.embed is not None else target.model.get_input_embeddings()
        if int(emb.weight.shape[1]) != cfg.hidden_size:
            raise ValueError(f"EagleHead: the token embedding is {int(emb.weight.shape[1])} wide, the head's hidden "
                             f"size is {cfg.hidden_size}")
        self.embed = emb
        self.target_head = target.model.get_output_embeddings() if net.lm_head is None else None
        ids = net.draft_to_target()
        self.draft_ids = None if ids is None else ids.to(self.device)
        self.dtype = torch.float32
        self.features: Optional[TargetFeatures] = None  # the target's cache (attach() before a generate call)
        # the layer as one ops.decoder_layer call (EAGLE-1 layout), or None; the weights as they are now
        self.fused = fused_layer_spec(net)
        # fc and the head's own LM head as one op call each, their operands taken now as the layer's are
        # (a quantized layer's packed weight looked up once, not per call)
        self._fc = _direct(net.fc)
        self._lm_head = _direct(net.lm_head) if cfg.style == "eagle" and net.lm_head is not None else None
        self._unit = torch.ones(cfg.hidden_size, dtype=self.dtype, device=self.device)
        # the head's rope by table lookup where that gives rope_tables' bits (RotaryTable, as the target's)
        self.rope = RotaryTable(_HeadRotary(cfg.head_dim, cfg.rope_theta), cfg.head_dim)
        #: one request's chain on the CPU (the batch-1 draft step) takes :meth:`_forward_one`: the same
        #: values from host integers and slices instead of batched gathers (False: always the batched path)
        self.lean = True

    def attach(self, features) -> None:
        """The target's cache that keeps its hidden states: a HiddenKVCache, or a PagedKVCache with features."""
        if getattr(features, "feature_dim", 0) != self.cfg.feature_size or \
                (not isinstance(features, HiddenKVCache) and getattr(features, "hidden_pages", None) is None):
            raise ValueError(f"EagleHead: the target's cache must hold features of width {self.cfg.feature_size} "
                             f"(HFCausalLM.capture_hidden), got {type(features).__name__} of width "
                             f"{getattr(features, 'feature_dim', None)}")
        self.features = TargetFeatures(features)

    def new_cache(self, batch: int, capacity: int) -> HiddenKVCache:
        cfg = self.cfg
        return HiddenKVCache(1, batch, cfg.num_kv_heads, cfg.head_dim, capacity, cfg.hidden_size + 1,
                             dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ calls
    @torch.no_grad()
    def forward(self, cache: HiddenKVCache, tokens: torch.Tensor, depths: torch.Tensor,
                tree_mask: Optional[torch.Tensor] = None, kv_offset: int = 0, reduced: bool = False
                ) -> torch.Tensor:
        """Logits [B, N, V] of the nodes. ``reduced``: over the draft vocabulary only, [B, N, len(draft_ids)]
        (column i is target token ``draft_ids[i]``; every other token's logit is -inf), where the head has a
        reduced vocabulary (else the same as False): what a greedy draft needs, without expanding each row
        to the target's vocabulary."""
        return self._forward(cache, tokens, depths, tree_mask, kv_offset, 0, reduced=reduced)

    __call__ = forward

    @torch.no_grad()
    def forward_last(self, cache, tokens, depths, last, reduced: bool = False) -> torch.Tensor:
        """:meth:`forward` of a causal chain per request whose logits are computed at one node per row only
        (``last`` [B]): float32 [B, V] (a catch-up over many tokens needs the logits after the last)."""
        B = tokens.shape[0]
        return self._forward(cache, tokens, depths, None, 0, 0, last=torch.as_tensor(last).view(B),
                             reduced=reduced)[:, 0]

    @torch.no_grad()
    def prefill(self, cache: HiddenKVCache, prompts: Sequence[Sequence[int]],
                rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        rows = list(range(len(prompts))) if rows is None else [int(r) for r in rows]
        out = torch.empty(len(prompts), self.vocab_size, dtype=torch.float32, device=self.device)
        for i, (p, r) in enumerate(zip(prompts, rows)):
            view = cache.rows(r, r + 1)
            view.lens.zero_()
            for c0 in range(0, len(p), 256):
                chunk = torch.tensor([list(p[c0:c0 + 256])], dtype=torch.int64, device=self.device)
                n = chunk.shape[1]
                depths = torch.arange(n, dtype=torch.int32, device=self.device).view(1, n)
                logits = self._forward(view, chunk, depths, None, 0, r, last=torch.tensor([n - 1]))
                view.lens.add_(n)
            out[i] = logits[0, 0]
        return out

    def _forward(self, cache, tokens, depths, tree_mask, kv_offset: int, row0: int,
                 last: Optional[torch.Tensor] = None, reduced: bool = False) -> torch.Tensor:
        """Logits [B, N, V] of the nodes, or [B, 1, V] at node ``last[b]`` of each row (the LM head on those rows
        only: a prefill or a catch-up needs the logits after its last token)."""
        if self.features is None:
            raise RuntimeError("EagleHead: no target features attached (the drafter attaches them in start())")
        if self.lean and tree_mask is None and kv_offset == 0 and tokens.shape[0] == 1 and tokens.device.type == "cpu":
            out = self._forward_one(cache, tokens, depths, row0, last, reduced)
            if out is not None:
                return out
        net, cfg = self.net, self.cfg
        B, N = tokens.shape
        lens = cache.lens.to(torch.int64).view(B, 1)
        pos = lens + depths                                                      # [B, N] absolute positions
        parent = pos - 1
        tgt = self.features
        from_target = (parent < tgt.lens[row0:row0 + B].view(B, 1)).unsqueeze(2)
        tfeat = tgt.gather(row0, parent.clamp(min=0, max=tgt.capacity - 1))
        tfeat = net.input_feature(tfeat.to(self.dtype)) * (parent >= 0).unsqueeze(2)
        H = cfg.hidden_size
        own = cache.hidden[:, 0]                                                 # [B, S, H + 1]
        mask = tree_mask  # None: a causal chain (verify_attention's default)
        if mask is None and kv_offset == 0:
            # a chain after the cache: only its first node's parent can be drafted (the cache's last slot);
            # the others' parents are this call's earlier nodes, committed text (module docstring)
            hfeat = own.gather(1, (lens - 1).clamp(min=0).unsqueeze(2).expand(B, 1, H + 1))[:, :, :H]
        else:
            if mask is None:  # a chain after kv_offset earlier nodes of the step: causal over all of them
                mask = torch.ones(N, kv_offset + N, dtype=torch.bool, device=tokens.device).tril(kv_offset) \
                    .expand(B, N, kv_offset + N)
            hfeat = self._own_parent_features(own, lens, pos, parent, mask, kv_offset, cache.capacity)
        feat = torch.where(from_target, tfeat, hfeat)
        emb = self.embed(tokens.clamp(min=0)).to(self.dtype)
        cos, sin = self.rope(emb, pos, cache.capacity)
        m = mask if mask is None or mask.is_contiguous() else mask.contiguous()
        out = self._layer(cache, emb, feat, cos, sin, m, kv_offset)
        write_hidden(cache, torch.cat((out, pos.to(self.dtype).unsqueeze(2)), dim=2), kv_offset)
        if last is not None:
            out = out.gather(1, last.to(device=out.device, dtype=torch.int64).view(B, 1, 1).expand(B, 1, H))
        return self._logits(out, reduced)

    def _layer(self, cache, emb: torch.Tensor, feat: torch.Tensor, cos, sin, mask, kv_offset: int) -> torch.Tensor:
        """The head's layer over the nodes' embeddings and features: its output [B, N, H] (K/V appended)."""
        net, cfg = self.net, self.cfg
        k_cache, v_cache, cl = cache.k[0], cache.v[0], cache.lens
        if self.fused is not None:  # fc, then the decoder layer in one call (the layer's own residual = x)
            x = self._fc(torch.cat((emb, feat), dim=-1))
            return ops.decoder_layer(x, x, *self.fused, net.post_attention_layernorm, cfg.rms_eps,
                                     self._unit, cfg.rms_eps, k_cache, v_cache, cl, cos, sin, mask, kv_offset,
                                     cfg.head_dim ** -0.5, cfg.num_heads, cfg.num_kv_heads)[1]

        def attend(q, k, v):
            ops.append_kv(k_cache, v_cache, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
                          cl, kv_offset)
            return ops.verify_attention(q.contiguous(), k_cache, v_cache, cl, mask, cfg.head_dim ** -0.5)

        return net.layer(emb, feat, cos, sin, attend)

    def _logits(self, out: torch.Tensor, reduced: bool = False) -> torch.Tensor:
        """The head's logits over the target's vocabulary (-inf outside a reduced draft vocabulary), or with
        ``reduced`` over the draft vocabulary alone."""
        logits = (self.net.logits(out, self.target_head) if self._lm_head is None else self._lm_head(out)).float()
        if self.draft_ids is None or reduced:
            return logits
        B, N = out.shape[:2]
        full = torch.full((B, N, self.vocab_size), float("-inf"), dtype=torch.float32, device=out.device)
        return full.index_copy_(2, self.draft_ids, logits)

    def _forward_one(self, cache, tokens, depths, row0: int, last: Optional[torch.Tensor] = None,
                     reduced: bool = False) -> Optional[torch.Tensor]:
        """:meth:`_forward` of one request's chain after its cache on the CPU, where every node's parent is
        committed text the target holds (consecutive positions: one slice of its states) or the call is one
        node after a drafted parent (the head's own last output). The values of the batched gathers, from
        host integers: the same features and rows, so the same bits. None: another case."""
        tgt = self.features
        N = tokens.shape[1]
        lens = cache.lens.tolist()[0]
        d = depths.tolist()[0]
        start = lens + d[0]
        if d != list(range(d[0], d[0] + N)):
            return None
        if start < 1 or lens + N > cache.capacity:
            return None
        tl = tgt.lens.tolist()[row0]
        H = self.cfg.hidden_size
        if start - 1 + N <= tl:  # every parent committed: the target's states at start - 1 ..
            feat = self.net.input_feature(tgt.span(row0, start - 1, N).to(self.dtype))
        elif N == 1 and start - 1 >= tl:  # a drafted parent: the head's own output in the cache's last slot
            feat = cache.hidden[0:1, 0, max(lens - 1, 0):max(lens - 1, 0) + 1, :H]
        else:
            return None
        emb = self._embed_rows(tokens)
        cos, sin = self.rope.span(emb, start, N, cache.capacity)
        out = self._layer(cache, emb, feat, cos, sin, None, 0)
        slots = cache.hidden[0, 0, lens:lens + N]
        slots[:, :H].copy_(out[0])
        if N == 1:
            slots[0, H] = float(start)
        else:
            slots[:, H].copy_(torch.arange(start, start + N))
        if last is not None:
            j = int(last[0])
            out = out[:, j:j + 1]
        return self._logits(out, reduced)

    def _embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding of one request's tokens [1, N] as [1, N, H]: a plain ``nn.Embedding`` by one row
        gather (its forward's values: no max_norm), any other module by its call."""
        emb = self.embed
        if type(emb) is torch.nn.Embedding and emb.max_norm is None:
            return emb.weight.index_select(0, tokens.view(-1).clamp(min=0)).view(1, -1, emb.weight.shape[1]) \
                .to(self.dtype)
        return emb(tokens.clamp(min=0)).to(self.dtype)

    @staticmethod
    def _own_parent_features(own, lens, pos, parent, tree_mask, kv_offset: int, capacity: int) -> torch.Tensor:
        """[B, N, H]: each node's parent's output among the step's visible slots (``tree_mask`` [B, N, kvo + N],
        by stored position), else the cache's last slot."""
        B, N = pos.shape
        H = own.shape[2] - 1
        dev = pos.device
        step_slots = lens + torch.arange(kv_offset + N, device=dev).view(1, -1)  # [B, kvo + N]
        step_pos = own.gather(1, step_slots.clamp(max=capacity - 1).unsqueeze(2)
                              .expand(B, kv_offset + N, H + 1))[:, :, H].to(torch.int64)
        step_pos[:, kv_offset:] = pos
        match = tree_mask & (step_pos.unsqueeze(1) == parent.unsqueeze(2))      # [B, N, kvo + N]
        slot = torch.where(match.any(dim=2), lens + match.to(torch.int8).argmax(dim=2), lens - 1).clamp(min=0)
        return own.gather(1, slot.unsqueeze(2).expand(B, N, H + 1))[:, :, :H]


class _HeadRotary:
    """The head's rope as a rotary module's call, ``(h, positions) -> (cos, sin)`` [B, N, head_dim] in h's dtype
    (rope_tables with the inverse frequencies kept): what :class:`RotaryTable` tabulates."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta = head_dim, theta
        self.inv: Optional[torch.Tensor] = None

    def __call__(self, h: torch.Tensor, positions: torch.Tensor):
        if self.inv is None or self.inv.device != positions.device:
            self.inv = rope_inverse_frequencies(self.head_dim, self.theta, positions.device)
        return rope_tables(positions, self.head_dim, self.theta, h.dtype, inv=self.inv)


def _direct(mod):
    """``mod``'s forward as one op call with its operands taken now (a GroupQuantLinear with a float32 bias or
    none, as the head's float32 activations take it: its op weight, on the CPU with quantized activations
    the packed layout, looked up once; EAGLE's ``fc`` has a bias); else ``mod``."""
    from specdec.models.quant import GroupQuantLinear

    if type(mod) is GroupQuantLinear and (mod.bias is None or mod.bias.dtype == torch.float32):
        w, scales, mins, bias, bits, act = mod.op_weight(), mod.scales, mod.mins, mod.bias, mod.bits, mod.act
        return lambda x: ops.qlinear(x, w, scales, mins, bias, bits, act=act) if x.dtype == torch.float32 else mod(x)
    return mod


def _slot(mods):
    """One ops.decoder_layer projection slot (weights, scales, mins, biases, bits) of linear layers concatenated
    along their outputs, or None when they cannot share one call. Quantized activations (act="q8"): bits + 32
    and, on the CPU, the concatenation's packed layout."""
    from specdec.models.quant import GroupQuantLinear, pack_q8act_cpu

    if any(m.bias is not None for m in mods):  # the published layouts have none
        return None
    if all(type(m) is torch.nn.Linear for m in mods):
        return torch.cat([m.weight.detach() for m in mods]).contiguous(), None, None, None, 0
    if all(isinstance(m, GroupQuantLinear) for m in mods):
        if len({(m.bits, m.mins is None, m.act) for m in mods}) != 1 or mods[0].act not in (None, "q8"):
            return None
        mins = None if mods[0].mins is None else torch.cat([m.mins for m in mods]).contiguous()
        qw, sc, bits = torch.cat([m.qweight for m in mods]).contiguous(), \
            torch.cat([m.scales for m in mods]).contiguous(), mods[0].bits
        if mods[0].act == "q8":
            if qw.device.type == "cpu":
                qw = pack_q8act_cpu(qw, sc, mins, bits)
            bits += 32
        return qw, sc, mins, None, bits
    return None


def fused_layer_spec(net: HeadNet):
    """The head's decoder layer as ops.decoder_layer's four projection slots (q|k|v, o, gate|up, down) for
    the EAGLE-1 layout (its layer input is fc's output, unnormed, also the residual); None otherwise."""
    if net.cfg.style != "eagle":
        return None
    slots = [_slot([net.q_proj, net.k_proj, net.v_proj]), _slot([net.o_proj]), _slot([net.gate_proj, net.up_proj]),
             _slot([net.down_proj])]
    if any(s is None for s in slots):
        return None
    return tuple(list(col) for col in zip(*slots))
