"""Hidden states of verified nodes (HFCausalLM.capture_hidden) equal a plain forward's."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec.models import HFCausalLM  # noqa: E402
from specdec.models.hidden import HiddenKVCache  # noqa: E402


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=97)
    return transformers.LlamaForCausalLM(cfg).eval()


def _reference(model, seq):
    """hidden_states of a plain transformers forward: [L + 1] tensors [T, H]; the last is the final normed state."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states]


@pytest.mark.parametrize("path", ["lean", "lean-unfused", "hooked", "generic"])
@pytest.mark.parametrize("spec", [(-1,), (0, 2, -1)])
def test_verified_hidden_equal_plain_forward(path, spec):
    torch.set_num_threads(1)
    model = _tiny_llama()
    kw = dict(lean=dict(), hooked=dict(fast_path=False), generic=dict(hook=False))
    kw["lean-unfused"] = dict(fused_ops=False)
    with pytest.warns(UserWarning) if path == "generic" else _nothing():
        lm = HFCausalLM(model, **kw[path])
    assert lm.fast_path == path.startswith("lean")
    width = lm.capture_hidden(spec)
    assert width == 64 * len(spec)
    cache = lm.new_cache(2, 40)
    assert isinstance(cache, HiddenKVCache)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (7, 5)]
    lm.prefill(cache, prompts)
    # a tree of 5 nodes per row: root, two children, a grandchild under each child
    parents = [-1, 0, 0, 1, 2]
    depths = torch.tensor([[0, 1, 1, 2, 2]] * 2, dtype=torch.int32)
    tokens = torch.randint(0, 97, (2, 5), generator=g)
    anc = torch.zeros(5, 5, dtype=torch.bool)
    for i, p in enumerate(parents):
        anc[i, i] = True
        j = p
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    lm.forward(cache, tokens, depths, anc.expand(2, 5, 5).contiguous())
    # row 0 accepts root -> node 2 -> node 4; row 1 accepts root -> node 1
    accepted = torch.tensor([[0, 2, 4, -1, -1], [0, 1, -1, -1, -1]], dtype=torch.int32)
    num = torch.tensor([2, 1], dtype=torch.int32)
    cache.commit(accepted, num)
    seqs = [prompts[0] + [tokens[0, i].item() for i in (0, 2, 4)], prompts[1] + [tokens[1, i].item() for i in (0, 1)]]
    assert cache.lens.tolist() == [len(s) for s in seqs]
    for r, seq in enumerate(seqs):
        ref = _reference(model, seq)
        want = torch.cat([ref[i] for i in spec], dim=-1)
        got = cache.features()[r, :len(seq)]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # a row move carries the states with the K/V
    from specdec.cache import move_cache_rows

    move_cache_rows(cache, [(1, 0, len(seqs[1]))])
    torch.testing.assert_close(cache.features()[0, :len(seqs[1])], cache.features()[1, :len(seqs[1])])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_capture_spec_errors():
    lm = HFCausalLM(_tiny_llama())
    with pytest.raises(ValueError, match="capture_hidden: layers"):
        lm.capture_hidden((5,))
    with pytest.raises(ValueError, match="empty"):
        lm.capture_hidden(())


@pytest.mark.parametrize("path", ["lean", "hooked"])
def test_paged_cache_keeps_the_verified_hidden_states(path):
    """With capture on, a paged cache keeps the states in its blocks: after a prefill, a tree pass and its commit
    they equal a plain forward's at every committed position, read through the block table (TargetFeatures);
    a fork copies the partial last block's states, a row move keeps them."""
    from specdec.models.hidden import TargetFeatures

    torch.set_num_threads(1)
    model = _tiny_llama()
    lm = HFCausalLM(model, **(dict() if path == "lean" else dict(fast_path=False)))
    spec = (0, -1)
    lm.capture_hidden(spec)
    assert lm.supports_paged
    cache = lm.new_paged_cache(num_blocks=16, block_size=4, max_requests=3)
    assert lm.feature_cache is cache and cache.feature_dim == 128 and cache.hidden_pages.shape[1:] == (4, 1, 128)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (7, 5)]
    for rid, p in enumerate(prompts):
        cache.add(rid, len(p) + 5, row=rid)
    view = cache.view(0, 2)
    lm.prefill(view, prompts)
    depths = torch.tensor([[0, 1, 1, 2, 2]] * 2, dtype=torch.int32)
    tokens = torch.randint(0, 97, (2, 5), generator=g)
    anc = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                       dtype=torch.bool)
    lm.forward(view, tokens, depths, anc.expand(2, 5, 5).contiguous())
    view.commit(torch.tensor([[0, 2, 4, -1, -1], [0, 1, -1, -1, -1]], dtype=torch.int32),
                torch.tensor([2, 1], dtype=torch.int32))
    seqs = [prompts[0] + [tokens[0, i].item() for i in (0, 2, 4)], prompts[1] + [tokens[1, i].item() for i in (0, 1)]]
    feats = TargetFeatures(cache)
    assert feats.lens[:2].tolist() == [len(s) for s in seqs]
    for r, seq in enumerate(seqs):
        ref = _reference(model, seq)
        want = torch.cat([ref[i] for i in spec], dim=-1)
        got = feats.gather(r, torch.arange(len(seq)).view(1, -1))[0]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(feats.span(r, 1, 3)[0], got[1:4])
    before = feats.gather(1, torch.arange(len(seqs[1])).view(1, -1))
    row = cache.fork(1, "child")                # 7 positions: one shared block, the partial one copied
    assert cache.block_tables[row, 1] != cache.block_tables[1, 1]
    torch.testing.assert_close(feats.gather(row, torch.arange(len(seqs[1])).view(1, -1)), before)
    cache.free(1)
    cache.move_row("child", 1)
    torch.testing.assert_close(feats.gather(1, torch.arange(len(seqs[1])).view(1, -1)), before)
    # the pool's bytes count the features (and the 16-byte pair the commit moves with them)
    from specdec.paged_cache import PagedKVCache

    per = PagedKVCache.bytes_per_block(2, 2, 16, 4, torch.float32, feature_dim=128)
    assert per == PagedKVCache.bytes_per_block(2, 2, 16, 4, torch.float32) + 4 * (128 * 4 + 16)
    with pytest.raises(ValueError, match="keeps no features"):
        TargetFeatures(HFCausalLM(_tiny_llama()).new_paged_cache(4))


