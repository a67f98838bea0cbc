"""The step's loss is summed over ranks without holding the ranks: ``runtime.wait_on_read``
hands out the all-reduce's result unwaited, ``loss.backward()`` does not wait for it, the
first read of its value does (and gets the global value), and what nobody read is waited
by the next step (``runtime.settle``). A parameter's gradient all-reduce kept in the graph
(``grad_all_reduce(..., wait="on_read")``) is likewise handed on unwaited in backward and
waited where autograd sums the parameter's gradients.

Real gloo ranks, one spawn for every case.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import _rel, full_grads, make_plan, whole_embedding_hints  # noqa: E402

from stpc.runtime.launch import spawn  # noqa: E402

pytestmark = pytest.mark.multirank

B, S = 4, 16


def _whole_embedding_plan(world: int):
    """gpt-tiny data-parallel, but embedding the whole batch on every rank: the tied weight's
    gradient is complete from the embedding and partial from the head (its f stays)."""
    import stpc
    from stpc import models
    from stpc.planner import search

    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = stpc.trace(m, models.example_inputs("gpt-tiny", B, S))
    whole = whole_embedding_hints()
    return search(tg, (world,), "cpu-local", hints=whole)


def _cases(rank, world, plans):
    plan_json, whole_json = plans
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
    # unread: settle waits it (no collective is left unwaited); two results dropped unread, the
    # second likely at the first's freed address, are both pending
    runtime.wait_on_read(runtime.all_reduce_start(x.detach().sum(), group))
    runtime.wait_on_read(runtime.all_reduce_start(x.detach().sum(), group))
    out["unread_pending"] = len(lazy_wait._pending)
    runtime.settle()
    out["unread_settled"] = len(lazy_wait._pending)
    # a parameter's gradient all-reduce marked wait="on_read": backward hands it on unwaited
    total = float(sum(r + 1 for r in range(world)))
    w = torch.ones(3, requires_grad=True)
    (g,) = torch.autograd.grad((runtime.grad_all_reduce(w, group, wait="on_read") * (rank + 1)).sum(), w)
    out["grad_unwaited"] = isinstance(g, runtime.LoadedLater) and not g.completed
    out["grad_value"] = torch.equal(g, torch.full((3,), total))
    # summed with a use whose gradient is complete: the sum waits it, .grad is a plain tensor
    w = torch.ones(3, requires_grad=True)
    ((runtime.grad_all_reduce(w, group, wait="on_read") * (rank + 1)).sum() + (5 * w).sum()).backward()
    out["sum_plain"] = type(w.grad) is torch.Tensor and torch.equal(w.grad, torch.full((3,), total + 5))
    out["sum_pending"] = len(lazy_wait._pending)

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
    out["next_call_settles"] = (lazy_wait.pending_key(first) is not None
                                and lazy_wait.pending_key(first) not in lazy_wait._pending
                                and lazy_wait.pending_key(second) in lazy_wait._pending)
    runtime.settle()

    # the tied head read whole by the embedding: its f waits where the tied gradients are summed
    torch.manual_seed(0)
    model = models.build("gpt-tiny")
    single = copy.deepcopy(model)
    pm = stpc.compile(model, (world,), (idx, tgt), plan=Plan.from_json(whole_json))
    gm = next(iter(pm.stpc.programs.values())).gm
    out["whole_marked"] = [n.kwargs.get("wait") for n in gm.graph.nodes if n.target is runtime.grad_all_reduce]
    single(idx, tgt).backward()
    pm(idx, tgt).backward()
    grads = full_grads(pm)
    out["whole_grads"] = max(_rel(grads[k], p.grad) for k, p in single.named_parameters())
    out["whole_plain"] = type(pm.lm_head.weight.grad.to_local()) is torch.Tensor
    out["whole_pending"] = len(lazy_wait._pending)
    return out


def test_loss_is_waited_where_read_not_where_computed():
    plans = make_plan("gpt-tiny", "2", "dp", B, S).to_json(), _whole_embedding_plan(2).to_json()
    for r in spawn(_cases, 2, plans, timeout_s=240):
        assert r["bare_unread_after_backward"] and r["bare_grad"] and r["bare_value"] and r["bare_repr"], r
        assert r["bare_pending_after_read"] == 0 and r["unread_pending"] == 2 and r["unread_settled"] == 0, r
        assert r["compiled_lazy"], r
        # fp32; rtol 1e-4 (``_rel``: 1 means at the tolerance): the sums' order differs only
        assert r["compiled_loss"] <= 1 and r["compiled_grads"] <= 1, r
        assert r["next_call_settles"], r
        assert r["grad_unwaited"] and r["grad_value"] and r["sum_plain"] and r["sum_pending"] == 0, r
        assert r["whole_marked"] == ["on_read"] and r["whole_plain"] and r["whole_pending"] == 0, r
        assert r["whole_grads"] <= 1, r
