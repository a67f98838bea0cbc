"""issue_early: a forward-only all-reduce of the step's inputs (the target count of a
row-split mean cross-entropy) is issued at the start of the step and waited where used."""
import torch

from _graphs import targets, traced_and_plan
from stpc import runtime
from stpc.passes import cleanup, insert_collectives, issue_early, ring_decompose, shard_params, verify


def _lowered(model, mesh, family):
    tg, plan = traced_and_plan(model, mesh, family)
    gm = shard_params(tg.gm, plan, groups=["g0", "g1"][:len(plan.mesh_shape)])
    return plan, cleanup(ring_decompose(insert_collectives(gm, plan), plan), plan)


def test_the_target_count_is_summed_at_the_start():
    plan, gm = _lowered("llama-tiny", "4", "dp")
    count = next(n for n in gm.graph.nodes if n.target is runtime.cross_entropy_count)
    before = targets(gm)
    gm = issue_early(gm, plan)
    nodes = list(gm.graph.nodes)
    start = next(n for n in nodes if n.target is runtime.all_reduce_start)
    done = next(n for n in nodes if n.target is runtime.wait)
    first_param_use = min(nodes.index(u) for n in nodes if n.op == "placeholder" and n.meta.get("param")
                          for u in n.users)
    # Expected: count and its sum issued before any parameter is used, the wait just before the division
    assert start.args[0] is count and nodes.index(start) < first_param_use
    assert list(done.users)[0].target is torch.ops.aten.div.Tensor and done.next in done.users
    # the loss's own all-reduce depends on the model: it stays where it was
    assert targets(gm)["all_reduce"] == before["all_reduce"] - 1
    verify(gm, plan)


def test_a_sum_of_the_computation_stays():
    g = torch.fx.Graph()
    w = g.placeholder("w")
    w.meta["param"] = "w"
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mm.default, (x, w))
    r = g.call_function(runtime.all_reduce, (y,), {"group": "g0", "grad": "identity"})
    r.meta["comm"] = {"op": "all_reduce", "axis": 0}
    g.output(r)
    gm = issue_early(torch.fx.GraphModule(torch.nn.Module(), g))
    assert targets(gm) == {"mm": 1, "all_reduce": 1}
