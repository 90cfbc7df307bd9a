"""Shared fixtures and helpers of the op tests.

Every op test is parametrized over ``DEVICES``: CPU always, CUDA when torch sees a GPU
AND the build holds the CUDA kernels (otherwise the CUDA cases are reported as
skipped, never silently dropped). Inputs are generated on the CPU with a seeded
``torch.Generator`` and then moved, so both backends see bit-identical inputs.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import pytest
import torch

import specdec
from specdec import ops

HAS_CUDA = bool(torch.cuda.is_available() and specdec.build_info().get("cuda", False))
_CUDA_SKIP = pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device, or specdec._C was built without the CUDA kernels")

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=_CUDA_SKIP)]
FLOAT_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                pytest.param(torch.bfloat16, id="bf16")]
TREE_KINDS = ("chain", "star", "deep", "wide", "random", "mixed")


@pytest.fixture(autouse=True)
def _no_strict_leak() -> Iterator[None]:
    """Every test starts and ends with strict value checks off (the default)."""
    ops.set_strict_checks(False)
    yield
    ops.set_strict_checks(False)


@contextlib.contextmanager
def strict_checks(on: bool = True) -> Iterator[None]:
    """Turn strict value checks on (or off) for a block, restoring the previous state."""
    before = ops.strict_checks()
    ops.set_strict_checks(on)
    try:
        yield
    finally:
        ops.set_strict_checks(before)


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# --------------------------------------------------------------------------- trees
def _parents_of(kind: str, n: int, g: torch.Generator) -> List[int]:
    """Parents of one request's n real nodes (node 0 = root, parents[i] < i)."""
    par = [-1]
    for i in range(1, n):
        r = lambda hi: int(torch.randint(0, hi, (1,), generator=g))  # noqa: E731
        if kind == "chain":
            p = i - 1
        elif kind == "star":
            p = 0
        elif kind == "deep":  # long spine with the odd side branch
            p = i - 1 if r(5) else r(i)
        elif kind == "wide":  # a bushy top: parents among the first 3 nodes
            p = r(min(i, 3))
        elif kind == "random":
            p = r(i)
        else:
            raise ValueError(kind)
        par.append(p)
    return par


