"""Linear layers at a GGUF checkpoint's own precision: the GGUF blocks become
:class:`specdec.models.quant.GroupQuantLinear` buffers without re-rounding.

A Q4_1 block (20 bytes) is float16 d, float16 m and 16 bytes of nibbles; a Q4_0 block
(18 bytes) drops m; a Q8_0 block (34 bytes) is float16 d and 32 int8 codes. The nibble order
(byte j: element j low, element j + 16 high) is ops.qlinear's, so the code bytes are copied
as they are. transformers permutes the rows of some tensors when it dequantizes a GGUF
(Llama's q / k projections, for its rotary layout); which permutation is found here by
matching every row of the module's float weight, bitwise, with the dequantized GGUF rows:
the quantized layer is then exactly the weight transformers loaded, and a tensor whose rows
do not all match is refused rather than guessed.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from specdec.models.quant import GroupQuantLinear, replace_module, untie

__all__ = ["gguf_linear_layers", "load_gguf_linears", "install_linears"]

_BLOCK = {"Q4_1": (20, 4), "Q4_0": (18, 4), "Q8_0": (34, 8)}  # bytes per block of 32, bits
_LLAMA_NAMES = {  # GGUF tensor name -> module name of transformers' Llama-style models
    r"blk\.(\d+)\.attn_q\.weight": r"model.layers.\1.self_attn.q_proj",
    r"blk\.(\d+)\.attn_k\.weight": r"model.layers.\1.self_attn.k_proj",
    r"blk\.(\d+)\.attn_v\.weight": r"model.layers.\1.self_attn.v_proj",
    r"blk\.(\d+)\.attn_output\.weight": r"model.layers.\1.self_attn.o_proj",
    r"blk\.(\d+)\.ffn_gate\.weight": r"model.layers.\1.mlp.gate_proj",
    r"blk\.(\d+)\.ffn_up\.weight": r"model.layers.\1.mlp.up_proj",
    r"blk\.(\d+)\.ffn_down\.weight": r"model.layers.\1.mlp.down_proj",
    r"output\.weight": "lm_head",
}


def _blocks(tensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]:
    """(qweight, scales, mins, bits) of one GGUF tensor of a supported block type."""
    size, bits = _BLOCK[tensor.tensor_type.name]
    raw = np.ascontiguousarray(tensor.data).view(np.uint8)
    N = int(raw.shape[0])
    blocks = raw.reshape(N, -1, size)
    G = blocks.shape[1]
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].copy())
    if tensor.tensor_type.name == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].copy())
        codes = blocks[..., 4:]
    else:
        m = None
        codes = blocks[..., 2:]
    q = torch.from_numpy(codes.reshape(N, -1).copy())
    if bits == 8:
        q = q.view(torch.int8)
    assert q.shape[1] == G * (32 if bits == 8 else 16)
    return q.contiguous(), d.contiguous(), None if m is None else m.contiguous(), bits


def _dequantize_fp32(q: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor], bits: int) -> torch.Tensor:
    """reference.dequantize_groups in float32 (exact: d * q fits a float32, + m rounds once)."""
    N, G = d.shape
    if bits == 8:
        codes = q.float().view(N, G, 32)
    else:
        b = q.view(N, G, 16)
        codes = torch.cat([b & 15, b >> 4], dim=2).float()
        if m is None:
            codes -= 8.0
    w = codes * d.float()[..., None]
    if m is not None:
        w += m.float()[..., None]
    return w.view(N, G * 32)


def gguf_linear_layers(gguf: Path, tied_head: bool) -> Dict[str, object]:
    """Module name -> GGUF tensor, for the block-quantized linear weights of a Llama-style GGUF
    (token_embd stands for lm_head when the head is tied)."""
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(str(gguf)).tensors:
        if t.tensor_type.name not in _BLOCK:
            continue
        if t.name == "token_embd.weight" and tied_head:
            out["lm_head"] = t
            continue
        for pat, mod in _LLAMA_NAMES.items():
            if re.fullmatch(pat, t.name):
                out[re.sub(pat, mod, t.name)] = t
    return out


def _row_permutation(weight: torch.Tensor, deq: torch.Tensor, name: str) -> torch.Tensor:
    """perm with weight == deq[perm] bitwise, or a ValueError naming the layer."""
    w = weight.detach().float()
    if torch.equal(w, deq):
        return torch.arange(deq.shape[0])
    rows: Dict[bytes, list] = {}
    for i, r in enumerate(deq.numpy()):
        rows.setdefault(r.tobytes(), []).append(i)
    perm = []
    for i, r in enumerate(weight.detach().float().contiguous().numpy()):
        hit = rows.get(r.tobytes())
        if not hit:
            raise ValueError(f"load_gguf_linears: row {i} of {name}'s weight matches no row of its GGUF tensor "
                             f"(the model was not loaded from this GGUF, or was modified)")
        perm.append(hit.pop())
    return torch.tensor(perm, dtype=torch.long)


def install_linears(model: torch.nn.Module, layers: Dict[str, dict]) -> None:
    """Put GroupQuantLinear layers (``name -> dict(qweight, scales, mins, bias, bits)``, as
    :func:`load_gguf_linears` returns them) into ``model`` in place."""
    for name, t in layers.items():
        replace_module(model, name, GroupQuantLinear(t["qweight"], t["scales"], t["mins"], t["bias"], t["bits"]))
    if "lm_head" in layers:
        untie(model)


def load_gguf_linears(model: torch.nn.Module, gguf: Path) -> Dict[str, dict]:
    """Replace (in place) every linear layer of ``model`` that has a block-quantized tensor in
    ``gguf`` by a :class:`GroupQuantLinear` holding that tensor's blocks (rows in the model's
    order). ``model`` must hold the weights transformers dequantized from the same file.
    Returns module name -> the layer's tensors (qweight, scales, mins, bias, bits, gguf_type),
    e.g. to save and :func:`install_linears` later."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    done = {}
    for name, tensor in gguf_linear_layers(gguf, tied).items():
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            continue
        if type(linear) is not torch.nn.Linear:
            continue
        q, d, m, bits = _blocks(tensor)
        deq = _dequantize_fp32(q, d, m, bits)
        if tuple(deq.shape) != tuple(linear.weight.shape):
            raise ValueError(f"load_gguf_linears: {name} has weight {tuple(linear.weight.shape)} but its GGUF tensor "
                             f"{tensor.name} is {tuple(deq.shape)}")
        perm = _row_permutation(linear.weight, deq, name)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        done[name] = dict(qweight=q[perm].contiguous(), scales=d[perm].contiguous(),
                          mins=None if m is None else m[perm].contiguous(), bias=bias, bits=bits,
                          gguf_type=tensor.tensor_type.name)
    install_linears(model, done)
    return done
