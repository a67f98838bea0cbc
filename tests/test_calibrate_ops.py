"""The ops that are not GEMMs: each probe is the op the planner sees, and its measured
slowdown over the roofline reaches every place the planner charges that op."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from stpc.cli.calibrate import OPTIMIZER_NUMEL, OPTIMIZER_SHAPES
from stpc.cli.calibrate_ops import PROBES, fit_op_slowdown, probe_facts, probe_step, roofline_seconds
from stpc.cost_models import CostModel, get_cluster
from stpc.cost_models.compute import (COPY_OP, FUSED_OPTIMIZER_OP, GELU_TANH_OP, MASKED_ATTENTION_OP, OPTIMIZER_OP,
                                      OPTIMIZER_STEP_BYTES,
                                      optimizer_step_time, roofline, slowdown)
from stpc.frontend import models
from stpc.frontend.trace import trace
from stpc.planner.costs import NodeTimer, param_copy_phases, slowdown_key
from stpc.planner import plan_graph, preset, search
from stpc.planner.summary import breakdown
from stpc.planner.hints import fsdp_tp


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.op)
def test_each_probe_traces_to_its_one_op_and_runs_forward_and_backward(probe):
    flops, moved = probe_facts(probe)
    assert moved > 0
    if probe.op == "aten.scaled_dot_product_attention.default":
        b, h, s, d = 2, 8, 512, 64
        assert flops == pytest.approx(2 * 2 * b * h * s * s * d)  # QK^T and PV, torch's formula
    step = probe_step(probe, torch.device("cpu"))
    step()  # forward and backward, no error


def test_fit_op_slowdown_divides_the_measurement_by_the_roofline_the_planner_charges():
    dev = get_cluster("cpu-local").device
    facts = {"aten.gelu.default": (0.0, 8e6), "aten.scaled_dot_product_attention.default": (1e9, 8e6)}
    measured = {"aten.gelu.default": 0.004, "aten.scaled_dot_product_attention.default": 0.09}
    got = fit_op_slowdown(measured, facts, dataclasses.replace(dev, op_slowdown={"aten.gelu.default": 9.0}))
    gelu = 8e6 / dev.mem_bw + 16e6 / dev.mem_bw  # forward over its bytes, backward over twice them
    assert got["aten.gelu.default"]["roofline_s"] == pytest.approx(gelu)  # (the device's own factor ignored)
    assert got["aten.gelu.default"]["slowdown"] == pytest.approx(0.004 / gelu)
    sdpa = roofline_seconds(dev, 1e9, 8e6)
    assert sdpa == pytest.approx(max(1e9 / dev.achievable_flops(), 8e6 / dev.mem_bw)
                                 + max(1e9 / dev.achievable_flops(), 16e6 / dev.mem_bw))
    assert got["aten.scaled_dot_product_attention.default"]["slowdown"] == pytest.approx(0.09 / sdpa)


def test_a_measured_slowdown_scales_the_planned_time_of_that_op_only():
    """Each op's factor reaches the plan's time of its nodes and no other's; gpt-tiny's gelu
    (tanh, a follower of the planner) takes its variant's factor where the device has one,
    gelu's where it has only that."""
    base = get_cluster("cpu-local")
    factors = {"aten.gelu.default": 5.0, "aten.scaled_dot_product_attention.default": 3.0}
    slow = dataclasses.replace(base, device=dataclasses.replace(base.device, op_slowdown=factors))
    tanh = dataclasses.replace(base, device=dataclasses.replace(base.device, op_slowdown={**factors, GELU_TANH_OP: 7.0}))
    assert roofline(slow.device, 0, 1e6, op="aten.gelu.default") == pytest.approx(5 * roofline(base.device, 0, 1e6))
    assert CostModel(slow, (2,)).compute(0, 1e6, op="aten.mul.Tensor") == CostModel(base, (2,)).compute(0, 1e6)
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = trace(m, models.example_inputs(models.get_config("gpt-tiny"), 4, 16))
    times = {}
    for name, cl in (("base", base), ("slow", slow), ("tanh", tanh)):  # one plan (the dp preset), costed on each
        p = plan_graph(tg, CostModel(cl, (2,)), hints=preset("dp", (2,)))
        times[name] = {n: (np_.op, np_.time_s) for n, np_ in p.nodes.items()}
    for name, gelu in (("slow", 5.0), ("tanh", 7.0)):
        for node, (op, t) in times["base"].items():
            factor = {"gelu.default": gelu, "scaled_dot_product_attention.default": 3.0}.get(op, 1.0)
            assert times[name][node][1] == pytest.approx(factor * t, rel=1e-9, abs=1e-15), (name, node, op)
    assert any(op == "gelu.default" and t > 0 for op, t in times["base"].values())  # a follower, charged


