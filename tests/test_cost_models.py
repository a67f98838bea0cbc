"""Unit tests of stpc.cost_models: formulas, mesh/link mapping, profiles, memory."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import warnings

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stpc import models
from stpc.cost_models import (CLUSTERS, OVERLAP_COMPUTE_SLOWDOWN, Cluster, CostModel, DeviceSpec, Link,
                              MemoryModel, exposed, fit_alpha_beta, fit_gemm_curve, gemm_time, get_cluster,
                              fresh_alloc_time, get_device, load_profile, matmul_phase_cost, optimizer_state_bytes, roofline,
                              save_profile)
from stpc.cost_models.cluster import RING_STEP_OVERHEAD_S, USABLE_MEMORY_FRACTION
from stpc.cost_models.devices import HOPPER_GEMM_EFFICIENCY, HOPPER_GEMM_RAMP_S
from stpc.planner.costs import axis_reshard, grid_relayout_s
from stpc.cost_models.estimator import closed_form_memory
from stpc.cost_models.memory import adamw_step_transient_bytes, training_step_peak
from stpc.cost_models.profile import fit_bands, predict


def _cluster(nodes=4, dpn=8, a_i=2e-6, bw_i=100e9, a_o=10e-6, bw_o=10e9):
    return Cluster("t", get_device("H100-SXM"), nodes, dpn, Link(a_i, bw_i), Link(a_o, bw_o))


# ----------------------------------------------------------------------------- ring formulas


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_volumes_reduce_to_known_fractions(n):
    bw, N = 50e9, 3e8
    cm = CostModel(Cluster("t", get_device("A100"), 1, 8, Link(0.0, bw), Link(0.0, bw)), (n,))
    # With alpha = 0 the time is bytes moved per rank / bandwidth (nccl-tests busbw factors).
    assert cm.all_gather(N, 0) == pytest.approx((n - 1) / n * N / bw)
    assert cm.reduce_scatter(N, 0) == pytest.approx((n - 1) / n * N / bw)
    assert cm.all_reduce(N, 0) == pytest.approx(2 * (n - 1) / n * N / bw)
    assert cm.all_to_all(N, 0) == pytest.approx((n - 1) / n * (N / n) / bw)
    # a redistribution by slice overlap: the busiest rank's share of its piece
    assert cm.all_to_all(N, 0, (n - 1) / n) == pytest.approx(cm.all_to_all(N, 0))
    assert cm.all_to_all(N, 0, 0.5) == pytest.approx(0.5 * (N / n) / bw)
    assert cm.p2p(N, 0) == pytest.approx(N / bw)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_latency_terms(n):
    a = 7e-6
    cm = CostModel(Cluster("t", get_device("A100"), 1, 8, Link(a, 1e9), Link(a, 1e9)), (n,))
    assert cm.all_gather(0, 0) == pytest.approx((n - 1) * a)
    assert cm.all_reduce(0, 0) == pytest.approx(2 * (n - 1) * a)
    assert cm.p2p(0, 0) == pytest.approx(a)


def test_size_one_axis_is_free():
    cm = CostModel(get_cluster("dgx-h100"), (1, 8))
    for fn in (cm.all_gather, cm.reduce_scatter, cm.all_reduce, cm.all_to_all, cm.p2p):
        assert fn(1e9, 0) == 0.0
        assert fn(1e9, 1) > 0.0


def test_mesh_axes_map_to_links():
    cl = get_cluster("dgx-h100")  # 8 devices per node
    cm = CostModel(cl, (2, 4, 8))
    assert not cm.crosses_nodes(2)  # stride 1, size 8: one node
    assert cm.crosses_nodes(1) and cm.crosses_nodes(0)
    assert cm.axis_link(2) == cl.intra
    # stride 8 >= devices per node: every member on its own node, a plain inter-node ring
    assert cm.axis_link(1).bw_bytes_per_s == pytest.approx(cl.inter.bw_bytes_per_s)
    cm2 = CostModel(cl, (4, 2))  # axis 1 stride 1 size 2, axis 0 stride 2 size 4: 8 ranks in a node
    assert not cm2.crosses_nodes(0) and not cm2.crosses_nodes(1)
    # 3 ranks of stride 1 in 8-device nodes: groups {0,1,2},{3,4,5},{6,7,8} straddle nodes
    assert CostModel(cl, (3, 3)).crosses_nodes(1)


def test_hierarchical_formula():
    cl = _cluster()  # 8 per node
    cm = CostModel(cl, (4, 4))  # axis 0: stride 4, size 4 -> 2 per node on 2 nodes
    N = 1e8
    n_in, n_out = 2, 2
    expect = ((n_in - 1) * 2e-6 + (n_in - 1) / n_in * N / 100e9
              + (n_out - 1) * 10e-6 + (n_out - 1) / n_out * (N / n_in) / 10e9)
    assert cm.all_gather(N, 0) == pytest.approx(expect)
    assert cm.reduce_scatter(N, 0) == pytest.approx(expect)
    assert cm.all_reduce(N, 0) == pytest.approx(2 * expect)
    # Crossing ring P2P pays the slow link.
    assert cm.p2p(N, 0) == pytest.approx(10e-6 + N / 10e9)


@settings(max_examples=200, deadline=None)
@given(n_log=st.integers(1, 3), in_log=st.integers(0, 3), N=st.floats(0, 1e10),
       a_i=st.floats(0, 1e-4), bw_i=st.floats(1e9, 1e12), slow_a=st.floats(1, 100),
       slow_bw=st.floats(1, 100))
def test_cross_node_never_cheaper_than_intra(n_log, in_log, N, a_i, bw_i, slow_a, slow_bw):
    n = 2 ** n_log
    n_in = min(2 ** in_log, n)
    D = 8
    cl = Cluster("t", get_device("V100"), nodes=8, devices_per_node=D, intra=Link(a_i, bw_i),
                 inter=Link(a_i * slow_a, bw_i / slow_bw))
    inside = CostModel(cl, (n,))  # n <= 8 contiguous ranks: one node
    # axis 0 of (n, D // n_in) has stride D // n_in: n_in members per node
    across = CostModel(cl, (n, D // n_in))
    if n_in == n:  # the group fits in a node: nothing to compare
        assert not across.crosses_nodes(0)
        return
    assert across.crosses_nodes(0) and not inside.crosses_nodes(0)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"):
        assert getattr(across, kind)(N, 0) >= getattr(inside, kind)(N, 0) * (1 - 1e-12), kind


def test_ring_step_overlaps_at_the_slowdown_and_pays_its_overhead():
    cl = get_cluster("dgx-h100")
    assert cl.ring_step_overhead_s == RING_STEP_OVERHEAD_S == 20e-6  # the named guess, with its source
    cm = CostModel(cl, (8,))
    s, o = OVERLAP_COMPUTE_SLOWDOWN, RING_STEP_OVERHEAD_S
    assert cm.ring_step(2.0, 3.0) == pytest.approx(3.0 + s * 2.0 + o)  # transfer-bound
    assert cm.ring_step(5.0, 3.0) == pytest.approx(5.0 + s * 3.0 + o)  # compute-bound
    # slowdown 1: nothing overlaps (the step is the sum); 0: perfect overlap
    assert CostModel(cl, (8,), overlap_slowdown=1.0).ring_step(5.0, 3.0) == pytest.approx(8.0 + o)
    assert CostModel(cl, (8,), overlap_slowdown=0.0).ring_step(5.0, 3.0) == pytest.approx(5.0 + o)
    # a cluster's own figures (a calibration profile's) replace the presets'
    measured = dataclasses.replace(cl, overlap_slowdown=0.9, ring_step_overhead_s=1e-3)
    assert CostModel(measured, (8,)).ring_step(5.0, 3.0) == pytest.approx(5.0 + 0.9 * 3.0 + 1e-3)
    # a ring's own measured slowdown (every rank waits at every step) rules its steps; an
    # asynchronous collective keeps the other
    apart = dataclasses.replace(measured, ring_overlap_slowdown=1.5)
    cm2 = CostModel(apart, (8,))
    assert cm2.ring_step(5.0, 3.0) == pytest.approx(5.0 + 1.5 * 3.0 + 1e-3)
    assert cm2.overlapped(3.0, 5.0) == pytest.approx(0.9 * 3.0)
    with pytest.raises(ValueError, match="ring_overlap_slowdown"):
        dataclasses.replace(cl, ring_overlap_slowdown=-0.1)
    assert CostModel(measured, (8,)).overlapped(1.0, 2.0) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="must be >= 0"):
        dataclasses.replace(cl, ring_step_overhead_s=-1.0)


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 10), st.floats(0, 10), st.floats(0, 1))
def test_overlap_exposes_what_compute_cannot_hide(comm, window, slowdown):
    got = exposed(comm, window, slowdown)
    assert min(comm, window) * slowdown + max(comm - window, 0) == pytest.approx(got, abs=1e-12)
    assert 0 <= got <= comm + 1e-12                            # never worse than no overlap
    assert exposed(comm, window, 1.0) == pytest.approx(comm)   # slowdown 1: nothing hidden
    assert exposed(comm, 0.0, slowdown) == pytest.approx(comm)  # no compute beside it


def test_overlap_slowdown_is_the_cited_figure():
    assert OVERLAP_COMPUTE_SLOWDOWN == 0.189
    cm = CostModel(get_cluster("dgx-h100"), (8,))
    assert cm.overlapped(1.0, 2.0) == pytest.approx(0.189)
    assert CostModel(get_cluster("dgx-h100"), (8,), overlap_slowdown=0.5).overlapped(1.0, 2.0) == 0.5


def test_mesh_larger_than_cluster_is_an_error():
    with pytest.raises(ValueError, match="needs 64 devices"):
        CostModel(get_cluster("cpu-local"), (8, 8))
    with pytest.raises(IndexError, match="axis 2"):
        CostModel(get_cluster("cpu-local"), (2, 2)).all_gather(1, 2)


# ----------------------------------------------------------------------------- compute, devices


def test_roofline_bounds():
    d = get_device("H100-SXM")
    # compute bound: huge flops, no bytes
    assert roofline(d, 1e15, 0, "bf16") == pytest.approx(1e15 / (989.4e12 * d.efficiency))
    # memory bound
    assert roofline(d, 1.0, 3.35e12, "bf16") == pytest.approx(1.0)
    assert roofline(d, 1e12, 0, "torch.float32") == roofline(d, 1e12, 0, "fp32")
    with pytest.raises(ValueError, match="unknown dtype"):
        roofline(d, 1, 1, "int8")


def test_a_p2p_gets_the_links_to_its_peer_a_collective_all_of_them():
    v100 = CostModel(get_cluster("primepar-v100"), (4,))
    assert v100.p2p(50e9, 0) == pytest.approx(5e-6 + 1.0)               # two NVLink2 links: 50 GB/s
    assert v100.all_gather(4 * 150e9, 0) == pytest.approx(3 * 5e-6 + 3.0)  # six: 150 GB/s per direction
    h100 = CostModel(get_cluster("dgx-h100"), (8,))
    assert h100.p2p(450e9, 0) == pytest.approx(3e-6 + 1.0)              # NVSwitch: one peer gets it all
    # across nodes a ring step is as slow as its inter-node hop, whatever the peer links
    v100x = CostModel(get_cluster("primepar-v100"), (8,))
    assert v100x.p2p(25e9, 0) == pytest.approx(10e-6 + 1.0)


def test_gemm_efficiency_curve_is_half_a_wave_on_unmeasured_gpus_measured_on_hopper_and_flat_on_the_cpu():
    v100 = get_device("V100")
    # NVIDIA's wave quantization, the unmeasured presets' guess: half a wave of 256x128 tiles
    # at K=4096 on 80 SMs at 75% of the fp16 peak
    assert v100.gemm_ramp_s == pytest.approx(80 * 256 * 128 * 4096 / (125e12 * 0.75))
    # Hopper's curve is the H200's measured one (benchmarks/gemm_curve_check.py), on the H100 too
    d = get_device("H100-SXM")
    assert (d.efficiency, d.gemm_ramp_s) == (get_device("H200").efficiency, get_device("H200").gemm_ramp_s)
    assert (d.efficiency, d.gemm_ramp_s) == (HOPPER_GEMM_EFFICIENCY, HOPPER_GEMM_RAMP_S)
    rate = 989.4e12 * d.efficiency
    half = rate * d.gemm_ramp_s
    # half the large-GEMM rate at f = rate * ramp: twice the roofline's time
    assert gemm_time(d, half, 0, "bf16") == pytest.approx(2 * roofline(d, half, 0, "bf16"))
    assert gemm_time(d, 1e15, 0, "bf16") < 1.01 * roofline(d, 1e15, 0, "bf16")   # large GEMMs: the roofline
    assert gemm_time(d, 1.0, 3.35e12, "bf16") == pytest.approx(1.0)   # memory-bound stays so
    assert get_device("V100").gemm_ramp_s > get_device("H100-SXM").gemm_ramp_s > 0  # fewer SMs, slower rate
    assert get_device("CPU").gemm_ramp_s == 0.0 and gemm_time(get_device("CPU"), 1e9, 0) == roofline(
        get_device("CPU"), 1e9, 0)
    with pytest.raises(ValueError, match="gemm_ramp_s"):
        dataclasses.replace(d, gemm_ramp_s=-1.0)
    with pytest.raises(ValueError, match="gemm_ramps"):
        dataclasses.replace(d, gemm_ramps={"bf16": -1e-6})


def test_fit_gemm_curve_recovers_rate_and_ramp_and_reads_no_ramp_into_a_flat_curve():
    rows = [{"m": m, "n": m, "k": m, "seconds": 2.0 * m ** 3 / 1e11 + 40e-6} for m in (128, 256, 512, 1024)]
    rate, ramp = fit_gemm_curve(rows)
    assert rate == pytest.approx(1e11, rel=1e-6) and ramp == pytest.approx(40e-6, rel=1e-6)
    # timing noise that puts the intercept below zero is no ramp, not a negative one
    flat = [{"m": m, "n": m, "k": m, "seconds": 2.0 * m ** 3 / 1e11 * (1.02 if m == 128 else 1.0) - 1e-6}
            for m in (128, 256, 512)]
    rate, ramp = fit_gemm_curve(flat)
    assert ramp == 0.0 and rate == pytest.approx(1e11, rel=0.02)


def test_matmul_phases():
    d = get_device("A100-80GB")
    pc = matmul_phase_cost(d, 8192, 4096, 4096, "bf16")
    t = 2 * 8192 * 4096 * 4096 / (312e12 * d.efficiency)
    assert pc.fwd == pytest.approx(t) and pc.bwd == pytest.approx(t) and pc.grad == pytest.approx(t)
    assert pc.total == pytest.approx(3 * t)
    skinny = matmul_phase_cost(d, 1, 4096, 4096, "bf16")  # a GEMV is bandwidth bound
    assert skinny.fwd == pytest.approx(2 * (4096 + 4096 * 4096 + 4096) / 2.039e12)


def test_devices_and_clusters():
    assert set(CLUSTERS) >= {"primepar-v100", "dgx-h100", "cpu-local"}
    assert get_cluster("primepar-v100").num_devices == 32
    assert get_device("v100").peak_flops["fp16"] > get_device("v100").peak_flops["fp32"]
    assert get_device("H200").mem_bytes > get_device("H100-SXM").mem_bytes
    with pytest.raises(KeyError, match="unknown device"):
        get_device("tpu")
    with pytest.raises(KeyError, match="not a preset"):
        get_cluster("nope")
    with pytest.raises(ValueError, match="lacks"):
        DeviceSpec("x", {"fp32": 1.0}, 1.0, 1.0)
    cm = CostModel(get_cluster("primepar-v100"), (8, 4))
    assert cm.device_memory_bytes == 32 * 2**30   # sold as "32GB": binary gigabytes
    assert get_cluster("primepar-v100").default_budget_bytes == pytest.approx(USABLE_MEMORY_FRACTION * 32 * 2**30)
    with pytest.raises(ValueError, match="usable_memory_fraction"):
        dataclasses.replace(get_cluster("dgx-h100"), usable_memory_fraction=1.5)


# ----------------------------------------------------------------------------- profiles


def test_fit_recovers_alpha_beta_and_roundtrips(tmp_path):
    n, alpha, bw = 4, 30e-6, 2e9
    sizes = [1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]
    samples = [(k, s, predict(k, n, s, alpha, bw)) for k in ("all_gather", "p2p", "all_reduce") for s in sizes]
    a, b, err = fit_alpha_beta(samples, n)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6) and err < 1e-9

    # A transport that gets slower per byte as messages grow (gloo over loopback past the
    # CPU caches): the bands follow it, one straight line cannot.
    sizes6 = sizes + [1 << 26]
    ag = [("all_gather", s, predict("all_gather", n, s, 1e-4, 2e9) * (1 + 0.3 * (s / (1 << 20)) ** 0.5))
          for s in sizes6]
    bands = fit_bands(ag, n)
    assert [u for u, _, _ in bands] == sizes6[1:]
    la, lbw, _ = fit_alpha_beta(ag, n)
    line_err = max(abs(predict("all_gather", n, s, la, lbw) / t - 1) for _, s, t in ag)
    prof = {"version": 1, "name": "synthetic", "ranks": n, "backend": "gloo",
            "device": {"name": "cpu-x", "peak_flops": {d: 1e11 for d in ("fp32", "tf32", "bf16", "fp16")},
                       "mem_bw": 1e10, "mem_bytes": 1e10, "efficiency": 1.0},
            "link": {"alpha_s": alpha, "bw_bytes_per_s": bw},
            "collectives": {"all_gather": {"alpha_s": 1e-4, "bw_bytes_per_s": 2e9, "bands": bands},
                            "p2p": {"alpha_s": alpha, "bw_bytes_per_s": bw}}}
    path = str(tmp_path / "p.json")
    save_profile(prof, path)
    cl = get_cluster(path)
    assert cl.num_devices == n and cl.device.peak_flops["bf16"] == 1e11
    cm = CostModel(cl, (n,))
    band_err = max(abs(cm.all_gather(s, 0) / t - 1) for _, s, t in ag)
    assert band_err < 0.2 < 0.3 < line_err
    assert cm.p2p(1e6, 0) == pytest.approx(alpha + 1e6 / bw)
    assert cm.reduce_scatter(1e6, 0) == pytest.approx(3 * alpha + 0.75e6 / bw)  # falls back to the joint link
    # a profile without the overlap figures (written before they were measured) gets the presets';
    # with them, its own
    assert (cl.overlap_slowdown, cl.ring_step_overhead_s) == (None, RING_STEP_OVERHEAD_S)
    save_profile({**prof, "overlap": {"slowdown": 0.97, "ring_step_overhead_s": 4e-4}}, path)
    # (ring figures fitted before a ring was costed step by step, n - 1 blocks moved: said, and how to refit)
    with pytest.warns(UserWarning, match="--probe overlap"):
        cm = CostModel(get_cluster(path), (n,))
    # (one slowdown, measured on a ring before the asynchronous one was told apart: both)
    assert (cm.overlap_slowdown, cm.ring_overlap_slowdown, cm.ring_step_overhead_s) == (0.97, 0.97, 4e-4)
    save_profile({**prof, "overlap": {"slowdown": 0.1, "ring_slowdown": 1.2, "ring_step_overhead_s": 4e-4,
                                      "ring_ranks": n}}, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # fitted as rings are costed now: nothing to say
        cm = CostModel(get_cluster(path), (n,))
    assert (cm.overlap_slowdown, cm.ring_overlap_slowdown) == (0.1, 1.2)
    # a blocking collective's synchronisation measured against the slowest rank's compute: said
    ring = {"slowdown": 0.1, "ring_slowdown": 1.2, "ring_step_overhead_s": 4e-4, "ring_ranks": n}
    save_profile({**prof, "overlap": {**ring, "collective_sync_s": 3e-3, "blocking": {"gemms_s": 0.07}}}, path)
    with pytest.warns(UserWarning, match="typical rank's.*--probe overlap"):
        get_cluster(path)
    save_profile({**prof, "overlap": {**ring, "collective_sync_s": 3e-3, "blocking": {"reference": "typical rank"}}},
                 path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_cluster(path).collective_sync_s == 3e-3
        assert get_cluster(path).ring_sync_s is None     # (measured before it was: the stretch's)
    save_profile({**prof, "overlap": {**ring, "collective_sync_s": 3e-3, "ring_sync_s": 1e-3,
                                      "blocking": {"reference": "typical rank"}}}, path)
    assert CostModel(get_cluster(path), (n,)).ring_sync_s == 1e-3
    with pytest.raises(FileNotFoundError, match="stpc calibrate"):
        load_profile(str(tmp_path / "missing.json"))
    # the GEMM curve a calibration fitted: fp32's ramp for every dtype, each dtype's own where fitted
    assert cl.device.gemm_ramp_s == 0.0
    save_profile({**prof, "device": {**prof["device"], "gemm_ramp_s": 5e-6, "gemm_ramps": {"bf16": 3e-5}}}, path)
    d = get_cluster(path).device
    assert (d.ramp_s("fp32"), d.ramp_s("bf16"), d.ramp_s("fp16")) == (5e-6, 3e-5, 5e-6)


def test_group_size_bands_cost_the_axes_of_that_size(tmp_path):
    """A profile's collectives timed on pairs (every pair at once) cost a mesh's axes of 2 ranks;
    the axes of the whole node keep the node's bands; an older profile without them costs pairs
    by the node's bands through the ring formula."""
    from stpc.cli.calibrate import sub_group_sizes

    assert sub_group_sizes(4) == [2] and sub_group_sizes(8) == [2, 4] and sub_group_sizes(2) == []
    assert sub_group_sizes(6) == [2, 3]
    sizes = [1 << 20, 1 << 22, 1 << 24]
    world = [("all_gather", s, predict("all_gather", 4, s, 1e-4, 1e9)) for s in sizes]
    pairs = [("all_gather", s, predict("all_gather", 2, s, 2e-4, 4e8)) for s in sizes]  # slower per byte
    prof = {"version": 1, "name": "synthetic-groups", "ranks": 4, "backend": "gloo",
            "device": {"name": "cpu-x", "peak_flops": {d: 1e11 for d in ("fp32", "tf32", "bf16", "fp16")},
                       "mem_bw": 1e10, "mem_bytes": 1e10, "efficiency": 1.0},
            "link": {"alpha_s": 1e-4, "bw_bytes_per_s": 1e9},
            "collectives": {"all_gather": {"alpha_s": 1e-4, "bw_bytes_per_s": 1e9, "bands": fit_bands(world, 4)}}}
    path = str(tmp_path / "old.json")
    save_profile(prof, path)
    old = CostModel(get_cluster(path), (2, 2))
    s = 1 << 23
    assert old.all_gather(s, 1) == pytest.approx(predict("all_gather", 2, s, 1e-4, 1e9), rel=1e-6)
    save_profile({**prof, "group_collectives": {"2": {"all_gather": {
        "alpha_s": 2e-4, "bw_bytes_per_s": 4e8, "bands": fit_bands(pairs, 2)}}}}, str(tmp_path / "new.json"))
    cl = get_cluster(str(tmp_path / "new.json"))
    pair, node = CostModel(cl, (2, 2)), CostModel(cl, (4,))
    for axis in (0, 1):
        assert pair.all_gather(s, axis) == pytest.approx(predict("all_gather", 2, s, 2e-4, 4e8), rel=1e-6)
    assert node.all_gather(s, 0) == pytest.approx(predict("all_gather", 4, s, 1e-4, 1e9), rel=1e-6)
    # a kind the pairs were not timed on falls back to the node's figures
    assert pair.reduce_scatter(s, 1) == pytest.approx(old.reduce_scatter(s, 1))


