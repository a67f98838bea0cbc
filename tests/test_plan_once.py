"""Rank 0 plans for everyone: one search per launch, not one per rank, and every rank runs
the same plan. The ranks first check that they traced the same program; an error rank 0's
search raises is raised on every rank (no rank waits for a plan that is not coming)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from stpc.planner import InfeasibleBudget  # noqa: E402
from stpc.runtime.agreement import _portable  # noqa: E402
from stpc.runtime.launch import spawn  # noqa: E402

B, S = 4, 16


def _compile(rank, world, batch_of, budget_gib=None):
    import torch

    import stpc
    from stpc import models

    compile_module = sys.modules["stpc.compile"]
    searched = []
    real = compile_module._plan
    compile_module._plan = lambda *a, **k: searched.append(1) or real(*a, **k)
    torch.manual_seed(0)
    model = models.build("gpt-tiny")
    idx, tgt = models.example_inputs("gpt-tiny", batch_of[rank], S, device="cpu")
    try:
        dm = stpc.compile(model, (world,), (idx, tgt), cache=False, budget_gib=budget_gib)
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "searched": len(searched),
                "min_budget": getattr(e, "min_budget", None)}
    loss = dm(idx, tgt)
    return {"searched": len(searched), "hash": dm.stpc.plan.hash(), "solved": dm.stpc.plan.solved is not None,
            "loss": float(loss)}


@pytest.mark.multirank
def test_rank_0_searches_and_the_others_run_its_plan():
    got = spawn(_compile, 2, [B, B], timeout_s=300)
    assert [g.get("searched") for g in got] == [1, 0], got
    assert got[0]["hash"] == got[1]["hash"] and got[0]["loss"] == got[1]["loss"]
    # rank 0's plan keeps the problem it was solved from; the others read the plan's JSON
    assert [g["solved"] for g in got] == [True, False]


@pytest.mark.multirank
def test_a_rank_that_traced_other_shapes_fails_on_every_rank():
    got = spawn(_compile, 2, [B, 2 * B], timeout_s=300)
    assert all(g.get("error") == "TraceMismatch" and "ranks [1]" in g["message"] and "Fix:" in g["message"]
               for g in got), got
    assert [g["searched"] for g in got] == [0, 0]  # caught before any search


@pytest.mark.multirank
def test_rank_0s_search_error_is_raised_on_every_rank():
    got = spawn(_compile, 2, [B, B], 1e-6, timeout_s=300)
    assert all(g.get("error") == "InfeasibleBudget" for g in got), got
    assert got[0]["min_budget"] == got[1]["min_budget"] > 0 and got[0]["message"] == got[1]["message"]
    assert [g["searched"] for g in got] == [1, 0]


class _TwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_an_error_crosses_to_the_other_ranks_as_itself_or_by_name():
    e = _portable(InfeasibleBudget(2**30, 3 * 2**30))
    assert isinstance(e, InfeasibleBudget) and e.min_budget == 3 * 2**30
    e = _portable(_TwoArgs(1, 2))  # does not unpickle: its type and message, as a RuntimeError
    assert type(e) is RuntimeError and str(e) == "_TwoArgs on rank 0: 1 and 2"
