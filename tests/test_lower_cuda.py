"""The whole pass pipeline lowers for a CUDA mesh on fake tensors (no GPU needed): every
value and every device argument in the final graph is on CUDA, none on the CPU or meta."""
import pytest
import torch

from _graphs import traced_and_plan
from stpc.compile import run_passes


def _devices(gm):
    """Every device the graph names: its values' and its device= arguments'."""
    found = set()
    for n in gm.graph.nodes:
        for v in (n.meta.get("val"), n.meta.get("global_val")):
            vals = v if isinstance(v, (list, tuple)) else [v]
            found.update(t.device.type for t in vals if isinstance(t, torch.Tensor))
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, torch.device):
                found.add(a.type)
    return found


@pytest.mark.parametrize("model,mesh,family", [("llama-tiny", "4", "dp"), ("gpt-tiny", "2x2", "megatron"),
                                               ("llama-tiny", "4", "ag_rs"),
                                               ("gpt-tiny", "4", "p2x2")])
def test_lowering_for_cuda_leaves_no_cpu_device(model, mesh, family):
    overrides = {"bias": False} if family == "p2x2" else {}
    tg, plan = traced_and_plan(model, mesh, family, **overrides)
    assert "meta" in _devices(tg.gm)  # traced on meta: the passes must move everything
    gm = run_passes(tg.gm, plan, device="cuda")
    assert gm.meta["stpc_device"].type == "cuda"
    assert _devices(gm) == {"cuda"}
