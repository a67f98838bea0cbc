"""The bucketed gradient reducer (``runtime.GradReducer``, installed by ``stpc.compile`` for the
parameters ``passes.defer_grad_sync`` defers): gradients equal the single-device model's
with buckets of any size, over one axis or two at once, under gradient accumulation and
after parameters are replaced, and buckets are launched while backward is still running.

Real gloo ranks, one spawn for every case.
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


def _cases(rank, world, plans):
    import copy

    import stpc
    from stpc import models
    from stpc.planner import Plan
    from stpc.runtime import GradReducer, joint_group

    out = {}
    # a bare reducer on plain tensors: each rank's gradient is rank+1 times a pattern
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2))
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2, 2))
    red = GradReducer([(b, joint_group(mesh, (0, 1))), (a, joint_group(mesh, (0, 1)))], bucket_bytes=8,
                      first_bucket_bytes=8)
    ((a * torch.arange(3.0)).sum() * (rank + 1) + (b * 2).sum() * (rank + 1)).backward()
    total = sum(r + 1 for r in range(world))
    out["bare"] = (torch.equal(a.grad, torch.arange(3.0) * total) and torch.equal(b.grad, torch.full((2, 2), 2.0 * total))
                   and len(red.buckets) == 2)
    red.remove()

    # each gradient is held once during backward: autograd's is dropped as soon as its bucket
    # holds the copy (b's, made first, is gone while a's is still being computed)
    red = GradReducer([(b, joint_group(mesh, (0, 1))), (a, joint_group(mesh, (0, 1)))], bucket_bytes=8,
                      first_bucket_bytes=8)
    a.grad = b.grad = None
    seen = []
    h = a * 3
    h.register_hook(lambda g: seen.append(b.grad is None))
    (h.sum() * (b * 2).sum() * (rank + 1)).backward()
    out["held_once"] = {"b_dropped_while_a_computed": seen == [True],
                        "values": torch.equal(a.grad, torch.full((3,), 24.0 * total))
                        and torch.equal(b.grad, torch.full((2, 2), 18.0 * total))}
    red.remove()

    # keep_buffers: a bucket's buffer written again only once nothing else holds it (no
    # gradient a caller kept is overwritten; an accumulating .grad keeps its sum)
    red = GradReducer([(b, joint_group(mesh, (0, 1))), (a, joint_group(mesh, (0, 1)))], bucket_bytes=8,
                      first_bucket_bytes=8, keep_buffers=True)

    def backward(k):
        ((a * torch.arange(3.0)).sum() * (rank + 1) * k + (b * 2).sum() * (rank + 1) * k).backward()

    def ptr(t):
        return t.untyped_storage().data_ptr()

    def right_a(k):
        return torch.equal(a.grad, torch.arange(3.0) * total * k)

    def right(k):
        return torch.equal(a.grad, torch.arange(3.0) * total * k) and torch.equal(b.grad, torch.full((2, 2), 2.0 * total * k))

    a.grad = b.grad = None
    backward(1)
    first, ok = ptr(a.grad), right(1)
    a.grad = b.grad = None
    backward(2)
    reused, ok = ptr(a.grad) == first, ok and right(2)
    held = a.grad
    a.grad = b.grad = None
    backward(3)
    kept_safe, ok = ptr(a.grad) != ptr(held) and torch.equal(held, torch.arange(3.0) * total * 2), ok and right(3)
    backward(4)  # no zero_grad: the reduced sum is added to the .grad already there
    ok = ok and right(7) and torch.equal(held, torch.arange(3.0) * total * 2)
    out["kept_buffers"] = {"values": ok, "reused": reused, "held_untouched": kept_safe}
    red.remove()
    a.grad = b.grad = None
    plain = GradReducer([(a, joint_group(mesh, (0, 1)))])
    backward(1)
    # by default the reducer holds no buffer past a pass (the .grad views alone keep it)
    out["fresh_by_default"] = all(bk.spare is None for bk in plain.buckets) and right_a(1)
    plain.remove()

    # the parameter feed's local view (runtime.param_local) and the reducer's gradient DTensor
    # (runtime.dtensors.grad_like) give what to_local's backward and from_local give
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from stpc.runtime.dtensors import grad_like, param_local
    same = []
    for placements in [(Replicate(), Replicate()), (Shard(0), Replicate()), (Shard(1), Shard(0))]:
        for transposed in (False, True):  # a gradient that reaches the view non-contiguous: the fallback
            full = torch.arange(16.0).reshape(4, 4)
            grads = []
            for local_of in (param_local, DTensor.to_local):
                p = torch.nn.Parameter(DTensor.from_local(full, mesh, [Replicate(), Replicate()]).redistribute(
                    mesh, placements))
                x = local_of(p)
                ((x.t() if transposed else x) * (rank + 2)).sum().backward()
                grads.append(p.grad)
            mine, theirs = grads
            same.append(type(mine) is DTensor and mine.placements == theirs.placements and mine.shape == theirs.shape
                        and mine.stride() == theirs.stride() and torch.equal(mine.to_local(), theirs.to_local())
                        # laid out as the parameter, as autograd lays out a plain leaf's gradient
                        and mine.to_local().stride() == p.to_local().stride())
        local = torch.full(p.to_local().shape, float(rank))
        mine = grad_like(p, local)
        theirs = DTensor.from_local(local, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        same.append(mine.placements == theirs.placements and mine.shape == theirs.shape
                    and mine.stride() == theirs.stride() and torch.equal(mine.to_local(), local))
    # double backward (the gradient itself differentiable): param_local's gradient keeps its
    # graph, as to_local's does (a direct DTensor of it did not: the second order was lost)
    orders = []
    for local_of in (param_local, DTensor.to_local):
        p = torch.nn.Parameter(DTensor.from_local(torch.arange(4.0) + rank, mesh, [Shard(0), Replicate()]))
        (g,) = torch.autograd.grad((local_of(p) ** 3).sum(), p, create_graph=True)
        (g.to_local() ** 2).sum().backward()
        orders.append((g.to_local(), p.grad.to_local() if p.grad is not None else None))
    (g1, h1), (g2, h2) = orders
    same.append(h1 is not None and torch.equal(g1, g2) and torch.equal(h1, h2))
    out["param_local"] = same

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 128, (B, S), generator=g), torch.randint(0, 128, (B, S), generator=g))
               for _ in range(2)]
    for label, mesh_shape, bucket_mb in [("2x2-small-buckets", (2, 2), 1e-4), ("4-default", (4,), 25.0),
                                         ("4-unbucketed", (4,), None)]:
        torch.manual_seed(0)
        model = models.build("llama-tiny")
        single = copy.deepcopy(model)
        pm = stpc.compile(model, mesh_shape, batches[0], plan=Plan.from_json(plans[mesh_shape]), bucket_mb=bucket_mb)
        prog = next(iter(pm.stpc.programs.values()))
        worst = 0.0
        for step in range(2):  # step 1 accumulates two micro-batches without zero_grad
            pm.zero_grad()
            single.zero_grad()
            for idx, tgt in (batches[:1] if step == 0 else batches):
                pm(idx, tgt).backward()
                single(idx, tgt).backward()
            grads = full_grads(pm)
            worst = max([worst] + [_rel(grads[k], p.grad) for k, p in single.named_parameters()])
        reducer = prog.reducer
        out[label] = {"worst": worst, "deferred": len(prog.deferred),
                      "buckets": len(reducer.buckets) if reducer else 0,
                      "launch_log": reducer.launch_log if reducer else []}

    # a parameter replaced after the first call (a new nn.Parameter; then every one, by
    # load_state_dict(assign=True)): the new objects' gradients are summed too
    torch.manual_seed(0)
    model = models.build("llama-tiny")
    single = copy.deepcopy(model)
    pm = stpc.compile(model, (4,), batches[0], plan=Plan.from_json(plans[(4,)]))
    prog = next(iter(pm.stpc.programs.values()))
    fqn = next(iter(prog.deferred))
    worst = []
    for step in range(3):
        if step == 1:
            owner, name = fqn.rsplit(".", 1)
            old = pm.get_parameter(fqn)
            setattr(pm.get_submodule(owner), name, torch.nn.Parameter(old.detach().clone()))
        if step == 2:
            pm.load_state_dict({k: v.detach().clone() for k, v in pm.state_dict().items()}, assign=True)
        pm.zero_grad()
        single.zero_grad()
        for idx, tgt in batches:
            pm(idx, tgt).backward()
            single(idx, tgt).backward()
        grads = full_grads(pm)
        worst.append(max(_rel(grads[k], p.grad) for k, p in single.named_parameters()))
    out["replaced"] = {"worst": worst, "fqn": fqn}
    return out


def test_bucketed_reduction_matches_single_device():
    # data parallel with the batch split at every linear (the tiny model on its own would be
    # planned whole on every rank: at this size latency beats any collective)
    plans = {shape: make_plan("llama-tiny", "x".join(map(str, shape)), "dp", B, S).to_json() for shape in [(2, 2), (4,)]}
    res = spawn(_cases, 4, plans, timeout_s=240)
    for r in res:
        assert r["bare"]
        assert r["held_once"] == {"b_dropped_while_a_computed": True, "values": True}, r["held_once"]
        assert r["kept_buffers"] == {"values": True, "reused": True, "held_untouched": True}, r["kept_buffers"]
        assert r["fresh_by_default"]
        assert all(r["param_local"]) and len(r["param_local"]) == 10, r["param_local"]
        small, default, plain = r["2x2-small-buckets"], r["4-default"], r["4-unbucketed"]
        # fp32, rtol 1e-4: bucketing changes the order of the sums only
        assert small["worst"] <= 1 and default["worst"] <= 1 and plain["worst"] <= 1, r
        assert small["deferred"] > 10 and small["buckets"] == small["deferred"]  # one parameter per bucket
        # each bucket launched as soon as its gradient was ready, while backward went on
        assert small["launch_log"] == list(range(1, small["buckets"] + 1))
        assert default["deferred"] > 10 and 1 <= default["buckets"] <= 2  # a 1 MiB first bucket, then 25 MiB
        assert plain["deferred"] == 0 and plain["buckets"] == 0
        # before the reducer re-hooked replaced parameters, steps 1 and 2 left a gradient unsummed
        assert max(r["replaced"]["worst"]) <= 1, r["replaced"]


def test_a_parameter_named_alone_gets_a_bucket_of_its_own():
    """``alone`` (stpc names tied parameters): that parameter's bucket holds it only, so no
    other gradient's arrival allocates its slot while its own is still being summed; the
    others still share buckets by size."""
    from stpc.runtime import GradReducer

    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(4)]
    red = GradReducer([(p, "g") for p in ps], bucket_bytes=2**20, alone=frozenset({id(ps[2])}))
    try:
        assert [[id(p) for p in b.params] for b in red.buckets] == [[id(ps[0]), id(ps[1])], [id(ps[2])],
                                                                  [id(ps[3])]]
        # (the first bucket is DDP's small one, then by size: without alone, two buckets)
        plain = GradReducer([(p, "g") for p in ps], bucket_bytes=2**20, first_bucket_bytes=16)
        assert [len(b.params) for b in plain.buckets] == [1, 3]
        red2 = GradReducer([(p, "g") for p in ps], bucket_bytes=2**20, first_bucket_bytes=16,
                           alone=frozenset({id(ps[2])}))
        assert [len(b.params) for b in red2.buckets] == [1, 1, 1, 1]
        plain.remove()
        red2.remove()
    finally:
        red.remove()


def _tied_bucket(rank, world):
    import stpc
    from stpc import models

    torch.manual_seed(0)
    model = models.build("gpt-tiny")
    pm = stpc.compile(model, (world,), models.example_inputs("gpt-tiny", B, S, device="cpu"), hints="dp", cache=False)
    pm(*models.example_inputs("gpt-tiny", B, S, device="cpu")).backward()
    prog = next(iter(pm.stpc.programs.values()))
    tied = pm.get_parameter("wte.weight")
    assert tied is pm.get_parameter("lm_head.weight")
    return {"deferred": "wte.weight" in prog.deferred or "lm_head.weight" in prog.deferred,
            "its_bucket": [len(b.params) for b in prog.reducer.buckets if any(p is tied for p in b.params)],
            "buckets": len(prog.reducer.buckets)}


def test_a_tied_weight_is_reduced_in_a_bucket_of_its_own():
    for r in spawn(_tied_bucket, 2, timeout_s=120):
        assert r["deferred"] and r["its_bucket"] == [1] and r["buckets"] > 1, r


def _kept_buckets(rank, world):
    import copy
    import dataclasses

    import stpc
    from stpc import models
    from stpc.cost_models import get_cluster

    base = get_cluster("cpu-local")
    # a device whose allocator hands freed memory back to the system (glibc on a CPU; the figures
    # a calibration profile measures): the plan keeps the buckets, the program's reducer follows
    kept = dataclasses.replace(base, device=dataclasses.replace(base.device, fresh_alloc_bytes=2.0**25,
                                                                 fresh_page_bw=1e9))
    torch.manual_seed(0)
    model = models.build("gpt-tiny")
    inputs = models.example_inputs("gpt-tiny", B, S, device="cpu")
    out = {}
    for name, cluster in (("kept", kept), ("made", base)):
        pm = stpc.compile(copy.deepcopy(model), (world,), inputs, hints="dp", cluster=cluster, cache=False)
        prog = next(iter(pm.stpc.programs.values()))
        ptrs, grads = [], []
        for step in range(3):
            pm.zero_grad(set_to_none=True)
            pm(*inputs).backward()
            ptrs.append(pm.get_parameter("layers.0.mlp.fc1.weight").grad.to_local().untyped_storage().data_ptr())
            # (copies: a view of a bucket held past zero_grad keeps the reducer from writing it again)
            grads.append({k: g.clone() for k, g in full_grads(pm).items()})
        out[name] = {"planned": prog.plan.stats["keep_grad_buckets"], "keeps": prog.reducer.keep_buffers,
                     "reused": ptrs[1] == ptrs[2], "grads": grads}
    out["same"] = all(torch.equal(a[k], b[k]) for a, b in zip(out["kept"].pop("grads"), out["made"].pop("grads"))
                      for k in a)
    return out


def test_a_plan_that_keeps_the_buckets_has_its_reducer_keep_them():
    """The plan's ``keep_grad_buckets`` (the planner's memory model held the buckets through
    forward: ``cost_models.keeps_grad_buckets``) reaches the compiled program's reducer: its
    buffers are written again step after step; a plan for a caching allocator's device makes
    them in each backward (here ``zero_grad`` drops the gradients, so a kept buffer is free to
    reuse). The same gradients either way, bit for bit: the same sums in the same order."""
    for r in spawn(_kept_buckets, 2, timeout_s=180):
        assert r["kept"] == {"planned": True, "keeps": True, "reused": True}, r
        assert r["made"]["planned"] is False and r["made"]["keeps"] is False, r
        assert r["same"], r


def _searched_for_its_buckets(rank, world):
    import copy

    import stpc
    from stpc import models

    torch.manual_seed(0)
    model = models.build("llama-tiny")
    # (a batch the plan splits over the ranks: at B x S, latency beats any collective)
    inputs = models.example_inputs("llama-tiny", 32, 128, device="cpu")
    out = {}
    for bucket_mb in (25, 0.5, None):
        pm = stpc.compile(copy.deepcopy(model), (world,), inputs, hints="dp", cluster="cpu-local", cache=False,
                          bucket_mb=bucket_mb)
        pm(*inputs).backward()  # (the reducer hooks the gradients at the first call)
        prog = next(iter(pm.stpc.programs.values()))
        out[bucket_mb] = {"costed": prog.plan.stats["grad_bucket_bytes"], "s": prog.plan.modelled_step_time_s,
                          "reducer": prog.reducer is not None}
    return out


def test_the_plan_is_searched_for_the_buckets_the_program_sums_in():
    """``stpc.compile(bucket_mb=)`` plans for the reducer it builds: the plan is costed with
    those buckets (``plan.stats["grad_bucket_bytes"]``), and without any (``None``: each
    summed gradient all-reduced where backward makes it, waited there) it is costed dearer."""
    for r in spawn(_searched_for_its_buckets, 2, timeout_s=180):
        assert [r[b]["costed"] for b in (25, 0.5, None)] == [25 * 2**20, 0.5 * 2**20, None], r
        assert r[25]["reducer"] and r[0.5]["reducer"] and not r[None]["reducer"], r
        assert r[None]["s"] > r[25]["s"], r
