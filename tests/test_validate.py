"""Bad input to stpc.compile is one clear error (cause and fix) before any tracing."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from stpc import models
from stpc.planner import search
from stpc.runtime.launch import spawn
from stpc.validate import InvalidArgument, budget, cluster, example_inputs, mesh_spec


class Plan2:
    mesh_shape = [2, 2]


@pytest.mark.parametrize("mesh,world,match", [
    (0, 4, "size < 1"), ("2by2", 4, "not a mesh spec"), ("", 4, "not a mesh spec"), (8, 4, "8 devices but this job has 4"),
    ((2, 3), 4, "6 devices"), ((2, 0), 4, "size < 1"), ((2.0, 2), 4, "whole numbers"), (True, 4, "not a mesh"),
    ([], 4, "whole numbers"), (4.0, 4, "not a mesh"),
])
def test_bad_meshes(mesh, world, match):
    with pytest.raises(InvalidArgument, match=match) as e:
        mesh_spec(mesh, None, world, "cpu")
    assert "Fix:" in str(e.value)


def test_good_meshes():
    assert mesh_spec(None, None, 4, "cpu") == 4
    assert mesh_spec("4", None, 4, "cpu") == 4
    assert mesh_spec("2x2", None, 4, "cpu") == (2, 2)
    assert mesh_spec(" 2 X 2 ", None, 4, "cpu") == (2, 2)
    assert mesh_spec([2, 2], None, 4, "cpu") == (2, 2)
    assert mesh_spec(None, Plan2(), 4, "cpu") == (2, 2)
    with pytest.raises(InvalidArgument, match="the plan is for mesh"):
        mesh_spec((4,), Plan2(), 4, "cpu")
    with pytest.raises(InvalidArgument, match="4 devices\\) but this job has 8"):
        mesh_spec(None, Plan2(), 8, "cpu")


def test_example_inputs_are_checked_against_forward():
    m = models.build("gpt-tiny")
    idx, tgt = models.example_inputs("gpt-tiny", 2, 8, device="cpu")
    assert example_inputs(m, (idx, tgt), {}, "cpu") == (idx, tgt)
    assert example_inputs(m, idx, {}, "cpu") == (idx,)
    with pytest.raises(InvalidArgument, match="do not fit GPT.forward"):
        example_inputs(m, (idx, tgt, tgt), {}, "cpu")
    with pytest.raises(InvalidArgument, match="do not fit GPT.forward"):
        example_inputs(m, (idx,), {"labels": tgt}, "cpu")
    with pytest.raises(InvalidArgument, match="must be a tuple"):
        example_inputs(m, [idx].__iter__(), {}, "cpu")

    class Dense(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).sum()

    with pytest.raises(InvalidArgument, match="example input 'x' is torch.float64 but the model's parameters are "
                                              "torch.float32"):
        example_inputs(Dense(), (torch.zeros(2, 4, dtype=torch.float64),), {}, "cpu")
    if not torch.cuda.is_available():  # a tensor on a device the mesh does not run on (meta stands in: allowed)
        assert example_inputs(Dense(), (torch.zeros(2, 4, device="meta"),), {}, "cpu")


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "70", True])
def test_bad_budgets(bad):
    with pytest.raises(InvalidArgument, match="budget_gib"):
        budget(bad)


def test_budget_in_bytes():
    assert budget(None) is None and budget(1.5) == 1.5 * 2**30


def test_the_default_cluster_follows_the_world(monkeypatch, tmp_path):
    monkeypatch.setenv("STPC_PROFILE", str(tmp_path / "none.json"))  # no calibration profile here
    eight = cluster(None, 8, "cpu")
    assert eight.num_devices == 8 and eight.device.name == "CPU"
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    import stpc
    tg = stpc.trace(m, models.example_inputs("gpt-tiny", 8, 16))
    assert search(tg, 8, cluster=eight).mesh_shape  # 8 devices plan (cpu-local has 4)
    with pytest.raises(InvalidArgument, match="has 4 devices but this job has 8"):
        cluster("cpu-local", 8, "cpu")
    with pytest.raises(InvalidArgument, match="unknown cluster"):
        cluster("no-such-cluster", 4, "cpu")


CASES = [({"mesh": 0}, "size < 1"), ({"mesh": "2by2"}, "not a mesh spec"), ({"mesh": 8}, "8 devices but this job has 2"),
         ({"budget_gib": -1}, "budget_gib"), ({"example_inputs": (torch.zeros(2, 4), torch.zeros(1))}, "do not fit"),
         ({"cluster": "nope"}, "unknown cluster"), ({"max_plans": 0}, "max_plans"), ({"outputs": "all"}, "outputs"),
         ({"input_placements": {"x": ("S0", "S1")}}, "input_placements")]


def _bad_compile(rank, world):
    import time

    import stpc

    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            raise RuntimeError("traced: validation came too late")

    out = []
    for how, _ in CASES:
        kwargs = {"mesh": (2,), "example_inputs": (torch.zeros(2, 4),), **how}
        t0 = time.perf_counter()
        try:
            stpc.compile(Untraceable(), **kwargs)
            out.append((None, 0.0))
        except stpc.InvalidArgument as e:
            out.append((str(e), time.perf_counter() - t0))
    return out


@pytest.mark.multirank
def test_compile_refuses_before_tracing():
    for results in spawn(_bad_compile, 2, timeout_s=120):
        for (how, match), (msg, secs) in zip(CASES, results):
            assert msg and match in msg and "Fix" in msg, (how, msg)
            assert secs < 5, (how, secs)
