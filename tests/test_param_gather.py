"""runtime.gather_start / gather_wait: several parameters' shards gathered whole in one
collective; backward reduce-scatters their gradients in one collective, launched from the
wait's backward (before the autograd engine reaches the start) and waited in the start's.

Real gloo ranks."""
from __future__ import annotations

import time

import pytest
import torch

from stpc.runtime.launch import spawn

pytestmark = pytest.mark.multirank


class _Spy:
    """Stands in for ``torch.ops._c10d_functional`` in a module: records the name of every
    functional collective the module issues, and passes the call on."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, name):
        op = getattr(torch.ops._c10d_functional, name)

        def call(*a, **k):
            self.calls.append(name)
            return op(*a, **k)
        return call


def _spy(module) -> list:
    """The list ``module``'s functional collectives are recorded into from now on."""
    calls: list = []
    module._c10d = _Spy(calls)
    return calls


def _gather(rank, world):
    import torch.distributed as dist

    from stpc import runtime
    from stpc.runtime import param_gather

    group = dist.group.WORLD.group_name
    calls = _spy(param_gather)
    out = {}
    for grad in ("rs", "slice"):
        calls.clear()
        # rank r holds rows r of a [world*2, 3] matrix (split on dim 0) and column r of b [4, world]
        a = torch.nn.Parameter(torch.full((2, 3), float(rank)))
        b = torch.nn.Parameter(torch.arange(4.0).view(4, 1) + 10 * rank)
        buf = runtime.gather_start([a, b], group, grad)
        fa, fb = runtime.gather_wait(buf, [(2, 3), (4, 1)], [0, 1], group)
        full_ok = (torch.equal(fa, torch.cat([torch.full((2, 3), float(r)) for r in range(world)]))
                   and torch.equal(fb, torch.cat([torch.arange(4.0).view(4, 1) + 10 * r for r in range(world)], 1)))
        # a rank-dependent loss: rank r's gradient of the whole parameters is (r + 1) * ones
        ((fa.sum() + fb.sum()) * (rank + 1)).backward()
        want = sum(r + 1 for r in range(world)) if grad == "rs" else rank + 1
        out[grad] = {"full": full_ok, "a": torch.equal(a.grad, torch.full((2, 3), float(want))),
                     "b": torch.equal(b.grad, torch.full((4, 1), float(want))), "calls": list(calls)}
    return out


def test_coalesced_gather_and_early_reduce_scatter():
    for r in spawn(_gather, 2, timeout_s=120):
        for grad in ("rs", "slice"):
            assert r[grad]["full"] and r[grad]["a"] and r[grad]["b"], r
        # forward: one gather, waited; backward: one reduce-scatter launched, then waited
        assert r["rs"]["calls"] == ["all_gather_into_tensor", "wait_tensor", "reduce_scatter_tensor", "wait_tensor"]
        assert r["slice"]["calls"] == ["all_gather_into_tensor", "wait_tensor"]  # complete: no reduction


def _regather(rank, world):
    import contextlib

    import torch.distributed as dist
    from torch.multiprocessing.reductions import StorageWeakRef

    from stpc import runtime
    from stpc.runtime import param_gather

    group = dist.group.WORLD.group_name
    calls = _spy(param_gather)
    g = torch.Generator().manual_seed(0)
    full1, full2 = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    x = torch.randn(3, 8, generator=g, requires_grad=True)  # its gradient needs the whole first weight
    out = {}
    for regather in (False, True):
        calls.clear()
        w1 = torch.nn.Parameter(full1.chunk(world)[rank].clone())  # two layers' weights, split on dim 0
        w2 = torch.nn.Parameter(full2.chunk(world)[rank].clone())
        with param_gather.RegatherSaved() if regather else contextlib.nullcontext() as ctx:
            (f1,) = runtime.gather_wait(runtime.gather_start([w1], group), [tuple(w1.shape)], [0], group)
            h = torch.tanh(x @ f1.t())  # saves the whole weight (a view of it) for backward
            # (the second layer's kept for backward, as prefetch_params marks the head's)
            (f2,) = runtime.gather_wait(runtime.gather_start([w2], group), [tuple(w2.shape)], [0], group, keep=True)
            loss = (h @ f2.t()).pow(2).sum()
            refs = [StorageWeakRef(f1.untyped_storage()), StorageWeakRef(f2.untyped_storage())]
            del f1, f2
        forward_calls = len(calls)
        # (a completed gather's output can stay referenced by its work object until gloo's
        # worker thread drops it: under load that lags; a freed one is freed within the wait)
        deadline = time.monotonic() + 5.0
        while regather and not refs[0].expired() and time.monotonic() < deadline:
            time.sleep(0.01)
        alive = [not r.expired() for r in refs]
        notes = [g.saved for g in ctx.gathered] if regather else []
        loss.backward()
        out[regather] = {"alive": alive, "notes": notes, "grads": (w1.grad.clone(), w2.grad.clone()),
                         "backward_calls": calls[forward_calls:]}
    return out


