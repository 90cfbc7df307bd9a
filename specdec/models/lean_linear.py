"""The lean forward's linear layers: how a projection is called (:func:`linear_fn`: specdec's ops on the layer's
tensors, batch invariant, with an argmax companion) and how ops.decoder_layer takes it (:func:`linear_spec`)."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from specdec import ops

# A projection as ops.decoder_layer takes it: (weight, scale(s), mins, bias, bits); bits 0 = ops.linear
# (float weight, or int8 with a per-row scale), 4 / 8 = ops.qlinear; | 32: act="q8" (quantized activations).
Spec = Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], int]


Q8ACT = 32  # the bits flag of a quantized-activation projection (ops.decoder_layer's convention)


def quant_bits(module) -> int:
    """A GroupQuantLinear's bits as ops.decoder_layer takes them (| 32 with act="q8")."""
    return module.bits | (Q8ACT if getattr(module, "act", None) == "q8" else 0)


def as_dtype(b: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return b if b is None or b.dtype == dtype else b.to(dtype)


def linear_spec(module: torch.nn.Module, fast_linear: bool, dtype: torch.dtype) -> Optional[Spec]:
    """The tensors of a linear layer whose type we know (None: call it as a module / F.linear)."""
    from specdec.models.quant import GroupQuantLinear, Int8Linear

    if type(module) is torch.nn.Linear:
        w, b = module.weight, module.bias
        if not fast_linear or w.dtype not in (torch.float32, torch.float16, torch.bfloat16) or w.dtype != dtype:
            return None
        return (w, None, None, b, 0)
    if type(module) is GroupQuantLinear:
        return (module.op_weight(), module.scales, module.mins, as_dtype(module.bias, dtype), quant_bits(module))
    if type(module) is Int8Linear:
        return (module.qweight, module.scale, None, as_dtype(module.bias, dtype), 0)
    return None


def _invariant(fn: Callable, argmax: Callable) -> Callable:
    fn.batch_invariant = True  # ops.linear / ops.qlinear: a row's bits whatever rows share the call (<= 64)
    fn.argmax = argmax  # torch.argmax(fn(x), -1) without the logits (ops.linear_argmax / ops.qlinear_argmax)
    return fn


def linear_fn(module: torch.nn.Module, fast_linear: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A direct call for a linear layer: ops.linear on its tensors when we know the type
    (nn.Linear only with fast_linear, as HFCausalLM's option says; F.linear otherwise); the ops calls are
    marked ``batch_invariant``."""
    from specdec.models.quant import GroupQuantLinear, Int8Linear

    if type(module) is torch.nn.Linear:
        w, b = module.weight, module.bias
        if not fast_linear or w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return lambda x: F.linear(x, w, b)
        return _invariant(lambda x: ops.linear(x, w, b), lambda x: ops.linear_argmax(x, w, b))
    if type(module) is GroupQuantLinear:  # its tensors bound once, not read from the module on every call
        d, m, b, bits, act = module.scales, module.mins, module.bias, module.bits, module.act
        bound = [None if act == "q8" else module.qweight]  # q8: the CPU's packed copy, made at the first call only

        def args(x: torch.Tensor):
            if bound[0] is None:
                bound[0] = module.op_weight()
            return x, bound[0], d, m, b if b is None or b.dtype == x.dtype else b.to(x.dtype), bits
        return _invariant(lambda x: ops.qlinear(*args(x), act=act), lambda x: ops.qlinear_argmax(*args(x), act=act))
    if type(module) is Int8Linear:
        qw, sc, b = module.qweight, module.scale, module.bias

        def bias(x: torch.Tensor):
            return b if b is None or b.dtype == x.dtype else b.to(x.dtype)
        return _invariant(lambda x: ops.linear(x, qw, bias(x), sc), lambda x: ops.linear_argmax(x, qw, bias(x), sc))
    return module  # e.g. torch.ao dynamic-quantized Linear: its own forward
