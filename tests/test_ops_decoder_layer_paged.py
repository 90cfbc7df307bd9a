"""paged_ops.decoder_layer_paged: the decoder layer on a paged cache.

On the same keys (the dense caches scattered into shuffled pages through a random block table)
it must give the dense layer op's bits and write the same K/V, equal the pure-torch paged
reference within float rounding, and reject a bad block table before anything is written.
"""
from __future__ import annotations

import pytest
import torch

from specdec import ops, paged_ops, reference_paged

from conftest import DEVICES, gen
from test_ops_decoder_layer import LAYOUTS, S, _case


def _paged(args, page_size: int, seed: int):
    """The dense case's caches as shuffled pages (+ 3 unused ones) and the block table that maps them."""
    g = gen(seed)
    k, v = args["k_cache"], args["v_cache"]
    B, Hkv, _, D = k.shape
    nb = S // page_size
    num_pages = B * nb + 3
    perm = torch.randperm(num_pages, generator=g)[:B * nb].view(B, nb)
    kp = torch.zeros(num_pages, page_size, Hkv, D, dtype=k.dtype, device=k.device)
    vp = torch.zeros_like(kp)
    for b in range(B):
        for i in range(nb):
            kp[perm[b, i]] = k[b, :, i * page_size:(i + 1) * page_size].transpose(0, 1)
            vp[perm[b, i]] = v[b, :, i * page_size:(i + 1) * page_size].transpose(0, 1)
    out = {key: val for key, val in args.items() if key not in ("k_cache", "v_cache")}
    out.update(k_pages=kp, v_pages=vp, block_tables=perm.to(torch.int32).to(k.device))
    return out


def _dense_of(pages, tables, B):
    """[B, Hkv, S, D] gathered back from pages through the table."""
    return torch.stack([pages[tables[b].long()].flatten(0, 1).transpose(0, 1) for b in range(B)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", ["decode", "tree", "frontier", "prefill"])
@pytest.mark.parametrize("page_size", [1, 8])
def test_paged_layer_gives_the_dense_layer_bits(device, dtype, layout, shape, page_size):
    kw = dict(decode=dict(B=1, N=1), tree=dict(B=2, N=5), frontier=dict(B=2, N=3, frontier=True),
              prefill=dict(B=1, N=36))[shape]
    args = _case(device, dtype, layout, seed=hash((layout, shape, page_size)) % 1000, **kw)
    paged = _paged(args, page_size, seed=page_size)
    dense = dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone())
    want = ops.decoder_layer(**dense)
    got = paged_ops.decoder_layer_paged(**paged)
    for t, w in zip(got, want):
        assert torch.equal(t, w), f"max diff {(t.float() - w.float()).abs().max().item():.3e}"
    B = args["x"].shape[0]
    assert torch.equal(_dense_of(paged["k_pages"], paged["block_tables"], B), dense["k_cache"])
    assert torch.equal(_dense_of(paged["v_pages"], paged["block_tables"], B), dense["v_cache"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["float7", "q4_1"])
def test_paged_layer_matches_the_reference(device, layout):
    args = _paged(_case(device, torch.float32, layout, B=2, N=4, bias=True, seed=3), 8, seed=1)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else
               [t if t is None else t.cpu() for t in v] if isinstance(v, list) and k != "bits" else v)
           for k, v in args.items()}
    cpu["k_pages"], cpu["v_pages"] = cpu["k_pages"].clone(), cpu["v_pages"].clone()
    got = paged_ops.decoder_layer_paged(**args)
    want = reference_paged.decoder_layer_paged(**cpu)
    for t, w in zip(got, want):
        torch.testing.assert_close(t.cpu(), w, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(args["k_pages"].cpu(), cpu["k_pages"], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["int64-table", "short-table", "pages-3d"])
def test_paged_layer_errors_change_nothing(device, bad):
    args = _paged(_case(device, torch.float32, "float7", B=2, N=3, seed=5), 8, seed=2)
    if bad == "int64-table":
        args["block_tables"] = args["block_tables"].long()
    elif bad == "short-table":
        args["block_tables"] = args["block_tables"][:1]
    else:
        args["k_pages"] = args["k_pages"].flatten(0, 1)
    k0, v0 = args["k_pages"].clone(), args["v_pages"].clone()
    with pytest.raises(RuntimeError, match="decoder_layer"):
        paged_ops.decoder_layer_paged(**args)
    assert torch.equal(args["k_pages"], k0) and torch.equal(args["v_pages"], v0)
