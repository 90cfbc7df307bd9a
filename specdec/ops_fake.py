"""Fake (meta) implementations of the ops of :mod:`specdec.ops`: output shapes and dtypes without
computing, so that torch.compile and meta tensors can trace through the ops."""
from __future__ import annotations

import torch

from specdec import _C  # noqa: F401  (loads the library that registers torch.ops.specdec)


@torch.library.register_fake("specdec::verify_attention")
def _verify_attention_fake(q, k_cache, v_cache, cache_lens, tree_mask, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("specdec::append_kv")
def _append_kv_fake(k_cache, v_cache, k_new, v_new, cache_lens, offset=0):
    return None


def _sample_fake(tokens, parents):
    B, N = tokens.shape
    accepted = tokens.new_empty((B, N), dtype=torch.int32)
    num_accepted = tokens.new_empty((B,), dtype=torch.int32)
    out_tokens = tokens.new_empty((B, N), dtype=torch.int64)
    return accepted, num_accepted, out_tokens


@torch.library.register_fake("specdec::rejection_sample")
def _rejection_sample_fake(tokens, parents, target_probs, draft_probs, uniforms):
    return _sample_fake(tokens, parents)


@torch.library.register_fake("specdec::greedy_verify")
def _greedy_verify_fake(tokens, parents, target_logits):
    return _sample_fake(tokens, parents)


@torch.library.register_fake("specdec::kv_commit")
def _kv_commit_fake(k_caches, v_caches, cache_lens, accepted, num_accepted):
    return None


@torch.library.register_fake("specdec::qlinear")
def _qlinear_fake(x, qweight, scales, mins, bias, bits):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.register_fake("specdec::linear")
def _linear_fake(x, weight, bias, weight_scale):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("specdec::rms_norm")
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("specdec::add_rms_norm")
def _add_rms_norm_fake(x, residual, weight, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.register_fake("specdec::rope")
def _rope_fake(q, k, cos, sin):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


@torch.library.register_fake("specdec::silu_mul")
def _silu_mul_fake(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.register_fake("specdec::decoder_layer")
def _decoder_layer_fake(x, h, weights, scales, mins, biases, bits, post_norm_weight, post_norm_eps,
                        next_norm_weight, next_norm_eps, k_cache, v_cache, cache_lens, cos, sin, tree_mask,
                        kv_offset, scale, num_heads, num_kv_heads):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.register_fake("specdec::linear_argmax")
def _linear_argmax_fake(x, weight, bias, weight_scale):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)


@torch.library.register_fake("specdec::qlinear_argmax")
def _qlinear_argmax_fake(x, qweight, scales, mins, bias, bits, q8act):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)