def test_blocks_posted_to_two_peers_at_once_share_the_port_unless_each_peer_has_links_of_its_own():
    """``CostModel.p2p_to_peers`` (a P(2x2) step's two blocks): on the 4-V100 board every pair
    has NVLinks of its own, so the longer transfer; through a switch (DGX H100), across nodes,
    or on a calibrated machine (one measured P2P line: loopback TCP here), one message of the
    bytes together."""
    mib = 2**20
    v100 = CostModel(get_cluster("primepar-v100"), (4,))
    assert v100.own_peer_links(0)
    assert v100.p2p_to_peers((2 * mib, mib), 0) == pytest.approx(v100.p2p(2 * mib, 0))
    h100 = CostModel(get_cluster("dgx-h100"), (4,))
    assert not h100.own_peer_links(0)
    assert h100.p2p_to_peers((2 * mib, mib), 0) == pytest.approx(h100.p2p(3 * mib, 0))
    across = CostModel(get_cluster("primepar-v100"), (8, 4))   # axis 0 joins the nodes
    assert not across.own_peer_links(0) and across.own_peer_links(1)
    assert across.p2p_to_peers((mib, mib), 0) == pytest.approx(across.p2p(2 * mib, 0))
    measured = dataclasses.replace(get_cluster("primepar-v100"), collective_links={"p2p": Link(1e-4, 1e9)})
    assert not CostModel(measured, (4,)).own_peer_links(0)
    assert h100.p2p_to_peers((0.0,), 0) == 0.0


