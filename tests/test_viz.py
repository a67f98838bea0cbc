"""stpc.viz: the pictures of a plan. Each figure has the panels and bars it should, the
per-layer bars add up to the plan's step-time split, the memory picture to the modelled
peak, the schedules follow the runtime's own peer rules, and ``plan --plot`` writes its files."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("matplotlib")

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import family_hints  # noqa: E402

import stpc  # noqa: E402
from stpc import models, viz  # noqa: E402
from stpc.cli import plan as cli_plan  # noqa: E402
from stpc.planner import Plan, search  # noqa: E402
from stpc.planner.hints import megatron  # noqa: E402
from stpc.planner.summary import breakdown  # noqa: E402
from stpc.runtime.ops.ring import primepar_coords, primepar_peers, ring_peers  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tg():
    with torch.device("meta"):
        m = models.build("llama-tiny")
    return stpc.trace(m, models.example_inputs("llama-tiny", 8, 64))


@pytest.fixture(scope="module")
def plans(tg):
    """Plans of llama-tiny forced to each family (cpu-local: transfers cost), and the solved one."""
    out = {f: search(tg, mesh, cluster="cpu-local", hints=family_hints(f))
           for f, mesh in (("p2x2", (4,)), ("ag_ring", (4,)), ("rs_ring", (2,)))}
    out["megatron"] = search(tg, (2, 2), cluster="cpu-local", hints=megatron((2, 2)))
    out["megatron-zero2"] = search(tg, (2, 2), cluster="cpu-local",
                                   hints=megatron((2, 2), 0, 1, distributed_optimizer=True))
    out["solved"] = search(tg, 4, cluster="cpu-local")
    return out


def _close(a, b):
    return abs(a - b) <= 1e-12 + 1e-9 * abs(b)


# ------------------------------------------------------------------ per-layer costs


@pytest.mark.parametrize("family", ["p2x2", "ag_ring", "rs_ring", "megatron", "solved"])
def test_layer_costs_add_up_to_the_plan_breakdown(plans, family):
    plan = plans[family]
    rows = viz.layer_costs(plan)
    bd = breakdown(plan)
    for part in ("compute_s", "exposed_s", "hidden_s"):
        assert _close(sum(r[part] for r in rows), bd[part]), part
    # (the step time is the solver's, in integer nanoseconds per group: equal to rounding, under
    # half a nanosecond per group)
    assert abs(sum(r["compute_s"] + r["exposed_s"] for r in rows) - plan.modelled_step_time_s) < \
        0.5e-9 * len(plan.nodes)
    # the embedding before the layers, the two tied layers as one, norm and head after
    assert [r["block"] for r in rows] == ["before", "layers.0", "after"]
    assert "x2, tied" in rows[1]["label"]
    if family in ("p2x2", "ag_ring", "rs_ring"):  # the ring transfers under the matmuls are in the layers
        assert rows[1]["hidden_s"] > 0 and rows[1]["exposed_s"] > 0


def test_layers_figure_has_a_bar_per_layer_plan_and_part(plans, tmp_path):
    out = tmp_path / "layers.png"
    fig = viz.layers(plans["p2x2"], plans["megatron"], out=out)
    assert out.read_bytes().startswith(PNG)
    (ax,) = fig.axes
    assert len(ax.containers) == 2 * 3  # per plan: compute, exposed, hidden
    assert all(len(c) == 3 for c in ax.containers)  # one bar per distinct layer
    unit = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}[ax.get_ylabel().split("(")[1].split(")")[0]]
    for j, plan in enumerate((plans["p2x2"], plans["megatron"])):
        compute, exposed = ax.containers[3 * j], ax.containers[3 * j + 1]
        drawn = sum(b.get_height() for b in (*compute, *exposed)) * unit
        assert abs(drawn - plan.modelled_step_time_s) < 1e-6 * plan.modelled_step_time_s
    assert "vs megatron" in ax.get_title() and ax.get_legend() is not None


# ------------------------------------------------------------------ memory


@pytest.mark.parametrize("family", ["p2x2", "megatron-zero2"])
def test_memory_timeline_is_the_memory_model(plans, family):
    plan = plans[family]
    tl = viz.memory_timeline(plan)
    bd = breakdown(plan)
    assert (bd["kept_weight_bytes"] > 0) == (family == "megatron-zero2")  # ZeRO-2's kept whole weights
    n_ops = sum(1 for n in plan.nodes.values() if n.role in ("decision", "follower"))
    assert len(tl["ops"]) == len(tl["activations"]) == len(tl["transient"]) == n_ops
    # activations grow through forward to what the model charges at the end of forward
    assert all(a <= b for a, b in zip(tl["activations"], tl["activations"][1:]))
    assert _close(tl["activations"][-1], bd["activation_bytes"])
    assert _close(max(tl["transient"]), bd["transient_bytes"])
    persistent = sum(tl["persistent"].values())  # (no gradients through forward: zero_grad freed them)
    assert _close(persistent, bd["weight_bytes"] + bd["optimizer_bytes"]) and tl["persistent"]["grads"] == 0
    assert persistent + max(tl["activations"] + tl["transient"]) <= plan.peak_memory_bytes * (1 + 1e-9)
    assert _close(persistent + bd["activation_bytes"] + bd["transient_bytes"], bd["forward_peak_bytes"])
    assert plan.peak_memory_bytes == max(bd["forward_peak_bytes"], bd["backward_peak_bytes"], bd["step_peak_bytes"])


@pytest.mark.parametrize("blocks, rest, rest_may_keep_blocks", [
    (r"q_proj$", r"(k_proj|v_proj)$", True),    # first saver P(2x2), the others may be: over-charged
    (r"(k_proj|v_proj)$", r"q_proj$", True),    # first saver not P(2x2): exact
    (r"q_proj$", r"(k_proj|v_proj)$", False)])  # the others cannot keep blocks: charged whole
def test_memory_timeline_holds_a_jointly_saved_tensor_as_the_model_does(tg, blocks, rest, rest_may_keep_blocks):
    """The norm q, k and v save, where some of them keep their own blocks (P(2x2)) and the
    others read it (spatial): the timeline holds what ``Builder._shared_saved_edges`` charges
    in each of its cases, so its end of forward is the model's."""
    from stpc.planner import Hints

    kinds = ("p2x2", "spatial") if rest_may_keep_blocks else ("spatial",)
    hints = Hints(force=[(blocks, lambda s: s.kind == "p2x2"), (rest, lambda s: s.kind in kinds)], name="mixed")
    plan = search(tg, (4,), cluster="cpu-local", hints=hints)
    facts = plan.solved.b.facts
    joint = [facts.joint_savers(it) for it in facts.savers]
    mixed = [{plan.nodes[s.node.name].kind for s in j} for j in joint if j is not None]
    assert {"p2x2", "spatial"} in mixed  # (the solver took spatial where it could take either)
    tl = viz.memory_timeline(plan)
    assert _close(tl["activations"][-1], breakdown(plan)["activation_bytes"])


