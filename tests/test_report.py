"""What a plan leaves out is said: replicated fallbacks (with their source lines), hints with
no effect, dims no mesh axis divides; strict=True makes the first two errors."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stpc
from stpc import models
from stpc.planner import Hints, search
from stpc.planner.report import fallbacks, hint_misses, indivisible
from stpc.runtime.launch import spawn


class Padded(nn.Module):
    """A pad on activations: an op stpc has no sharding rule for."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = F.pad(self.lin(x), (0, 2))  # the line a fallback warning must name
        return h.sum()


def test_fallbacks_name_the_node_and_its_line():
    tg = stpc.trace(Padded(), (torch.randn(4, 8),))
    plan = search(tg, 2)
    got = fallbacks(plan, tg)
    assert [op for _, op, _ in got] == ["aten.pad.default"]
    assert "test_report.py" in got[0][2] and "F.pad" not in got[0][2]  # file:line, not the text


def test_hints_without_effect():
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = stpc.trace(m, models.example_inputs("gpt-tiny", 4, 16))
    hints = Hints(force=[(r"no_such_node", lambda s: True), (r"^linear", lambda s: True)],
                  param_force=[(r"no_such_param", lambda p: True), (r"fc1\.weight$", lambda p: p == ("S7",)),
                               (r"fc2\.weight$", lambda p: True)],
                  param_exact={"nope.weight": ("R",)})
    got = hint_misses(hints, tg, (4,))
    assert len(got) == 4, got
    assert any("'no_such_node' matches no node" in g for g in got)
    assert any("'no_such_param' matches no parameter" in g for g in got)
    assert any("accepts no placement of layers.0.mlp.fc1.weight" in g for g in got)
    assert any("'nope.weight', which is not a parameter" in g for g in got)
    assert hint_misses("megatron", tg, (4,)) == []  # presets by name are checked by compile


def test_indivisible_dims_are_listed_in_the_plan():
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = stpc.trace(m, models.example_inputs("gpt-tiny", 3, 7))
    assert indivisible(tg, (4,)) == {"idx": [0, 1], "targets": [0, 1]}
    assert indivisible(tg, (3,)) == {"idx": [1], "targets": [1]} | {
        k: v for k, v in indivisible(tg, (3,)).items() if k not in ("idx", "targets")}
    plan = search(tg, (4,))
    assert plan.stats["indivisible"]["idx"] == [0, 1]
    assert "dims no mesh axis divides (never split): idx [0, 1]" in plan.table()
    assert "dims no mesh axis divides (never split): idx [0, 1]" in plan.summary()  # what the CLI prints


def _compile_padded(rank, world, strict):
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stpc.compile(Padded(), (world,), (torch.randn(4, 8),), strict=strict, cache=False)
        return "ok", [str(w.message) for w in caught if issubclass(w.category, stpc.PlanWarning)]
    except stpc.NotPlanned as e:
        return "raised", [str(e)]


@pytest.mark.multirank
def test_compile_warns_or_raises_under_strict():
    for outcome, msgs in spawn(_compile_padded, 2, False, timeout_s=120):
        assert outcome == "ok" and len(msgs) == 1 and "aten.pad.default has no sharding rule" in msgs[0], msgs
        assert "test_report.py" in msgs[0]
    for outcome, msgs in spawn(_compile_padded, 2, True, timeout_s=120):
        assert outcome == "raised" and "strict" in msgs[0] and "aten.pad.default" in msgs[0], msgs
