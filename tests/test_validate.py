"""Bad input to stpc.compile is one clear error (cause and fix) before any tracing."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from stpc import models, validate
from stpc.cost_models import CLUSTERS, get_cluster, get_device, save_profile
from stpc.planner import Hints, search
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
        budget(bad, "primepar-v100")


def test_budget_in_bytes_and_the_default_leaves_the_allocator_headroom():
    assert budget(1.5, "primepar-v100") == 1.5 * 2**30
    # a V100 sold as 32 GB holds 32 GiB; a plan may fill 80% of it by default
    assert budget(None, "primepar-v100") == pytest.approx(0.8 * 32 * 2**30)
    cl = dataclasses.replace(get_cluster("dgx-h100"), usable_memory_fraction=0.9)
    assert budget(None, cl) == pytest.approx(0.9 * 80 * 2**30)


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


def _gpu(monkeypatch, name: str, count: int) -> None:
    """This process sees ``count`` GPUs called ``name`` (no GPU needed: only the names are read)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_the_default_cluster_of_a_cuda_world_is_its_gpus_node(monkeypatch, tmp_path):
    monkeypatch.setenv("STPC_PROFILE", str(tmp_path / "none.json"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 8)
    h100 = cluster(None, 8, "cuda")
    assert h100.name == "dgx-h100-8" and h100.device == get_device("H100-SXM")
    assert (h100.nodes, h100.devices_per_node) == (1, 8) and h100.intra == CLUSTERS["dgx-h100"].intra
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: 2 nodes of 4 GPUs
    assert (cluster(None, 8, "cuda").nodes, cluster(None, 8, "cuda").devices_per_node) == (2, 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    _gpu(monkeypatch, "Tesla V100-SXM2-32GB", 4)
    v100 = cluster(None, 8, "cuda")  # 4 GPUs a node: 2 nodes
    assert v100.device == get_device("V100-32GB") and (v100.nodes, v100.devices_per_node) == (2, 4)
    _gpu(monkeypatch, "NVIDIA GeForce GTX 1080", 1)
    with pytest.raises(InvalidArgument, match="no cost model for the GPU 'NVIDIA GeForce GTX 1080'. Fix: pass cluster="):
        cluster(None, 1, "cuda")


def _profile(path, backend: str, name: str = "this-box") -> None:
    save_profile({"version": 1, "name": name, "backend": backend, "ranks": 2,
                  "device": {"name": "calibrated", "peak_flops": dict.fromkeys(("fp32", "tf32", "bf16", "fp16"), 1e11), "mem_bw": 2e10, "mem_bytes": 2**34},
                  "link": {"alpha_s": 1e-5, "bw_bytes_per_s": 1e9},
                  "collectives": {"all_reduce": {"alpha_s": 2e-5, "bw_bytes_per_s": 5e8}}}, str(path))


def test_the_default_cluster_is_this_machines_calibrated_profile(monkeypatch, tmp_path):
    monkeypatch.delenv("STPC_PROFILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the profile's default place: $XDG_CACHE_HOME/stpc
    assert cluster(None, 3, "cpu").name == "cpu-local-3"  # none written yet
    (tmp_path / "stpc").mkdir()
    _profile(tmp_path / "stpc" / "profile.json", "gloo")
    got = cluster(None, 3, "cpu")
    assert got.name == "this-box" and got.device.name == "calibrated" and got.device.mem_bytes == 2**34
    assert (got.nodes, got.devices_per_node) == (1, 3)  # measured on 2 ranks, resized to the world
    assert got.collective_links["all_reduce"].bw_bytes_per_s == 5e8
    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 8)  # a gloo profile says nothing of a CUDA world
    assert cluster(None, 8, "cuda").name == "dgx-h100-8"
    monkeypatch.setenv("STPC_PROFILE", str(tmp_path / "gpu.json"))  # $STPC_PROFILE comes first
    _profile(tmp_path / "gpu.json", "nccl", name="gpu-box")
    assert cluster(None, 8, "cuda").name == "gpu-box" and cluster(None, 2, "cpu").name == "cpu-local-2"
    (tmp_path / "gpu.json").write_text('{"version": 1}')  # a broken profile: named, with the way out
    with pytest.raises(InvalidArgument, match=f"missing key.*Fix: .*{tmp_path / 'gpu.json'} with `python -m stpc "
                                              f"calibrate`"):
        cluster(None, 8, "cuda")


def test_a_mesh_on_another_device_type_is_refused(world_of_one):
    mesh = init_device_mesh("cpu", (1,))
    assert mesh_spec(mesh, None, 1, "cpu") == (1,)
    with pytest.raises(InvalidArgument, match="the DeviceMesh is on 'cpu' but this world's backend \\(gloo\\) runs "
                                              "on 'cuda'. Fix: build the mesh with init_device_mesh\\('cuda'"):
        mesh_spec(mesh, None, 1, "cuda")
    assert validate.world_device_type() == "cpu"  # the real gloo world


@pytest.mark.parametrize("backend,cuda,want", [
    ("gloo", True, "cpu"), ("nccl", True, "cuda"), ("cpu:gloo", True, "cpu"),
    ("cpu:gloo,cuda:nccl", True, "cuda"), ("cuda:nccl,cpu:gloo", True, "cuda"), ("cpu:gloo, cuda:nccl", True, "cuda"),
    ("cpu:gloo,cuda:nccl", False, "cpu"),     # the string asks for CUDA, the machine has none
    ("cuda:nccl", True, "cuda"), ("mpi", True, "cpu"),
])
def test_the_worlds_device_type_reads_mixed_backends(monkeypatch, backend, cuda, want):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert validate.world_device_type() == want


@pytest.mark.parametrize("config,want", [("cpu:gloo,cuda:nccl", "cuda"), ("cpu:gloo", "cpu")])
def test_a_world_without_a_backend_has_torchs_default(monkeypatch, config, want):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")  # init_process_group() with none
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert validate.world_device_type() == want


def test_hints_are_checked():
    h = Hints(param_exact={"wte.weight": ("S0",)})
    assert validate.hints(None) is None and validate.hints(h) is h
    for name in ("megatron", "dp", "spatial", "fsdp-tp"):
        assert validate.hints(name) == name
    for bad, match in [("foo", "hints='foo' is not a hints preset"), ("Megatron", "not a hints preset"),
                       ({"wte.weight": ("S0",)}, "are not hints"), (["megatron"], "are not hints"),
                       (lambda s: True, "are not hints"), (3, "are not hints")]:
        with pytest.raises(InvalidArgument, match=match) as e:
            validate.hints(bad)
        assert "Fix:" in str(e.value) and "'megatron'" in str(e.value), bad


def test_backend_is_checked():
    def my_backend(gm, example_inputs):
        return gm

    for good in (None, "inductor", "aot_eager", "eager", my_backend):
        assert validate.backend(good) is good
    for bad, match in [("inductr", "backend='inductr' is not a torch.compile backend"), ("", "is not a"),
                       (3, "\\(int\\) is not a torch.compile backend"), (["inductor"], "is not a")]:
        with pytest.raises(InvalidArgument, match=match) as e:
            validate.backend(bad)
        assert "Fix:" in str(e.value) and "inductor" in str(e.value), bad


CASES = [({"mesh": 0}, "size < 1"), ({"mesh": "2by2"}, "not a mesh spec"), ({"mesh": 8}, "8 devices but this job has 2"),
         ({"budget_gib": -1}, "budget_gib"), ({"example_inputs": (torch.zeros(2, 4), torch.zeros(1))}, "do not fit"),
         ({"cluster": "nope"}, "unknown cluster"), ({"max_plans": 0}, "max_plans"), ({"outputs": "all"}, "outputs"),
         ({"input_placements": {"x": ("S0", "S1")}}, "input_placements"),
         ({"hints": "foo"}, "not a hints preset"), ({"hints": {"x": 1}}, "are not hints"),
         ({"backend": "inductr"}, "not a torch.compile backend"),
         ({"optimizer_impl": "fusd"}, "optimizer_impl='fusd' is not an AdamW implementation")]


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
