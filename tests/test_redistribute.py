"""``redistribute``: one split layout to another on one mesh axis by slice overlap, on 4 real
gloo ranks (a 2 x 2 grid for the PrimePar tokens).

Every ordered pair of split tokens over a [8, 12, 16] tensor (S on each dim, B / X / W over
two dims): the result is exactly this rank's block of the whole tensor under the target
layout (``shard_tensor``), the gradient exactly its block under the source layout, and each
rank receives only what it lacks: the per-peer sizes the all-to-all is given are the
target block less what the rank already holds (never the whole tensor, as gathering then
slicing moved).

Over a group of two mesh axes (the 2 x 2 world, ranks row-major over the axes, as
``joint_group`` orders them), every ordered pair of two-axis split layouts, nested outer axis
first: the block and the gradient land as ``shard_tensor`` lays them out, and a rank whose
rows are re-cut across both axes receives only its new block's part it lacks.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

import stpc.runtime.reshard as reshard
from stpc.runtime.launch import spawn
from stpc.placement import received_fraction
from stpc.runtime.reshard import redistribute, shard_tensor

FULL = (8, 12, 16)
TOKENS = ["S0", "S1", "S2", "B1.2", "X1.2", "W1.2", "B0.2", "X0.1"]
PAIRS = [(a, b) for a, b in itertools.product(TOKENS, TOKENS) if a != b]
LAYOUTS = list(itertools.product(["S0", "S1", "S2"], repeat=2))  # (outer axis, inner axis) of a 2 x 2 mesh
JOINT_PAIRS = [(a, b) for a, b in itertools.product(LAYOUTS, LAYOUTS) if a != b]


def _worker(rank, world):
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(FULL, generator=gen, dtype=torch.float64)
    grad = torch.randn(FULL, generator=gen, dtype=torch.float64)
    res = {}
    for src, dst in PAIRS:
        x = shard_tensor(full, (src,), (world,), (rank,)).clone().requires_grad_()
        y = redistribute(x, src, dst, name)
        y.backward(shard_tensor(grad, (dst,), (world,), (rank,)))
        res[src, dst] = (torch.equal(y.detach(), shard_tensor(full, (dst,), (world,), (rank,))),
                         torch.equal(x.grad, shard_tensor(grad, (src,), (world,), (rank,))))
    # what the all-to-all is asked to move: B1.2 -> S1, the per-peer sizes it receives
    seen = []

    class Recording:  # the functional collectives, recording the all-to-all's split sizes
        def __getattr__(self, name):
            return getattr(functional, name)

        def all_to_all_single(self, x, out_sizes, in_sizes, group):
            seen.append(list(out_sizes))
            return functional.all_to_all_single(x, out_sizes, in_sizes, group)

    functional = reshard._c10d
    reshard._c10d = Recording()
    try:
        redistribute(shard_tensor(full, ("B1.2",), (world,), (rank,)), "B1.2", "S1", name)
        res["b_to_s_received"] = list(seen)
        for src, dst in PAIRS:  # every pair: the elements received from peers
            seen.clear()
            redistribute(shard_tensor(full, (src,), (world,), (rank,)), src, dst, name)
            res["received", src, dst] = sum(k for p, k in enumerate(seen[0]) if p != rank) if seen else None
        # two axes taken together: the rows split on both, their outer split re-cut (the
        # logits of a tp-outer 2 x 2 plan going to a row-split loss)
        seen.clear()
        redistribute(shard_tensor(full, ("S1", "S0"), (2, 2), divmod(rank, 2)), ("S1", "S0"), ("S0", "S0"),
                     name, (2, 2))
        res["joint_received"] = list(seen[0])
    finally:
        reshard._c10d = functional
    coords = divmod(rank, 2)
    for src, dst in JOINT_PAIRS:
        x = shard_tensor(full, src, (2, 2), coords).clone().requires_grad_()
        y = redistribute(x, src, dst, name, (2, 2))
        y.backward(shard_tensor(grad, dst, (2, 2), coords))
        res["joint", src, dst] = (torch.equal(y.detach(), shard_tensor(full, dst, (2, 2), coords)),
                                  torch.equal(x.grad, shard_tensor(grad, src, (2, 2), coords)))
    try:
        redistribute(full, ("S0", "S1"), ("S1", "S0"), name, (4, 2))
    except ValueError as e:
        res["bad_sizes"] = str(e)
    return res


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=120)


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_redistribute_lands_every_block_and_its_gradient(results, src, dst):
    for rank, r in enumerate(results):
        value_ok, grad_ok = r[src, dst]
        assert value_ok, f"rank {rank}: {src} -> {dst} gave the wrong block"
        assert grad_ok, f"rank {rank}: the gradient of {src} -> {dst} is not the {src} block of the gradient"


def test_each_rank_receives_only_what_it_lacks(results):
    # B1.2 -> S1 on a 2x2 grid: rank k wants rows quarter k of dim 1, all of dim 2; its grid
    # block already covers half of that (half of dim 2 of those rows), which it passes to
    # itself; the other half, 1/8 of the tensor, comes from the one peer that holds it (a
    # gather then a slice moved 3/4 of the tensor to every rank).
    total = math.prod(FULL)
    for rank, r in enumerate(results):
        (sizes,) = r["b_to_s_received"]
        from_peers = [k for p, k in enumerate(sizes) if p != rank]
        assert sizes[rank] == total // 8, f"rank {rank}: kept {sizes[rank]} of its own elements"
        assert sorted(from_peers) == [0, 0, total // 8], f"rank {rank}: received {sizes}"


def test_the_cost_model_charges_what_the_busiest_rank_receives(results):
    """``placement.received_fraction`` (what ``costs.axis_reshard`` charges a split-to-split
    reshard) is the share of its new piece the busiest rank receives in the runtime's
    exchange, for every pair a single all-to-all carries (a P2P skew, B -> X, is charged
    as one); below an all-to-all's 3/4 where the layouts share slices, above it where a
    rank's new piece lies wholly elsewhere."""
    local = math.prod(FULL) // 4
    seen = set()
    for src, dst in PAIRS:
        got = [r["received", src, dst] for r in results]
        if None in got:
            continue  # not one all-to-all (a skew's P2P permutation)
        want = received_fraction(src, dst, 4)
        assert max(got) / local == pytest.approx(want), (src, dst, got)
        seen.add(round(want, 3))
    assert {0.5, 0.75, 1.0} <= seen


