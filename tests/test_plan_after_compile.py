"""A plan inspected after ``stpc.compile`` says what it said before: the passes lower a copy of
the traced graph, so the plan's solved problem (``plan.summary()``, ``breakdown``) still reads
global shapes, not the ranks' local ones.

Real gloo ranks.
"""
from __future__ import annotations

import pytest
import torch

from stpc.runtime.launch import spawn

pytestmark = pytest.mark.multirank


def _compare(rank, world):
    import stpc
    from stpc import models
    from stpc.planner import search
    from stpc.planner.hints import preset
    from stpc.planner.summary import breakdown

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)
    pm = stpc.compile(models.build("gpt-tiny"), (world,), (idx, tgt), hints="megatron", cache=False)
    plan = pm.stpc.plan
    pm(idx, tgt).backward()  # (a step run: nothing of it may reach the plan either)
    after = breakdown(plan)
    summary = plan.summary()
    if rank != 0:  # (rank 0 planned for every rank: the others run its plan, read from its JSON)
        return {"same_plan": plan.solved is None, "diff": {}, "summary": "end of forward" in summary}
    # the same plan searched on a fresh trace, in this process, on the cluster compile costed it on
    ref = search(stpc.trace(models.build("gpt-tiny"), (idx, tgt)), (world,), plan.solved.b.cm.cluster,
                 hints=preset("megatron", (world,)))
    def strategies(p):
        return {k: (n.kind, list(n.out), [list(i) for i in n.ins]) for k, n in p.nodes.items()}

    return {"same_plan": strategies(ref) == strategies(plan), "diff": {k: (after[k], v) for k, v in breakdown(ref).items()
                                                              if after[k] != v},
            "summary": "end of forward" in summary}


def test_breakdown_after_compile_is_the_plans():
    for r in spawn(_compare, 2, timeout_s=240):
        assert r["same_plan"] and r["summary"], r
        assert r["diff"] == {}, r  # (local shapes gave other weights, compute and scratch)
