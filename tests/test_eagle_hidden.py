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
