"""runtime.gather_start / gather_wait: several parameters' shards gathered whole in one
collective; backward reduce-scatters their gradients in one collective, launched from the
wait's backward (before the autograd engine reaches the start) and waited in the start's.

Real gloo ranks."""
from __future__ import annotations

import pytest
import torch

from stpc.runtime.launch import spawn

pytestmark = pytest.mark.multirank


def _gather(rank, world):
    import torch.distributed as dist

    from stpc import runtime
    from stpc.runtime import param_gather

    group = dist.group.WORLD.group_name
    calls = []

    class Spy:  # records the functional collectives the module issues, and passes them on
        def __getattr__(self, name):
            op = getattr(torch.ops._c10d_functional, name)

            def call(*a, **k):
                calls.append(name)
                return op(*a, **k)
            return call

    param_gather._c10d = Spy()
    out = {}
    for grad in ("rs", "slice"):
        calls.clear()
        # rank r holds rows r of a [world*2, 3] matrix (split on dim 0) and column r of b [4, world]
        a = torch.nn.Parameter(torch.full((2, 3), float(rank)))
        b = torch.nn.Parameter(torch.arange(4.0).view(4, 1) + 10 * rank)
        buf = runtime.gather_start([a, b], group, grad)
        fa, fb = runtime.gather_wait(buf, [(2, 3), (4, 1)], [0, 1], group)
        full_ok = (torch.equal(fa, torch.cat([torch.full((2, 3), float(r)) for r in range(world)]))
                   and torch.equal(fb, torch.cat([torch.arange(4.0).view(4, 1) + 10 * r for r in range(world)], 1)))
        # a rank-dependent loss: rank r's gradient of the whole parameters is (r + 1) * ones
        ((fa.sum() + fb.sum()) * (rank + 1)).backward()
        want = sum(r + 1 for r in range(world)) if grad == "rs" else rank + 1
        out[grad] = {"full": full_ok, "a": torch.equal(a.grad, torch.full((2, 3), float(want))),
                     "b": torch.equal(b.grad, torch.full((4, 1), float(want))), "calls": list(calls)}
    return out


def test_coalesced_gather_and_early_reduce_scatter():
    for r in spawn(_gather, 2, timeout_s=120):
        for grad in ("rs", "slice"):
            assert r[grad]["full"] and r[grad]["a"] and r[grad]["b"], r
        # forward: one gather, waited; backward: one reduce-scatter launched, then waited
        assert r["rs"]["calls"] == ["all_gather_into_tensor", "wait_tensor", "reduce_scatter_tensor", "wait_tensor"]
        assert r["slice"]["calls"] == ["all_gather_into_tensor", "wait_tensor"]  # complete: no reduction
