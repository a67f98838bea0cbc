"""normalize: tuple-valued views become single-output views the planner can see
(split_to_slices), a written-out RMSNorm one ``rms_norm`` node (fuse_rms_norm), and the
program computes the same values."""
import operator

import torch
import torch.nn as nn

import stpc
from stpc import models
from stpc.frontend.normalize import fuse_rms_norm, split_to_slices

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


class WrittenOutRMSNorm(nn.Module):
    """Llama's RMSNorm (as ``stpc.models`` and Hugging Face write it), twice: the second with
    the rsqrt first in the product and the weight on the left, as Hugging Face's is."""

    def __init__(self, d=8, eps=1e-6):
        super().__init__()
        self.eps, self.w1, self.w2 = eps, nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w1
        return self.w2 * (torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * y)


class NotAnRMSNorm(nn.Module):
    """Look-alikes that must stay as they are: a mean over another dim, an intermediate read
    elsewhere (the mean is returned too), a square by another power."""

    def forward(self, x):
        over_rows = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)
        ms = x.pow(2).mean(-1, keepdim=True)
        shared = x * torch.rsqrt(ms + 1e-6)
        cubes = x * torch.rsqrt(x.pow(3).mean(-1, keepdim=True) + 1e-6)
        return over_rows, shared, ms, cubes


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_written_out_rms_norm_becomes_one_node_with_the_same_values_and_gradients():
    torch.manual_seed(0)
    m, x = WrittenOutRMSNorm(), torch.randn(3, 5, 8)
    before = _export(m, x)
    assert aten.rms_norm.default not in _targets(before)
    after = fuse_rms_norm(_export(m, x))
    # Expected: rms_norm(x, [8], None, eps) -> mul(w1); rms_norm(y, [8], None, eps) -> mul(w2)
    norms = [n for n in after.graph.nodes if n.target is aten.rms_norm.default]
    assert [(n.args[1], n.args[2], n.args[3]) for n in norms] == [([8], None, 1e-6)] * 2
    assert all([u.target for u in n.users] == [aten.mul.Tensor] for n in norms)
    assert not {aten.pow.Tensor_Scalar, aten.mean.dim, aten.rsqrt.default} & set(_targets(after))
    assert _targets(after).count(aten.mul.Tensor) == 2  # the weights' muls stay
    assert all(isinstance(n.meta["val"], torch.Tensor) and n.meta.get("stack_trace") for n in norms)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    params = [[p.detach().clone().requires_grad_() for p in m.parameters()] for _ in range(2)]
    outs = [gm(*ps, xi) for gm, ps, xi in zip((before, after), params, xs)]
    assert torch.equal(outs[0][0], outs[1][0])  # (aten's CPU rms_norm is the same five kernels)
    for o, ps, xi in zip(outs, params, xs):
        o[0].square().sum().backward()
    assert torch.equal(xs[0].grad, xs[1].grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(params[0], params[1]))


def test_rms_norm_look_alikes_are_left_alone():
    m, x = NotAnRMSNorm(), torch.randn(3, 5, 8)
    after = fuse_rms_norm(_export(m, x))
    assert aten.rms_norm.default not in _targets(after)
    assert _targets(after).count(aten.rsqrt.default) == 3


def test_the_llama_trace_has_one_rms_norm_per_norm():
    with torch.device("meta"):
        m = models.build("llama-tiny")
    tg = stpc.trace(m, models.example_inputs("llama-tiny", 2, 8))
    norms = [n for n in tg.gm.graph.nodes if n.target is aten.rms_norm.default]
    assert len(norms) == 2 * models.get_config("llama-tiny").n_layers + 1  # two a layer, and the final one
    assert {n.meta["module"] for n in norms} >= {"layers.0.attn_norm", "layers.0.mlp_norm"}
    assert aten.rsqrt.default not in _targets(tg.gm)
