"""stpc.runtime.ops.selfcheck on real gloo ranks: the three primitives agree with one plain
matmul, forward and gradients, and the check itself fails when a primitive is wrong.

One spawn per world size runs every case (the process start-up is the cost)."""
import functools
import math

import pytest
import torch

from stpc.runtime.launch import spawn
from stpc.runtime.ops import selfcheck

pytestmark = pytest.mark.multirank


def _worker(rank, world):
    from stpc.runtime.ops import ring

    out = {"float32": selfcheck.check_primitives(rank, world)}
    out["float64"] = selfcheck.check_primitives(rank, world, seed=3, shape=(1, 8, 8), k_out=4, dtype=torch.float64)
    # a wrong AG-ring (each rank's rows rotated before the ring): the check must see it
    saved = selfcheck.ring_allgather_matmul
    selfcheck.ring_allgather_matmul = lambda x, w, dim: ring.ring_allgather_matmul(x.roll(1, dims=1), w, dim)
    try:
        out["broken_ag"] = selfcheck.check_primitives(rank, world)
    finally:
        selfcheck.ring_allgather_matmul = saved
    return out


@functools.lru_cache(maxsize=None)
def _run(world):
    return spawn(_worker, world, timeout_s=240)


@pytest.mark.parametrize("world", [2, 4])
def test_every_primitive_matches_the_plain_matmul(world):
    results = _run(world)
    assert all(r == results[0] for r in results), "ranks disagree on the (max over ranks) errors"
    got = results[0]
    for dtype in ("float32", "float64"):
        tol = selfcheck.TOLERANCE[getattr(torch, dtype)]
        for prim in ("ag_ring", "rs_ring"):
            assert set(got[dtype][prim]) == {"out", "dx", "dw"}
            assert max(got[dtype][prim].values()) <= tol, (dtype, prim, got[dtype][prim])
        if world == 4:
            assert max(got[dtype]["p2x2"].values()) <= tol, (dtype, got[dtype]["p2x2"])
        else:  # not a 2^k x 2^k grid
            assert got[dtype]["p2x2"] is None
    assert set(got["float32"]) == set(selfcheck.PRIMITIVES)


@pytest.mark.parametrize("world", [2, 4])
def test_the_check_fails_for_a_wrong_primitive(world):
    got = _run(world)[0]["broken_ag"]
    assert got["ag_ring"]["out"] > 0.1 and got["ag_ring"]["dx"] > 0.1
    assert max(got["rs_ring"].values()) <= selfcheck.TOLERANCE[torch.float32]  # the others unaffected


def test_a_shape_that_does_not_divide_is_refused_before_any_communication():
    with pytest.raises(ValueError, match="S=6 does not divide by the 4 ranks"):
        selfcheck.check_primitives(0, 4, shape=(1, 6, 8))


def test_the_error_is_relative_and_fails_closed():
    ref = torch.tensor([2.0, -4.0], dtype=torch.float64)
    assert selfcheck._err(torch.tensor([2.0, -4.0]), ref) == 0.0
    assert selfcheck._err(torch.tensor([2.4, -4.0]), ref) == pytest.approx(0.1, rel=1e-6)
    assert selfcheck._err(torch.tensor([float("nan"), 0.0]), ref) == math.inf
    assert selfcheck._err(torch.zeros(3), ref) == math.inf  # shape mismatch
    assert selfcheck._grid_k(4) == 1 and selfcheck._grid_k(16) == 2 and selfcheck._grid_k(8) is None
