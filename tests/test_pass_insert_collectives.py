"""insert_collectives: the edge algebra (reshard_steps) and the rewritten graphs."""
import pytest
import torch

from _graphs import targets, traced_and_plan
from stpc import runtime
from stpc.passes import insert_collectives, shard_params
from stpc.passes._common import LoweringError
from stpc.passes.insert_collectives import reshard_steps
from stpc.placement import local_shape


def ops(steps):
    return [(fn, a, kw.get("dim", kw.get("grad", ""))) for fn, a, kw, _ in steps]


@pytest.mark.parametrize("src,dst,split,expected", [
    # S -> R for a consumer that does not split: all-gather, backward slices
    (("S0",), ("R",), (False,), [("all_gather", 0, 0)]),
    # ... for one that splits: the gradient is partial, backward reduce-scatters
    (("S1",), ("R",), (True,), [("all_gather", 0, 1)]),
    (("P",), ("R",), (False,), [("all_reduce", 0, "identity")]),
    (("P",), ("R",), (True,), [("all_reduce", 0, "all_reduce")]),  # Megatron's g followed by f
    (("P",), ("S1",), (True,), [("reduce_scatter", 0, 1)]),
    (("R",), ("S2",), (True,), [("shard_slice", 0, 2)]),
    (("R",), ("P",), (True,), [("to_partial", 0, "")]),
    (("S0",), ("S1",), (True,), [("all_to_all", 0, "")]),
    # R read by a consumer that splits its work: identity forward, all-reduce backward ("f")
    (("R", "R"), ("R", "R"), (False, True), [("grad_all_reduce", 1, "")]),
    # nested splits of one dim: the inner axis is gathered first, and re-split after
    (("S0", "S0"), ("S1", "S0"), (True, True),
     [("all_gather", 1, 0), ("all_to_all", 0, ""), ("shard_slice", 1, 0)]),
    (("R", "S0"), ("S0", "S0"), (True, True), [("all_gather", 1, 0), ("shard_slice", 0, 0), ("shard_slice", 1, 0)]),
    (("S0", "P"), ("R", "R"), (False, False), [("all_reduce", 1, "identity"), ("all_gather", 0, 0)]),
    (("B1.2",), ("X1.2",), (True,), [("grid_skew", 0, "")]),
    (("W0.1",), ("R",), (True,), [("grid_gather", 0, "rs")]),
])
def test_reshard_steps(src, dst, split, expected):
    mesh = (4,) * len(src)
    steps = reshard_steps(src, dst, mesh, split, needs_grad=True)
    got = ops(steps)
    # the grad mode is what the "dim" column shows for all_gather when the dim is 0 vs 1 here
    assert [(f, a) for f, a, _ in got] == [(f, a) for f, a, _ in expected]
    for (f, a, x), (_, _, y) in zip(got, expected):
        if f in ("all_gather", "reduce_scatter", "shard_slice") and isinstance(y, int):
            assert x == y
    assert steps[-1][3] == dst[steps[-1][1]] if steps else src == dst


@pytest.mark.parametrize("src,dst,split,expected", [
    # a dim split on both axes whose outer split changes: one redistribution over both axes
    # instead of gathering the inner axis whole and splitting it again
    (("S1", "S0"), ("S0", "S0"), (True, True), ("redistribute", (0, 1))),
    (("S0", "S0"), ("S1", "S0"), (True, True), ("redistribute", (0, 1))),
    (("S0", "S1"), ("S1", "S0"), (True, True), ("redistribute", (0, 1))),
    # not for a reshard the axes make directly (the inner axis re-cuts within the outer block) ...
    (("S0", "S1"), ("S0", "S0"), (True, True), ("all_to_all", 1)),
    # ... nor where an axis gathers to Replicate or sums a Partial: those keep their collectives
    (("S0", "S0"), ("R", "S0"), (False, True), ("all_gather", 1)),
    (("R", "S0"), ("S0", "S0"), (True, True), ("all_gather", 1)),
    (("P", "S0"), ("S0", "S0"), (True, True), ("all_gather", 1)),
])
def test_reshard_steps_over_a_joint_group(src, dst, split, expected):
    steps = reshard_steps(src, dst, (2, 2), split, needs_grad=True, joint=True)
    assert steps[0][:2] == expected, steps
    if expected[0] == "redistribute":
        (fn, axes, kw, after), = steps
        assert kw == {"src": src, "dst": dst, "sizes": (2, 2)} and after == dst
    # without joint groups (a graph lowered before the compiler made them) the axes go one by one
    assert all(isinstance(a, int) for _, a, _, _ in reshard_steps(src, dst, (2, 2), split, joint=False))


