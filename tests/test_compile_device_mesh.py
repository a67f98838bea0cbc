"""stpc.compile on a user's 1-D DeviceMesh: the ranks are viewed as the plan's 2-D mesh."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import full_grads, make_plan  # noqa: E402

from stpc.runtime.launch import spawn  # noqa: E402

pytestmark = pytest.mark.multirank


def _worker(rank, world, plan_json):
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import stpc
    from stpc import models
    from stpc.planner import Plan

    mesh1d = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = models.build("llama-tiny")
    torch.manual_seed(1)
    idx, tgt = models.example_inputs("llama-tiny", 4, 16, device="cpu")
    single = copy.deepcopy(model)
    dm = stpc.compile(model, mesh1d, (idx, tgt), plan=Plan.from_json(plan_json))
    loss = dm(idx, tgt)
    loss.backward()
    grads = full_grads(dm)
    ref = single(idx, tgt)
    ref.backward()
    worst = max((grads[k] - p.grad).abs().max().item() / p.grad.abs().max().clamp_min(1e-6).item()
                for k, p in single.named_parameters())
    return tuple(dm.stpc.mesh.shape), loss.item(), ref.item(), worst


def test_1d_device_mesh_viewed_as_plan_shape():
    plan = make_plan("llama-tiny", "2x2", "megatron", 4, 16)
    res = spawn(_worker, 4, plan.to_json(), timeout_s=300)
    for shape, loss, ref, worst in res:
        assert shape == (2, 2)
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        assert worst < 1e-4
