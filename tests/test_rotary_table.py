"""specdec.models.rotary_table.RotaryTable: the lean forward's cos / sin by table lookup equal the
model's rotary module called on the same positions, bit for bit, at every shape a step uses; the
table stays off where that is not guaranteed."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdec.models.rotary_table import RotaryTable


def _rotary(head_dim=64, **rope):
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                   max_position_embeddings=8192, rope_theta=10000.0, **rope)
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("rope", [{}, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 1024}}],
                         ids=["default", "llama3"])
def test_table_equals_the_module(rope):
    rot = _rotary(**rope)
    table = RotaryTable(rot, 64)
    assert table.enabled
    g = torch.Generator().manual_seed(0)
    h = torch.zeros(1, 1, 256)
    for B, N in ((1, 1), (1, 8), (3, 5), (4, 16), (2, 1)):
        pos = torch.randint(0, 3000, (B, N), generator=g)
        hb = h.expand(B, N, 256)
        got, want = table(hb, pos, 3000), rot(hb, pos)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert table._cos.shape[0] == 3000
    table(h, torch.tensor([[4999]]), 5000)  # a larger cache: the table grows
    assert table._cos.shape[0] == 5000
    # a position past the table (depths beyond the step's nodes): the module's own values
    far = torch.tensor([[6000, 1]])
    got = table(h.expand(1, 2, 256), far, 5000)
    assert torch.equal(got[0], rot(h.expand(1, 2, 256), far)[0])


def test_table_off_where_not_guaranteed():
    assert not RotaryTable(_rotary(head_dim=48), 48).enabled  # 48 % 32: vector tails would differ
    dyn = _rotary(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    t = RotaryTable(dyn, 64)
    assert not t.enabled
    pos = torch.tensor([[10, 9000]])
    h = torch.zeros(1, 2, 256)
    assert torch.equal(t(h, pos, 9001)[0], dyn(h, pos)[0])
    on = RotaryTable(_rotary(), 64)
    assert torch.equal(on(h, pos, None)[0], on.rotary(h, pos)[0]) and on._cos is None  # no capacity: the module
    huge = (32 << 20) // (2 * 64 * 4) + 1  # cos and sin of that many positions exceed the table's byte cap
    assert torch.equal(on(h, pos, huge)[0], on.rotary(h, pos)[0]) and on._cos is None


def test_span_equals_the_call_at_consecutive_positions():
    """span(h, start, n): one request's consecutive positions as views of the table's rows, the module's values
    bit for bit; before the table exists, past its end and where it is off: the call's own path."""
    rot = _rotary()
    table = RotaryTable(rot, 64)
    h = torch.zeros(1, 1, 256)
    for start, n in ((0, 1), (5, 3), (2990, 10)):  # the first call builds the table through the call
        got = table.span(h.expand(1, n, 256), start, n, 3000)
        want = rot(h.expand(1, n, 256), torch.arange(start, start + n).view(1, n))
        assert got[0].shape == (1, n, 64) and got[0].is_contiguous()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = table.span(h.expand(1, 2, 256), 3100, 2, 3000)   # past the table: the module's values
    want = rot(h.expand(1, 2, 256), torch.arange(3100, 3102).view(1, 2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    off = RotaryTable(_rotary(head_dim=48), 48)
    got = off.span(torch.zeros(1, 1, 192), 7, 1, 100)
    want = off.rotary(torch.zeros(1, 1, 192), torch.tensor([[7]]))
    assert torch.equal(got[0], want[0])