def test_fit_overlap_reads_overhead_from_the_tiny_ring_and_slowdown_from_the_long_one():
    """The probe's ring is read as the planner costs a ring (``CostModel.ring``): of its W
    steps all but the last move a block, each step paying the overhead."""
    from stpc.cli.calibrate import fit_overlap

    o, slowdown, W = 3e-4, 0.8, 4
    gemm, p2p = 0.010, 0.004  # a long step: the transfer hides behind the GEMM, at the slowdown
    tiny = (1e-6, 1e-4)

    def per_step(g, c, moved_step):  # the ring's time over its W steps, as the probe stores it
        return ((W - 1) * moved_step + g + o) / W

    ranks = [{"long": (gemm, p2p, per_step(gemm, p2p, gemm + slowdown * p2p + o)),
              "tiny": (*tiny, per_step(*tiny, sum(tiny) + o))},
             {"long": (gemm * 0.9, p2p, gemm * 0.9 + p2p / 2), "tiny": (*tiny, sum(tiny))},  # a faster rank
             {"long": (gemm * 0.9, p2p, gemm * 0.9 + p2p / 2), "tiny": (*tiny, sum(tiny))},
             {"long": (gemm * 0.9, p2p, gemm * 0.9 + p2p / 2), "tiny": (*tiny, sum(tiny))}]
    got = fit_overlap(ranks)  # the slowest rank's times; a ring of as many ranks as reported
    assert got["ring_step_overhead_s"] == pytest.approx(o)
    assert got["slowdown"] == pytest.approx(slowdown) and got["ring_ranks"] == W
    # the ring the planner costs with these figures takes the probe's time back
    cm = CostModel(dataclasses.replace(get_cluster("cpu-local"), ring_overlap_slowdown=got["ring_slowdown"],
                                       ring_step_overhead_s=got["ring_step_overhead_s"]), (W,))
    assert cm.ring(gemm, [p2p] * (W - 1) + [0.0]) == pytest.approx(W * ranks[0]["long"][2])
    # noise below the ideal overlap does not make a negative slowdown or overhead
    quiet = fit_overlap([{"long": (gemm, p2p, gemm * 0.99), "tiny": (*tiny, 0.5 * sum(tiny))}], world=W)
    assert quiet["slowdown"] == 0.0 and quiet["ring_step_overhead_s"] == 0.0
    with pytest.raises(ValueError, match="at least 2"):
        fit_overlap([ranks[0]])