def test_the_logits_of_a_tp_outer_plan_reach_a_row_split_loss_in_one_exchange():
    """gpt-tiny under FSDP + TP with TP on the outer axis of 2x2: the head's logits (vocab split
    on the outer axis, rows on the inner) go to a loss splitting rows on both axes in one
    redistribution over the joint group the compiler made, no gather; without the joint
    groups, axis by axis (gather, all-to-all, slice)."""
    def lowered(joint):
        tg, plan = traced_and_plan("gpt-tiny", "2x2", "fsdp-tp-outer")  # (lowering localises the graph)
        gm = shard_params(tg.gm, plan)
        if joint:
            gm.meta["stpc_joint_groups"] = {(0, 1): "joint01"}
        gm = insert_collectives(gm, plan)
        return [n.meta["comm"] for n in gm.graph.nodes
                if n.meta.get("comm", {}).get("edge", ("", ""))[1].startswith("cross_entropy")]

    (c,) = lowered(True)
    assert (c["op"], c["axis"], c["group"], c["src"], c["dst"]) == (
        "redistribute", (0, 1), "joint01", ("S1", "S0"), ("S0", "S0"))
    assert [(c["op"], c["axis"]) for c in lowered(False)] == [("all_gather", 1), ("all_to_all", 0),
                                                              ("shard_slice", 1)]


def test_all_gather_backward_mode_follows_the_consumer():
    (_, _, kw, _), = reshard_steps(("S0",), ("R",), (4,), (False,))
    assert kw["grad"] == "slice"
    (_, _, kw, _), = reshard_steps(("S0",), ("R",), (4,), (True,))
    assert kw["grad"] == "rs"
    assert reshard_steps(("R",), ("R",), (4,), (True,), needs_grad=False) == []


def _lowered(model, mesh, family, **kw):
    tg, plan = traced_and_plan(model, mesh, family, **kw)
    gm = insert_collectives(shard_params(tg.gm, plan), plan)
    return gm, plan


def test_megatron_graph_is_local_and_has_the_collectives():
    gm, plan = _lowered("gpt-tiny", "2x2", "megatron")
    mesh = tuple(plan.mesh_shape)
    t = targets(gm)
    # row-parallel o_proj/fc2 (2 per layer x 2 layers) end in an all-reduce, or a reduce-scatter
    # where the solver keeps the next norm split on the sequence; the loss too
    assert t["all_reduce"] + t["reduce_scatter"] >= 4
    assert t["grad_all_reduce"] > 0  # replicated weights read by split work: complete gradients
    for n in gm.graph.nodes:
        if "placement" in n.meta:
            assert tuple(n.meta["val"].shape) == local_shape(tuple(n.meta["global_val"].shape),
                                                             n.meta["placement"], mesh), n.name
    # view shapes became local: [4, 16, 4, 8] with heads split 2-way and batch 2-way
    view = next(n for n in gm.graph.nodes if n.name == "view")
    assert view.args[1] == [2, 16, 2, 8]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert out.target is runtime.all_reduce and out.meta["placement"] == ("R", "R")


def test_vocab_split_embedding_and_mean_rescale():
    from stpc.planner import Hints

    tg, _ = traced_and_plan("llama-tiny", "4", "dp")
    from stpc.planner import search
    plan = search(tg, (4,), hints=Hints(force=[(r"^embedding$", lambda s: s.ins[0] == ("S0",)),
                                               (r"^cross_entropy", lambda s: s.out == ("P",))]))
    gm = insert_collectives(shard_params(tg.gm, plan), plan)
    emb = next(n for n in gm.graph.nodes if n.name == "embedding")
    assert emb.target is runtime.vocab_parallel_embedding and emb.kwargs["vocab"] == 128
    # the row-split mean loss: local sum / the all-reduced count of targets that count
    ce = next(n for n in gm.graph.nodes if n.name == "cross_entropy_loss")
    assert ce.args[3] == 2  # reduction: sum
    (div,) = [u for u in ce.users if u.target is torch.ops.aten.div.Tensor]
    den = div.args[1]
    assert den.target is runtime.all_reduce and den.meta["comm"]["op"] == "all_reduce"
    count = den.args[0]
    assert count.target is runtime.cross_entropy_count and count.args[0] is ce.args[1]  # the targets
    assert div.meta["placement"] == ("P",)


