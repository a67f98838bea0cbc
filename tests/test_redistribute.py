"""``redistribute``: one split layout to another on one mesh axis by slice overlap, on 4 real
gloo ranks (a 2 x 2 grid for the PrimePar tokens).

Every ordered pair of split tokens over a [8, 12, 16] tensor (S on each dim, B / X / W over
two dims): the result is exactly this rank's block of the whole tensor under the target
layout (``shard_tensor``), the gradient exactly its block under the source layout, and each
rank receives only what it lacks: the bytes that cross the wire are the target block less
what the rank already holds (never the whole tensor, as gathering then slicing moved).
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from stpc.runtime.launch import spawn
from stpc.runtime.reshard import _held_box, _overlap, redistribute, shard_tensor

FULL = (8, 12, 16)
TOKENS = ["S0", "S1", "S2", "B1.2", "X1.2", "W1.2", "B0.2", "X0.1"]
PAIRS = [(a, b) for a, b in itertools.product(TOKENS, TOKENS) if a != b]


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


def test_each_rank_receives_only_what_it_lacks():
    # B1.2 -> S1 on a 2x2 grid: rank k wants rows quarter k of dim 1, all of dim 2; it holds
    # half of that already (its grid block covers half of dim 2 of those rows): it receives
    # the other half from one peer, 1/8 of the tensor, where a gather moved 3/4 of it.
    n, full = 4, list(FULL)
    total = math.prod(full)
    for k in range(n):
        want = _held_box("S1", k, n, full)
        have = _overlap(_held_box("B1.2", k, n, full), want)
        got = sum(math.prod(length for _, length in box) for p in range(n) if p != k
                  for box in [_overlap(_held_box("B1.2", p, n, full), want)] if box is not None)
        assert got + math.prod(length for _, length in have) == total // n
        assert got == total // 8