def test_fit_grid_reads_the_p2x2_op_as_the_planner_costs_it():
    """The P(2x2) probe (``calibrate._grid_times``): the op's forward + backward against its
    GEMMs and its transfers alone, read as ``CostModel.ring`` costs the op's 3q steps (each
    its overhead; the moving ones their transfer times the grid's slowdown, the GEMMs
    outlasting them); per round the slowest rank's parts, then the median over rounds. The
    overlap fit takes it where every rank ran it, with the tiny ring's overhead."""
    from stpc.cli.calibrate import fit_grid, fit_overlap

    o, W, q = 2e-4, 4, 2
    rounds = [(0.140 * f, 0.022 * f, 0.140 * f + s * 0.022 * f + 3 * q * o)
              for f, s in zip([1.0, 1.5, 1.0, 1.2, 1.0], [1.4, 1.6, 1.5, 9.0, 1.5])]
    faster = [(g * 0.9, c, g * 0.9 + c) for g, c, _ in rounds]
    got = fit_grid([rounds, faster, faster, faster], o, W)
    assert got["slowdown"] == pytest.approx(1.5) and got["grid"] == 2 and got["rounds"] == 5
    assert got["gemms_s"] == pytest.approx(0.140) and got["transfers_s"] == pytest.approx(0.022)
    # noise below a free overlap does not make a negative figure
    assert fit_grid([[(0.14, 0.02, 0.13)]], o, W)["slowdown"] == 0.0
    with pytest.raises(ValueError, match="no P\\(2\\^k x 2\\^k\\) grid"):
        fit_grid([rounds], o, 8)
    tiny = (1e-6, 1e-4, ((W - 1) * (1e-4 + 1e-6 + o) + 1e-6 + o) / W)
    long = (0.02, 0.004, 0.025)
    ov = fit_overlap([{"long": long, "tiny": tiny, "grid": rounds}] * W)
    assert ov["ring_step_overhead_s"] == pytest.approx(o) and ov["grid_slowdown"] == pytest.approx(1.5)
    assert "grid_slowdown" not in fit_overlap([{"long": long, "tiny": tiny, "grid": None}] * W)
    # what the planner charges a P(2x2) op with these figures takes the probe's time back
    cl = dataclasses.replace(get_cluster("cpu-local"), ring_overlap_slowdown=ov["ring_slowdown"],
                             grid_overlap_slowdown=ov["grid_slowdown"], ring_step_overhead_s=o)
    cm = CostModel(cl, (W,))
    g, c = 0.140 / (3 * q), 0.022 / (3 * q - 2)
    assert cm.ring(g, [c] * (3 * q - 2) + [0.0] * 2, cm.grid_overlap_slowdown) == pytest.approx(0.140 + 1.5 * 0.022 + 3 * q * o)