def test_masked_attention_has_its_own_slowdown_and_falls_back_to_attentions():
    """BLOOM's ALiBi attention (a mask) and causal attention run other kernels: each node is
    charged its own variant's factor where the device has one (Hopper's presets, measured),
    the plain op's where it has only that (a CPU calibration probes causal attention)."""
    sdpa = "aten.scaled_dot_product_attention.default"
    nodes = {}
    for name, kw in (("bloom-tiny", {"position": "alibi", "embed_norm": True}), ("gpt-tiny", {})):
        with torch.device("meta"):
            m = models.build("gpt-tiny", **kw)
        tg = trace(m, models.example_inputs(models.get_config("gpt-tiny"), 2, 16))
        nodes[name] = next(n for n in tg.gm.graph.nodes if str(n.target) == sdpa)
    assert slowdown_key(nodes["bloom-tiny"]) == MASKED_ATTENTION_OP and slowdown_key(nodes["gpt-tiny"]) == sdpa
    base = get_cluster("cpu-local")
    both = dataclasses.replace(base, device=dataclasses.replace(base.device, op_slowdown={sdpa: 2.0,
                                                                                         MASKED_ATTENTION_OP: 7.0}))
    plain = dataclasses.replace(base, device=dataclasses.replace(base.device, op_slowdown={sdpa: 2.0}))
    for name, want_both, want_plain in (("bloom-tiny", 7.0, 2.0), ("gpt-tiny", 2.0, 2.0)):
        node = nodes[name]
        t = {label: sum(NodeTimer(node, CostModel(cl, (1,)), [True] * 3).phases(1))
             for label, cl in (("base", base), ("both", both), ("plain", plain))}
        assert t["both"] == pytest.approx(want_both * t["base"]) and t["plain"] == pytest.approx(want_plain * t["base"])
    hopper = get_cluster("dgx-h100").device
    assert slowdown(hopper, MASKED_ATTENTION_OP) > slowdown(hopper, sdpa) > 1.0  # measured on an H200
    assert slowdown(get_cluster("primepar-v100").device, MASKED_ATTENTION_OP) == 1.0  # unmeasured: the roofline


def test_gelus_tanh_approximation_has_its_own_slowdown_and_falls_back_to_gelus():
    """GPT-2's gelu (tanh, stpc's GPT models) and the exact one (erf) are one aten op run by
    other kernels: each node is charged its own variant's factor where the device has one,
    the plain op's where it has only that; the probe times the variant the models run."""
    gelu = "aten.gelu.default"
    nodes = {}
    for approximate in ("tanh", "none"):
        tg = trace(nn.GELU(approximate=approximate).to("meta"), (torch.empty(2, 8, device="meta"),))
        nodes[approximate] = next(n for n in tg.gm.graph.nodes if str(n.target) == gelu)
    assert slowdown_key(nodes["tanh"]) == GELU_TANH_OP and slowdown_key(nodes["none"]) == gelu
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = trace(m, models.example_inputs("gpt-tiny", 2, 16))
    assert {slowdown_key(n) for n in tg.gm.graph.nodes if str(n.target) == gelu} == {GELU_TANH_OP}
    assert GELU_TANH_OP in {p.op for p in PROBES}
    base = get_cluster("cpu-local")
    both = dataclasses.replace(base, device=dataclasses.replace(base.device, op_slowdown={gelu: 2.0, GELU_TANH_OP: 5.0}))
    plain = dataclasses.replace(base, device=dataclasses.replace(base.device, op_slowdown={gelu: 2.0}))
    for approximate, want_both in (("tanh", 5.0), ("none", 2.0)):
        node = nodes[approximate]
        t = {label: sum(NodeTimer(node, CostModel(cl, (1,)), [True]).phases(1))
             for label, cl in (("base", base), ("both", both), ("plain", plain))}
        assert t["base"] > 0
        assert t["both"] == pytest.approx(want_both * t["base"]) and t["plain"] == pytest.approx(2.0 * t["base"])


