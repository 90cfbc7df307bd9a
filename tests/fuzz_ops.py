"""Property-based fuzz harness over every specdec op (hypothesis).

The property, for every op and every drawn input: the op either

* raises a RuntimeError / ValueError whose message starts with the op's name and names
  one of its arguments, leaving EVERY input bitwise unchanged, or
* returns exactly what specdec.reference returns (integer outputs and in-place integer /
  copied state equal; float outputs within the documented tolerance), without touching
  its read-only inputs. The paged KV ops are compared with specdec.reference_paged, over
  block tables with shuffled, shared and padded pages (page sizes 1 to 64); on the CPU the
  paged attention must also give the dense kernel's bits for the gathered keys.

Drawn inputs cover zero-size dimensions (B = 0, V = 1, K = 0, N = 0, prefix 0,
S = prefix + N exactly), every float dtype and mixed dtypes, non-contiguous and
storage-offset views, boundary values (u = 0, u = 1, the largest double below 1, NaN /
inf / negative / all-zero probability rows, -1 tokens and parents, lengths at and past
capacity) and aliased tensors. Strict checks are off (their default), so CPU value checks
and the kernels' own robustness are what is exercised.

On CUDA the ops check tensor VALUES (lengths, tokens, parents, paths, uniforms) only in
strict mode (specdec.ops.set_strict_checks): without it, a draw with an invalid value
returns whatever the memory-safe kernel gives, and the reference raises or disagrees. So on
a device whose ops skip value checks (:func:`values_checked_only_in_strict`) a draw that
the op accepts is first judged by the CPU op (which always checks values) on a copy:

* the CPU accepts it: the draw is valid and the op's result must match the reference, as
  on the CPU;
* the CPU rejects it (an invalid value): the unchecked run was a memory-safety case (it
  returned, synchronised without a CUDA error and left its read-only inputs unchanged;
  compute-sanitizer tells the rest), and the same inputs are run again with strict checks
  on, which must raise the op's clear error with nothing changed.

That keeps every check of the CPU property and adds the strict-mode errors: see
:func:`run_property`.

A crash (SIGSEGV, SIGFPE, abort) cannot be caught in-process, so tests/test_fuzz_ops.py
runs each op's batch in a subprocess of this file:

    python tests/fuzz_ops.py --op rejection_sample --examples 200 --device cpu

Before each example the case is written to stderr, so the case that killed the process
is the last line there. Deterministic: hypothesis is derandomized (a fixed seed per op
and --seed) and keeps no example database. SPECDEC_FUZZ_EXAMPLES overrides the example
count of the CI profile (the long profile: benchmarks/fuzz_ops.sh).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import re
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specdec import ops, paged_ops, reference, reference_paged, reference_q8act  # noqa: E402

ONE_MINUS = 1.0 - 2.0 ** -53
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
ULP = {torch.float32: 2.0 ** -17, torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6}  # tolerance units
DEVICE = "cpu"
ARGS: Dict[str, Sequence[str]] = {
    "verify_attention": ("q", "k_cache", "v_cache", "cache_lens", "tree_mask", "scale", "head dim"),
    "append_kv": ("k_cache", "v_cache", "k_new", "v_new", "cache_lens", "offset"),
    "rejection_sample": ("tokens", "parents", "target_probs", "draft_probs", "uniforms"),
    "greedy_verify": ("tokens", "parents", "target_logits"),
    "kv_commit": ("k_caches", "v_caches", "cache_lens", "accepted", "num_accepted"),
    "verify_attention_paged": ("q", "k_pages", "v_pages", "block_tables", "cache_lens", "tree_mask", "scale"),
    "append_kv_paged": ("k_pages", "v_pages", "k_new", "v_new", "block_tables", "cache_lens", "offset"),
    "kv_commit_paged": ("k_pages", "v_pages", "block_tables", "cache_lens", "accepted", "num_accepted"),
    "linear": ("x", "weight", "bias", "weight_scale"),
    "qlinear": ("x", "qweight", "scales", "mins", "bias", "bits", "K"),
    "qlinear_q8act": ("x", "qweight", "scales", "mins", "bias", "bits", "K"),
    "linear_argmax": ("x", "weight", "bias", "weight_scale"),
    "qlinear_argmax": ("x", "qweight", "scales", "mins", "bias", "bits", "K"),
    "quantize_q8": ("x", "K"),
    "pack_q8act": ("qweight", "scales", "mins", "bits", "K"),
    "rms_norm": ("x", "weight", "eps"),
    "add_rms_norm": ("x", "residual", "weight", "eps"),
    "rope": ("q", "k", "cos", "sin", "head dim"),
    "silu_mul": ("gate", "up"),
    "decoder_layer": ("x", "h", "weights", "scales", "mins", "biases", "bits", "norm_weight", "k_cache",
                      "v_cache", "cache_lens", "cos", "sin", "tree_mask", "kv_offset", "num_heads", "projection",
                      "attention inputs"),
    "decoder_layer_paged": ("x", "h", "weights", "scales", "mins", "biases", "bits", "norm_weight", "k_pages",
                            "v_pages", "k_cache", "block_tables", "cache_lens", "cos", "sin", "tree_mask", "kv_offset",
                            "num_heads", "projection", "attention inputs"),
}
STATS = {"examples": 0, "raised": 0, "matched": 0, "unchecked": 0}
ERRORS: "collections.Counter[str]" = collections.Counter()  # error kinds seen (message up to the first digit)


# --------------------------------------------------------------------------- helpers
def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}s{list(t.stride())}+{t.storage_offset()}"
    if isinstance(t, (list, tuple)):
        return "[" + ", ".join(describe(x) for x in t) + "]"
    return repr(t)


def place(t: torch.Tensor, how: str) -> torch.Tensor:
    """t on DEVICE with the same values and a drawn memory layout."""
    t = t.to(DEVICE)
    if how == "contig" or t.dim() == 0:
        return t.contiguous()
    if how.startswith("offset"):
        k = int(how[len("offset"):])
        buf = torch.empty(t.numel() + k, dtype=t.dtype, device=DEVICE)
        view = buf[k:].view(t.shape)
        view.copy_(t)
        return view
    if how == "transposed" and t.dim() >= 2:  # same values, last two dims swapped in memory
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "strided":  # every other element of a wider buffer along the last dim
        buf = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=DEVICE)
        view = buf[..., ::2]
        view.copy_(t)
        return view
    return t.contiguous()


def pools(k: torch.Tensor, v: torch.Tensor, how: str):
    """Page pools k, v [P, ps, H, D] on DEVICE, in place in a stack's layout: "nhd" (contiguous), "hnd"
    (views of [P, H, ps, D] tensors) or "combined" (the halves of one [P, 2, ps, H, D] buffer)."""
    if how == "hnd":
        return tuple(t.transpose(1, 2).to(DEVICE).clone(memory_format=torch.contiguous_format).transpose(1, 2)
                     for t in (k, v))
    if how == "combined" and k.shape == v.shape and k.dtype == v.dtype:
        pool = torch.stack([k, v], 1).to(DEVICE)
        return pool[:, 0], pool[:, 1]
    return place(k, "contig"), place(v, "contig")


POOL_LAYOUTS = st.sampled_from(("nhd",) * 4 + ("hnd", "combined"))


def layouts(*extra: str):
    return st.sampled_from(("contig",) * 4 + ("offset1", "offset4", "transposed", "strided") + extra)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())  # fresh standard strides
    return t.view(torch.uint8) if t.numel() and t.dim() else t


def snapshot(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)):
        return [snapshot(o) for o in obj]
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    return obj


def assert_unchanged(before, after, what: str) -> None:
    if isinstance(before, torch.Tensor):
        assert torch.equal(bits(before), bits(after)), f"{what} was modified"
    elif isinstance(before, list):
        for i, (a, b) in enumerate(zip(before, after)):
            assert_unchanged(a, b, f"{what}[{i}]")
    elif isinstance(before, dict):
        for k in before:
            assert_unchanged(before[k], after[k], k)


def values_checked_only_in_strict(device) -> bool:
    """Whether the ops on ``device`` check tensor values only in strict mode: CUDA (a value check
    there costs a device -> host copy and a synchronisation); the CPU ops always check them."""
    return torch.device(device).type != "cpu"


def sync() -> None:
    """Wait for the device, so that an asynchronous CUDA fault fails the example that caused it."""
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def strict_mode():
    before = ops.strict_checks()
    ops.set_strict_checks(True)
    try:
        yield
    finally:
        ops.set_strict_checks(before)


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, (list, tuple)):
        return [to_cpu(o) for o in obj]
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def cpu_rejects(fn: Callable[..., object], before: dict) -> Optional[str]:
    """The first line of the error the CPU op raises on a copy of the inputs (None: it accepts them)."""
    try:
        fn(**to_cpu(before))
    except (RuntimeError, ValueError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def assert_clear_error(op: str, e: BaseException, before, args) -> str:
    msg = str(e).splitlines()[0] if str(e) else ""
    assert msg.startswith(op + ":") or f" {op}:" in msg or msg.startswith(f"specdec.{op}"), \
        f"error message does not name the op {op!r}: {msg!r}"
    assert any(a in msg for a in ARGS[op]), f"error message names no argument of {op}: {msg!r}"
    assert_unchanged(before, args, "input")
    return msg


def run_property(op: str, fn: Callable[..., object], args: dict, check: Callable[[object, dict], None],
                 read_only: Sequence[str]) -> None:
    """The harness property: a clear error with nothing changed, or the reference's result.

    ``fn(**args)`` runs the op. Where values are checked only in strict mode (CUDA), an accepted
    draw that the CPU op rejects is a value-corrupted draw: its unchecked run must be memory-safe
    (returned, synchronised, read-only inputs unchanged) and a rerun with strict checks on must
    raise the clear error. Why not only one of the two: memory-safety-only would never check the
    strict errors, and strict-only would never run the kernels on bad values with checks off (the
    CUDA default, what compute-sanitizer's memcheck stage watches); both keep the most checking.
    """
    STATS["examples"] += 1
    log(f"{op}: " + ", ".join(f"{k}={describe(v)}" for k, v in args.items()))
    before = snapshot(args)
    try:
        out = fn(**args)
    except (RuntimeError, ValueError) as e:
        msg = assert_clear_error(op, e, before, args)
        STATS["raised"] += 1
        ERRORS[re.split(r"[0-9\[(]", msg, maxsplit=1)[0][:90]] += 1
        return
    sync()  # outside the try: a CUDA fault is no clear error
    for name in read_only:
        assert_unchanged(before[name], args[name], name)
    if values_checked_only_in_strict(DEVICE):
        rejected = cpu_rejects(fn, before)
        if rejected is not None:
            if strict_rerun_raises(op, fn, before):
                STATS["unchecked"] += 1
                ERRORS["strict only: " + re.split(r"[0-9\[(]", rejected, maxsplit=1)[0][:78]] += 1
                return
            # Strict checks accept what the CPU rejects: the backends differ on this input, and the
            # reference decides (a missing strict check gives a result it does not have).
            try:
                check(out, before)
            except Exception as e:  # a reference that raises, or a result that differs
                raise AssertionError(f"{op}: the CPU rejects these inputs ({rejected}) but strict checks on "
                                     f"{DEVICE} accept them, and the result is not the reference's: {e}") from e
            STATS["matched"] += 1
            return
    check(out, before)
    STATS["matched"] += 1


def strict_rerun_raises(op: str, fn: Callable[..., object], before: dict) -> bool:
    """The inputs again (fresh copies on the device) with strict checks on: True when the op raises its
    clear error with nothing changed (anything else that it raises fails the example)."""
    again, pristine = snapshot(before), snapshot(before)
    with strict_mode():
        try:
            fn(**again)
        except (RuntimeError, ValueError) as e:
            assert_clear_error(op, e, pristine, again)
            return True
    sync()
    return False


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float, what: str) -> None:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    tol = ULP[dtype] * (scale + want.abs()) + 1e-30
    bad = ~((got - want).abs() <= tol) & ~(torch.isnan(got) & torch.isnan(want)) & ~(got == want)
    assert not bool(bad.any()), f"{what}: max |err| {(got - want).abs()[bad].max().item():.3e} past the tolerance"


# --------------------------------------------------------------------------- strategies
@st.composite
def tree(draw, B: int, N: int, V: int, valid: bool):
    """tokens [B, N] int64 and parents [B, N] int32: topological trees with -1 padding,
    and (when not valid) one corrupted entry."""
    tokens = torch.full((B, N), -1, dtype=torch.int64)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    for b in range(B):
        n = draw(st.integers(1, N))
        tokens[b, 0] = draw(st.integers(0, max(0, V - 1)))
        for i in range(1, n):
            parents[b, i] = draw(st.integers(0, i - 1))
            tokens[b, i] = draw(st.integers(0, max(0, V - 1)))
    if not valid and B > 0:
        b, i = draw(st.integers(0, B - 1)), draw(st.integers(0, N - 1))
        if draw(st.booleans()):
            parents[b, i] = draw(st.sampled_from([-2, i, i + 1, N + 5, 2 ** 31 - 1]))
        else:
            tokens[b, i] = draw(st.sampled_from([-1, -7, V, V + 100]))
    return tokens, parents


@st.composite
def prob_rows(draw, shape, sampled: bool):
    """Probability rows with the adversarial entries of the harness."""
    kind = draw(st.sampled_from(("softmax", "softmax", "peaked", "dyadic", "zeros", "nan", "inf", "negative",
                                 "one_hot", "tiny", "huge")))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    V = shape[-1]
    if kind == "peaked":
        p = torch.softmax(25 * torch.randn(*shape, generator=g), -1)
    elif kind == "dyadic":
        p = torch.randint(0, 5, shape, generator=g).float()
        p = p / p.sum(-1, keepdim=True).clamp(min=1) if sampled else p / 8
    elif kind == "zeros":
        p = torch.zeros(shape)
    elif kind == "one_hot":
        p = torch.zeros(shape)
        if p.numel():
            p.view(-1, V)[:, int(torch.randint(0, V, (1,), generator=g))] = 1.0
    elif kind == "tiny":
        p = torch.rand(shape, generator=g) * 1e-38
    elif kind == "huge":
        p = torch.rand(shape, generator=g) * 3e38
    else:
        p = torch.softmax(3 * torch.randn(*shape, generator=g), -1)
        p = p * (torch.rand(shape, generator=g) < 0.7)
        if p.numel() and kind in ("nan", "inf", "negative"):
            flat = p.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 7),), generator=g)
            flat[idx] = {"nan": float("nan"), "inf": float("inf"), "negative": -0.25}[kind]
    return p.float()


@st.composite
def uniforms_strategy(draw, B: int, N: int):
    """Uniforms in [0, 1] with the boundary values, and (1 in 6) one invalid entry."""
    special = st.sampled_from([0.0, 1.0, ONE_MINUS, 0.5, 2.0 ** -60])
    value = st.one_of(st.floats(0.0, 1.0, allow_nan=False), special, special)
    u = torch.tensor(draw(st.lists(value, min_size=B * N, max_size=B * N)), dtype=torch.float64).reshape(B, N)
    if B * N and draw(st.integers(0, 5)) == 0:
        u.view(-1)[draw(st.integers(0, B * N - 1))] = draw(st.sampled_from([-0.25, 1.5, float("nan")]))
    return u


# --------------------------------------------------------------------------- ops
@st.composite
def attention_case(draw):
    B = draw(st.sampled_from([0, 1, 1, 2, 3]))
    N = draw(st.sampled_from([1, 1, 2, 2, 3, 3, 5, 5, 8, 0]))
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from([1, 2, 3]))
    if draw(st.integers(0, 19)) == 0:
        Hq += 1  # not a multiple of Hkv
    D = draw(st.sampled_from([64, 64, 80, 96, 128, 256, 8, 1]))
    dtype = draw(st.sampled_from(FLOATS))
    # frontier form: the queries are the last N of the step's Nkv new nodes (mask [B, N, Nkv])
    Nkv = N + draw(st.sampled_from([0, 0, 0, 1, 3, 8]))
    lens = [draw(st.integers(0, 9)) for _ in range(B)]
    S = max([l + Nkv for l in lens] + [max(Nkv, 1)]) + draw(st.sampled_from([0, 0, 1, 3]))
    if B and draw(st.integers(0, 9)) == 0:  # a length at / past capacity
        lens[draw(st.integers(0, B - 1))] = draw(st.sampled_from([S - Nkv + 1, S, -1]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    for b, l in enumerate(lens):  # positions past the step's nodes hold NaN: they must never be read
        if 0 <= l and l + Nkv < S:
            k[b, :, l + Nkv:] = float("nan")
            v[b, :, l + Nkv:] = float("nan")
    kdtype = dtype if draw(st.integers(0, 14)) else draw(st.sampled_from(FLOATS))
    q = torch.randn(B, N, Hq, D, generator=g).to(dtype)
    qhow = draw(st.sampled_from(("contig", "contig", "offset1", "hf_transposed", "strided")))
    if qhow == "hf_transposed":  # transformers' [B, H, N, D] -> [B, N, H, D] view
        qd = q.transpose(1, 2).contiguous().to(DEVICE).transpose(1, 2)
    else:
        qd = place(q, qhow)
    mask_kind = draw(st.sampled_from(("none", "tree", "tree", "random", "all_false_row", "last_only") * 2
                                     + ("wrong_shape",)))
    mask = None
    if Nkv > N and mask_kind == "none" and draw(st.integers(0, 3)):
        mask_kind = "tree"  # the frontier form needs a mask (None is causal, Nkv = Nq): mostly valid cases
    if mask_kind != "none" and N > 0:
        mask = torch.rand(B, N, Nkv, generator=g) < 0.5
        if mask_kind == "tree":  # the last N rows of a whole tree's ancestor mask
            mask = reference.tree_attention_mask(draw(tree(B, Nkv, 5, True))[1])[:, Nkv - N:]
        if mask_kind == "all_false_row":
            mask[:, 0] = False
        if mask_kind == "last_only":  # a row that sees only the last node
            mask[:, 0] = False
            mask[:, 0, Nkv - 1] = True
        if mask_kind == "wrong_shape":
            mask = (mask[:, :, : N - 1] if Nkv == N else mask[:, :1]) if N > 1 else mask.int()
        mask = place(mask, draw(st.sampled_from(("contig", "offset1", "transposed"))))
    scale = draw(st.sampled_from([None] * 12 + [0.3, 2.0, float("nan"), float("inf")]))
    args = dict(q=qd,
                k_cache=place(k.to(kdtype),
                              draw(st.sampled_from(("contig",) * 5 + ("offset4", "offset4", "transposed")))),
                v_cache=place(v.to(kdtype), "contig"), cache_lens=place(torch.tensor(lens, dtype=torch.int32),
                                                                        draw(st.sampled_from(("contig", "strided")))),
                tree_mask=mask, scale=scale)
    return args


@given(attention_case())
def fuzz_verify_attention(args):
    def check(out, before):
        sc = before["scale"] if before["scale"] is not None else before["q"].shape[-1] ** -0.5
        want = reference.verify_attention(before["q"].cpu(), before["k_cache"].cpu(), before["v_cache"].cpu(),
                                          before["cache_lens"].cpu(), None if before["tree_mask"] is None
                                          else before["tree_mask"].cpu(), sc)
        assert out.dtype == before["q"].dtype
        assert not bool(torch.isnan(out.float()).any()), "NaN in the output (read past the tree?)"
        close(out, want, before["q"].dtype, 4.0, "out")
    run_property("verify_attention", ops.verify_attention, args, check, list(args))


@st.composite
def append_case(draw):
    B = draw(st.sampled_from([0, 1, 2, 3]))
    N = draw(st.sampled_from([1, 2, 3, 0]))
    Hkv, D = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 8, 64, 80]))
    dtype = draw(st.sampled_from(FLOATS))
    offset = draw(st.sampled_from([0, 0, 0, 1, 3]))  # writes at cache_lens + offset + j
    lens = [draw(st.integers(0, 6)) for _ in range(B)]
    S = max([l + offset + N for l in lens] + [max(offset + N, 1)]) + draw(st.sampled_from([0, 0, 2]))
    if B and draw(st.integers(0, 7)) == 0:
        lens[draw(st.integers(0, B - 1))] = draw(st.sampled_from([S - N + 1, -1, 2 ** 31 - 1]))
    if draw(st.integers(0, 11)) == 0:  # an offset out of range
        offset = draw(st.sampled_from([-1, S - N + 1, 2 ** 31, -2 ** 40]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    k = place(torch.randn(B, Hkv, S, D, generator=g).to(dtype), draw(st.sampled_from(("contig", "contig", "offset4"))))
    v = place(torch.randn(B, Hkv, S, D, generator=g).to(dtype), "contig")
    kn = place(torch.randn(B, Hkv, N, D, generator=g).to(dtype), draw(layouts()))
    vn = place(torch.randn(B, Hkv, N, D, generator=g).to(dtype), draw(layouts()))
    alias = draw(st.sampled_from(("none",) * 6 + ("kv", "new_in_cache")))
    if alias == "kv":
        v = k
    elif alias == "new_in_cache" and N > 0 and S >= N:
        kn = k[:, :, S - N:]
    return dict(k_cache=k, v_cache=v, k_new=kn, v_new=vn,
                cache_lens=place(torch.tensor(lens, dtype=torch.int32), draw(st.sampled_from(("contig", "strided")))),
                offset=offset)


@given(append_case())
def fuzz_append_kv(args):
    def check(out, before):
        k, v = before["k_cache"].cpu(), before["v_cache"].cpu()
        reference.append_kv(k, v, before["k_new"].cpu(), before["v_new"].cpu(), before["cache_lens"].cpu(),
                            before["offset"])
        assert torch.equal(bits(args["k_cache"]), bits(k)), "k_cache differs from the reference"
        assert torch.equal(bits(args["v_cache"]), bits(v)), "v_cache differs from the reference"
    run_property("append_kv", ops.append_kv, args, check, ["k_new", "v_new", "cache_lens"])


@st.composite
def sampling_case(draw, sampled_op: bool):
    B = draw(st.sampled_from([0, 1, 1, 2, 4]))
    N = draw(st.sampled_from([1, 1, 2, 3, 5, 8]))
    V = draw(st.sampled_from([1, 2, 3, 17, 64, 1000, 3000]))
    valid = draw(st.integers(0, 5)) > 0
    tokens, parents = draw(tree(B, N, V, valid))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    if sampled_op:
        with_q = draw(st.booleans())
        p = draw(prob_rows((B, N, V), False))
        q = draw(prob_rows((B, N, V), True)) if with_q else None
        if q is not None and draw(st.booleans()):  # draw the drafted tokens from q where it has mass
            qq = torch.nan_to_num(q, nan=0.0, posinf=0.0).clamp(min=0)
            ok = qq.sum(-1) > 0
            drawn = torch.multinomial(torch.where(ok[..., None], qq, torch.ones_like(qq)).reshape(-1, V), 1,
                                      generator=g).reshape(B, N)
            tokens = torch.where(parents >= 0, drawn, tokens)
        u = draw(uniforms_strategy(B, N))
        hows = [draw(st.sampled_from(("contig", "contig", "offset1", "transposed"))) for _ in range(3)]
        wrong = draw(st.sampled_from((None,) * 12 + ("tokens", "parents", "target_probs", "draft_probs", "uniforms")))
        if wrong == "tokens":
            tokens = tokens.int()
        elif wrong == "parents":
            parents = parents.long()
        elif wrong == "target_probs":
            p = p.to(draw(st.sampled_from((torch.float16, torch.float64, torch.bfloat16))))
        elif wrong == "draft_probs" and q is not None:
            q = q.double()
        elif wrong == "uniforms":
            u = u.float()
        args = dict(tokens=place(tokens, hows[0]), parents=place(parents, hows[1]),
                    target_probs=place(p, draw(st.sampled_from(("contig",) * 5 + ("offset1", "offset4", "strided")))),
                    draft_probs=None if q is None else place(q, draw(st.sampled_from(("contig",) * 5 + ("offset1",)))),
                    uniforms=place(u, hows[2]))
    else:
        dtype = draw(st.sampled_from(FLOATS))
        logits = torch.randn(B, N, V, generator=g) * 3
        special = draw(st.sampled_from(("none", "ties", "nan", "inf", "neg_inf", "all_equal")))
        if logits.numel():
            flat = logits.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 5),), generator=g)
            if special == "ties":
                logits = logits.round()
            elif special in ("nan", "inf", "neg_inf"):
                flat[idx] = {"nan": float("nan"), "inf": float("inf"), "neg_inf": float("-inf")}[special]
            elif special == "all_equal":
                logits.fill_(1.0)
        if B and N > 1 and draw(st.booleans()):  # children that follow the argmax: long accepted paths
            best = logits.to(dtype).float().argmax(-1)
            par = parents.clamp(0, N - 1).long()
            tokens = torch.where(parents >= 0, torch.gather(best, 1, par), tokens)
        args = dict(tokens=place(tokens, draw(layouts())), parents=place(parents, draw(layouts())),
                    target_logits=place(logits.to(dtype), draw(st.sampled_from(("contig",) * 4 + ("offset1",)))))
    return args


def _check_sample(op):
    def check(out, before):
        cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in before.items()}
        want = getattr(reference, op)(**cpu)
        for name, a, b in zip(("accepted", "num_accepted", "out_tokens"), out, want):
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b), f"{name} differs from the reference"
    return check


@given(sampling_case(True))
def fuzz_rejection_sample(args):
    run_property("rejection_sample", ops.rejection_sample, args, _check_sample("rejection_sample"),
                 list(args))


@given(sampling_case(False), st.integers(0, 3))
def fuzz_greedy_verify(args, form):
    t = args.get("target_logits")
    if form == 0 and isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] > 0 and t.is_floating_point():
        args = dict(args, target_logits=torch.argmax(t, dim=-1))  # the int64 form: the argmax at each node
    run_property("greedy_verify", ops.greedy_verify, args, _check_sample("greedy_verify"), list(args))


@st.composite
def commit_case(draw):
    L = draw(st.sampled_from([1, 2, 3]))
    B = draw(st.sampled_from([0, 1, 2, 3]))
    N = draw(st.sampled_from([1, 2, 4, 6]))
    Hkv, D = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3, 8, 64]))
    dtype = draw(st.sampled_from(FLOATS))
    lens = [draw(st.integers(0, 5)) for _ in range(B)]
    S = max([l + N for l in lens] + [N]) + draw(st.sampled_from([0, 0, 2]))
    accepted = torch.full((B, N), -1, dtype=torch.int32)
    num = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = draw(st.integers(0, N - 1))
        path = sorted(draw(st.lists(st.integers(1, N - 1), min_size=n, max_size=n, unique=True))) if N > 1 else []
        accepted[b, 0] = 0
        accepted[b, 1:len(path) + 1] = torch.tensor(path, dtype=torch.int32)
        num[b] = len(path)
    if B and draw(st.integers(0, 5)) == 0:  # one corrupted value
        b = draw(st.integers(0, B - 1))
        what = draw(st.sampled_from(("num", "acc", "len")))
        if what == "num":
            num[b] = draw(st.sampled_from([-1, N, N + 3]))
        elif what == "acc" and N > 1:
            accepted[b, draw(st.integers(0, N - 1))] = draw(st.sampled_from([-1, N, 0]))
        else:
            lens[b] = draw(st.sampled_from([S - N + 1, S, -1]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    kc = [place(torch.randn(B, Hkv, S, D, generator=g).to(dtype), draw(st.sampled_from(("contig", "offset4"))))
          for _ in range(L)]
    vc = [place(torch.randn(B, Hkv, S, D, generator=g).to(dtype), "contig") for _ in range(L)]
    alias = draw(st.sampled_from(("none",) * 6 + ("k_is_v", "layer_twice", "lens_is_num")))
    cache_lens = place(torch.tensor(lens, dtype=torch.int32), draw(st.sampled_from(("contig", "strided"))))
    num_t = place(num, draw(st.sampled_from(("contig", "strided"))))
    if alias == "k_is_v":
        vc[0] = kc[0]
    elif alias == "layer_twice" and L > 1:
        kc[1] = kc[0]
    elif alias == "lens_is_num":
        num_t = cache_lens
    return dict(k_caches=kc, v_caches=vc, cache_lens=cache_lens, accepted=place(accepted, draw(layouts())),
                num_accepted=num_t)


@given(commit_case())
def fuzz_kv_commit(args):
    def check(out, before):
        kc = [t.cpu() for t in before["k_caches"]]
        vc = [t.cpu() for t in before["v_caches"]]
        lens = before["cache_lens"].cpu()
        reference.kv_commit(kc, vc, lens, before["accepted"].cpu(), before["num_accepted"].cpu())
        for i, (a, b) in enumerate(zip(args["k_caches"], kc)):
            assert torch.equal(bits(a), bits(b)), f"k_caches[{i}] differs from the reference"
        for i, (a, b) in enumerate(zip(args["v_caches"], vc)):
            assert torch.equal(bits(a), bits(b)), f"v_caches[{i}] differs from the reference"
        assert torch.equal(args["cache_lens"].cpu(), lens), "cache_lens differs from the reference"
    run_property("kv_commit", ops.kv_commit, args, check, ["accepted", "num_accepted"])


# --------------------------------------------------------------------------- paged KV ops
PAGE_SIZES = (1, 1, 16, 16, 64, 2, 3, 5)
_PAD, _ANY = -100, -200  # placeholders while a block table is built
_BAD_PAGES = (-1, -2 ** 31, 2 ** 31 - 1)  # plus num_pages and num_pages + 3, drawn where the pool is known


def paged_lens(draw, B: int) -> List[int]:
    """Ragged committed lengths: mostly short, now and then across a page or a 64-key block boundary."""
    return [draw(st.integers(0, 9)) if draw(st.integers(0, 4)) else
            draw(st.sampled_from([15, 16, 17, 63, 64, 65, 130])) for _ in range(B)]


@st.composite
def block_tables(draw, ends: List[int], starts: Optional[List[int]], ps: int):
    """(block_tables [B, M] int64, num_pages) for a call that touches positions [starts[b], ends[b]) of row b.

    starts None: a read-only call (verify) that reads every position < ends[b]; its blocks are distinct
    pages, a common prefix (rows share row 0's first blocks) or pages drawn at random (one page at several
    blocks of a row or of several rows). Otherwise the call writes positions [starts[b], ends[b]): their
    blocks are pages of the row's own, distinct across the batch (a page two rows write would race), and
    the blocks before them, never read, hold distinct pages, a prefix shared by every row, or padding.
    Past ends[b]: padding (-1, garbage ids or any page). Page ids are shuffled over a pool with spares.
    """
    B = len(ends)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    nblk = [-(-e // ps) for e in ends]
    first = [0] * B if starts is None else [min(s // ps, n) for s, n in zip(starts, nblk)]
    M = max(nblk + [1]) + draw(st.sampled_from([0, 0, 1, 3]))
    share = draw(st.sampled_from(("distinct", "prefix", "any") if starts is None else ("distinct", "prefix", "pad")))
    table = torch.full((B, M), _PAD, dtype=torch.int64)
    count, prefix = 0, {}
    for b in range(B):
        for j in range(nblk[b]):
            if (starts is not None and j >= first[b]) or share == "distinct":  # a fresh page
                table[b, j], count = count, count + 1
            elif share == "any":
                table[b, j] = _ANY
            elif share == "prefix":
                if j not in prefix:
                    prefix[j], count = count, count + 1
                table[b, j] = prefix[j]
    if share == "any":
        P = draw(st.integers(1, max(1, sum(nblk)) + 1))
    else:
        P = max(1, count + draw(st.sampled_from([0, 1, 3])))
    perm = torch.randperm(P, generator=g)
    real = table >= 0
    table[real] = perm[table[real]]
    anyb = table == _ANY
    table[anyb] = torch.randint(0, P, (int(anyb.sum()),), generator=g)
    pad = table == _PAD
    kind = draw(st.sampled_from(("minus1", "garbage", "pages")))
    if kind == "minus1":
        table[pad] = -1
    elif kind == "garbage":
        table[pad] = torch.tensor([-1, -7, P, P + 5, 2 ** 31 - 1])[torch.randint(0, 5, (int(pad.sum()),), generator=g)]
    else:
        table[pad] = torch.randint(0, P, (int(pad.sum()),), generator=g)
    return table, P


def corrupt_block(draw, table: torch.Tensor, ends: List[int], starts: Optional[List[int]], ps: int, P: int) -> None:
    """One block that the call uses names no page (-1, past the pool, int32 extremes)."""
    spans = [(b, (0 if starts is None else starts[b] // ps), -(-e // ps) - 1) for b, e in enumerate(ends)]
    spans = [s for s in spans if s[1] <= s[2]]
    if spans:
        b, lo, hi = draw(st.sampled_from(spans))
        table[b, draw(st.integers(lo, hi))] = draw(st.sampled_from(_BAD_PAGES + (P, P + 3)))


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """t's values on DEVICE in a non-contiguous view (a view with size-1 dims only can only be contiguous)."""
    for how in ("transposed", "strided"):
        out = place(t, how)
        if not out.is_contiguous():
            return out
    out = torch.empty(2 * t.shape[0], *t.shape[1:], dtype=t.dtype, device=DEVICE)[::2]
    out.copy_(t)
    return out


def dense_caches(pages: torch.Tensor, tables: torch.Tensor, ends: List[int]) -> torch.Tensor:
    """Positions [0, ends[b]) of every row as a dense [B, Hkv, S, D] cache (zeros past a row's end)."""
    P, ps, H, D = pages.shape
    out = torch.zeros(len(ends), H, max(ends + [1]), D, dtype=pages.dtype)
    for b, e in enumerate(ends):
        out[b, :, :e] = reference_paged.gather_dense(pages, tables, b, e)
    return out


@st.composite
def paged_attention_case(draw):
    # every invalid draw (about a third) comes from `special`
    special = draw(st.sampled_from(("none",) * 40 + ("page", "page", "len", "len", "n0", "heads", "scale", "mask_shape",
                                                     "mask_int", "tables_dtype", "tables_shape", "tables_cols0",
                                                     "lens_dtype", "lens_shape", "pages_dtype", "kv_dtype", "pages_3d",
                                                     "pages_empty", "v_shape", "head_dim", "noncontig", "q3d")))
    B = draw(st.sampled_from([0, 1, 1, 2, 3]))
    N = 0 if special == "n0" else draw(st.sampled_from([1, 1, 2, 2, 3, 3, 5, 8]))
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from([1, 2, 3])) + (special == "heads")  # "heads": not a multiple of Hkv
    D = draw(st.sampled_from([64, 64, 40, 80, 128, 8, 1]))
    dtype = draw(st.sampled_from(FLOATS))
    ps = draw(st.sampled_from(PAGE_SIZES))
    Nkv = N + draw(st.sampled_from([0, 0, 0, 1, 3, 8]))  # the frontier form: queries = the last N of Nkv nodes
    lens = paged_lens(draw, B)
    ends = [l + Nkv for l in lens]
    table, P = draw(block_tables(ends, None, ps))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    k = torch.randn(P, ps, Hkv, D, generator=g)
    v = torch.randn(P, ps, Hkv, D, generator=g)
    read = torch.zeros(P * ps, dtype=torch.bool)  # slots that no row reads hold NaN: they must never be read
    for b, e in enumerate(ends):
        read[reference_paged.slots(table, b, torch.arange(e), ps)] = True
    k.view(P * ps, Hkv, D)[~read] = float("nan")
    v.view(P * ps, Hkv, D)[~read] = float("nan")
    if special == "page":
        corrupt_block(draw, table, ends, None, ps, P)
    elif special == "len" and B:
        cap = table.shape[1] * ps
        lens[draw(st.integers(0, B - 1))] = draw(st.sampled_from([cap - Nkv + 1, cap, -1, 2 ** 31 - 1, -2 ** 31]))
    kdtype = draw(st.sampled_from([f for f in FLOATS if f != dtype])) if special == "kv_dtype" else dtype
    k, v = k.to(kdtype), v.to(kdtype)
    q = torch.randn(B, N, Hq, D, generator=g).to(dtype)
    qhow = draw(st.sampled_from(("contig", "contig", "offset1", "hf_transposed", "strided")))
    if qhow == "hf_transposed":  # transformers' [B, H, N, D] -> [B, N, H, D] view
        qd = q.transpose(1, 2).contiguous().to(DEVICE).transpose(1, 2)
    else:
        qd = place(q, qhow)
    mask_kind = draw(st.sampled_from(("none", "chain", "tree", "tree", "random", "all_false_row", "last_only")))
    mask_kind = {"mask_shape": "wrong_shape", "mask_int": "int"}.get(special, mask_kind)
    mask = None
    if Nkv > N and mask_kind == "none" and draw(st.integers(0, 3)):
        mask_kind = "tree"  # the frontier form needs a mask (None is causal, Nkv = Nq); None keeps Nkv = Nq
    if mask_kind != "none" and N > 0:
        mask = torch.rand(B, N, Nkv, generator=g) < 0.5
        if mask_kind == "tree":  # the last N rows of ragged trees' ancestor masks
            mask = reference.tree_attention_mask(draw(tree(B, Nkv, 5, True))[1])[:, Nkv - N:]
        elif mask_kind == "chain":
            mask = torch.ones(Nkv, Nkv, dtype=torch.bool).tril()[Nkv - N:].expand(B, N, Nkv).clone()
        elif mask_kind == "all_false_row":
            mask[:, 0] = False
        elif mask_kind == "last_only":  # a row that sees only the last node
            mask[:, 0] = False
            mask[:, 0, Nkv - 1] = True
        elif mask_kind == "wrong_shape":
            mask = (mask[:, :, : N - 1] if Nkv == N else mask[:, :1]) if N > 1 else mask[:, :, :0]
        elif mask_kind == "int":
            mask = mask.int()
        mask = place(mask, draw(st.sampled_from(("contig", "offset1", "transposed"))))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    if special == "tables_dtype":
        table = table.to(draw(st.sampled_from((torch.int64, torch.int16, torch.float32))))
    elif special == "tables_shape":
        table = table[:-1] if B else torch.zeros(1, 2, dtype=torch.int64)
    elif special == "tables_cols0":
        table = table[:, :0]
    elif special == "lens_dtype":
        lens_t = lens_t.long()
    elif special == "lens_shape":
        lens_t = torch.zeros(B + 1, dtype=torch.int32) if draw(st.booleans()) else lens_t[None]
    elif special == "pages_dtype":
        k = k.to(torch.float64) if draw(st.booleans()) else k.to(torch.int32)
    elif special == "pages_3d":
        k, v = k[0], v[0]
    elif special == "pages_empty":
        k, v = k[:0], v[:0]
    elif special == "v_shape":
        v = torch.cat([v, v[:1]])
    elif special == "head_dim":
        k, v = k[..., : D - 1].contiguous(), v[..., : D - 1].contiguous()
    elif special == "q3d":
        qd = qd.reshape(B, N, Hq * D)
    table = table.to(torch.int32) if special != "tables_dtype" else table
    kp = noncontig(k) if special == "noncontig" else place(k, draw(st.sampled_from(("contig",) * 3 + ("offset4",))))
    scale = draw(st.sampled_from([None] * 6 + [0.3, 2.0]))
    if special == "scale":
        scale = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    vp = place(v, draw(st.sampled_from(("contig", "contig", "offset1"))))
    if special == "none":
        layout = draw(POOL_LAYOUTS)
        if layout != "nhd":
            kp, vp = pools(k, v, layout)
    return dict(q=qd, k_pages=kp, v_pages=vp,
                block_tables=place(table, draw(st.sampled_from(("contig",) * 3 + ("offset1", "transposed",
                                                                                  "strided")))),
                cache_lens=place(lens_t, draw(st.sampled_from(("contig", "strided", "offset1")))), tree_mask=mask,
                scale=scale)