def test_fit_overlap_takes_each_term_per_round_then_the_median():
    # the machine slows between rounds: a round's parts move together, and its terms hold;
    # the medians of the parts, taken apart, would put the drift into the difference
    from stpc.cli.calibrate import fit_overlap

    def probe(g, c, s, load):  # a round's (alone, alone, both) under a load factor
        return tuple(x * load for x in (g, c, max(g, c) + s * min(g, c)))

    loads = [1.0, 1.0, 1.6, 1.6, 1.6]
    # (a ring of two ranks: one step moves a block, the other computes on what is there)
    ring = [(g, c, (both + g) / 2) for g, c, both in (probe(0.010, 0.004, 0.5, f) for f in loads)]
    tiny = [(1e-6, 1e-4, (1e-4 + 2e-6) / 2)] * 5
    probes = {"async": [probe(0.28, 0.06, 1.2, f) for f in loads],
              # compute and network loaded apart, round by round; each round's sync is 5 ms
              "blocking": [(0.066 * f, 0.008 * h, 0.066 * f + 0.008 * h + 0.005)
                           for f, h in zip([1.0, 1.6, 1.0, 1.6, 1.3], [1.5, 2.0, 2.0, 1.0, 1.0])]}
    got = fit_overlap([{"long": ring, "tiny": tiny, "probes": probes}], world=2)
    assert got["ring_slowdown"] == pytest.approx(0.5) and got["slowdown"] == pytest.approx(1.2)
    assert got["collective_sync_s"] == pytest.approx(0.005) and got["rounds"] == 5
    assert "ring_sync_s" not in got    # (a run without the after-ring probe: none fitted)
    # the same collective right after a ring: 2 ms a round over the ring and the collective
    after = [(0.070 * f, 0.008 * h, 0.070 * f + 0.008 * h + 0.002) for f, h in zip(loads, [1.0, 2.0, 1.0, 1.5, 1.0])]
    got = fit_overlap([{"long": ring, "tiny": tiny, "probes": {**probes, "after_ring": after}}], world=2)
    assert got["ring_sync_s"] == pytest.approx(0.002) and got["after_ring"]["ring_typical_s"] == pytest.approx(0.112)
    # the parts' medians, taken apart (the old fit's way), would say 1 ms
    g, c, both = (sorted(r[i] for r in probes["blocking"])[2] for i in range(3))
    assert both - g - c == pytest.approx(0.001)
    # three ranks, one slower at the block all along: each block beside the collective waits
    # for it, and the typical rank's compute (what the planner charges) is the median one's
    ranks = [{"long": ring, "tiny": tiny, "probes": {"async": probes["async"],
                                                      "blocking": [(g, 0.008, 0.070 + 0.008 + 0.003)] * 5}}
             for g in (0.060, 0.062, 0.070)]
    got = fit_overlap(ranks, world=2)
    assert got["collective_sync_s"] == pytest.approx(0.081 - 0.062 - 0.008)  # not 3 ms, as from the slowest
    assert got["blocking"]["gemms_typical_s"] == pytest.approx(0.062) and got["blocking"]["gemms_s"] == 0.070


def _synthetic_profile(ranks: int = 2, **device) -> dict:
    """A minimal calibration profile of ``ranks`` gloo ranks, its device given ``device``'s figures."""
    return {"version": 1, "name": "synthetic", "ranks": ranks, "backend": "gloo",
            "device": {"name": "cpu-x", "peak_flops": {d: 1e11 for d in ("fp32", "tf32", "bf16", "fp16")},
                       "mem_bw": 1e10, "mem_bytes": 1e10, **device},
            "link": {"alpha_s": 1e-4, "bw_bytes_per_s": 1e9}, "collectives": {}}


def test_fit_batched_reads_the_weight_reread_from_each_rounds_difference():
    """calibrate's batched-block probe: per round each part the slowest rank's, each block's
    extra the median of the rounds' differences (its weight read again batch - 1 times), and
    from the two blocks' extras the bandwidth and the part of a weight the cache serves:
    the model then gives both blocks' extras back; no extra where the big block measured no
    slower."""
    from stpc.cli.calibrate import BATCHED_BLOCK, BATCHED_SMALL, fit_batched
    from stpc.cost_models import batched_weight_time

    batch, _, n, k = BATCHED_BLOCK
    wbytes, small_bytes = 4.0 * n * k, 4.0 * BATCHED_SMALL[2] * BATCHED_SMALL[3]
    assert small_bytes == wbytes / 4 and BATCHED_SMALL[:2] == BATCHED_BLOCK[:2]
    bw, cached = 5e9, 0.7 * small_bytes
    extra = (batch - 1) * (wbytes - cached) / bw
    extra_small = (batch - 1) * (small_bytes - cached) / bw
    loads = [1.0, 1.3, 1.0, 1.6, 1.1]   # the machine's load moves both parts of a round together
    fast = [(0.020 * f + extra, 0.020 * f, 0.005 * f + extra_small, 0.005 * f) for f in loads]
    slow = [tuple(x * 1.01 for x in r) for r in fast]   # the other rank, a little slower: its rounds count
    got = fit_batched([fast, slow])
    assert got["rounds"] == 5 and got["weight_bytes"] == wbytes and got["small"]["weight_bytes"] == small_bytes
    assert got["shape"] == list(BATCHED_BLOCK) and got["small"]["shape"] == list(BATCHED_SMALL)
    assert got["extra_s"] == pytest.approx(1.01 * extra)
    assert got["small"]["extra_s"] == pytest.approx(1.01 * extra_small)
    assert got["batch_reread_bw"] == pytest.approx(bw / 1.01)
    assert got["batch_reread_cached_bytes"] == pytest.approx(cached)
    dev = dataclasses.replace(get_device("CPU"), batch_reread_bw=got["batch_reread_bw"],
                              batch_reread_cached_bytes=got["batch_reread_cached_bytes"])
    assert batched_weight_time(dev, batch, wbytes) == pytest.approx(got["extra_s"])
    assert batched_weight_time(dev, batch, small_bytes) == pytest.approx(got["small"]["extra_s"])
    # the small weight free: all of it cached; as dear a byte as the big one: none of it
    free = fit_batched([[(0.020 + extra, 0.020, 0.005, 0.0051)] * 3])
    assert free["batch_reread_cached_bytes"] == small_bytes
    assert free["batch_reread_bw"] == pytest.approx((batch - 1) * (wbytes - small_bytes) / extra)
    flat = fit_batched([[(0.020 + extra, 0.020, 0.005 + extra / 2, 0.005)] * 3])
    assert flat["batch_reread_cached_bytes"] == 0.0
    assert flat["batch_reread_bw"] == pytest.approx((batch - 1) * wbytes / extra)
    assert fit_batched([[(0.020, 0.021, 0.005, 0.0051)] * 3])["batch_reread_bw"] is None


def test_a_batched_gemm_reads_its_shared_weight_again_per_element(tmp_path):
    """``DeviceSpec.batch_reread_bw``: a GEMM batched over one weight pays the weight's bytes
    again per element past the first; the presets and profiles without the figure pay
    nothing; a profile's figure reaches the device."""
    from stpc.cost_models import batched_weight_time

    dev = dataclasses.replace(get_device("CPU"), batch_reread_bw=4e9)
    assert batched_weight_time(dev, 4, 8e6) == pytest.approx(3 * 8e6 / 4e9)
    assert batched_weight_time(dev, 1, 8e6) == 0.0
    assert all(d.batch_reread_bw is None for d in (c.device for c in CLUSTERS.values()))
    assert batched_weight_time(get_device("H100"), 8, 8e6) == 0.0
    assert CostModel(get_cluster("primepar-v100"), (4,)).batched_gemm_extra(4, 8e6) == 0.0
    with pytest.raises(ValueError, match="batch_reread_bw"):
        dataclasses.replace(dev, batch_reread_bw=0.0)
    # the part of the weight the cache serves is free
    cached = dataclasses.replace(dev, batch_reread_cached_bytes=2e6)
    assert batched_weight_time(cached, 4, 8e6) == pytest.approx(3 * 6e6 / 4e9)
    assert batched_weight_time(cached, 4, 1e6) == 0.0
    with pytest.raises(ValueError, match="batch_reread_cached_bytes"):
        dataclasses.replace(dev, batch_reread_cached_bytes=-1.0)
    prof = _synthetic_profile()
    path = str(tmp_path / "p.json")
    save_profile(prof, path)
    assert get_cluster(path).device.batch_reread_bw is None
    save_profile({**prof, "device": {**prof["device"], "batch_reread_bw": 6e9}}, path)
    cm = CostModel(get_cluster(path), (2,))
    assert cm.device.batch_reread_bw == 6e9 and cm.batched_gemm_extra(3, 6e6) == pytest.approx(2e-3)
    assert cm.device.batch_reread_cached_bytes == 0.0   # (a profile from before the second block)
    save_profile({**prof, "device": {**prof["device"], "batch_reread_bw": 6e9, "batch_reread_cached_bytes": 3e6}},
                 path)
    cm = CostModel(get_cluster(path), (2,))
    assert cm.device.batch_reread_cached_bytes == 3e6 and cm.batched_gemm_extra(3, 6e6) == pytest.approx(1e-3)


