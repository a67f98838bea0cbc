"""recompute: each layer's span becomes one checkpointed submodule; backward replays it.

Before: a lowered program whose layers' nodes sit in the top-level graph. After: one
``Recompute`` call per layer, the same nodes inside (``inline`` gives them back), the
replayed communication listed for ``verify``; run for real, the same loss and gradients
with far fewer tensors kept from forward to backward.
"""
import copy

import pytest
import torch
from _graphs import traced_and_plan

import stpc
from stpc import models
from stpc.passes import (LoweringError, Recompute, cleanup, comm_schedule, insert_collectives, recompute,
                         ring_decompose, shard_params, verify)
from stpc.passes.recompute import inline
from stpc.planner.analysis import layer_of


def _lowered(model="gpt-tiny", mesh="2x2", family="megatron"):
    tg, plan = traced_and_plan(model, mesh, family)
    gm = shard_params(tg.gm, plan, groups=["g0", "g1"][:len(plan.mesh_shape)])
    return plan, cleanup(ring_decompose(insert_collectives(gm, plan), plan), plan)


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Recompute)]


def test_a_plan_without_recompute_is_left_alone():
    plan, gm = _lowered()
    code = gm.code
    assert recompute(gm, plan).code == code and not _calls(gm)


@pytest.mark.parametrize("model,mesh,family", [("gpt-tiny", "2x2", "megatron"), ("llama-tiny", "4", "ag_rs"),
                                               ("llama-tiny", "4", "zero")])
def test_each_layer_becomes_one_span(model, mesh, family):
    plan, gm = _lowered(model, mesh, family)
    before = {n.name for n in gm.graph.nodes if n.op == "call_function"}
    layers = {layer_of(n) for n in gm.graph.nodes if n.op == "call_function"} - {None}
    plan.stats["recompute"] = "full"
    gm = recompute(gm, plan)
    calls = _calls(gm)
    assert [gm.get_submodule(c.target).layer for c in calls] == sorted(layers) == [0, 1]
    # no layer's compute is left outside its span, and the spans hold nothing else of the layers'
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and layer_of(n) is not None]
    for c in calls:
        body = gm.get_submodule(c.target).body
        assert {layer_of(n) for n in body.graph.nodes if n.op == "call_function"} <= {None, c.meta["recompute"]}
    # the flat program is the one before, node for node
    assert {n.name for n in inline(gm).nodes if n.op == "call_function"} == before
    verify(gm, plan)


def test_replayed_communication_is_the_spans_forward_again():
    plan, gm = _lowered()
    plain = comm_schedule(gm, plan, 0)
    plan.stats["recompute"] = "full"
    gm = recompute(gm, plan)
    sched = comm_schedule(gm, plan, 0)
    replay = [e for e in sched if e["phase"] == "recompute"]
    assert [e for e in sched if e["phase"] != "recompute"] == plain
    flat = inline(gm)
    in_span = {n.name: n.meta["recompute"] for n in flat.nodes if "recompute" in n.meta}
    fwd = [e for e in plain if e["phase"] == "fwd"]
    # per layer, its span's forward communication in forward order, replayed before its backward duals
    for layer in (1, 0):
        mine = [(e["node"], e["op"]) for e in fwd if in_span.get(e["node"]) == layer]
        assert mine and [(e["node"], e["op"]) for e in replay if in_span[e["node"]] == layer] == mine
    first_replay = {layer: min(i for i, e in enumerate(sched) if e["phase"] == "recompute"
                               and in_span[e["node"]] == layer) for layer in (0, 1)}
    assert first_replay[1] < first_replay[0]  # backward reaches the last layer first
    for layer, k in first_replay.items():  # no backward dual of a layer's span comes before its replay
        assert all(in_span.get(e["node"]) != layer for e in sched[:k] if e["phase"] == "bwd")


def test_interleaved_layers_are_refused_by_name():
    plan, gm = _lowered()
    plan.stats["recompute"] = "full"
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    first_of_1 = next(n for n in nodes if layer_of(n) == 1)
    last_of_0 = [n for n in nodes if layer_of(n) == 0][-1]
    last_of_0.meta["module"] = first_of_1.meta["module"]  # a layer-1 node inside layer 0's span
    first_of_1.meta["module"] = "layers.0.ln1"
    with pytest.raises(LoweringError, match=r"layers 0 and 1 interleave.*Fix: plan without recompute"):
        recompute(gm, plan)


def _saved_bytes(fn):
    """(output, bytes autograd keeps from forward to backward while ``fn`` runs)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def test_one_process_same_gradients_and_less_kept():
    """The traced single-device program, spans outlined, run for real: bit-identical loss
    and gradients, and what forward keeps for backward shrinks to the layers' inputs."""
    torch.manual_seed(0)
    model = models.build("llama-tiny", n_layers=3)
    idx, tgt = models.example_inputs("llama-tiny", 4, 32, device="cpu")
    tg = stpc.trace(model, (idx, tgt))
    plain = copy.deepcopy(tg.gm)
    _, plan = traced_and_plan("llama-tiny", "2", "dp")
    plan.stats["recompute"] = "full"
    rec = recompute(tg.gm, plan)
    assert len(_calls(rec)) == 3
    params = dict(model.named_parameters())
    runs = []
    for gm in (plain, rec):
        leaves = {k: p.detach().clone().requires_grad_() for k, p in params.items()}
        args = [leaves[tg.param_fqns[n.name]] if n.name in tg.param_fqns else {"idx": idx, "targets": tgt}[n.name]
                for n in gm.graph.nodes if n.op == "placeholder"]
        out, kept = _saved_bytes(lambda: gm(*args))
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()
        runs.append((loss.detach(), {k: v.grad for k, v in leaves.items()}, kept))
    (l0, g0, kept0), (l1, g1, kept1) = runs
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    assert kept1 < kept0 / 3, (kept0, kept1)
