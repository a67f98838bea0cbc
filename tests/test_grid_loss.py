"""``runtime.grid_cross_entropy``: cross-entropy over logits in a P(2x2) block layout (rows over
the grid's rows, the vocabulary over its columns) on 4 real gloo ranks, against
``torch.nn.functional.cross_entropy`` of the whole logits on one device.

Each rank holds its B(0, 1) block of [8, 12] logits (two columns masked to -inf) and the
whole target (one ignored);
the loss summed over the ranks (the output's Partial placement) must be the single-device
loss, mean and sum, and each rank's logits gradient its block of the single-device one.
fp64, so the comparison is tight; the only communication is the row statistics' two
all-gathers forward (1 value per local row, then 2), none backward, never the logits.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _graphs import traced_and_plan  # noqa: E402
from _multirank import family_hints  # noqa: E402

import stpc  # noqa: E402
import stpc.runtime.grid_loss as grid_loss  # noqa: E402
from stpc import models  # noqa: E402
from stpc.cost_models import CostModel, MemoryModel, get_cluster  # noqa: E402
from stpc.planner import Hints, search  # noqa: E402
from stpc.planner.costs import NodeTimer, grad_bytes, ring_backward_bytes, transient_bytes  # noqa: E402
from stpc.planner.strategies import enumerate_strategies  # noqa: E402
from stpc.planner.summary import breakdown  # noqa: E402
from stpc.runtime.launch import spawn  # noqa: E402
from stpc.runtime.reshard import shard_tensor  # noqa: E402

FULL = (8, 12)
TOK = ("B0.1",)
B_S = 4 * 16  # the tiny models' batch x sequence in tests/_graphs


def _worker(rank, world, reduction):
    import torch.distributed as dist

    from stpc.runtime import grid_cross_entropy

    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(FULL, generator=gen, dtype=torch.float64) * 4
    target = torch.randint(1, FULL[1] // 2, (FULL[0],), generator=gen)
    target[::2] += FULL[1] // 2  # (never column 0 or 6)
    target[3] = -100
    # masked columns: where the target lies on another device of the grid row, the column
    # its clamped index reads is -inf (a product with 0 there would make a NaN)
    logits[:, [0, FULL[1] // 2]] = float("-inf")
    ref_x = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_x, target, reduction=reduction)
    ref.backward(torch.tensor(0.5, dtype=torch.float64))

    gathered = []
    real_ag = grid_loss._ag

    def recording_ag(t, dim, group):
        gathered.append(tuple(t.shape))
        return real_ag(t, dim, group)

    grid_loss._ag = recording_ag
    try:
        lx = shard_tensor(logits, TOK, (world,), (rank,)).clone().requires_grad_()
        out = grid_cross_entropy(lx, target, name, reduction=reduction)
        n_fwd = len(gathered)
        out.backward(torch.tensor(0.5, dtype=torch.float64))
    finally:
        grid_loss._ag = real_ag
    total = out.detach().clone()
    dist.all_reduce(total)
    return {"loss": (float(total), float(ref)),
            "grad": float((lx.grad - shard_tensor(ref_x.grad, TOK, (world,), (rank,))).abs().max()),
            "gathers": gathered, "fwd": n_fwd}


@pytest.mark.multirank
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grid_cross_entropy_matches_the_whole_logits_loss_on_4_ranks(reduction):
    results = spawn(_worker, 4, reduction, timeout_s=120)
    for r in results:
        got, want = r["loss"]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert r["grad"] < 1e-12
        # two exchanges of row statistics forward (max; sum of exponentials and the target's
        # logit) of the 4 local rows, none backward
        assert r["gathers"] == [(1, 4, 1), (1, 4, 2)] and r["fwd"] == 2


def test_grid_cross_entropy_names_what_does_not_fit():
    with pytest.raises(ValueError, match="reduction 'none'"):
        _single("none")


def _single(reduction):
    real = grid_loss._size
    grid_loss._size = lambda group: 4
    try:
        return grid_loss.grid_cross_entropy(torch.zeros(4, 6), torch.zeros(8, dtype=torch.long), "g", reduction=reduction)
    finally:
        grid_loss._size = real


def _loss_node(tg):
    return next(n for n in tg.gm.graph.nodes if n.target is torch.ops.aten.cross_entropy_loss.default)


def test_the_loss_may_read_its_logits_in_the_grid_and_is_charged_its_two_exchanges():
    tg, _ = traced_and_plan("gpt-tiny", "4", "p2x2", bias=False)
    loss = _loss_node(tg)
    by_ins = {s.ins: s for s in enumerate_strategies(loss, (4,))[0]}
    grid = by_ins[(("B0.1",), ("R",))]  # logits [B*S, vocab] in blocks, the target whole
    assert grid.out == ("P",)
    assert not any(s.ins[0][0][0] == "B" for s in enumerate_strategies(loss, (2,))[0])  # no grid on 2
    cm = CostModel(get_cluster("cpu-local"), (4,))
    timer = NodeTimer(loss, cm, [True, False])
    rows = 4 * 16 // 2  # this device's rows: its grid row's half of B*S
    stats = sum(cm.blocking(cm.all_gather(4 * rows * k * 4, 0)) for k in (1, 2))
    # the local work of a row split of 4, plus the row maxima's and the sums' exchanges, forward only
    split = by_ins[(("S0",), ("S0",))]
    assert timer(grid) == pytest.approx(timer(split) + stats)
    assert timer.forward(grid) == pytest.approx(timer.forward(split) + stats)


def test_the_solver_reads_a_large_vocabularys_logits_in_the_grid():
    """The cost model decides: with gpt-tiny's 128-word vocabulary the logits' gather costs
    less than the loss's two statistics exchanges (latency), so the loss gathers them; with
    8192 words, each row's 8192 logits outweigh its 3 statistics, and the solver keeps the
    grid through the loss."""
    grid = family_hints("p2x2-grid")
    free = Hints(force=[f for f in grid.force if not f[0].startswith("^cross")], name="grid-free-loss")
    chosen = {}
    for vocab in (128, 8192):
        with torch.device("meta"):
            m = models.build("gpt-tiny", bias=False, vocab=vocab)
        tg = stpc.trace(m, models.example_inputs("gpt-tiny", 4, 16))
        plan = search(tg, (4,), cluster="cpu-local", hints=free)
        chosen[vocab] = plan.nodes[_loss_node(tg).name].ins[0]
    assert chosen == {128: ["R"], 8192: ["B0.1"]}, chosen


def test_the_heads_p2x2_backward_is_charged_its_ring_buffers():
    """The head's P(2x2) backward (``stpc::primepar_linear_backward``) runs while all forward
    saved is alive and holds two dO blocks, dI, dX and an activation block in flight, the dW
    accumulator, its neighbour's partial and dW (``costs.ring_backward_bytes``): with the
    vocabulary's logits the largest block, far more than its two gradients alone."""
    tg, plan = traced_and_plan("gpt-tiny", "4", "p2x2-grid", bias=False, vocab=1024)
    head = next(n for n in tg.gm.graph.nodes if n.name == "linear_12")
    (s,) = [s for s in enumerate_strategies(head, (4,))[0] if s.kind == "p2x2" and s.out == tuple(plan.nodes["linear_12"].out)]
    x_b = B_S * 32 * 4 // 4  # [B*S, 32] fp32 in 2x2 blocks
    w_b = 1024 * 32 * 4 // 4
    o_b = B_S * 1024 * 4 // 4
    assert ring_backward_bytes(head, [s], (4,)) == [2 * o_b + 3 * x_b + 3 * w_b]
    assert ring_backward_bytes(head, [s], (4,))[0] > 2 * grad_bytes(head, [s], (4,), [True, True])[0]
    assert breakdown(plan)["transient_bytes"] >= 2 * o_b + 3 * x_b + 3 * w_b