def test_fit_fresh_reads_the_first_touch_from_each_rounds_difference():
    """calibrate's fresh-allocation probe: per round each part the slowest rank's, the extra the
    median of the rounds' clone less warm copy, the rate the probe's bytes over it; nothing to
    charge where the clone cost no more or the allocator has no such threshold."""
    from stpc.cli.calibrate import FRESH_BYTES, GLIBC_MMAP_THRESHOLD_MAX, fit_fresh, fresh_line

    loads = [1.0, 1.4, 1.0, 1.2, 1.1]   # the machine's load moves both parts of a round together
    fast = [(0.030 * f + 0.035, 0.010 * f) for f in loads]
    slow = [tuple(x * 1.02 for x in r) for r in fast]
    got = fit_fresh([fast, slow], GLIBC_MMAP_THRESHOLD_MAX)
    assert got["rounds"] == 5 and got["bytes"] == FRESH_BYTES > GLIBC_MMAP_THRESHOLD_MAX == 32 << 20
    extra = statistics.median(1.02 * (0.020 * f + 0.035) for f in loads)
    assert got["extra_s"] == pytest.approx(extra)
    assert got["fresh_page_bw"] == pytest.approx(FRESH_BYTES / extra)
    assert got["fresh_alloc_bytes"] == GLIBC_MMAP_THRESHOLD_MAX
    assert "first touched at" in fresh_line(got)
    dev = dataclasses.replace(get_device("CPU"), fresh_alloc_bytes=got["fresh_alloc_bytes"],
                              fresh_page_bw=got["fresh_page_bw"])
    assert fresh_alloc_time(dev, FRESH_BYTES) == pytest.approx(got["extra_s"])
    warm = fit_fresh([[(0.010, 0.011)] * 3], GLIBC_MMAP_THRESHOLD_MAX)
    assert warm["fresh_page_bw"] is None and warm["fresh_alloc_bytes"] is None
    assert "no extra cost" in fresh_line(warm)
    assert fit_fresh([fast], None)["fresh_page_bw"] is None   # (off glibc: not measured)


def test_fresh_alloc_threshold_follows_glibc(monkeypatch):
    """glibc maps every block from its dynamic threshold's cap (32 MiB on 64-bit) fresh; a fixed
    MALLOC_MMAP_THRESHOLD_ (the benches' --allocator keep) is the threshold instead."""
    import platform

    from stpc.cli.calibrate import GLIBC_MMAP_THRESHOLD_MAX, fresh_alloc_threshold

    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.35"))
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert fresh_alloc_threshold() == GLIBC_MMAP_THRESHOLD_MAX
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 << 20))
    assert fresh_alloc_threshold() == 128 << 20
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert fresh_alloc_threshold() is None


def test_a_tensor_the_allocator_maps_fresh_pays_its_first_touch(tmp_path):
    """``DeviceSpec.fresh_alloc_bytes`` / ``fresh_page_bw``: a new tensor of the threshold's size
    or more costs its bytes at the first-touch rate beyond writing them (a copy into a new
    buffer too), a smaller one nothing; the presets (a caching allocator) and profiles
    without the figures charge nothing; a profile's figures reach the device."""
    dev = dataclasses.replace(get_device("CPU"), fresh_alloc_bytes=32 * 2**20, fresh_page_bw=1.5e9)
    assert fresh_alloc_time(dev, 48 * 2**20) == pytest.approx(48 * 2**20 / 1.5e9)
    assert fresh_alloc_time(dev, 32 * 2**20) == pytest.approx(32 * 2**20 / 1.5e9)
    assert fresh_alloc_time(dev, 32 * 2**20 - 1) == 0.0
    assert all(c.device.fresh_page_bw is None and c.device.fresh_alloc_bytes is None for c in CLUSTERS.values())
    assert fresh_alloc_time(get_device("H100"), 1e9) == 0.0
    for name in ("fresh_alloc_bytes", "fresh_page_bw"):
        with pytest.raises(ValueError, match=name):
            dataclasses.replace(dev, **{name: 0.0})
    cl = dataclasses.replace(get_cluster("cpu-local"), device=dev)
    cm, plain = CostModel(cl, (2,)), CostModel(get_cluster("cpu-local"), (2,))
    assert cm.copy(48 * 2**20) - plain.copy(48 * 2**20) == pytest.approx(48 * 2**20 / 1.5e9)
    assert cm.copy(16 * 2**20) == plain.copy(16 * 2**20)
    prof = _synthetic_profile()
    path = str(tmp_path / "p.json")
    save_profile(prof, path)
    got = get_cluster(path).device
    assert got.fresh_page_bw is None and got.fresh_alloc_bytes is None
    save_profile({**prof, "device": {**prof["device"], "fresh_alloc_bytes": 2**25, "fresh_page_bw": 1.2e9}}, path)
    got = get_cluster(path).device
    assert (got.fresh_alloc_bytes, got.fresh_page_bw) == (2**25, 1.2e9)


def test_a_collective_pays_its_fresh_outputs_first_touch_and_the_lines_fit_the_rest(tmp_path):
    """Each collective's output (an all-gather's and an all-reduce's whole tensor, a
    reduce-scatter's and an all-to-all's piece) pays its first touch where the allocator maps
    a block that size fresh, on top of the line; calibrate fits the lines to the samples less
    that part, so a profile's samples are given back; a sample the part would leave at nothing
    is kept whole; a refit profile's every entry is the fit of its samples so."""
    from stpc.cli.calibrate import refit_collectives, transfer_samples
    from stpc.cost_models import collective_output_bytes

    mib = 2**20
    assert [collective_output_bytes(k, 64 * mib, 4) for k in ("all_gather", "all_reduce", "reduce_scatter",
                                                              "all_to_all", "p2p")] == [64 * mib, 64 * mib,
                                                                                        16 * mib, 16 * mib, 0.0]
    base = get_cluster("cpu-local")
    dev = dataclasses.replace(base.device, fresh_alloc_bytes=32 * mib, fresh_page_bw=1e9)
    cm, plain = CostModel(dataclasses.replace(base, device=dev), (4,)), CostModel(base, (4,))
    assert cm.all_gather(64 * mib, 0) - plain.all_gather(64 * mib, 0) == pytest.approx(64 * mib / 1e9)
    assert cm.all_reduce(48 * mib, 0) - plain.all_reduce(48 * mib, 0) == pytest.approx(48 * mib / 1e9)
    assert cm.reduce_scatter(64 * mib, 0) == plain.reduce_scatter(64 * mib, 0)         # (a 16 MiB piece)
    assert cm.reduce_scatter(256 * mib, 0) - plain.reduce_scatter(256 * mib, 0) == pytest.approx(64 * mib / 1e9)
    assert cm.all_to_all(256 * mib, 0) - plain.all_to_all(256 * mib, 0) == pytest.approx(64 * mib / 1e9)
    assert cm.p2p(64 * mib, 0) == plain.p2p(64 * mib, 0) and cm.all_gather(16 * mib, 0) == plain.all_gather(16 * mib, 0)
    ks = [("all_gather", 16 * mib, 0.020), ("all_gather", 64 * mib, 0.200), ("all_gather", 40 * mib, 0.030)]
    got = transfer_samples(ks, 4, dev)
    assert got[0] == ks[0] and got[1] == ("all_gather", 64 * mib, pytest.approx(0.200 - 64 * mib / 1e9))
    assert got[2] == ks[2]   # (its fresh part, 42 ms, above the whole sample: kept as measured)
    assert transfer_samples(ks, 4, None) == ks
    # a profile refit: every entry (the node's, a group size's, the joint link) fits its samples less it;
    # samples on a line but for the 64 MiB one's fresh output: its line and the output give it back
    line = [[nb * mib, 3e-3 + 0.75 * nb * mib / 1e9 + (nb * mib / 1e9 if nb >= 32 else 0.0)] for nb in (16, 64, 4)]
    prof = _synthetic_profile(ranks=4, fresh_alloc_bytes=32 * mib, fresh_page_bw=1e9)
    prof.update(collectives={"all_gather": {"samples": line}},
                group_collectives={"2": {"all_reduce": {"samples": [[4 * mib, 0.01], [64 * mib, 0.3]]}}})
    refit_collectives(prof)
    ag = prof["collectives"]["all_gather"]
    ag_ks = [("all_gather", float(nb), t) for nb, t in ag["samples"]]
    assert ag["bands"] == fit_bands(transfer_samples(ag_ks, 4, dev), 4)
    assert ag["samples"] == line   # (as measured)
    assert ag["bw_bytes_per_s"] == pytest.approx(1e9) and ag["alpha_s"] == pytest.approx(1e-3)
    ar = prof["group_collectives"]["2"]["all_reduce"]
    assert ar["bands"] == fit_bands(transfer_samples([("all_reduce", 4.0 * mib, 0.01), ("all_reduce", 64.0 * mib, 0.3)],
                                                     2, dev), 2)
    assert prof["link"]["alpha_s"] == fit_alpha_beta(transfer_samples(ag_ks, 4, dev), 4)[0]
    path = str(tmp_path / "refit.json")
    save_profile(prof, path)
    refit_cm = CostModel(get_cluster(path), (4,))
    for nb, t in line:
        assert refit_cm.all_gather(nb, 0) == pytest.approx(t, rel=1e-6), nb


