"""read_params_at_use: an eager program reads each parameter right before its first use, so
backward hands a layer's gradients on (to the bucketed reducer) as soon as they are complete,
not after all of backward (where a read at the start of the step left them: autograd runs
the newest ready node first, and those reads were the oldest)."""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.fx as fx

sys.path.insert(0, os.path.dirname(__file__))
from _graphs import targets, traced_and_plan  # noqa: E402

from stpc import runtime  # noqa: E402
from stpc.compile import run_passes  # noqa: E402
from stpc.frontend.module_calls import TAPS  # noqa: E402
from stpc.passes import read_params_at_use  # noqa: E402
from stpc.runtime.launch import spawn  # noqa: E402


def _before() -> fx.GraphModule:
    """w1, x, w2, g, unused -> mm(x, w1) -> tanh -> mm(., w2) -> add(., w2-ish) with g a grid block."""
    g = fx.Graph()
    phs = {}
    for name, placement in (("w1", ("R",)), ("x", ("S0",)), ("w2", ("R",)), ("g", ("B0.1",)), ("unused", ("R",))):
        phs[name] = g.placeholder(name)
        phs[name].meta.update(placement=placement, val=torch.empty(4, 4))
        if name != "x":
            phs[name].meta["param"] = name
    phs["w2"].meta[TAPS] = [(0, "in", 0)]
    h = g.call_function(torch.ops.aten.mm.default, (phs["x"], phs["w1"]))
    t = g.call_function(torch.ops.aten.tanh.default, (h,))
    y = g.call_function(torch.ops.aten.mm.default, (t, phs["w2"]))
    z = g.call_function(torch.ops.aten.add.Tensor, (y, phs["w2"]))
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (z, phs["g"])))
    return fx.GraphModule(torch.nn.Module(), g)


def test_each_parameter_is_read_right_before_its_first_use():
    gm = read_params_at_use(_before())
    nodes = list(gm.graph.nodes)
    ph = {n.name: n for n in nodes if n.op == "placeholder"}
    reads = {n.args[0].name: n for n in nodes if n.target is runtime.read_param}
    # Expected: w1 read just before the first mm, w2 just before the second (one read for both
    # of its uses), the grid block and the unused parameter as they were, x not a parameter
    assert sorted(reads) == ["w1", "w2"]
    first_mm, second_mm = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert reads["w1"].next is first_mm and first_mm.args == (ph["x"], reads["w1"])
    assert reads["w2"].next is second_mm and second_mm.args[1] is reads["w2"]
    add = next(n for n in nodes if n.target is torch.ops.aten.add.Tensor)
    assert add.args[1] is reads["w2"]
    assert list(ph["w1"].users) == [reads["w1"]] and list(ph["w2"].users) == [reads["w2"]]
    assert ph["g"].meta.get("read_at_use") is None and "read_at_use" not in ph["unused"].meta
    assert ph["w1"].meta["read_at_use"] and ph["w2"].meta["read_at_use"] and "read_at_use" not in ph["x"].meta
    # the read holds the value now: its local value, its placement and the submodule taps move to it
    assert reads["w2"].meta["placement"] == ("R",) and reads["w2"].meta["val"].shape == (4, 4)
    assert reads["w2"].meta[TAPS] == [(0, "in", 0)] and TAPS not in ph["w2"].meta
    assert "param" not in reads["w2"].meta  # (not a placeholder: passes that look for parameters skip it)
    # and it computes the same: a plain tensor parameter is read as itself
    w1, x, w2, gblk = (torch.randn(4, 4) for _ in range(4))
    assert torch.equal(gm(w1, x, w2, gblk, torch.zeros(4, 4)), _before()(w1, x, w2, gblk, torch.zeros(4, 4)))


def test_the_pipeline_reads_every_plain_parameter_where_used():
    """On llama-tiny's data-parallel program: every parameter placeholder is read by one
    ``read_param`` node and by nothing else, and the communication is the same as without it."""
    tg, plan = traced_and_plan("llama-tiny", "4", "dp")
    without = run_passes(fx.GraphModule(tg.gm, tg.gm.graph.__deepcopy__()), plan, ["g0"], defer_grads=True)
    tg, plan = traced_and_plan("llama-tiny", "4", "dp")
    with_reads = run_passes(tg.gm, plan, ["g0"], defer_grads=True, read_at_use=True)
    params = [n for n in with_reads.graph.nodes if n.op == "placeholder" and n.meta.get("param") and n.users]
    assert params and all(len(p.users) == 1 and next(iter(p.users)).target is runtime.read_param for p in params)
    assert all(p.meta["read_at_use"] for p in params)
    counted = targets(with_reads)
    assert counted.pop("read_param") == len(params)
    assert counted == targets(without)


# --------------------------------------------------------------------------- on real ranks


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                          torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def forward(self, x):
        return (self.layers(x) ** 2).mean()


def _hook_order(rank, world):
    """The order backward hands gradients on in stpc's data-parallel program: the last layer's
    weight against the caller's input (whose gradient is complete once the first layer's
    backward ran), with each parameter read where used and, as a control, all read at the start."""
    import copy

    from torch.distributed.tensor import Shard

    import stpc

    compile_module = importlib.import_module("stpc.compile")
    torch.manual_seed(0)
    base = _MLP()
    x = torch.randn(8, 8)
    mine = x[rank * 4:(rank + 1) * 4]
    out = {}
    for label, at_use in (("at_use", True), ("at_start", False)):
        original = compile_module.run_passes
        compile_module.run_passes = lambda *a, **k: original(*a, **{**k, "read_at_use": at_use and k["read_at_use"]})
        try:
            pm = stpc.compile(copy.deepcopy(base), (world,), (x,), hints="dp", input_placements={"x": [Shard(0)]},
                              cache=False)
        finally:
            compile_module.run_passes = original
        prog = next(iter(pm.stpc.programs.values()))
        order = []
        for name, p in pm.named_parameters():
            p.register_hook(lambda g, name=name: order.append(name))
        for _ in range(2):  # the second step: the reducer is built, as in training
            order.clear()
            pm.zero_grad(set_to_none=True)
            xin = mine.clone().requires_grad_(True)
            xin.register_hook(lambda g: order.append("input"))
            pm(xin).backward()
        out[label] = {"order": order, "read_at_use": sum(e[0] == "param_ref" for e in prog.feed),
                      "reducer": prog.reducer is not None,
                      "grads": {k: p.grad.full_tensor() for k, p in pm.named_parameters()}}
    return out


@pytest.mark.multirank
def test_backward_hands_the_last_layers_gradient_on_before_the_first_layers_runs():
    res = spawn(_hook_order, 2, timeout_s=120)
    for r in res:
        at_use, at_start = r["at_use"], r["at_start"]
        assert at_use["reducer"] and at_use["read_at_use"] == 6 and at_start["read_at_use"] == 0
        last = at_use["order"].index("layers.4.weight")
        assert last < at_use["order"].index("input"), at_use["order"]
        # the control: read at the start, every parameter's gradient came after all of backward
        assert at_start["order"][0] == "input", at_start["order"]
        # the same gradients either way (the same arithmetic, in another order of nodes)
        for k, g in at_use["grads"].items():
            assert torch.equal(g, at_start["grads"][k]), k