@pytest.mark.parametrize("probe", [p for p in PROBES if p.op in ("aten.gelu.default", GELU_TANH_OP, "aten.layer_norm.default",
                                                                 "aten.scaled_dot_product_attention.default")],
                         ids=lambda p: p.op)
def test_the_roofline_a_probe_is_divided_by_is_what_the_planner_charges_its_node(probe):
    # roofline_seconds restates NodeTimer's phases of an op that is not a GEMM (forward over
    # its bytes, backward over twice them): held to the planner's own timer on the traced node
    meta = torch.device("meta")
    tg = trace(probe.module().to(meta), probe.inputs(meta))
    node = next(n for n in tg.gm.graph.nodes if n.op == "call_function" and slowdown_key(n) == probe.op)
    cl = get_cluster("cpu-local")
    fwd, bwd, grad = NodeTimer(node, CostModel(cl, (1,)), [True] * len(node.all_input_nodes)).phases(1)
    assert fwd + bwd + grad == pytest.approx(roofline_seconds(cl.device, *probe_facts(probe)), rel=1e-12)


def test_the_runtimes_parameter_copies_are_charged_on_the_ranks_own_thread():
    # A ZeRO weight (stored S0, read R): the gathered buffer cut into the parameter in forward
    # and again for backward's re-gather, and the gradient laid out rank-major: three copies
    # of the gathered bytes; kept gathered (ZeRO-2), two. A replicated weight whose gradient
    # is summed: one, into its bucket. Nothing else, and nothing on an axis of size 1.
    base = get_cluster("cpu-local")
    slow = dataclasses.replace(base, device=dataclasses.replace(base.device, op_slowdown={COPY_OP: 3.0}))
    n = 8e6
    for cl in (base, slow):
        cm = CostModel(cl, (4, 1))
        one = cm.copy(n)
        assert one == pytest.approx(2 * n / cl.device.mem_bw * cl.device.op_slowdown.get(COPY_OP, 1.0))
        assert param_copy_phases(cm, 0, "S0", "R", n, True, True, regather=True) == pytest.approx((one, 2 * one))
        assert param_copy_phases(cm, 0, "S0", "R", n, True, True, regather=False) == pytest.approx((one, one))
        assert param_copy_phases(cm, 0, "S0", "R", n, True, False, regather=True) == (one, 0.0)
        assert param_copy_phases(cm, 0, "R", "R", n, True, True) == (0.0, one)
        assert param_copy_phases(cm, 0, "R", "R", n, False, True) == (0.0, 0.0)
        assert param_copy_phases(cm, 0, "S0", "S0", n, True, True) == (0.0, 0.0)
        assert param_copy_phases(cm, 1, "S0", "R", n, True, True, regather=True) == (0.0, 0.0)
    # the planner adds them, not overlapped, to a ZeRO plan's parameter edges
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = trace(m, models.example_inputs(models.get_config("gpt-tiny"), 4, 16))
    steps = {name: plan_graph(tg, CostModel(cl, (2,)), hints=fsdp_tp((2,), 0)).modelled_step_time_s
             for name, cl in (("base", base), ("slow", slow))}
    assert steps["slow"] > steps["base"]