# ----------------------------------------------------------------------------- memory formulas


def test_optimizer_layouts():
    n = 1000
    assert optimizer_state_bytes(n, "fp32-adam").total == 16 * n
    mp = optimizer_state_bytes(n, "mixed-adam")
    assert (mp.weight, mp.grad, mp.optimizer, mp.total) == (2 * n, 4 * n, 12 * n, 18 * n)
    assert optimizer_state_bytes(n, "mixed-adam", fp32_grad_accum=False).total == 16 * n
    # Megatron distributed optimizer (ZeRO-1): 6 + 12/dp bytes per parameter
    assert optimizer_state_bytes(n, "mixed-adam", zero_shards=8, zero_stage=1).total == pytest.approx((6 + 12 / 8) * n)
    z2 = optimizer_state_bytes(n, "fp32-adam", zero_shards=4)
    assert (z2.weight, z2.grad, z2.optimizer) == (4 * n, n, 2 * n)
    assert optimizer_state_bytes(n, "fp32-adam", zero_shards=4, zero_stage=3).weight == n
    with pytest.raises(ValueError, match="unknown optimizer layout"):
        optimizer_state_bytes(n, "sgd")


def test_node_and_step_memory():
    mm = MemoryModel()
    # a node with 100 B of inputs, 50 B of output and 80 B saved, split 2 ways, plus a ring
    # whose double buffer holds two 2.5 B blocks
    assert mm.saved_bytes(80, shards=2) == 40
    assert mm.transient_bytes([100 / 2], 50 / 2, ring_block=2.5) == 80
    assert mm.transient_bytes([30, 20], 10) == 60  # spatial: no ring buffer
    assert mm.param_bytes(1000, shards=4) == 16 * 1000 / 4
    assert MemoryModel("mixed-adam").param_bytes(1000) == 18 * 1000
    with pytest.raises(ValueError, match="unknown optimizer layout"):
        MemoryModel("sgd")
    assert adamw_step_transient_bytes([10, 30, 20]) == 60
    assert adamw_step_transient_bytes([10, 30, 20], "foreach") == 60
    assert training_step_peak(100, 10, 20, 15, 3) == 120
    assert training_step_peak(100, 10, 20, 15, 8) == 123


def test_step_scratch_holds_the_last_summed_gradients_second_copy_under_fused_adamw():
    """(together, one at a time) bytes of a parameter of 1000 elements this device steps: fused
    AdamW has no scratch, so the phase's one-at-a-time part is backward's end, where a gradient
    summed over ranks is there twice (autograd's and its bucket's), and a tied one three times
    (its two readers' and their sum); the other implementations' own scratch already covers it
    (foreach: every parameter's 4 B at once; single: 8 B)."""
    n = 1000
    assert MemoryModel(optimizer_impl="fused").step_scratch(n) == (0.0, 0.0)
    assert MemoryModel(optimizer_impl="fused").step_scratch(n, reduced=True) == (0.0, 4.0 * n)
    assert MemoryModel("mixed-adam", optimizer_impl="fused").step_scratch(n, reduced=True) == (0.0, 4.0 * n)
    assert MemoryModel("mixed-adam", fp32_grad_accum=False, optimizer_impl="fused").step_scratch(
        n, reduced=True) == (0.0, 2.0 * n)
    for reduced in (False, True):  # a tied one: its two readers' gradients beside their sum
        assert MemoryModel(optimizer_impl="fused").step_scratch(n, reduced, tied=True) == (0.0, 8.0 * n)
        assert MemoryModel(optimizer_impl="foreach").step_scratch(n, reduced) == (4.0 * n, 0.0)
        assert MemoryModel(optimizer_impl="single").step_scratch(n, reduced) == (0.0, 8.0 * n)
        assert MemoryModel(optimizer_impl="single").step_scratch(n, reduced, tied=True) == (0.0, 8.0 * n)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "gpt-50m", "opt-6.7b", "bloom-7b1", "llama3-8b"])
def test_closed_form_param_count_matches_model(name):
    from stpc.cost_models.estimator import param_count_expr, h, V, L, a, k, f, P
    cfg = models.CONFIGS[name]
    with torch.device("meta"):
        n_real = models.num_params(models.build(name))
    subs = {V: cfg.vocab, h: cfg.d_model, L: cfg.n_layers, a: cfg.n_heads,
            k: getattr(cfg, "n_kv_heads", cfg.n_heads), f: cfg.ffn, P: cfg.max_seq}
    assert int(param_count_expr(cfg).subs(subs)) == n_real


def test_closed_form_llama_matches_paper_formula():
    cfg = models.CONFIGS["llama2-70b"]
    s_, b_, tp_, dp_ = 4096, 16, 8, 4
    r = closed_form_memory(cfg, seq=s_, batch=b_, dp=dp_, tp=tp_, sp=1, dtype="bf16")
    hh, aa, kk, ff = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.ffn
    b_local = b_ // dp_
    paper = cfg.n_layers * s_ * b_local * hh * (12 + 4 * kk / aa + 8 * ff / hh) / tp_  # bytes, bf16
    logits = 4 * s_ * b_local * cfg.vocab / tp_
    assert r.values["activations"] == pytest.approx(paper + logits)
    with torch.device("meta"):
        n = models.num_params(models.build("llama2-70b"))
    assert r.values["params"] + r.values["grads"] + r.values["optimizer"] == pytest.approx(18 * n / tp_)
    assert r.value == pytest.approx(sum(r.values.values()))
    names = {str(x) for x in r.expr.free_symbols}
    assert {"s", "b", "tp", "sp", "h", "L"} <= names  # symbolic, for notebooks
    z = closed_form_memory(cfg, seq=s_, batch=b_, dp=dp_, tp=tp_, zero=True)
    assert z.values["optimizer"] == pytest.approx(r.values["optimizer"] / dp_)
    with pytest.raises(ValueError, match="divisible"):
        closed_form_memory(cfg, seq=s_, batch=3, dp=2)


