"""The step's loss is summed over ranks without holding the ranks: ``runtime.wait_on_read``
hands out the all-reduce's result unwaited, ``loss.backward()`` does not wait for it, the
first read of its value does (and gets the global value), and what nobody read is waited
by the next step (``runtime.settle``).

Real gloo ranks, one spawn for every case.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import _rel, full_grads, make_plan  # noqa: E402

from stpc.runtime.launch import spawn  # noqa: E402

pytestmark = pytest.mark.multirank

B, S = 4, 16


def _cases(rank, world, plan_json):
    import copy

    import stpc
    from stpc import models, runtime
    from stpc.planner import Plan
    from stpc.runtime import lazy_wait

    out = {}
    group = torch.distributed.group.WORLD.group_name
    # bare: each rank's loss is (rank + 1) * sum(2x); the global one is their sum
    x = torch.ones(3, requires_grad=True)
    loss = runtime.wait_on_read(runtime.all_reduce_start((2 * x).sum() * (rank + 1), group))
    loss.backward()
    out["bare_unread_after_backward"] = not loss.completed
    out["bare_grad"] = torch.equal(x.grad, torch.full((3,), 2.0 * (rank + 1)))
    out["bare_value"] = loss.item() == 6.0 * sum(r + 1 for r in range(world))
    out["bare_repr"] = repr(loss).startswith(f"tensor({6 * sum(r + 1 for r in range(world))}.")  # (its value, waited)
    out["bare_pending_after_read"] = len(lazy_wait._pending)
    # unread: settle waits it (no collective is left unwaited)
    runtime.wait_on_read(runtime.all_reduce_start(x.detach().sum(), group))
    out["unread_pending"] = len(lazy_wait._pending)
    runtime.settle()
    out["unread_settled"] = len(lazy_wait._pending)

    # the compiled model: its loss is such a result; read before backward it is the global mean
    torch.manual_seed(0)
    model = models.build("gpt-tiny")
    single = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, 128, (B, S), generator=g), torch.randint(0, 128, (B, S), generator=g)
    pm = stpc.compile(model, (world,), (idx, tgt), plan=Plan.from_json(plan_json))
    ref = single(idx, tgt)
    ref.backward()
    loss = pm(idx, tgt)
    out["compiled_lazy"] = isinstance(loss, runtime.LoadedLater) and not loss.completed
    out["compiled_loss"] = _rel(loss.detach(), ref.detach())
    loss.backward()
    grads = full_grads(pm)
    out["compiled_grads"] = max(_rel(grads[k], p.grad) for k, p in single.named_parameters())
    # unread this time (and no backward, whose reducer waits it at its end): the next call
    # waits it before its own collectives
    first = pm(idx, tgt)
    second = pm(idx, tgt)
    out["next_call_settles"] = id(first) not in lazy_wait._pending and id(second) in lazy_wait._pending
    runtime.settle()
    return out


def test_loss_is_waited_where_read_not_where_computed():
    plan = make_plan("gpt-tiny", "2", "dp", B, S).to_json()
    for r in spawn(_cases, 2, plan, timeout_s=240):
        assert r["bare_unread_after_backward"] and r["bare_grad"] and r["bare_value"] and r["bare_repr"], r
        assert r["bare_pending_after_read"] == 0 and r["unread_pending"] == 1 and r["unread_settled"] == 0, r
        assert r["compiled_lazy"], r
        # fp32; rtol 1e-4 (``_rel``: 1 means at the tolerance): the sums' order differs only
        assert r["compiled_loss"] <= 1 and r["compiled_grads"] <= 1, r
        assert r["next_call_settles"], r