def test_paged_feature_writes_agree_host_and_tensor_forms():
    """write_hidden on a paged view: the host-integer form (a few rows) and the tensor form (index_copy_ through
    the block table) fill the same slots; positions past the capacity land on the scratch page only."""
    from specdec.models.hidden import TargetFeatures, write_hidden
    from specdec.paged_cache import PagedKVCache

    g = torch.Generator().manual_seed(3)
    feats = torch.randn(2, 40, 8, generator=g)
    caches = []
    for chunks in ((0, 40), (0, 20, 40)):  # one call of 80 nodes (tensor form), two of 40 (host form)
        c = PagedKVCache(1, 1, 4, num_blocks=24, block_size=4, max_requests=2, scratch_page=True, feature_dim=8)
        c.add("a", 43, row=0)
        c.add("b", 41, row=1)
        c.cache_lens[:] = torch.tensor([3, 1], dtype=torch.int32)
        for a, b in zip(chunks, chunks[1:]):
            write_hidden(c.view(0, 2), feats[:, a:b], a)
        caches.append(c)
    for c in caches:
        tf = TargetFeatures(c)
        torch.testing.assert_close(tf.gather(0, torch.arange(3, 43).view(1, -1))[0], feats[0])
        torch.testing.assert_close(tf.gather(1, torch.arange(1, 41).view(1, -1))[0], feats[1])
        torch.testing.assert_close(tf.span(0, 5, 9)[0], feats[0, 2:11])
    torch.testing.assert_close(caches[0].hidden_pages[:24], caches[1].hidden_pages[:24])
    # past the capacity (96 positions here): the scratch page, no real block touched
    c = caches[1]
    before = c.hidden_pages[:24].clone()
    c.cache_lens[0] = 94
    write_hidden(c.view(0, 1), torch.ones(1, 6, 8), 0)
    assert torch.equal(c.hidden_pages[:24][c.block_tables[0, :11].long()], before[c.block_tables[0, :11].long()])


def test_dense_feature_writes_agree_host_and_tensor_forms():
    """write_hidden on a dense HiddenKVCache: the host-integer slice copies (a few rows on the CPU) and the
    scatter (more rows) fill the same slots, at a kv_offset too; nodes past the capacity are not written
    (the scatter clamps them onto the last slot, which holds padding)."""
    from specdec.models.hidden import write_hidden

    g = torch.Generator().manual_seed(5)
    feats = torch.randn(3, 30, 8, generator=g)
    caches = []
    for chunks in ((0, 30), (0, 10, 30)):  # one call of 90 nodes (scatter), calls of 30 and 60 (host form)
        c = HiddenKVCache(1, 3, 1, 4, 48, 8)
        c.lens[:] = torch.tensor([0, 7, 20], dtype=torch.int32)
        for a, b in zip(chunks, chunks[1:]):
            write_hidden(c, feats[:, a:b], a)
        caches.append(c)
    for c in caches:
        for r, start in enumerate((0, 7, 20)):
            n = min(30, 47 - start)  # the scatter's clamp leaves slot 47 holding some padding node
            torch.testing.assert_close(c.hidden[r, 0, start:start + n], feats[r, :n])
    torch.testing.assert_close(caches[0].hidden[:, :, :47], caches[1].hidden[:, :, :47])
    # a node past the capacity: the host form writes nothing there, and nothing else
    c = HiddenKVCache(1, 1, 1, 4, 8, 8)
    c.lens[:] = 6
    write_hidden(c, torch.ones(1, 4, 8), 0)
    assert torch.equal(c.hidden[0, 0, 6:], torch.ones(2, 8)) and not c.hidden[0, 0, :6].any()
