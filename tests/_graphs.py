"""Single-process helpers for the pass tests: a traced tiny model and a forced plan."""
from __future__ import annotations

import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import make_plan  # noqa: E402

import stpc  # noqa: E402
from stpc import models  # noqa: E402

B, S = 4, 16


def traced_and_plan(model="gpt-tiny", mesh="2x2", family="megatron", **overrides):
    """(TracedGraph, Plan) of a tiny model built on meta under a plan forced to ``family``."""
    with torch.device("meta"):
        m = models.build(model, **overrides)
    tg = stpc.trace(m, models.example_inputs(model, B, S))
    return tg, make_plan(model, mesh, family, B, S, **overrides)


def targets(gm) -> Counter:
    """How many call_function nodes call each target (by short name)."""
    return Counter(getattr(n.target, "__name__", str(n.target)).removesuffix(".default")
                   for n in gm.graph.nodes if n.op == "call_function")