@pytest.mark.parametrize("src,dst", JOINT_PAIRS, ids=[f"{'.'.join(a)}-{'.'.join(b)}" for a, b in JOINT_PAIRS])
def test_redistribute_over_two_axes_lands_every_block_and_its_gradient(results, src, dst):
    for rank, r in enumerate(results):
        value_ok, grad_ok = r["joint", src, dst]
        assert value_ok, f"rank {rank}: {src} -> {dst} over both axes gave the wrong block"
        assert grad_ok, f"rank {rank}: the gradient of {src} -> {dst} is not the {src} block of the gradient"


def test_a_split_re_cut_over_two_axes_moves_only_the_overlaps(results):
    # (S1, S0) -> (S0, S0) on 2 x 2: rank (t, d) holds rows half d, columns half t; it wants
    # rows quarter 2t + d, every column (1/4 of the tensor). That lies in the blocks of ranks
    # (0, t) and (1, t), half of each: 1/8 of the tensor from each, one of them itself where
    # t == d. (Axis by axis, the inner axis was gathered whole first, its rows half of every
    # column half, then re-cut by an all-to-all of the gathered block and sliced.)
    total = math.prod(FULL)
    for rank, r in enumerate(results):
        t, d = divmod(rank, 2)
        sizes = r["joint_received"]
        assert sizes == [total // 8 if p in (2 * 0 + t, 2 * 1 + t) else 0 for p in range(4)], (rank, sizes)
        assert ("the group has 4 ranks" in r["bad_sizes"]), r["bad_sizes"]