def test_the_optimizer_step_is_charged_at_its_measured_slowdown_and_planned_with_it():
    assert OPTIMIZER_NUMEL == sum(torch.empty(s, device="meta").numel() for s in OPTIMIZER_SHAPES)
    base = get_cluster("cpu-local")
    fast = dataclasses.replace(base, device=dataclasses.replace(base.device, op_slowdown={OPTIMIZER_OP: 0.5}))
    n = 4e6
    plain = n * OPTIMIZER_STEP_BYTES["fp32-adam"] / base.device.mem_bw
    assert optimizer_step_time(base.device, n) == pytest.approx(plain)   # no profile: the roofline
    assert optimizer_step_time(fast.device, n) == pytest.approx(0.5 * plain)
    # the planner's step carries it: data parallel holds every parameter's state on each rank
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = trace(m, models.example_inputs("gpt-tiny", 4, 16))
    steps = [breakdown(search(tg, (2,), cluster=cl, hints="dp"))["optimizer_step_s"] for cl in (base, fast)]
    assert steps[1] == pytest.approx(0.5 * steps[0]) and steps[0] > 0


def test_a_fused_adamw_step_is_charged_its_own_bytes_and_slowdown_and_planned_with_them():
    """``optimizer_impl="fused"`` (``AdamW(fused=True)``): one pass of 28 B per element where
    foreach makes eight of 80 B, at the fused probe's own slowdown (a profile without it falls
    back to the foreach step's), no scratch in the step's memory (its phase holds backward's end
    then: the tied table's gradient twice more, its two readers' beside their sum, less than
    foreach's scratch; under ZeRO-3, where no gradient is summed over ranks, the same two at the
    table's stored shard); every plan of a search is charged so, and the plan says which
    implementation it was costed for."""
    base = get_cluster("cpu-local")
    n = 4e6
    assert optimizer_step_time(base.device, n, impl="fused") == pytest.approx(n * 28 / base.device.mem_bw)
    assert optimizer_step_time(base.device, n, impl="single") == optimizer_step_time(base.device, n)
    only_foreach = dataclasses.replace(base.device, op_slowdown={OPTIMIZER_OP: 0.5})
    both = dataclasses.replace(base.device, op_slowdown={OPTIMIZER_OP: 0.5, FUSED_OPTIMIZER_OP: 0.25})
    assert optimizer_step_time(only_foreach, n, impl="fused") == pytest.approx(0.5 * n * 28 / base.device.mem_bw)
    assert optimizer_step_time(both, n, impl="fused") == pytest.approx(0.25 * n * 28 / base.device.mem_bw)
    assert optimizer_step_time(both, n) == pytest.approx(0.5 * n * 80 / base.device.mem_bw)
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = trace(m, models.example_inputs("gpt-tiny", 4, 16))
    plans = {impl: search(tg, (2,), cluster=base, hints="dp", optimizer_impl=impl) for impl in ("foreach", "fused")}
    bd = {impl: breakdown(p) for impl, p in plans.items()}
    assert bd["fused"]["optimizer_step_s"] == pytest.approx(bd["foreach"]["optimizer_step_s"] * 28 / 80)
    table = 4 * max(p.numel() for p in m.parameters())  # (fp32: the tied table's gradient)
    assert tg.tied_params  # (the LM head reads the embedding's table)
    assert bd["fused"]["step_scratch_bytes"] == pytest.approx(2 * table, abs=64)
    assert 0 < bd["fused"]["step_scratch_bytes"] < bd["foreach"]["step_scratch_bytes"]
    zero3 = search(tg, (2,), cluster=base, hints="fsdp-tp", optimizer_impl="fused")
    assert zero3.stats["layout"]["zero"] == 3
    assert breakdown(zero3)["step_scratch_bytes"] == pytest.approx(2 * table / 2, abs=64)
    assert plans["fused"].modelled_step_time_s < plans["foreach"].modelled_step_time_s
    assert [p.stats["optimizer"] for p in plans.values()] == [{"layout": "fp32-adam", "impl": "foreach"},
                                                              {"layout": "fp32-adam", "impl": "fused"}]
    with pytest.raises(ValueError, match="unknown optimizer implementation 'adam8bit'"):
        search(tg, (2,), cluster=base, hints="dp", optimizer_impl="adam8bit")
