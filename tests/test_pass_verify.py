"""verify: every rank's communication must match; mismatches name ranks and nodes."""
import pytest
import torch

from _graphs import traced_and_plan
from stpc import runtime
from stpc.passes import VerifyError, cleanup, comm_schedule, insert_collectives, ring_decompose, shard_params, verify


def _final(model="gpt-tiny", mesh="2x2", family="megatron", **kw):
    tg, plan = traced_and_plan(model, mesh, family, **kw)
    gm = cleanup(ring_decompose(insert_collectives(shard_params(tg.gm, plan), plan), plan), plan)
    return gm, plan


@pytest.mark.parametrize("model,mesh,family", [("gpt-tiny", "2x2", "megatron"), ("llama-tiny", "4", "ag_rs"),
                                               ("llama-tiny", "4", "p2x2"), ("gpt-tiny", "2", "zero")])
def test_correct_programs_pass(model, mesh, family):
    gm, plan = _final(model, mesh, family)
    verify(gm, plan)
    sched = comm_schedule(gm, plan, 0)
    assert sched and {e["phase"] for e in sched} == {"fwd", "bwd"}


def test_rank_that_skips_a_collective_is_named():
    gm, plan = _final()
    broken, _ = _final()
    victim = next(n for n in broken.graph.nodes if n.target is runtime.all_reduce)
    victim.replace_all_uses_with(victim.args[0])
    broken.graph.erase_node(victim)
    with pytest.raises(VerifyError, match=rf"rank 1: .*node {victim.name}|rank 0: .*{victim.name}"):
        verify(gm, plan, rank_graphs={0: gm, 1: broken, 2: gm, 3: gm})


def test_uneven_split_gives_ranks_different_shapes():
    gm, plan = _final()
    ag = next(n for n in gm.graph.nodes if n.target is runtime.all_gather)
    src = ag.args[0]
    gv = src.meta["global_val"]
    d = ag.kwargs["dim"]
    shape = list(gv.shape)
    shape[d] += 1  # as if the traced size were not divisible by the mesh axis
    with gv.fake_mode:
        src.meta["global_val"] = torch.empty(shape, dtype=gv.dtype)
    with pytest.raises(VerifyError, match=rf"node {ag.name}"):
        verify(gm, plan)


def test_mismatched_p2p_is_reported():
    gm, plan = _final("llama-tiny", "4", "ag_rs")
    broken, _ = _final("llama-tiny", "4", "ag_rs")
    # rank 2 runs the PrimePar skew where the others do not: its sends meet no receive
    x = next(n for n in broken.graph.nodes if n.op == "placeholder" and n.name == "idx")
    with broken.graph.inserting_after(x):
        sk = broken.graph.call_function(runtime.grid_skew, (x,), {"group": "mesh_axis0", "inverse": False})
    sk.meta["comm"] = {"op": "grid_skew", "axis": 0, "group": "mesh_axis0", "inverse": False}
    with pytest.raises(VerifyError, match=r"P2P rank 2 -> rank \d.*grid_skew|P2P rank \d -> rank 2"):
        verify(gm, plan, rank_graphs={0: gm, 1: gm, 2: broken, 3: gm})