def test_memory_figure_panels_and_parts(plans, tmp_path):
    plan = plans["ag_ring"]
    out = tmp_path / "sub" / "mem.png"  # a missing folder is made
    fig = viz.memory(plan, out=out)
    assert out.read_bytes().startswith(PNG)
    timeline, parts = fig.axes
    assert "modelled" in fig._suptitle.get_text()
    assert "op (graph order)" in timeline.get_xlabel() and "memory per device" in timeline.get_ylabel()
    bars = parts.containers
    assert len(bars) == 5  # parameters, gradients, optimizer, activations, transient
    unit = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[parts.get_ylabel().split("(")[1].split(")")[0]]
    assert _close(sum(c[0].get_height() for c in bars) * unit, breakdown(plan)["forward_peak_bytes"])


def test_memory_of_a_loaded_plan_draws_what_it_keeps(plans, tg):
    plan = plans["megatron"]
    breakdown(plan)  # kept in plan.stats, so saved with it
    loaded = Plan.from_json(plan.to_json())
    fig = viz.memory(loaded)  # no graph, no problem: the parts at the peak only
    assert len(fig.axes) == 1 and len(fig.axes[0].containers) == 5
    tl = viz.memory_timeline(loaded, tg)  # with the graph: activations, no transients
    assert tl["transient"] is None and _close(tl["activations"][-1], breakdown(plan)["activation_bytes"])
    assert len(viz.memory(loaded, tg).axes) == 2
    with pytest.raises(ValueError, match="re-plan"):
        viz.layer_costs(loaded)


# ------------------------------------------------------------------ schedules


@pytest.mark.parametrize("P", [2, 4])
def test_ring_schedules_follow_the_runtime_peer_rule(P):
    ag, rs = viz.schedule_blocks("ag_ring", P), viz.schedule_blocks("rs-ring", P)
    for s in (ag, rs):
        assert len(s["steps"]) == P and all(len(row) == P for row in s["steps"])
    for t in range(P):
        for i in range(P):
            # the ring module's conventions: AG holds x block (i+t) % P, RS works on (i+t+1) % P
            assert ag["steps"][t][i]["I"] == ((i + t) % P, 0) and ag["steps"][t][i]["O"] == ((i + t) % P, i)
            assert rs["steps"][t][i]["O"] == ((i + t + 1) % P, 0) and rs["steps"][t][i]["I"] == ((i + t + 1) % P, i)
            if t:  # what arrives comes from the runtime's receive-from peer
                src = ring_peers(i, P)[1]
                assert ag["steps"][t][i]["I"] == ag["steps"][t - 1][src]["I"]
                assert rs["steps"][t][i]["O"] == rs["steps"][t - 1][src]["O"]
                assert rs["steps"][t][i]["terms"] == rs["steps"][t - 1][src]["terms"] + 1
    for i in range(P):  # AG: every output block of the device's column once; RS: its own block, fully summed
        assert sorted(ag["steps"][t][i]["O"] for t in range(P)) == [(m, i) for m in range(P)]
        assert rs["steps"][-1][i]["done"] == [(i, 0)] and rs["steps"][-1][i]["terms"] == P


