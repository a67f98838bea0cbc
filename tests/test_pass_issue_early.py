"""issue_early: a forward-only all-reduce of the step's inputs (the target count of a
row-split mean cross-entropy) is issued at the start of the step and waited where used;
one that is the step's output (the loss) is issued where it stands and waited where the
caller reads it."""
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
    start, loss_start = [n for n in nodes if n.target is runtime.all_reduce_start]
    done = next(n for n in nodes if n.target is runtime.wait)
    first_param_use = min(nodes.index(u) for n in nodes if n.op == "placeholder" and n.meta.get("param")
                          for u in n.users)
    # Expected: count and its sum issued before any parameter is used, the wait just before the division
    assert start.args[0] is count and nodes.index(start) < first_param_use
    assert list(done.users)[0].target is torch.ops.aten.div.Tensor and done.next in done.users
    # the loss's own all-reduce depends on the model: issued where it was (after the loss),
    # its only use the output, waited there on read
    assert before["all_reduce"] == 2 and "all_reduce" not in targets(gm)
    assert loss_start.args[0].target is torch.ops.aten.div.Tensor
    (lazy,) = loss_start.users
    assert lazy.target is runtime.wait_on_read and list(lazy.users) == [nodes[-1]] and nodes[-1].op == "output"
    verify(gm, plan)


def _sum_of_computation(read_in_step: bool):
    g = torch.fx.Graph()
    w = g.placeholder("w")
    w.meta["param"] = "w"
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mm.default, (x, w))
    r = g.call_function(runtime.all_reduce, (y,), {"group": "g0", "grad": "identity"})
    r.meta["comm"] = {"op": "all_reduce", "axis": 0}
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (r, r)) if read_in_step else r)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_a_sum_of_the_computation_stays_unless_it_is_an_output():
    # Before: mm -> all_reduce -> mul -> output. Expected: unchanged (the step reads the sum)
    gm = issue_early(_sum_of_computation(read_in_step=True))
    assert targets(gm) == {"mm": 1, "all_reduce": 1, "mul.Tensor": 1}
    # Before: mm -> all_reduce -> output. Expected: mm -> all_reduce_start -> wait_on_read -> output
    gm = issue_early(_sum_of_computation(read_in_step=False))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
        torch.ops.aten.mm.default, runtime.all_reduce_start, runtime.wait_on_read]