def test_the_grid_loss_keeps_to_one_axis_and_its_blocks_nest_inside_earlier_splits():
    """A grid loss whose rows a later axis splits too would read the wrong targets (splits
    nest outer axis first, the target's rows would not be the logits'), and one over two
    grid axes would see a part of each row's vocabulary: neither is offered. Rows split by
    an earlier axis nest (data parallelism outside the grid)."""
    tg, _ = traced_and_plan("gpt-tiny", "4", "p2x2", bias=False)
    loss = _loss_node(tg)
    grid = lambda mesh: {s.ins[0] for s in enumerate_strategies(loss, mesh)[0]  # noqa: E731
                         if any(t[0] == "B" for t in s.ins[0])}
    assert grid((4, 2)) == {("B0.1", "R")}
    assert grid((2, 4)) == {("R", "B0.1"), ("S0", "B0.1")}
    assert grid((4, 4)) == {("B0.1", "R"), ("R", "B0.1"), ("S0", "B0.1")}


def test_a_grid_never_has_a_later_axis_cut_its_blocks():
    """x * w with w whole along the grid's columns, read through its grid column's slice: a
    later axis splitting the columns too would cut w's piece across the grid (the block
    holds column piece c, then b; w would be sliced b, then c)."""
    with torch.device("meta"):
        mul = stpc.trace(_Scale(), (torch.empty(8, 8, 16),))
    node = next(n for n in mul.gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    for mesh in [(4, 2), (2, 4)]:
        for s in enumerate_strategies(node, mesh)[0]:
            for a, tok in enumerate(s.out):
                if tok[0] == "B":
                    i, j = (int(d) for d in tok[1:].split("."))
                    assert all(s.out[b] not in (f"S{i}", f"S{j}") for b in range(a + 1, len(mesh))), s


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        return x * self.w


def test_sixteen_bit_logits_are_charged_the_grid_losss_fp32_working_copy():
    for dtype, copies in ((torch.float32, 1), (torch.bfloat16, 3)):
        with torch.device("meta"):
            m = models.build("gpt-tiny", bias=False).to(dtype)
        tg = stpc.trace(m, models.example_inputs("gpt-tiny", 4, 16))
        loss = _loss_node(tg)
        strategies = [s for s in enumerate_strategies(loss, (4,))[0] if s.ins[0] == ("B0.1",)]
        logits = loss.args[0].meta["val"]
        local = logits.numel() * logits.element_size() / 4
        target, out = loss.args[1].meta["val"], loss.meta["val"]
        rest = target.numel() * target.element_size() + out.element_size()  # (the whole target, the scalar)
        (got,) = transient_bytes(loss, strategies, (4,), MemoryModel())
        assert got == pytest.approx(local + copies * local + rest), (dtype, got)
