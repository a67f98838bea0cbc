"""module_calls (the trace's record of submodule calls) and tap_hooks (the program copy that
hands hooked calls their values), on single-process graphs; the hooks firing across ranks
is tests/test_submodule_hooks.py."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from _graphs import targets, traced_and_plan  # noqa: E402

import stpc  # noqa: E402
from stpc import passes  # noqa: E402
from stpc.compile import run_passes  # noqa: E402
from stpc.frontend.module_calls import TAPS  # noqa: E402
from stpc.runtime.hook_taps import UnsupportedHook, hook_record  # noqa: E402


class Pair(nn.Module):
    """A call with a keyword tensor, a constant and a tuple output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, *, scale, mask=None):
        y = self.lin(x) * scale
        return y, y + mask


class Top(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = Pair()

    def forward(self, x, m):
        a, b = self.pair(x, scale=2.0, mask=m)
        return (a * b).sum()


def test_module_calls_record_structure_and_tag_the_nodes():
    seen = []
    top = Top()
    handle = top.pair.register_forward_hook(lambda mod, a, o: seen.append(o))
    tg = stpc.trace(top, (torch.randn(2, 8), torch.randn(2, 8)))
    calls = {c.fqn: c for c in tg.meta["module_calls"]}
    assert seen == [], "the user's submodule hooks must not run on the trace's fake tensors"
    assert top.pair._forward_hooks and handle.id in top.pair._forward_hooks  # put back, same handle
    pair, lin = calls["pair"], calls["pair.lin"]
    assert [k for k, _ in pair.inputs] == ["tensor", "const", "tensor"]  # x, scale=2.0, mask (kwargs by name)
    assert pair.inputs[1] == ("const", 2.0)
    args, kwargs = torch.utils._pytree.tree_unflatten(["X", 2.0, "M"], pair.in_spec)
    assert args == ("X",) and kwargs == {"scale": 2.0, "mask": "M"}
    assert [k for k, _ in pair.outputs] == ["tensor", "tensor"]
    assert pair.enter < lin.enter < lin.exit < pair.exit  # eager order: the inner call returns first
    tagged = {n.name: sorted(n.meta[TAPS]) for n in tg.gm.graph.nodes if n.meta.get(TAPS)}
    assert tagged["x"] == [(pair.id, "in", 0), (lin.id, "in", 0)]
    assert tagged["m"] == [(pair.id, "in", 2)]
    assert tagged["linear"] == [(lin.id, "out", 0)]
    outs = [name for name, tags in tagged.items() if any(t[:2] == (pair.id, "out") for t in tags)]
    assert len(outs) == 2 and "linear" not in outs


@pytest.mark.parametrize("family,mesh", [("megatron", "2x2"), ("ag_rs", "4")])
def test_tap_hooks_adds_one_record_per_tagged_value_and_leaves_the_program_alone(family, mesh):
    tg, plan = traced_and_plan("gpt-tiny", mesh, family=family)
    calls = tg.meta["module_calls"]
    gm = run_passes(tg.gm, plan)
    before = targets(gm)
    tapped, slots, wanted = passes.tap_hooks(gm, calls, {"layers.0.attn.o_proj", "layers.0.mlp"}.__contains__, 7)
    assert targets(gm) == before  # the program itself is untouched
    after = targets(tapped)
    assert after.pop("hook_record") == len(slots)
    assert after == before
    assert {c.fqn for c in calls if c.id in wanted} == {"layers.0.attn.o_proj", "layers.0.mlp"}
    records = [n for n in tapped.graph.nodes if n.target is hook_record]
    for n in records:
        taps, slot, value = n.args
        assert taps == 7 and n.prev is value  # right after the value is computed
        assert slots[slot][1] == tuple(value.meta["placement"])
    # the o_proj output under AG/RS rings is the RS ring's output (split), its input the attention's
    o_proj = next(c for c in calls if c.fqn == "layers.0.attn.o_proj")
    (out_slot,) = [s for s in slots if (o_proj.id, "out", 0) in s[0]]
    if family == "ag_rs":
        (rec,) = [n for n in records if n.args[1] == slots.index(out_slot)]
        producer = rec.args[2]
        assert producer.target in (torch.ops.stpc.ring_matmul_reducescatter.default, torch.ops.aten.add.Tensor)


def test_tap_hooks_names_the_module_whose_value_the_program_never_holds():
    tg, plan = traced_and_plan("gpt-tiny", "2x2", family="megatron")
    calls = tg.meta["module_calls"]
    gm = run_passes(tg.gm, plan)
    mlp = next(c for c in calls if c.fqn == "layers.0.mlp")
    for n in gm.graph.nodes:  # as if a pass had dropped the tag of the MLP's output
        n.meta[TAPS] = [t for t in n.meta.get(TAPS, ()) if t[:2] != (mlp.id, "out")]
    with pytest.raises(UnsupportedHook, match=r"'layers.0.mlp'.*an output"):
        passes.tap_hooks(gm, calls, {"layers.0.mlp"}.__contains__, 0)
