import torch
import torch.nn as nn

from stpc import trace


class Lin(nn.Module):
    def __init__(self, k, n, bias):
        super().__init__()
        self.fc = nn.Linear(k, n, bias=bias)

    def forward(self, x):
        return self.fc(x)


def _node(tg, target):
    return next(n for n in tg.graph.nodes if n.target is target)


def test_linear_flops_is_2mnk():
    for (m, k, n, bias) in [(8, 16, 32, True), (5, 7, 3, False), (64, 128, 256, True)]:
        tg = trace(Lin(k, n, bias).to("meta"), (torch.empty(m, k, device="meta"),))
        assert _node(tg, torch.ops.aten.linear.default).meta["flops"] == 2 * m * n * k


def test_batched_linear_and_bmm_flops():
    tg = trace(Lin(16, 32, False).to("meta"), (torch.empty(4, 8, 16, device="meta"),))
    assert _node(tg, torch.ops.aten.linear.default).meta["flops"] == 2 * 4 * 8 * 16 * 32

    class B(nn.Module):
        def forward(self, a, b):
            return torch.bmm(a, b)
    tg = trace(B(), (torch.empty(3, 5, 7), torch.empty(3, 7, 11)))
    assert _node(tg, torch.ops.aten.bmm.default).meta["flops"] == 2 * 3 * 5 * 7 * 11


def test_attention_flops_match_torch_formula():
    class A(nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    b, h, s, d = 2, 4, 16, 8
    q = torch.empty(b, h, s, d)
    tg = trace(A(), (q, q, q))
    # QK^T and PV: two batched matmuls of 2*b*h*s*s*d each.
    assert _node(tg, torch.ops.aten.scaled_dot_product_attention.default).meta["flops"] == 4 * b * h * s * s * d


def test_bytes_and_views():
    class V(nn.Module):
        def forward(self, x):
            return (x.view(4, 8) * 2).transpose(0, 1)
    tg = trace(V(), (torch.empty(32),))
    view = _node(tg, torch.ops.aten.view.default)
    mul = _node(tg, torch.ops.aten.mul.Tensor)
    assert view.meta["bytes_read"] == view.meta["bytes_written"] == 0
    assert mul.meta["bytes_read"] == 32 * 4 and mul.meta["bytes_written"] == 32 * 4