def test_regather_saved_frees_whole_parameters_after_forward_and_gathers_again_in_backward():
    """FSDP2's reshard-after-forward: under RegatherSaved the whole weights are gone once
    forward is done (only a note of each saved view is kept), but for a gather made with
    ``keep`` (the head's, whose backward comes first: FSDP2's root module keeps its own
    alike); backward gathers the others again (the one before the kept layer issued ahead,
    as the kept one's backward begins) and computes the very same gradients."""
    for r in spawn(_regather, 2, timeout_s=120):
        keep, free = r[False], r[True]
        # the first layer's weights are gone once the second layer's gather has run; the
        # second's, gathered with keep, are kept for its backward
        assert keep["alive"] == [True, True] and free["alive"] == [False, True], r
        assert free["notes"] == [1, 1], free  # each layer's saved weight kept as a note, not a tensor
        for a, b in zip(keep["grads"], free["grads"]):
            assert torch.equal(a, b)
        # backward: layer 1 gathered again, issued first (ahead of layer 2's backward, which
        # reads the kept copy), before and beside the gradients' reduce-scatters
        assert keep["backward_calls"].count("all_gather_into_tensor") == 0, keep
        assert free["backward_calls"].count("all_gather_into_tensor") == 1, free
        assert free["backward_calls"][0] == "all_gather_into_tensor", free


def _compiled_gathers(rank, world, plans):
    """Per plan: the functional collectives ``param_gather`` issues in one forward and in the
    backward after it, through ``stpc.compile`` (which picks regather or keep from the plan)."""
    import stpc
    from stpc import models
    from stpc.planner import Plan
    from stpc.runtime import param_gather

    out = {}
    for name, plan_json in plans.items():
        plan = Plan.from_json(plan_json)
        torch.manual_seed(0)
        model = models.build("gpt-tiny")
        idx, tgt = models.example_inputs("gpt-tiny", 4, 16, device="cpu")
        dm = stpc.compile(model, tuple(plan.mesh_shape), (idx, tgt), plan=plan)
        dm(idx, tgt).backward()  # (a first step: buffers and groups made)
        calls = _spy(param_gather)
        loss = dm(idx, tgt)
        forward = len(calls)
        loss.backward()
        kept = sum(1 for n in dm.stpc.graph_module.graph.nodes if n.target is param_gather.gather_wait and n.kwargs.get("keep"))
        out[name] = {"forward": calls[:forward], "backward": calls[forward:], "kept": kept}
    return out


def test_a_zero2_plan_gathers_once_per_step_and_a_zero3_plan_again_in_backward():
    """``stpc.compile`` runs what the plan says: Megatron's distributed optimizer (ZeRO-2,
    ``plan.stats["keep_gathered"]``) keeps forward's gathered weights for backward, so its
    backward only reduce-scatters gradients; FSDP (ZeRO-3) gathers each layer again there."""
    from stpc import models, trace
    from stpc.planner import search
    from stpc.planner.hints import fsdp_tp, megatron

    with torch.device("meta"):
        tg = trace(models.build("gpt-tiny"), models.example_inputs("gpt-tiny", 4, 16))
    zero2 = search(tg, (2,), "cpu-local", hints=megatron((2,), 0, None, distributed_optimizer=True))
    zero3 = search(tg, (2,), "cpu-local", hints=fsdp_tp((2,), 0))
    assert zero2.stats["keep_gathered"] and "keep_gathered" not in zero3.stats
    for r in spawn(_compiled_gathers, 2, {"zero2": zero2.to_json(), "zero3": zero3.to_json()}, timeout_s=240):
        for name in ("zero2", "zero3"):
            assert r[name]["forward"].count("all_gather_into_tensor") > 0, r
            assert r[name]["backward"].count("reduce_scatter_tensor") > 0, r
        assert r["zero2"]["backward"].count("all_gather_into_tensor") == 0, r
        # every group gathered again but those kept for the head's backward: the head's, and
        # the tied table's, whose one gather the embedding and the head share (this plan reads
        # it whole in both)
        assert r["zero3"]["kept"] == 2, r
        assert r["zero3"]["backward"].count("all_gather_into_tensor") == r["zero3"]["forward"].count(
            "all_gather_into_tensor") - r["zero3"]["kept"], r


def test_a_plan_kept_over_one_axis_gathers_again_only_over_the_others():
    """On a 2x2 mesh, each layer's q/k/v weights stored split over axis 0 and its other
    linears' over axis 1, every weight read whole: kept gathered over axis 0 only
    (``Hints.keep_gathered=(0,)``, as stpc's own points may choose), backward gathers the
    axis-1 groups again and not the axis-0 ones; kept over no axis, both; over both axes,
    neither."""
    from stpc import models, trace
    from stpc.planner import Hints, search

    with torch.device("meta"):
        tg = trace(models.build("gpt-tiny"), models.example_inputs("gpt-tiny", 4, 16))
    one_axis = dict(
        force=[(r"^linear", lambda s: s.kind == "spatial" and all(t == "R" for t in s.ins[1])
                and all(t == "S0" for t in s.ins[0]))],
        param_force=[(r"(q_proj|k_proj|v_proj)\.weight$", lambda p: p[0][0] == "S" and p[1] == "R"),
                     (r"(o_proj|fc1|fc2)\.weight$", lambda p: p[0] == "R" and p[1][0] == "S"),
                     (r"(bias|ln\w*\.weight|wte\.weight|wpe\.weight|lm_head\.weight)$",
                      lambda p: all(t == "R" for t in p))], temporal=False)
    plans = {str(kept): search(tg, (2, 2), "cpu-local", hints=Hints(**one_axis, keep_gathered=kept)).to_json()
             for kept in ((), (0,), (0, 1))}
    for r in spawn(_compiled_gathers, 4, plans, timeout_s=300):
        fwd, bwd = ({k: r[k][ph].count("all_gather_into_tensor") for k in plans} for ph in ("forward", "backward"))
        assert fwd["()"] == fwd["(0,)"] == fwd["(0, 1)"] > 0, r
        # (the head's weights are whole here: no head group to keep)
        assert bwd["()"] == fwd["()"] and bwd["(0, 1)"] == 0, r
        assert 0 < bwd["(0,)"] < fwd["(0,)"], r