@pytest.mark.parametrize("devices", [4, 16])
def test_primepar_schedule_is_designs_and_the_runtimes(devices):
    s = viz.schedule_blocks("p2x2", devices)
    k = {4: 1, 16: 2}[devices]
    q = 2**k
    assert len(s["steps"]) == q
    for t, row in enumerate(s["steps"]):
        for d, held in enumerate(row):
            r, c = primepar_coords(d, k)
            n = (r + c + t) % q  # DESIGN.md forward: M slice r, N slice r+c+t, K slice c
            assert (held["I"], held["W"], held["O"]) == ((r, n), (n, c), (r, c))
            if t:
                (_, i_from, _), (_, w_from, _) = primepar_peers(d, k)
                assert held["I"] == s["steps"][t - 1][i_from]["I"] and held["W"] == s["steps"][t - 1][w_from]["W"]
    for d in range(devices):  # each output block sums every N slice once
        assert sorted(row[d]["W"][0] for row in s["steps"]) == list(range(q))


def test_schedule_is_computed_from_the_runtime_rule_not_a_copy(monkeypatch):
    # turn the runtime's ring around: the picture turns with it
    monkeypatch.setattr("stpc.viz.rings.ring_peers", lambda i, P: ((i + 1) % P, (i - 1) % P))
    s = viz.schedule_blocks("ag_ring", 4)
    assert [s["steps"][1][i]["I"][0] for i in range(4)] == [3, 0, 1, 2]


def test_schedule_figure_is_a_grid_of_devices_by_steps(tmp_path):
    out = tmp_path / "p2x2.png"
    fig = viz.schedule("p2x2", devices=4, out=out)
    assert out.read_bytes().startswith(PNG)
    assert len(fig.axes) == 4 * 2  # 4 devices x 2 steps
    assert [ax.get_title() for ax in fig.axes[:2]] == ["step 0", "step 1"]
    assert len(viz.schedule("ag_ring", devices=2).axes) == 2 * 2
    with pytest.raises(ValueError, match="4, 16, 64"):
        viz.schedule_blocks("p2x2", 8)
    with pytest.raises(ValueError, match="unknown schedule"):
        viz.schedule_blocks("p3x3", 9)


# ------------------------------------------------------------------ CLI


def test_plan_cli_plot_writes_the_pictures(tmp_path, capsys):
    out = tmp_path / "llama.png"
    rc = cli_plan.main_plan(["--model", "llama-tiny", "--mesh", "4", "--cluster", "cpu-local", "--batch", "8",
                             "--seq", "64", "--brief", "--plot", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    written = viz.plot_paths(out)
    assert [os.path.basename(p) for p in written] == ["llama-memory.png", "llama-layers.png"]
    for p in written:
        assert open(p, "rb").read(8) == PNG and f"wrote {p}" in printed
    assert "--plot FILE.png" in cli_plan.__doc__  # --help shows the module docstring


@pytest.mark.parametrize("rest", [("p2x2",), ("p2x2", "spatial")])
def test_a_loaded_plan_holds_a_jointly_saved_tensor_as_it_was_planned(tg, rest):
    """The norm q, k and v save, q forced to P(2x2) and k, v to ``rest``, read from disk (no
    strategies): the timeline's end of forward is still the model's, as before saving. Before
    the planner's figure went with the plan, a loaded plan drew that tensor at its producer's
    placement: above the model where all three keep their own blocks (it holds none), below
    it where one does not (it charges the largest placement for each such saver)."""
    from stpc.planner import Hints

    hints = Hints(force=[(r"q_proj$", lambda s: s.kind == "p2x2"),
                         (r"(k_proj|v_proj)$", lambda s: s.kind in rest)], name="qkv")
    plan = search(tg, (4,), cluster="cpu-local", hints=hints)
    joint = plan.stats["jointly_saved_bytes"]
    assert joint and all(isinstance(v, int) for v in joint.values())
    assert (set(joint.values()) == {0}) == (rest == ("p2x2",))
    want = breakdown(plan)["activation_bytes"]
    assert _close(viz.memory_timeline(plan)["activations"][-1], want)
    loaded = Plan.from_json(plan.to_json())
    assert loaded.solved is None and loaded.stats["jointly_saved_bytes"] == joint
    assert _close(viz.memory_timeline(loaded, tg)["activations"][-1], want)
    del loaded.stats["jointly_saved_bytes"]  # (a plan saved before the figure was kept)
    old = viz.memory_timeline(loaded, tg)["activations"][-1]
    assert old > want * (1 + 1e-6) if rest == ("p2x2",) else old < want * (1 - 1e-6)