@given(paged_attention_case())
def fuzz_verify_attention_paged(args):
    def check(out, before):
        q = before["q"].cpu()
        kp, vp, tables, lens = (before[n].cpu() for n in ("k_pages", "v_pages", "block_tables", "cache_lens"))
        mask = None if before["tree_mask"] is None else before["tree_mask"].cpu()
        sc = before["scale"] if before["scale"] is not None else q.shape[-1] ** -0.5
        assert out.dtype == q.dtype and out.shape == q.shape, f"out is {out.dtype} {tuple(out.shape)}"
        if q.shape[0] == 0:
            return
        want = reference_paged.verify_attention_paged(q, kp, vp, tables, lens, mask, sc)
        assert not bool(torch.isnan(out.float()).any()), "NaN in the output (read a slot past the row?)"
        close(out, want, q.dtype, 4.0, "out")
        if torch.device(DEVICE).type == "cpu":  # the CPU kernel gives the dense kernel's bits for the same keys
            Nkv = q.shape[1] if mask is None else mask.shape[2]
            ends = [int(l) + Nkv for l in lens.tolist()]
            dense = ops.verify_attention(q, dense_caches(kp, tables, ends), dense_caches(vp, tables, ends), lens,
                                         mask, sc)
            assert torch.equal(bits(out), bits(dense)), "the paged CPU kernel differs from the dense one"
    run_property("verify_attention_paged", paged_ops.verify_attention_paged, args, check, list(args))


