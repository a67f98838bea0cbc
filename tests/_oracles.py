"""Test oracles: exhaustive answers for tiny instances, used only by the tests."""
from __future__ import annotations

import itertools

from stpc.planner.solver import Problem


def brute_force(p: Problem) -> tuple[int, list[int]] | None:
    """Exhaustive optimum of a tiny solver problem: (objective, choice), or None if no
    choice fits the budget."""
    best = None
    for choice in itertools.product(*(range(len(c)) for c in p.cost)):
        obj, mem = p.evaluate(list(choice))
        if p.budget is not None and mem > p.budget:
            continue
        if best is None or obj < best[0]:
            best = (obj, list(choice))
    return best
