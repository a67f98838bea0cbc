"""split_to_slices: tuple-valued views become single-output views the planner can see,
and the program computes the same values."""
import operator

import torch
import torch.nn as nn

import stpc
from stpc.frontend.normalize import split_to_slices

aten = torch.ops.aten


class Fused(nn.Module):
    """GPT-2's fused projection: one matmul, then split into three; plus unbind and chunk."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).split(8, dim=-1)
        a, b = x.chunk(2, dim=1)
        rows = x.unbind(0)
        return q * k + v, a - b, rows[1]


def _export(m, x):
    return torch.export.export(m, (x,), strict=False).graph_module


def test_split_chunk_unbind_become_slices_with_the_same_values():
    torch.manual_seed(0)
    m, x = Fused(), torch.randn(3, 6, 8)
    before = _export(m, x)
    targets = {n.target for n in before.graph.nodes}
    assert {aten.split.Tensor, aten.chunk.default, aten.unbind.int} & targets  # there is something to do
    want = before(*[p.detach() for p in m.parameters()], x)
    after = split_to_slices(_export(m, x))
    targets = [n.target for n in after.graph.nodes]
    assert not {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
                operator.getitem} & set(targets)
    assert aten.slice.Tensor in targets and aten.select.int in targets
    got = after(*[p.detach() for p in m.parameters()], x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for n in after.graph.nodes:  # every new view carries its value
        if n.target in (aten.slice.Tensor, aten.select.int):
            assert isinstance(n.meta["val"], torch.Tensor)


def test_the_trace_plans_every_piece():
    """After stpc.trace no tuple-valued split is left, so no op falls back to replication."""
    tg = stpc.trace(Fused(), (torch.randn(4, 8, 8),))
    plan = stpc.search(tg, 2)
    assert plan.stats["fallback_ops"] == {}