@st.composite
def paged_append_case(draw):
    special = draw(st.sampled_from(("none",) * 40 + ("page", "page", "len", "len", "offset", "offset", "n0",
                                                     "knew_heads", "knew_dim", "knew_3d", "vnew_shape", "knew_dtype",
                                                     "v_pages", "pages_dtype", "pages_empty", "noncontig",
                                                     "tables_dtype", "tables_shape", "lens_dtype", "lens_shape",
                                                     "v_is_k", "new_in_pages")))
    B = draw(st.sampled_from([0, 1, 2, 3]))
    N = 0 if special == "n0" else draw(st.sampled_from([1, 1, 2, 3, 5]))
    Hkv, D = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 8, 64, 80]))
    dtype = draw(st.sampled_from(FLOATS))
    ps = draw(st.sampled_from(PAGE_SIZES))
    offset = draw(st.sampled_from([0, 0, 0, 1, 3]))  # writes at cache_lens + offset + j
    lens = paged_lens(draw, B)
    starts = [l + offset for l in lens]
    ends = [s + N for s in starts]
    table, P = draw(block_tables(ends, starts, ps))
    cap = table.shape[1] * ps
    if special == "page":
        corrupt_block(draw, table, ends, starts, ps, P)
    elif special == "len" and B:
        lens[draw(st.integers(0, B - 1))] = draw(st.sampled_from([cap - offset - N + 1, cap, -1, 2 ** 31 - 1]))
    elif special == "offset":
        offset = draw(st.sampled_from([-1, cap - N + 1, 2 ** 31, -2 ** 40]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    k = torch.randn(P, ps, Hkv, D, generator=g).to(dtype)
    v = torch.randn(P, ps, Hkv, D, generator=g).to(dtype)
    kn = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    vn = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    table = table.to(torch.int32)
    if special == "knew_heads":
        kn = torch.zeros(B, Hkv + 1, N, D, dtype=dtype)
    elif special == "knew_dim":
        kn, vn = kn[..., : D - 1], vn[..., : D - 1]
    elif special == "knew_3d":
        kn = kn.reshape(B * Hkv, N, D)
    elif special == "vnew_shape":
        vn = torch.zeros(B, Hkv, N + 1, D, dtype=dtype)
    elif special == "knew_dtype":
        kn = kn.to(torch.float32 if dtype != torch.float32 else torch.float16)
    elif special == "v_pages":
        v = torch.cat([v, v[:1]]) if draw(st.booleans()) else v.to(torch.float64)
    elif special == "pages_dtype":
        k, v, kn, vn = k.double(), v.double(), kn.double(), vn.double()
    elif special == "pages_empty":
        k, v = k[:0], v[:0]
    elif special == "tables_dtype":
        table = table.long()
    elif special == "tables_shape":
        table = table[:, None] if draw(st.booleans()) else torch.zeros(B + 1, 1, dtype=torch.int32)
    elif special == "lens_dtype":
        lens_t = lens_t.long()
    elif special == "lens_shape":
        lens_t = lens_t[:-1] if B else torch.zeros(1, dtype=torch.int32)
    kp = noncontig(k) if special == "noncontig" else place(k, draw(st.sampled_from(("contig",) * 3 + ("offset4",))))
    vp = kp if special == "v_is_k" else place(v, "contig")
    if special == "none":
        layout = draw(POOL_LAYOUTS)
        if layout != "nhd":
            kp, vp = pools(k, v, layout)
    knd = place(kn, draw(layouts()))
    if special == "new_in_pages" and P >= B and ps >= N:  # k_new a [B, Hkv, N, D] view of k_pages
        knd = kp[:B, :N].transpose(1, 2)
    return dict(k_pages=kp, v_pages=vp, k_new=knd, v_new=place(vn, draw(layouts())),
                block_tables=place(table, draw(st.sampled_from(("contig",) * 3 + ("offset1", "transposed")))),
                cache_lens=place(lens_t, draw(st.sampled_from(("contig", "strided", "offset1")))), offset=offset)


@given(paged_append_case())
def fuzz_append_kv_paged(args):
    def check(out, before):
        k, v = before["k_pages"].cpu(), before["v_pages"].cpu()
        reference_paged.append_kv_paged(k, v, before["k_new"].cpu(), before["v_new"].cpu(),
                                        before["block_tables"].cpu(), before["cache_lens"].cpu(), before["offset"])
        assert torch.equal(bits(args["k_pages"]), bits(k)), "k_pages differs from the reference"
        assert torch.equal(bits(args["v_pages"]), bits(v)), "v_pages differs from the reference"
    run_property("append_kv_paged", paged_ops.append_kv_paged, args, check,
                 ["k_new", "v_new", "block_tables", "cache_lens"])


@st.composite
def paged_commit_case(draw):
    L = draw(st.sampled_from([1, 2, 3]))
    B = draw(st.sampled_from([0, 1, 2, 3]))
    N = draw(st.sampled_from([1, 2, 4, 6]))
    dims = [(draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3, 8, 64])))]
    dims += [dims[0] if draw(st.booleans()) else (draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3, 8, 64])))
             for _ in range(L - 1)]  # layers may differ in Hkv and D
    dtype = draw(st.sampled_from(FLOATS))
    ps = draw(st.sampled_from(PAGE_SIZES))
    lens = paged_lens(draw, B)
    ends = [l + N for l in lens]
    table, P = draw(block_tables(ends, lens, ps))
    accepted = torch.full((B, N), -1, dtype=torch.int32)
    num = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = draw(st.integers(0, N - 1))
        if draw(st.booleans()):  # a chain: every accepted node in place, no byte moves
            path = list(range(1, n + 1))
        else:
            path = sorted(draw(st.lists(st.integers(1, N - 1), min_size=n, max_size=n, unique=True))) if N > 1 else []
        accepted[b, 0] = 0
        accepted[b, 1:len(path) + 1] = torch.tensor(path, dtype=torch.int32)
        num[b] = len(path)
    special = draw(st.sampled_from(("none",) * 36 + ("page", "page", "len", "len", "num", "acc", "root",
                                                     "layer_pages", "layer_ps", "layer_dtype", "v_count", "empty",
                                                     "noncontig", "tables_dtype", "lens_dtype", "acc_dtype",
                                                     "num_shape", "acc_cols0", "k_is_v", "layer_twice",
                                                     "lens_is_num", "lens_in_tables")))
    if special == "page":
        corrupt_block(draw, table, ends, lens, ps, P)
    elif special == "len" and B:
        cap = table.shape[1] * ps
        lens[draw(st.integers(0, B - 1))] = draw(st.sampled_from([cap - N + 1, cap, -1, 2 ** 31 - 1]))
    elif special == "num" and B:
        num[draw(st.integers(0, B - 1))] = draw(st.sampled_from([-1, N, N + 3]))
    elif special == "acc" and B and N > 1:
        accepted[draw(st.integers(0, B - 1)), draw(st.integers(1, N - 1))] = draw(st.sampled_from([-1, N, 0]))
    elif special == "root" and B:
        accepted[draw(st.integers(0, B - 1)), 0] = draw(st.sampled_from([1, -1]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    kc = [torch.randn(P, ps, h, d, generator=g).to(dtype) for h, d in dims]
    vc = [torch.randn(P, ps, h, d, generator=g).to(dtype) for h, d in dims]
    table = table.to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    if special == "layer_pages":
        vc[-1] = torch.cat([vc[-1], vc[-1][:1]])
    elif special == "layer_ps" and ps > 1:
        kc[-1] = kc[-1][:, :ps - 1].contiguous()
    elif special == "layer_dtype":
        kc[-1] = kc[-1].to(torch.float32 if dtype != torch.float32 else torch.bfloat16)
    elif special == "v_count":
        vc = vc[:-1]
    elif special == "empty":
        kc, vc = [], []
    elif special == "tables_dtype":
        table = table.long()
    elif special == "lens_dtype":
        lens_t = lens_t.long()
    elif special == "acc_dtype":
        accepted = accepted.long()
    elif special == "num_shape":
        num = num[None]
    elif special == "acc_cols0":
        accepted = accepted[:, :0]
    kc = [noncontig(t) if special == "noncontig" and i == len(kc) - 1 else
          place(t, draw(st.sampled_from(("contig", "contig", "offset4")))) for i, t in enumerate(kc)]
    vc = [place(t, "contig") for t in vc]
    if special == "none":
        layout = draw(POOL_LAYOUTS)
        if layout != "nhd":
            pairs = [pools(a, b, layout) for a, b in zip(kc, vc)]
            kc, vc = [p[0] for p in pairs], [p[1] for p in pairs]
    table_d = place(table, draw(st.sampled_from(("contig", "contig", "offset1", "transposed"))))
    cache_lens = place(lens_t, draw(st.sampled_from(("contig", "strided"))))
    num_t = place(num, draw(st.sampled_from(("contig", "strided"))))
    if special == "k_is_v":
        vc[0] = kc[0]
    elif special == "layer_twice" and L > 1:
        kc[1] = kc[0]
    elif special == "lens_is_num":
        num_t = cache_lens
    elif special == "lens_in_tables":  # cache_lens a view of block_tables' memory
        cache_lens = table_d[:, 0]
    return dict(k_pages=kc, v_pages=vc, block_tables=table_d, cache_lens=cache_lens,
                accepted=place(accepted, draw(layouts())), num_accepted=num_t)


@given(paged_commit_case())
def fuzz_kv_commit_paged(args):
    def check(out, before):
        kc = [t.cpu() for t in before["k_pages"]]
        vc = [t.cpu() for t in before["v_pages"]]
        lens = before["cache_lens"].cpu()
        reference_paged.kv_commit_paged(kc, vc, before["block_tables"].cpu(), lens, before["accepted"].cpu(),
                                        before["num_accepted"].cpu())
        for i, (a, b) in enumerate(zip(args["k_pages"], kc)):
            assert torch.equal(bits(a), bits(b)), f"k_pages[{i}] differs from the reference"
        for i, (a, b) in enumerate(zip(args["v_pages"], vc)):
            assert torch.equal(bits(a), bits(b)), f"v_pages[{i}] differs from the reference"
        assert torch.equal(args["cache_lens"].cpu(), lens), "cache_lens differs from the reference"
    run_property("kv_commit_paged", paged_ops.kv_commit_paged, args, check,
                 ["block_tables", "accepted", "num_accepted"])


@st.composite
def linear_case(draw):
    lead = draw(st.sampled_from([(1,), (2,), (5,), (0,), (33,), (2, 3), ()]))
    K = draw(st.sampled_from([0, 1, 3, 8, 17, 64]))
    N = draw(st.sampled_from([0, 1, 3, 9, 40]))
    dtype = draw(st.sampled_from(FLOATS))
    wkind = draw(st.sampled_from(("same", "same", "int8", "other")))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    x = torch.randn(*lead, K, generator=g).to(dtype)
    scale = None
    if wkind == "int8":
        w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        scale = torch.rand(N, generator=g) * 0.02 if draw(st.integers(0, 9)) else None
    else:
        wd = dtype if wkind == "same" else draw(st.sampled_from(FLOATS))
        w = (torch.randn(N, K, generator=g) / math.sqrt(max(K, 1))).to(wd)
    bias = torch.randn(N, generator=g).to(dtype) if draw(st.booleans()) else None
    if draw(st.integers(0, 14)) == 0:
        bias = torch.randn(N + 1, generator=g).to(dtype)  # wrong shape
    return dict(x=place(x, draw(layouts())), weight=place(w, draw(layouts())),
                bias=None if bias is None else place(bias, draw(st.sampled_from(("contig", "offset1", "strided")))),
                weight_scale=None if scale is None else place(scale, draw(st.sampled_from(("contig", "offset1")))))


@given(linear_case())
def fuzz_linear(args):
    def check(out, before):
        x, w = before["x"].cpu(), before["weight"].cpu()
        b = None if before["bias"] is None else before["bias"].cpu()
        s = None if before["weight_scale"] is None else before["weight_scale"].cpu()
        want = reference.linear(x, w, b, s)
        assert out.dtype == x.dtype and out.shape == want.shape
        mag = x.double().abs() @ w.double().abs().T
        if s is not None:
            mag = mag * s.double()
        tol = 2e-5 * math.sqrt(max(x.shape[-1], 1)) * mag + 2 * ULP[x.dtype] * want.double().abs() + 1e-30
        err = (out.cpu().double() - want.double()).abs()
        assert bool((err <= tol).all()), f"linear: max |err| {err.max().item() if err.numel() else 0:.3e}"
    run_property("linear", ops.linear, args, check, list(args))


@st.composite
def qlinear_case(draw):
    lead = draw(st.sampled_from([(1,), (2,), (3,), (0,), (17,), (33,), (2, 3)]))
    G = draw(st.sampled_from([0, 1, 2, 3]))
    K = 32 * G + (draw(st.sampled_from([1, 16])) if draw(st.integers(0, 11)) == 0 else 0)  # rarely not a multiple
    N = draw(st.sampled_from([0, 1, 4, 9]))
    dtype = draw(st.sampled_from(FLOATS))
    fmt = draw(st.sampled_from(("q8_0", "q4_0", "q4_1")))
    bits = 8 if fmt == "q8_0" else 4
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    Kq = K - K % 32
    if Kq:
        qw, d, m = ops.quantize_weight_groups(torch.randn(N, Kq, generator=g), fmt)
    else:
        qw = torch.zeros(N, 0, dtype=torch.int8 if bits == 8 else torch.uint8)
        d = torch.zeros(N, 0, dtype=torch.float16)
        m = torch.zeros(N, 0, dtype=torch.float16) if fmt == "q4_1" else None
    special = draw(st.sampled_from(("none",) * 8 + ("inf_scale", "nan_scale", "bits", "mins8", "dtype")))
    if special == "inf_scale" and d.numel():
        d.view(-1)[0] = float("inf")
    elif special == "nan_scale" and d.numel():
        d.view(-1)[0] = float("nan")
    elif special == "bits":
        bits = draw(st.sampled_from([0, 2, 16]))
    elif special == "mins8" and bits == 8:
        m = d.clone()
    elif special == "dtype":
        d = d.float()
    x = torch.randn(*lead, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if draw(st.booleans()) else None
    return dict(x=place(x, draw(layouts())),
                qweight=place(qw, draw(st.sampled_from(("contig",) * 4 + ("offset1", "transposed")))),
                scales=place(d, "contig"), mins=None if m is None else place(m, "contig"),
                bias=None if bias is None else place(bias, draw(st.sampled_from(("contig", "strided")))), bits=bits)


@given(qlinear_case())
def fuzz_qlinear(args):
    def check(out, before):
        x = before["x"].cpu()
        mins = None if before["mins"] is None else before["mins"].cpu()
        bias = None if before["bias"] is None else before["bias"].cpu()
        want = reference.qlinear(x, before["qweight"].cpu(), before["scales"].cpu(), mins, bias, before["bits"])
        assert out.dtype == x.dtype and out.shape == want.shape
        w = reference.dequantize_groups(before["qweight"].cpu(), before["scales"].cpu(), mins, before["bits"])
        mag = x.double().abs() @ w.abs().T
        tol = 2e-5 * math.sqrt(max(x.shape[-1], 1)) * mag + 2 * ULP[x.dtype] * want.double().abs() + 1e-30
        got = out.cpu().double()
        # non-finite weights (an inf / NaN scale) give non-finite outputs; which kind depends on the order
        ok = ((got - want.double()).abs() <= tol) | (got == want.double()) | \
            (~torch.isfinite(got) & ~torch.isfinite(want.double()))
        assert bool(ok.all()), "qlinear differs from the reference past the tolerance"
    run_property("qlinear", ops.qlinear, args, check, list(args))


def _q8_finite_rows(x: torch.Tensor) -> torch.Tensor:
    """[M] bool: rows of x [..., K] whose values are all finite (the q8 definition covers those)."""
    return torch.isfinite(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).float()).all(-1)


@given(qlinear_case(), st.booleans())
def fuzz_qlinear_q8act(args, packed):
    args = dict(args, packed=packed)
    def check(out, before):
        x = before["x"].cpu()
        mins = None if before["mins"] is None else before["mins"].cpu()
        bias = None if before["bias"] is None else before["bias"].cpu()
        want = reference_q8act.qlinear_q8act(x, before["qweight"].cpu(), before["scales"].cpu(), mins, bias,
                                             before["bits"])
        assert out.dtype == x.dtype and out.shape == want.shape
        got = out.cpu()
        # bit-exact; an inf / NaN scale gives non-finite outputs whose kind depends on the order
        ok = (got == want) | (~torch.isfinite(got) & ~torch.isfinite(want))
        assert bool(ok.all()), "qlinear_q8act differs from the reference (bit-exact expected)"

    def fn(**kw):
        try:
            return ops.qlinear(**kw, act="q8")
        except RuntimeError as e:  # the op's own name opens its errors
            assert str(e).startswith("qlinear_q8act:"), str(e)
            raise
    if args.pop("packed"):  # the CPU tiers' layout in place of the weight, where it packs (else the usual one)
        try:
            w = args["qweight"]
            args["qweight"] = place(ops.pack_q8act(w.cpu(), args["scales"].cpu(),
                                                   None if args["mins"] is None else args["mins"].cpu(),
                                                   args["bits"]), "contig")
        except RuntimeError:
            pass
    run_property("qlinear_q8act", fn, args, check, list(args))


def _argmax_check(product):
    """The argmax ops' property: int64 [...], equal to torch.argmax of the same device's product exactly."""
    def check(out, before):
        want = torch.argmax(product(**snapshot(before)), dim=-1)
        assert out.dtype == torch.int64 and out.shape == want.shape, (out.dtype, tuple(out.shape))
        assert torch.equal(out, want), "the argmax differs from torch.argmax of the op's result"
    return check


@given(linear_case())
def fuzz_linear_argmax(args):
    run_property("linear_argmax", ops.linear_argmax, args, _argmax_check(ops.linear), list(args))


@given(qlinear_case(), st.sampled_from((None, "q8", "q8_packed")))
def fuzz_qlinear_argmax(args, act):
    if act == "q8_packed":  # the CPU tiers' layout in place of the weight, where it packs (else the usual one)
        act = "q8"
        try:
            args["qweight"] = place(ops.pack_q8act(args["qweight"].cpu(), args["scales"].cpu(),
                                                   None if args["mins"] is None else args["mins"].cpu(),
                                                   args["bits"]), "contig")
        except RuntimeError:
            pass
    run_property("qlinear_argmax", lambda **kw: ops.qlinear_argmax(**kw, act=act), args,
                 _argmax_check(lambda **kw: ops.qlinear(**kw, act=act)), list(args))


@given(qlinear_case())
def fuzz_pack_q8act(args):
    args = {k: args[k] for k in ("qweight", "scales", "mins", "bits")}

    def check(out, before):
        mins = None if before["mins"] is None else before["mins"].cpu()
        want = reference_q8act.pack_q8act(before["qweight"].cpu(), before["scales"].cpu(), mins, before["bits"])
        assert out.dtype == torch.uint8 and torch.equal(out.cpu(), want), "pack_q8act differs from the reference"
    run_property("pack_q8act", ops.pack_q8act, args, check, list(args))


@st.composite
def quantize_q8_case(draw):
    lead = draw(st.sampled_from([(1,), (3,), (0,), (2, 2)]))
    K = 32 * draw(st.sampled_from([0, 1, 2, 5])) + draw(st.sampled_from((0,) * 11 + (16,)))  # rarely not 32 k
    dtype = draw(st.sampled_from(FLOATS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    x = torch.randn(*lead, K, generator=g) * draw(st.sampled_from([1.0, 1e-3, 1e-38, 1e-42, 1e30]))
    special = draw(st.sampled_from(("none",) * 6 + ("zeros", "ties", "huge", "nonfinite")))
    if x.numel():
        flat = x.view(-1)
        if special == "zeros":
            flat[: min(32, flat.numel())] = 0
        elif special == "ties":  # amax 127: id = 1 and x = k + 0.5 exactly
            flat[0] = 127.0
            flat[1: min(32, flat.numel())] = torch.arange(min(32, flat.numel()) - 1) - 15.5
        elif special == "huge":
            flat[0] = 3e38
        elif special == "nonfinite":
            flat[0] = draw(st.sampled_from([float("inf"), float("-inf"), float("nan")]))
    return dict(x=place(x.to(dtype), draw(layouts())))


@given(quantize_q8_case())
def fuzz_quantize_q8(args):
    def check(out, before):
        x = before["x"].cpu()
        a, d = out
        ra, rd = reference_q8act.quantize_q8(x)
        assert a.dtype == torch.int8 and d.dtype == torch.float32 and a.shape == x.shape
        assert d.shape == (*x.shape[:-1], x.shape[-1] // 32)
        rows = _q8_finite_rows(x)  # non-finite inputs: unspecified codes (memory-safe)
        K = x.shape[-1]
        M = rows.numel()
        assert torch.equal(a.cpu().reshape(M, K)[rows], ra.reshape(M, K)[rows]), "quantize_q8: codes differ"
        dd, rdd = d.cpu().reshape(M, K // 32)[rows], rd.reshape(M, K // 32)[rows]
        assert torch.equal(dd, rdd), "quantize_q8: scales differ"
    run_property("quantize_q8", ops.quantize_q8, args, check, list(args))


def _equal_nan(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = got.detach().cpu(), want.detach().cpu()
    return got.shape == want.shape and got.dtype == want.dtype and bool(
        ((got == want) | (torch.isnan(got) & torch.isnan(want))).all())


@st.composite
def norm_case(draw, residual: bool):
    lead = draw(st.sampled_from([(1,), (3,), (0,), (2, 5), (70,)]))
    H = draw(st.sampled_from([0, 1, 7, 64, 576]))
    dtype = draw(st.sampled_from(FLOATS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    x = torch.randn(*lead, H, generator=g) * draw(st.sampled_from([1e-3, 1.0, 30.0]))
    w = torch.rand(H, generator=g) + 0.25
    r = torch.randn(*lead, H, generator=g)
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.0]))
    special = draw(st.sampled_from(("none",) * 8 + ("zeros", "inf", "nan", "wdtype", "wshape", "eps", "rdtype",
                                                    "rshape", "xint", "x0d")))
    if special == "zeros":
        x.zero_()
    elif special in ("inf", "nan") and x.numel():
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = float(special)
    x, w, r = x.to(dtype), w.to(dtype), r.to(dtype)
    if special == "wdtype":
        w = w.to(torch.float32 if dtype != torch.float32 else torch.float16)
    elif special == "wshape":
        w = torch.ones(H + 1, dtype=dtype)
    elif special == "eps":
        eps = draw(st.sampled_from([-1e-5, float("nan"), float("inf")]))
    elif special == "rdtype":
        r = r.to(torch.float32 if dtype != torch.float32 else torch.bfloat16)
    elif special == "rshape":
        r = torch.zeros(*lead, H + 1, dtype=dtype)
    elif special == "xint":
        x = x.to(torch.int32)
    elif special == "x0d":
        x = torch.tensor(1.0, dtype=dtype)
    args = dict(x=place(x, draw(layouts())))
    if residual:
        args["residual"] = place(r, draw(layouts()))
    args.update(weight=place(w, draw(st.sampled_from(("contig", "offset1", "strided")))), eps=eps)
    return args


def _check_norm(out, before, residual: bool):
    x = before["x"].cpu()
    if residual:
        want_out, want_sum = reference.add_rms_norm(x, before["residual"].cpu(), before["weight"].cpu(), before["eps"])
        got_out, got_sum = out
        assert _equal_nan(got_sum, want_sum), "add_rms_norm: the residual sum is not x + residual"
    else:
        want_out, got_out = reference.rms_norm(x, before["weight"].cpu(), before["eps"]), out
    assert got_out.dtype == x.dtype
    close(got_out, want_out, x.dtype, 0.0, "rms_norm")


@given(norm_case(False))
def fuzz_rms_norm(args):
    run_property("rms_norm", ops.rms_norm, args, lambda o, b: _check_norm(o, b, False), list(args))


@given(norm_case(True))
def fuzz_add_rms_norm(args):
    run_property("add_rms_norm", ops.add_rms_norm, args, lambda o, b: _check_norm(o, b, True),
                 list(args))


@st.composite
def rope_case(draw):
    B, N = draw(st.sampled_from([(1, 1), (2, 3), (0, 2), (3, 0), (1, 17)]))
    Hq, Hkv = draw(st.sampled_from([(1, 1), (4, 2), (9, 3), (2, 0)]))
    D = draw(st.sampled_from([2, 6, 8, 64]))
    dtype = draw(st.sampled_from(FLOATS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    q = torch.randn(B, N, Hq, D, generator=g)
    k = torch.randn(B, N, Hkv, D, generator=g)
    ang = torch.rand(B, N, D // 2, generator=g) * 1000
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    special = draw(st.sampled_from(("none",) * 8 + ("inf", "odd", "kshape", "cshape", "sdtype", "q3d", "qint")))
    if special == "inf" and q.numel():
        q.view(-1)[0] = float("inf")
    q, k, cos, sin = q.to(dtype), k.to(dtype), cos.to(dtype), sin.to(dtype)
    if special == "odd":
        q, k = q[..., :D - 1], k[..., :D - 1]
    elif special == "kshape":
        k = torch.zeros(B, N + 1, Hkv, D, dtype=dtype)
    elif special == "cshape":
        cos = cos[:, :, : D // 2]
    elif special == "sdtype":
        sin = sin.to(torch.float32 if dtype != torch.float32 else torch.float16)
    elif special == "q3d":
        q = q.reshape(B, N, Hq * D)
    elif special == "qint":
        q = q.to(torch.int64)
    lay = lambda: draw(layouts())  # noqa: E731
    return dict(q=place(q, lay()), k=place(k, lay()), cos=place(cos, lay()), sin=place(sin, lay()))


@given(rope_case())
def fuzz_rope(args):
    def check(out, before):
        want = reference.rope(*(before[n].cpu() for n in ("q", "k", "cos", "sin")))
        assert _equal_nan(out[0], want[0]) and _equal_nan(out[1], want[1]), "rope is not bit-identical to the reference"
    run_property("rope", ops.rope, args, check, list(args))


@st.composite
def silu_case(draw):
    shape = draw(st.sampled_from([(1, 1536), (3, 7), (0, 4), (2, 0), (5, 2, 11), (40, 1700)]))
    dtype = draw(st.sampled_from(FLOATS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    gate = torch.randn(*shape, generator=g) * draw(st.sampled_from([1.0, 8.0, 60.0]))
    up = torch.randn(*shape, generator=g)
    special = draw(st.sampled_from(("none",) * 8 + ("nan", "shape", "dtype", "double")))
    if special == "nan" and gate.numel():
        gate.view(-1)[0] = float("nan")
    gate, up = gate.to(dtype), up.to(dtype)
    if special == "shape":
        up = up.reshape(-1) if up.dim() > 1 and up.numel() else torch.zeros(7, dtype=dtype)
    elif special == "dtype":
        up = up.to(torch.float32 if dtype != torch.float32 else torch.bfloat16)
    elif special == "double":
        gate, up = gate.double(), up.double()
    return dict(gate=place(gate, draw(layouts())), up=place(up, draw(layouts())))


@given(silu_case())
def fuzz_silu_mul(args):
    def check(out, before):
        gate, up = before["gate"].cpu(), before["up"].cpu()
        want = reference.silu_mul(gate, up)
        assert out.dtype == gate.dtype
        close(out, want, gate.dtype, 2.0 ** -12 if gate.dtype == torch.float16 else 1e-30, "silu_mul")
    run_property("silu_mul", ops.silu_mul, args, check, list(args))


@st.composite
def decoder_layer_case(draw):
    from test_ops_decoder_layer import BAD, LAYOUTS, _bad, _case

    frontier = draw(st.booleans())
    args = _case(DEVICE, draw(st.sampled_from(FLOATS)), draw(st.sampled_from(LAYOUTS)), B=draw(st.integers(1, 3)),
                 N=draw(st.integers(1, 6)), frontier=frontier, bias=draw(st.booleans()),
                 seed=draw(st.integers(0, 2 ** 31 - 1)))
    special = draw(st.sampled_from(["none"] * len(BAD) + BAD))
    if special != "none":
        try:
            _bad(special)[0](args)
        except (IndexError, RuntimeError):  # a corruption that does not apply to this layout / shape
            pass
    return args


@given(decoder_layer_case())
def fuzz_decoder_layer(args):
    def check(out, before):
        b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in before.items()}
        want = reference.decoder_layer_with(ops, **b)
        for got, w in zip(out, want):
            assert _equal_nan(got, w), "decoder_layer differs from the separate ops"
        assert _equal_nan(args["k_cache"], b["k_cache"]) and _equal_nan(args["v_cache"], b["v_cache"]), \
            "decoder_layer wrote other K/V than the separate ops"
    read_only = [k for k in args if k not in ("k_cache", "v_cache")]
    run_property("decoder_layer", ops.decoder_layer, args, check, read_only)


@st.composite
def decoder_layer_paged_case(draw):
    """A valid layer case paged through a shuffled table (page sizes 1 / 4 / 8 / 14), sometimes with a
    corrupted table or pool; returns (args, the uncorrupted table)."""
    from test_ops_decoder_layer import LAYOUTS, _case
    from test_ops_decoder_layer_paged import _paged

    args = _case(DEVICE, draw(st.sampled_from(FLOATS)), draw(st.sampled_from(LAYOUTS)), B=draw(st.integers(1, 3)),
                 N=draw(st.integers(1, 6)), frontier=draw(st.booleans()), bias=draw(st.booleans()),
                 seed=draw(st.integers(0, 2 ** 31 - 1)))
    args = _paged(args, draw(st.sampled_from([1, 4, 8, 14])), seed=draw(st.integers(0, 1000)))
    table = args["block_tables"].clone()
    bad = draw(st.sampled_from(["none"] * 4 + ["int64", "entry", "rows", "pages"]))
    if bad == "int64":
        args["block_tables"] = table.long()
    elif bad == "entry":
        t = table.clone()
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from([-1, args["k_pages"].shape[0], 1 << 30]))
        args["block_tables"] = t
    elif bad == "rows":
        args["block_tables"] = table[:, :1]
    elif bad == "pages":
        args["v_pages"] = args["v_pages"][:-1]
    return args, table


@given(decoder_layer_paged_case())
def fuzz_decoder_layer_paged(case):
    from test_ops_decoder_layer_paged import _dense_of

    args, table = case

    def check(out, before):
        B = before["x"].shape[0]
        dense = {k: v for k, v in before.items() if k not in ("k_pages", "v_pages", "block_tables")}
        dense["k_cache"] = _dense_of(before["k_pages"], table, B)
        dense["v_cache"] = _dense_of(before["v_pages"], table, B)
        want = ops.decoder_layer(**dense)
        for got, w in zip(out, want):
            assert _equal_nan(got, w), "decoder_layer_paged differs from decoder_layer on the same keys"
        assert _equal_nan(_dense_of(args["k_pages"], table, B), dense["k_cache"]) and \
            _equal_nan(_dense_of(args["v_pages"], table, B), dense["v_cache"]), \
            "decoder_layer_paged wrote other K/V than decoder_layer"
    read_only = [k for k in args if k not in ("k_pages", "v_pages")]
    run_property("decoder_layer_paged", paged_ops.decoder_layer_paged, args, check, read_only)


FUZZERS = {
    "verify_attention": fuzz_verify_attention,
    "append_kv": fuzz_append_kv,
    "rejection_sample": fuzz_rejection_sample,
    "greedy_verify": fuzz_greedy_verify,
    "kv_commit": fuzz_kv_commit,
    "verify_attention_paged": fuzz_verify_attention_paged,
    "append_kv_paged": fuzz_append_kv_paged,
    "kv_commit_paged": fuzz_kv_commit_paged,
    "linear": fuzz_linear,
    "qlinear": fuzz_qlinear,
    "qlinear_q8act": fuzz_qlinear_q8act,
    "linear_argmax": fuzz_linear_argmax,
    "qlinear_argmax": fuzz_qlinear_argmax,
    "quantize_q8": fuzz_quantize_q8,
    "pack_q8act": fuzz_pack_q8act,
    "rms_norm": fuzz_rms_norm,
    "add_rms_norm": fuzz_add_rms_norm,
    "rope": fuzz_rope,
    "silu_mul": fuzz_silu_mul,
    "decoder_layer": fuzz_decoder_layer,
    "decoder_layer_paged": fuzz_decoder_layer_paged,
}


def main(argv: Optional[List[str]] = None) -> int:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=sorted(FUZZERS), required=True)
    ap.add_argument("--examples", type=int, default=int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "150")))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--show-errors", type=int, default=0, help="print the N most frequent error kinds")
    ap.add_argument("--shrink", choices=("auto", "yes", "no"), default="auto",
                    help="shrink a failing example (auto: on the CPU only; on CUDA a fault can leave the context "
                         "unusable and shrinking would spend the time budget; the failing case is logged anyway)")
    a = ap.parse_args(argv)
    DEVICE = a.device
    torch.set_num_threads(1)
    shrink = a.shrink == "yes" or (a.shrink == "auto" and torch.device(DEVICE).type == "cpu")
    phases = [p for p in Phase if shrink or p not in (Phase.shrink, Phase.explain)]
    fn = FUZZERS[a.op]
    fn = settings(max_examples=a.examples, database=None, deadline=None, print_blob=True, phases=phases,
                  suppress_health_check=list(HealthCheck))(fn)
    fn = seed(a.seed * 1000 + sorted(FUZZERS).index(a.op))(fn)
    t0 = time.time()
    fn()
    unchecked = (f", {STATS['unchecked']} invalid values: memory-safe unchecked, raised under strict checks"
                 if values_checked_only_in_strict(DEVICE) else "")
    print(f"{a.op} on {a.device}: {STATS['examples']} examples ({STATS['raised']} raised a clear error, "
          f"{STATS['matched']} matched the reference{unchecked}) in {time.time() - t0:.1f} s", flush=True)
    for kind, n in ERRORS.most_common(a.show_errors):
        print(f"  {n:6d}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