def test_ring_families_are_emitted_as_their_spatial_equivalent():
    gm, plan = _lowered("llama-tiny", "4", "ag_rs")
    rings = [n for n in gm.graph.nodes if n.meta.get("ring") and "comm" in n.meta]
    kinds = {n.meta["ring"]["kind"] for n in rings}
    assert kinds == {"ag_ring", "rs_ring"}
    for n in rings:
        if n.meta["ring"]["kind"] == "ag_ring":
            assert n.target is runtime.all_gather and list(n.users)[0].name == n.meta["ring"]["linear"]
        else:
            assert n.target is runtime.reduce_scatter and n.args[0].name == n.meta["ring"]["linear"]


def test_a_plan_for_another_graph_is_reported_with_node_and_source():
    tg, plan = traced_and_plan("gpt-tiny", "2x2", "megatron")
    plan.nodes["view"].out = ["S1", "S0"]
    with pytest.raises(LoweringError, match=r"node view .*models\.py:\d+.*Fix:"):
        insert_collectives(shard_params(tg.gm, plan), plan)


_TOKS = ("R", "S0", "S1", "S2", "P")
_ALL = [((a, b), (c, d)) for a in _TOKS for b in _TOKS for c in _TOKS[:4] for d in _TOKS[:4]]


@pytest.mark.parametrize("joint", [False, True], ids=["axes", "joint"])
@pytest.mark.parametrize("src,dst", _ALL, ids=[f"{s}->{d}" for s, d in _ALL])
def test_reshard_steps_compute_the_right_pieces(src, dst, joint):
    """Simulate the steps on every rank of a 2x3 mesh with real tensors: each rank must end
    with exactly its piece of ``dst`` (nested splits in row-major order). With joint groups, a
    redistribution over both axes moves each rank's block to where ``runtime.reshard``'s boxes
    say (the exchange itself runs on real ranks in test_redistribute)."""
    import torch

    from stpc.runtime import reshard, shard_tensor
    mesh = (2, 3)
    full = torch.arange(6 * 6 * 6 * 2, dtype=torch.float64).reshape(6, 6, 12)
    coords = [(i, j) for i in range(2) for j in range(3)]

    def piece(p, c):  # what rank c holds under placement p (P: its share of the sum)
        return shard_tensor(full, p, mesh, c)
    local = {c: piece(src, c) for c in coords}
    cur = list(src)
    for fn, a, kw, tok in reshard_steps(src, dst, mesh, (True, True), joint=joint):
        new = {}
        if isinstance(a, tuple):  # over both axes: every block put where its box says, re-cut
            assert a == (0, 1) and kw["sizes"] == mesh and kw["src"] == tuple(cur)
            whole = torch.empty_like(full)
            for k, c in enumerate(coords):
                box = reshard._layout_box(kw["src"], k, mesh, list(full.shape))
                whole[tuple(slice(s, s + n) for s, n in box)] = local[c]
            local = {c: shard_tensor(whole, kw["dst"], mesh, c) for c in coords}
            cur = list(tok)
            continue
        for c in coords:
            group = [c[:a] + (k,) + c[a + 1:] for k in range(mesh[a])]
            xs = [local[g] for g in group]
            i = c[a]
            if fn == "all_gather":
                new[c] = torch.cat(xs, kw["dim"])
            elif fn == "all_reduce":
                new[c] = sum(xs)
            elif fn == "reduce_scatter":
                new[c] = sum(xs).chunk(mesh[a], kw["dim"])[i]
            elif fn == "all_to_all":
                new[c] = torch.cat([x.chunk(mesh[a], kw["dst_dim"])[i] for x in xs], kw["src_dim"])
            elif fn == "shard_slice":
                new[c] = local[c].chunk(mesh[a], kw["dim"])[i]
            elif fn == "to_partial":
                new[c] = local[c] / mesh[a]
            else:
                new[c] = local[c]
        local = new
        cur[a] = tok
    assert tuple(cur) == dst
    for c in coords:
        want = piece(dst, c)
        if "P" in dst:  # partial: the sum over the partial axes is what must match
            continue
        assert torch.allclose(local[c], want), (c, src, dst)
