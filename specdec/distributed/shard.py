"""One rank's slice of a Llama-style decoder, run with specdec's ops and two all-reduces per layer.

Split (Megatron-style, as vLLM's Column/RowParallelLinear): q / k / v by KV-head groups (a rank keeps
its KV heads and the query heads that read them), gate / up by FFN columns (column-parallel: no
communication), o / down by the matching input columns (row-parallel: each rank's partial product is
summed by one all-reduce, the bias added after it), the LM head by vocabulary rows (each rank
computes its vocabulary slice of the kept rows' logits; rank 0 gathers them). Norms, embedding and
rotary tables are replicated. Uneven splits are allowed (SmolLM2's 3 KV heads over 2 ranks: 2 + 1);
FFN and head boundaries fall on multiples of 32 columns so that group-quantized layers (Q8_0 /
Q4_1 blocks of 32) split on block boundaries.

Weights: plain ``nn.Linear`` (fp32 / fp16 / bf16), specdec's ``Int8Linear`` (per-row scales: a
column slice keeps them) and ``GroupQuantLinear`` (row slices, and column slices on block
boundaries): every precision the lean forward (:mod:`specdec.models.fast_llama`) runs.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from transformers.modeling_utils import slice_logits_to_keep

from specdec import ops, paged_ops
from specdec.cache import StaticKVCache
from specdec.paged_cache import PagedKVCache
from specdec.models.fast_llama import build
from specdec.models.quant import GroupQuantLinear, Int8Linear

__all__ = ["ShardedLlama", "split_sizes"]

_Fn = Callable[[torch.Tensor], torch.Tensor]


def split_sizes(total: int, parts: int, unit: int = 1) -> List[int]:
    """``total`` split into ``parts`` sizes that are multiples of ``unit`` (the first ones larger)."""
    if total % unit:
        raise ValueError(f"split_sizes: {total} is not a multiple of {unit}")
    blocks = total // unit
    if blocks < parts:
        raise ValueError(f"tensor parallel: {total} cannot be split over {parts} ranks in units of {unit}")
    base, extra = divmod(blocks, parts)
    return [(base + (1 if r < extra else 0)) * unit for r in range(parts)]


def _range(sizes: Sequence[int], rank: int) -> Tuple[int, int]:
    a = sum(sizes[:rank])
    return a, a + sizes[rank]


def _bias_fn(b: Optional[torch.Tensor]):
    return None if b is None else b.detach().clone()


def _slice(module: torch.nn.Module, rows: Optional[Tuple[int, int]], cols: Optional[Tuple[int, int]]):
    """(kind, tensors) of a row / column slice of a linear layer (copies: the full model can be freed)."""
    r = slice(*rows) if rows else slice(None)
    c = slice(*cols) if cols else slice(None)
    bias = module.bias if rows else None  # a row-parallel bias is added once, after the all-reduce
    bias = None if bias is None else bias[r].detach().clone()
    if type(module) is torch.nn.Linear:
        return "float", (module.weight.detach()[r, c].contiguous(), bias)
    if type(module) is Int8Linear:
        return "int8", (module.qweight[r, c].contiguous(), module.scale[r].contiguous(), bias)
    if type(module) is GroupQuantLinear:
        if cols and (cols[0] % 32 or cols[1] % 32):
            raise ValueError(f"tensor parallel: a group-quantized layer splits on 32-column blocks, got {cols}")
        per_byte = 2 if module.bits == 4 else 1
        qc = slice(cols[0] // per_byte, cols[1] // per_byte) if cols else slice(None)
        gc = slice(cols[0] // 32, cols[1] // 32) if cols else slice(None)
        mins = None if module.mins is None else module.mins[r, gc].contiguous()
        return "group", (module.qweight[r, qc].contiguous(), module.scales[r, gc].contiguous(), mins, bias,
                         module.bits, module.act)
    raise TypeError(f"tensor parallel: cannot split a {type(module).__name__} layer (nn.Linear, Int8Linear or "
                    f"GroupQuantLinear expected)")


def _concat(parts):
    """One projection from several slices of the same input (q / k / v, gate / up)."""
    kind = parts[0][0]
    if any(p[0] != kind for p in parts):
        return None
    cols = list(zip(*[p[1] for p in parts]))
    cat = [None if col[0] is None or not isinstance(col[0], torch.Tensor) else torch.cat(col, 0) for col in cols]
    if kind == "group":
        if any(p[1][5] != parts[0][1][5] for p in parts):
            raise ValueError("tensor parallel: the projections merged into one (q / k / v, gate / up) must share "
                             f"one activation format, got {[p[1][5] for p in parts]}")
        cat[4], cat[5] = parts[0][1][4], parts[0][1][5]
    return kind, tuple(cat)


def _fn(spec) -> _Fn:
    kind, t = spec
    if kind == "float":
        w, b = t
        return lambda x: ops.linear(x, w, b)
    if kind == "int8":
        w, s, b = t
        return lambda x: ops.linear(x, w, None if b is None else b.to(x.dtype), s)
    w, s, m, b, bits, act = t  # act: the layer's activation format (None or "q8", qlinear's act)
    return lambda x: ops.qlinear(x, w, s, m, None if b is None else b.to(x.dtype), bits, act=act)


class _Layer:
    __slots__ = ("ln1", "ln2", "qkv", "o", "o_bias", "gate_up", "down", "down_bias", "scale")


class ShardedLlama:
    """Rank ``rank`` of ``world_size``: its slice of ``model`` (a Llama-style transformers model the lean
    forward supports) and ``comm`` (:class:`specdec.distributed.comm.Comm` or ``LocalComm``).
    :meth:`forward` returns the float32 logits of the kept rows on rank 0 and None on the others."""

    def __init__(self, model: torch.nn.Module, rank: int, world_size: int, comm) -> None:
        runner, why = build(model, fused_layers=False)
        if runner is None:
            raise ValueError(f"tensor parallel: {type(model).__name__} is not supported ({why})")
        self.rank, self.world_size, self.comm = rank, world_size, comm
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = (inner.norm.weight, float(inner.norm.variance_epsilon))
        hq, hkv, D = runner.hq, runner.hkv, runner.head_dim
        self.head_dim, self.group = D, hq // hkv
        kv_sizes = split_sizes(hkv, world_size)
        self.kv_heads = kv_sizes[rank]
        self.q_heads = self.kv_heads * self.group
        k0, k1 = _range(kv_sizes, rank)
        q_rows, kv_rows = (k0 * self.group * D, k1 * self.group * D), (k0 * D, k1 * D)
        inter = int(model.config.intermediate_size)
        f0, f1 = _range(split_sizes(inter, world_size, 32 if inter % 32 == 0 else 1), rank)
        self.layers: List[_Layer] = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            L = _Layer()
            L.ln1 = (layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon))
            L.ln2 = (layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon))
            qkv = [_slice(att.q_proj, q_rows, None), _slice(att.k_proj, kv_rows, None),
                   _slice(att.v_proj, kv_rows, None)]
            L.qkv = _fn(_concat(qkv))
            L.o, L.o_bias = _fn(_slice(att.o_proj, None, q_rows)), _bias_fn(att.o_proj.bias)
            L.gate_up = _fn(_concat([_slice(mlp.gate_proj, (f0, f1), None), _slice(mlp.up_proj, (f0, f1), None)]))
            L.down, L.down_bias = _fn(_slice(mlp.down_proj, None, (f0, f1))), _bias_fn(mlp.down_proj.bias)
            L.scale = float(getattr(att, "scaling", D ** -0.5))
            self.layers.append(L)
        self.vocab_size = int(model.lm_head.out_features if hasattr(model.lm_head, "out_features")
                              else model.config.vocab_size)
        self.vocab_part = -(-self.vocab_size // world_size)  # padded: every rank gathers the same shape
        v0, v1 = min(rank * self.vocab_part, self.vocab_size), min((rank + 1) * self.vocab_part, self.vocab_size)
        self.lm_head = _fn(_slice(model.lm_head, (v0, v1), None))
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self.fused = all(w.dtype == self.dtype for w in [self.norm[0]] + [n[0] for L in self.layers
                                                                          for n in (L.ln1, L.ln2)])

    def new_cache(self, batch: int, capacity: int) -> StaticKVCache:
        return StaticKVCache(len(self.layers), batch, self.kv_heads, self.head_dim, capacity, dtype=self.dtype,
                             device=self.device)

    def new_paged_cache(self, num_blocks: int, block_size: int, max_requests: int,
                        max_blocks_per_request: Optional[int]) -> PagedKVCache:
        """This rank's page pools (its KV heads) with a scratch page, as HFCausalLM.new_paged_cache."""
        return PagedKVCache(len(self.layers), self.kv_heads, self.head_dim, num_blocks, block_size, max_requests,
                            max_blocks_per_request, dtype=self.dtype, device=self.device, scratch_page=True)

    # ------------------------------------------------------------------ norms
    def _norm(self, x: torch.Tensor, w, eps: float) -> torch.Tensor:
        if self.fused:
            return ops.rms_norm(x, w, eps)
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def _add_norm(self, y: torch.Tensor, h: torch.Tensor, w, eps: float):
        if self.fused:
            return ops.add_rms_norm(y, h, w, eps)
        h = h + y
        return self._norm(h, w, eps), h

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, cache: StaticKVCache, tokens: torch.Tensor, depths: torch.Tensor,
                tree_mask: Optional[torch.Tensor], kv_offset: int = 0, logits_to_keep=0,
                head: bool = True) -> Optional[torch.Tensor]:
        """Logits float32 [B, kept, V] on rank 0 (None on other ranks, and with ``head=False``)."""
        B, N = tokens.shape
        D, hq, hkv = self.head_dim, self.q_heads, self.kv_heads
        h = self.embed(tokens.clamp(min=0))
        positions = cache.lens.to(torch.long).unsqueeze(1) + depths.to(torch.long)
        cos, sin = self.rotary(h, positions)
        if cos.shape[0] != B:
            cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
        layers = self.layers
        paged = getattr(cache, "paged", False)
        x = self._norm(h, *layers[0].ln1)
        nq, nkv = hq * D, hkv * D
        for l, L in enumerate(layers):
            nxt = layers[l + 1].ln1 if l + 1 < len(layers) else self.norm
            q, k, v = L.qkv(x).split([nq, nkv, nkv], dim=-1)
            q, k = ops.rope(q.reshape(B, N, hq, D), k.reshape(B, N, hkv, D), cos, sin)
            v = v.reshape(B, N, hkv, D)
            if paged:  # a PagedKVView of this rank's pools (block tables and lengths from rank 0)
                paged_ops.append_kv_paged(cache.k[l], cache.v[l], k.transpose(1, 2), v.transpose(1, 2),
                                          cache.block_tables, cache.lens, kv_offset)
                a = paged_ops.verify_attention_paged(q, cache.k[l], cache.v[l], cache.block_tables, cache.lens,
                                                     tree_mask, L.scale)
            else:
                ops.append_kv(cache.k[l], cache.v[l], k.transpose(1, 2), v.transpose(1, 2), cache.lens, kv_offset)
                a = ops.verify_attention(q, cache.k[l], cache.v[l], cache.lens, tree_mask, L.scale)
            o = self.comm.all_reduce(L.o(a.reshape(B, N, nq)))
            if L.o_bias is not None:
                o = o + L.o_bias.to(o.dtype)
            x, h = self._add_norm(o, h, *L.ln2)
            g, u = L.gate_up(x).chunk(2, dim=-1)
            d = self.comm.all_reduce(L.down(ops.silu_mul(g, u)))
            if L.down_bias is not None:
                d = d + L.down_bias.to(d.dtype)
            x, h = self._add_norm(d, h, *nxt)
        if not head:
            return None
        if isinstance(logits_to_keep, torch.Tensor) or logits_to_keep != 0:
            x = slice_logits_to_keep(x, logits_to_keep)
        part = self.lm_head(x).float()
        if part.shape[-1] < self.vocab_part:  # the last rank's slice is short (padded for the gather)
            part = F.pad(part, (0, self.vocab_part - part.shape[-1]))
        parts = self.comm.gather(part)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]