@given(st.floats(1e3, 1e9), st.floats(1e3, 1e9), st.integers(0, 2))
@example(999999999.9999999, 1e9, 0)   # (the part is the whole message to float precision)
def test_a_coalesced_collective_shares_one_latency_by_bytes(nbytes, message, which):
    """A parameter's part of a coalesced collective (a gradient bucket, a ZeRO layer's one
    gather) is the message's time in proportion to its bytes; a part at least as large as
    the message is a collective of its own; parts filling a message cost the message."""
    kind = ("all_gather", "reduce_scatter", "all_reduce")[which]
    cm = CostModel(get_cluster("primepar-v100"), (4,))
    fn = getattr(cm, kind)
    got = cm.coalesced(kind, nbytes, 0, message)
    if nbytes >= message:
        assert got == fn(nbytes, 0)
    else:
        assert got == pytest.approx(fn(message, 0) * nbytes / message, rel=1e-12)
        # (one latency shared, not one each: strictly less unless the part is the whole
        # message to float precision, where the two are the same number: hypothesis found
        # nbytes = 999999999.9999999 against a message of 1e9)
        assert got <= fn(nbytes, 0)
        if nbytes < message * (1 - 1e-9):
            assert got < fn(nbytes, 0)
    parts = [message / 4] * 4
    assert sum(cm.coalesced(kind, x, 0, message) for x in parts) == pytest.approx(fn(message, 0), rel=1e-12)
    assert cm.coalesced(kind, nbytes, 0, 0.0) == fn(nbytes, 0)



def test_a_blocking_collective_pays_the_ranks_skew_once():
    """An activation's reshard, which every rank waits on where it runs, costs its
    collective and the cluster's measured synchronisation (``collective_sync_s``: 0 on the
    presets) per collective it runs: forward and backward each; no collective, nothing."""
    cl = get_cluster("primepar-v100")
    assert cl.collective_sync_s == 0.0
    skewed = dataclasses.replace(cl, collective_sync_s=5e-3)
    cm, base = CostModel(skewed, (4,)), CostModel(cl, (4,))
    assert cm.blocking(0.0) == 0.0 and cm.blocking(2e-3) == pytest.approx(7e-3)
    nbytes = 8e6
    # S -> R: an all-gather forward, its reduce-scatter backward: two collectives, two skews
    assert axis_reshard(cm, 0, "S0", "R", nbytes, True, True) == pytest.approx(
        axis_reshard(base, 0, "S0", "R", nbytes, True, True) + 2 * 5e-3)
    # R -> S0 (a slice, forward free): the backward all-gather alone
    assert axis_reshard(cm, 0, "R", "S0", nbytes, False, True) == pytest.approx(
        base.all_gather(nbytes, 0) + 5e-3)
    assert axis_reshard(cm, 0, "S0", "S0", nbytes, True, True) == 0.0
    with pytest.raises(ValueError, match="collective_sync_s"):
        dataclasses.replace(cl, collective_sync_s=-1.0)


def test_a_transfer_right_after_a_ring_pays_the_skew_of_one_step_not_of_a_stretch():
    """Where a transfer runs right after a P(2^k x 2^k) op's backward (the gradient relaid
    out of its skewed input layout), the ranks met at the op's last exchange, one
    GEMM step before: it pays ``ring_sync_s`` (None: ``collective_sync_s``), every other
    blocking collective the skew of a stretch of compute."""
    cl = get_cluster("primepar-v100")
    skewed = dataclasses.replace(cl, collective_sync_s=5e-3)
    assert CostModel(skewed, (4,)).ring_sync_s == 5e-3           # (not measured: the stretch's)
    met = dataclasses.replace(skewed, ring_sync_s=1e-3)
    cm, base = CostModel(met, (4,)), CostModel(cl, (4,))
    assert cm.blocking(2e-3, after_ring=True) == pytest.approx(3e-3) and cm.blocking(2e-3) == pytest.approx(7e-3)
    assert cm.blocking(0.0, after_ring=True) == 0.0
    nbytes = 8e6
    step = base.p2p(nbytes / 4, 0)
    # a grid block into the same dims' skew: one P2P step forward (after a stretch: the
    # producer's family is not the edge's to know), its dual right after the P2x2's backward
    assert axis_reshard(cm, 0, "B0.1", "X0.1", nbytes, True, True) == pytest.approx(2 * step + 5e-3 + 1e-3)
    # into a plain split: both directions after a stretch
    a2a = base.all_to_all(nbytes, 0, 0.75)
    assert axis_reshard(cm, 0, "S0", "S1", nbytes, True, True) == pytest.approx(2 * (a2a + 5e-3))
    # a skewed weight's relayout: forward in the feed, backward last (autograd runs the
    # feed's nodes after every op of the program), each back to back: its transfers alone
    w = 4e6
    assert grid_relayout_s(cm, ("W0.1",), w, True) == pytest.approx(2 * base.p2p(w / 4, 0))
    assert grid_relayout_s(cm, ("W0.1",), w, False) == pytest.approx(base.p2p(w / 4, 0))
    with pytest.raises(ValueError, match="ring_sync_s"):
        dataclasses.replace(cl, ring_sync_s=-1.0)


def test_a_collective_a_short_compute_after_the_ranks_met_pays_the_skew_that_compute_leaves():
    """``since_meeting_s``: where the ranks met a known compute before the collective (a grid
    norm's statistics exchange, then its normalisation), the skew charged is the square-root
    law of that compute through the profile's figure, which ``collective_sync_compute_s``
    says it was measured after, and never more than that figure. Without it, the figure."""
    cl = get_cluster("primepar-v100")
    assert cl.collective_sync_compute_s is None
    skewed = dataclasses.replace(cl, collective_sync_s=8e-3, collective_sync_compute_s=0.1)
    cm, base = CostModel(skewed, (4,)), CostModel(cl, (4,))
    assert cm.blocking(2e-3, since_meeting_s=0.025) == pytest.approx(2e-3 + 8e-3 * 0.5)
    assert cm.blocking(2e-3, since_meeting_s=0.0) == pytest.approx(2e-3)
    assert cm.blocking(2e-3, since_meeting_s=0.4) == pytest.approx(1e-2)   # (at most the stretch's)
    assert cm.blocking(2e-3) == pytest.approx(1e-2) and cm.blocking(0.0, since_meeting_s=0.025) == 0.0
    unknown = CostModel(dataclasses.replace(cl, collective_sync_s=8e-3), (4,))
    assert unknown.blocking(2e-3, since_meeting_s=0.025) == pytest.approx(1e-2)
    # a reshard: its forward collective follows the meeting; its backward dual (here after
    # the P2x2's backward: ring_sync_s, unmeasured: the stretch's) does not
    nbytes = 8e6
    step = base.p2p(nbytes / 4, 0)
    assert axis_reshard(cm, 0, "B0.1", "X0.1", nbytes, True, True, since_meeting_s=0.025) == pytest.approx(
        2 * step + 4e-3 + 8e-3)
    assert axis_reshard(cm, 0, "B0.1", "X0.1", nbytes, True, True) == pytest.approx(2 * step + 2 * 8e-3)
    with pytest.raises(ValueError, match="collective_sync_compute_s"):
        dataclasses.replace(cl, collective_sync_compute_s=0.0)


def test_a_profile_says_what_compute_its_blocking_skew_followed():
    """``collective_sync_compute_s`` is the typical rank's compute before ``calibrate``'s
    blocking probe's collective, as the profile recorded it."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "calibration_cpu_vm_s66.json")
    with open(path) as f:
        blocking = json.load(f)["overlap"]["blocking"]
    assert get_cluster(path).collective_sync_compute_s == blocking["gemms_typical_s"] > 0