def make_trees(B: int, N: int, V: int, kind: str = "random", *, g: torch.Generator,
               ragged: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random token trees in the op layout.

    kind: one of TREE_KINDS ("mixed" draws a kind per request). ragged: each request
    gets its own node count in [1, N]; the nodes beyond it are padding (parent -1,
    token -1), as the contract lays out. Returns tokens [B, N] int64 (random in
    [0, V); the root's token too), parents [B, N] int32, counts [B] int64.
    """
    tokens = torch.full((B, N), -1, dtype=torch.int64)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    counts = torch.empty(B, dtype=torch.int64)
    for b in range(B):
        k = kind if kind != "mixed" else TREE_KINDS[int(torch.randint(0, 5, (1,), generator=g))]
        n = int(torch.randint(1, N + 1, (1,), generator=g)) if ragged else N
        if ragged and b == 0:
            n = 1  # always one request with the root only
        if ragged and b == 1:
            n = N  # and one that fills the tree
        parents[b, :n] = torch.tensor(_parents_of(k, n, g), dtype=torch.int32)
        tokens[b, :n] = torch.randint(0, V, (n,), generator=g)
        counts[b] = n
    return tokens, parents, counts


def children_of(parents_b: Sequence[int], node: int) -> List[int]:
    return [c for c in range(node + 1, len(parents_b)) if int(parents_b[c]) == node]


# --------------------------------------------------------------------------- checks
def assert_sample_structure(tokens: torch.Tensor, parents: torch.Tensor, accepted: torch.Tensor,
                            num_accepted: torch.Tensor, out_tokens: torch.Tensor, V: int) -> None:
    """Structural invariants of (accepted, num_accepted, out_tokens), vectorized (any B).

    - dtypes / shapes are the contract's; accepted[:, 0] == 0 (the root);
    - everything after the first -1 is -1 (accepted and out_tokens);
    - num_accepted == (#non -1 entries of accepted) - 1, out_tokens has num_accepted + 1;
    - accepted is a root path: parents[accepted[i]] == accepted[i - 1];
    - out_tokens[:num] are the tokens of the accepted draft nodes; the last one is in [0, V).
    """
    B, N = tokens.shape
    accepted, num_accepted, out_tokens = accepted.cpu(), num_accepted.cpu(), out_tokens.cpu()
    tokens, parents = tokens.cpu(), parents.cpu()
    assert accepted.dtype == torch.int32 and accepted.shape == (B, N)
    assert num_accepted.dtype == torch.int32 and num_accepted.shape == (B,)
    assert out_tokens.dtype == torch.int64 and out_tokens.shape == (B, N)
    assert bool((accepted[:, 0] == 0).all())
    for name, t in (("accepted", accepted), ("out_tokens", out_tokens)):
        pad = t == -1
        after_first_pad = torch.cumsum(pad.to(torch.int64), dim=1) > 0
        assert torch.equal(pad, after_first_pad), f"{name}: a non -1 entry after the first -1"
        assert bool((t >= -1).all()), f"{name}: entries below -1"
    n_acc = (accepted != -1).sum(1)
    assert torch.equal(num_accepted.to(torch.int64), n_acc - 1)
    assert torch.equal((out_tokens != -1).sum(1), n_acc)
    cols = torch.arange(N)
    in_path = cols[None, 1:] <= num_accepted[:, None].to(torch.int64)  # [B, N-1]: accepted[:, i] real
    node = accepted[:, 1:].clamp(min=0).to(torch.int64)
    prev = accepted[:, :-1].to(torch.int64)
    par = torch.gather(parents.to(torch.int64), 1, node)
    assert bool(((par == prev) | ~in_path).all()), "accepted is not a root path"
    tok = torch.gather(tokens, 1, node)
    assert bool(((out_tokens[:, :-1] == tok) | ~in_path).all()), "out_tokens != tokens of the accepted nodes"
    last = torch.gather(out_tokens, 1, num_accepted[:, None].to(torch.int64))[:, 0]
    assert bool(((last >= 0) & (last < V)).all()), "drawn token out of [0, V)"


def assert_same_outputs(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    """Integer outputs must be EXACTLY equal (dtype, shape and values)."""
    names = ("accepted", "num_accepted", "out_tokens")
    for name, a, b in zip(names, got, want):
        a = a.cpu()
        b = b.cpu()
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
        if not torch.equal(a, b):
            bad = (a != b).reshape(a.shape[0], -1).any(1).nonzero().flatten().tolist()
            raise AssertionError(f"{name} differs from the reference in requests {bad[:10]}:\n"
                                 f"got  {a[bad[:3]].tolist()}\nwant {b[bad[:3]].tolist()}")


def snapshot(obj):
    """Deep copy of every tensor in a (nested) list / tuple / dict of arguments."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(o) for o in obj)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    return obj


def assert_unchanged(before, after) -> None:
    """Bitwise equality of every tensor (NaN equal to NaN)."""
    if isinstance(before, torch.Tensor):
        torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
    elif isinstance(before, (list, tuple)):
        assert len(before) == len(after)
        for a, b in zip(before, after):
            assert_unchanged(a, b)
    elif isinstance(before, dict):
        for k in before:
            assert_unchanged(before[k], after[k])


def to_device(obj, device: str):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def maybe(x: Optional[torch.Tensor], device: str) -> Optional[torch.Tensor]:
    return None if x is None else x.to(device)


def one_thread_unless_smollm2(request):
    """Generator body of the toy-model fixtures: tiny models gain nothing from torch's thread pool
    (only synchronisation, ~5x slower on 2 busy cores); SmolLM2 tests keep the setting."""
    if "smollm2" in request.node.name:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_llama(seed: int, layers: int = 2, noise: float = 0.0, vocab: int = 97):
    """An HFCausalLM over a random 64-wide Llama built with a fixed seed; ``noise`` > 0: its weights perturbed
    (a fixed generator), a draft close to the seed's model: accepted often, not always."""
    import transformers

    from specdec import HFCausalLM

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if noise:
        g = torch.Generator().manual_seed(99)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn(p.shape, generator=g))
    return HFCausalLM(model)
