"""Forward hooks on a compiled model's submodules fire, as on the single-device model.

Real gloo ranks. Hooks on submodules (registered before and after ``stpc.compile``, plain
and ``with_kwargs``, pre and post) see each call's args and output as DTensors whose full
values equal what the same hooks see on an unsharded copy, under plans whose values are
split (Megatron TP+SP), reduce-scattered by a ring (AG/RS rings) and held as PrimePar grid
blocks (P2x2). A hook that returns a value is refused by name; removing hooks returns to
the untapped program; the loss and every gradient stay those of one device.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import _rel, full_grads, make_plan  # noqa: E402

from stpc.runtime.launch import spawn  # noqa: E402

pytestmark = pytest.mark.multirank

B, S = 4, 16
HOOKED = {  # module -> what its hook records
    "gpt-tiny": ["layers.0.attn.q_proj", "layers.0.attn.o_proj", "layers.0.mlp", "layers.1", "ln_f", "lm_head"],
    "llama-tiny": ["layers.0.attn.q_proj", "layers.0.mlp.down_proj", "layers.0.mlp", "layers.1", "norm", "lm_head"],
}


def _full(x):
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return x.full_tensor().detach().clone()
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _install(model, names, log, prefix=""):
    """Forward hooks (plain and with kwargs) and pre-hooks recording full values into ``log``."""
    handles = []
    for name in names:
        mod = model.get_submodule(name)
        handles.append(mod.register_forward_hook(
            lambda m, a, o, name=name: log.append((prefix + name, "out", _full(o)))))
        handles.append(mod.register_forward_pre_hook(
            lambda m, a, kw, name=name: log.append((prefix + name, "in", _full(a[0]), sorted(kw))),
            with_kwargs=True))
    return handles


def _hooks(rank, world, model_name, plan_json, overrides):
    import copy

    import stpc
    from stpc import models
    from stpc.planner import Plan
    from stpc.runtime.hook_taps import UnsupportedHook

    torch.manual_seed(0)
    model = models.build(model_name, **overrides)
    single = copy.deepcopy(model)
    names = HOOKED[model_name]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, model.cfg.vocab, (B, S), generator=g),
                torch.randint(0, model.cfg.vocab, (B, S), generator=g)) for _ in range(3)]
    out = {}

    # one hook registered before compile: it must not run on the trace's fake tensors
    early_log, ref_early = [], []
    early = model.get_submodule(names[0]).register_forward_hook(lambda m, a, o: early_log.append(_full(o)))
    single.get_submodule(names[0]).register_forward_hook(lambda m, a, o: ref_early.append(_full(o)))
    pm = stpc.compile(model, None, batches[0], plan=Plan.from_json(plan_json))
    out["none_at_trace"] = early_log == []

    log, ref_log = [], []
    handles = _install(pm, names, log)
    _install(single, names, ref_log)
    worst = 0.0  # the taps change nothing the step computes: loss and every gradient as on one device
    for idx, tgt in batches:
        pm.zero_grad()
        single.zero_grad()
        loss, ref = pm(idx, tgt), single(idx, tgt)
        loss.backward()
        ref.backward()
        grads = full_grads(pm)
        worst = max([worst, _rel(loss.detach(), ref.detach())] +
                    [_rel(grads[k], p.grad) for k, p in single.named_parameters()])
    out["loss"] = worst
    out["calls"] = ([(e[0], e[1]) for e in log] == [(e[0], e[1]) for e in ref_log], len(log), len(ref_log))
    out["kwargs_seen"] = all(e[3] == r[3] for e, r in zip(log, ref_log) if e[1] == "in")
    out["values"] = max(_rel(e[2], r[2]) for e, r in zip(log, ref_log))
    out["early"] = (len(early_log) == len(ref_early) == len(batches),
                    max(_rel(a, b) for a, b in zip(early_log, ref_early)))
    out["variants"] = len(pm.stpc.programs[pm.stpc.first].variants)

    # removed hooks: the untapped program runs again and nothing more is recorded
    for h in handles + [early]:
        h.remove()
    before = len(log)
    pm(*batches[0])
    out["removed"] = len(log) == before and len(early_log) == len(batches)

    # a hook that returns a value would change the computation: refused, naming the module
    bad = pm.get_submodule(names[2]).register_forward_hook(lambda m, a, o: o * 2)
    try:
        pm(*batches[0])
        out["refused"] = "not raised"
    except UnsupportedHook as e:
        out["refused"] = names[2] in str(e) and "returned a value" in str(e)
    bad.remove()
    return out


@pytest.mark.parametrize("model_name,family,mesh", [
    ("llama-tiny", "p2x2", "4"),
    pytest.param("gpt-tiny", "megatron", "2x2", marks=pytest.mark.slow),
    pytest.param("gpt-tiny", "ag_rs", "4", marks=pytest.mark.slow)])
def test_submodule_forward_hooks_see_the_single_device_values(model_name, family, mesh):
    plan = make_plan(model_name, mesh, family, B, S)
    kinds = {n.kind for n in plan.nodes.values()}
    assert {"megatron": "spatial", "ag_rs": "rs_ring", "p2x2": "p2x2"}[family] in kinds, kinds
    for r in spawn(_hooks, 4, model_name, plan.to_json(), {}, timeout_s=300):
        ok, n_log, n_ref = r.pop("calls")
        assert ok and n_log == n_ref == 3 * 2 * len(HOOKED[model_name]), (n_log, n_ref)
        assert r.pop("loss") <= 1 and r.pop("values") <= 1, r
        early_count, early_err = r.pop("early")
        assert early_count and early_err <= 1, r
        assert r.pop("variants") == 1, r
        assert all(v is True for v in r.values()), r
