"""Elementwise aten ops without a hand-written rule (clamp, softplus, erf, lerp,
addcmul, leaky_relu) get strategies from aten's pointwise tag: planned without the
all-replicate fallback, and sharded through them the model matches one device."""
import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _multirank import full_grads  # noqa: E402

from stpc import trace  # noqa: E402
from stpc.cost_models import CostModel, get_cluster  # noqa: E402
from stpc.runtime.launch import spawn  # noqa: E402
from stpc.planner import Hints, plan_graph  # noqa: E402
from stpc.planner.strategies import enumerate_strategies, op_spec  # noqa: E402


class PointwiseMLP(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)
        self.scale = nn.Parameter(torch.ones(h))

    def forward(self, x):
        h = self.fc1(x)
        h = torch.clamp(F.softplus(h), max=3.0) + torch.erf(h)
        h = torch.lerp(h, F.leaky_relu(h), 0.25)
        h = torch.addcmul(h, h, self.scale)
        return self.fc2(h).pow(2).mean()


def _traced(device="meta"):
    with torch.device(device):
        m = PointwiseMLP()
    return trace(m, (torch.randn(8, 4, 16, device=device),))


# Column-parallel fc1, row-parallel fc2 on the one axis: the pointwise ops run on
# hidden-sharded activations in between.
TP = Hints(force=[(r"^linear$", lambda s: s.kind == "spatial" and s.out[-1] == "S2"),
                  (r"^linear_1$", lambda s: s.kind == "spatial" and s.out[-1] == "P")],
           temporal=False, name="tp")


def test_pointwise_ops_have_rules():
    tg = _traced()
    names = {"clamp", "softplus", "erf", "lerp", "leaky_relu", "addcmul"}
    nodes = [n for n in tg.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__name__", "").split(".")[0] in names]
    assert {n.target.__name__.split(".")[0] for n in nodes} == names
    for n in nodes:
        assert op_spec(n) is not None, n.target
        strategies, fallback = enumerate_strategies(n, (4,))
        assert not fallback and any(s.out != ("R",) for s in strategies), n.target
    plan = plan_graph(tg, CostModel(get_cluster("cpu-local"), (4,)), hints=TP)
    assert plan.stats["fallback_ops"] == {}
    assert all(plan.nodes[n.name].out == ["S2"] for n in nodes)


def _worker(rank, world, plan_json):
    import stpc
    from stpc.planner import Plan

    torch.manual_seed(0)
    model = PointwiseMLP()
    single = copy.deepcopy(model)
    x = torch.randn(8, 4, 16)
    dm = stpc.compile(model, (world,), (x,), plan=Plan.from_json(plan_json))
    loss = dm(x)
    loss.backward()
    grads = full_grads(dm)
    ref = single(x)
    ref.backward()
    worst = max((grads[k] - p.grad).abs().max().item() / p.grad.abs().max().clamp_min(1e-6).item()
                for k, p in single.named_parameters())
    return loss.item(), ref.item(), worst


@pytest.mark.multirank
def test_sharded_through_pointwise_ops_matches_one_device():
    plan = plan_graph(_traced(), CostModel(get_cluster("cpu-local"), (4,)), hints=TP)
    for loss, ref, worst in spawn(_worker, 4, plan.to_json(), timeout_s=300):
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        assert worst < 1e-4
