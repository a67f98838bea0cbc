"""recompute: each layer's span becomes one checkpointed submodule; backward replays it.

Before: a lowered program whose layers' nodes sit in the top-level graph. After: one
``Recompute`` call per layer, the same nodes inside (``inline`` gives them back), the
replayed communication listed for ``verify``; run for real, the same loss and gradients
with far fewer tensors kept from forward to backward.
"""
import copy
import dataclasses

import pytest
import torch
import torch.fx as fx
from _graphs import traced_and_plan
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import stpc
from stpc import models
from stpc.passes import (LoweringError, Recompute, cleanup, comm_schedule, insert_collectives, recompute,
                         ring_decompose, shard_params, verify)
from stpc.passes.recompute import _KERNELS, SelectiveMismatch, inline
from stpc.planner import search
from stpc.planner.analysis import layer_of


def _lowered(model="gpt-tiny", mesh="2x2", family="megatron"):
    tg, plan = traced_and_plan(model, mesh, family)
    gm = shard_params(tg.gm, plan, groups=["g0", "g1"][:len(plan.mesh_shape)])
    return plan, cleanup(ring_decompose(insert_collectives(gm, plan), plan), plan)


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Recompute)]


def test_a_plan_without_recompute_is_left_alone():
    plan, gm = _lowered()
    code = gm.code
    assert recompute(gm, plan).code == code and not _calls(gm)


@pytest.mark.parametrize("model,mesh,family", [("gpt-tiny", "2x2", "megatron"), ("llama-tiny", "4", "ag_rs"),
                                               ("llama-tiny", "4", "zero")])
def test_each_layer_becomes_one_span(model, mesh, family):
    plan, gm = _lowered(model, mesh, family)
    before = {n.name for n in gm.graph.nodes if n.op == "call_function"}
    layers = {layer_of(n) for n in gm.graph.nodes if n.op == "call_function"} - {None}
    plan.stats["recompute"] = "full"
    gm = recompute(gm, plan)
    calls = _calls(gm)
    assert [gm.get_submodule(c.target).layer for c in calls] == sorted(layers) == [0, 1]
    # no layer's compute is left outside its span, and the spans hold nothing else of the layers'
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and layer_of(n) is not None]
    for c in calls:
        body = gm.get_submodule(c.target).body
        assert {layer_of(n) for n in body.graph.nodes if n.op == "call_function"} <= {None, c.meta["recompute"]}
    # the flat program is the one before, node for node
    assert {n.name for n in inline(gm).nodes if n.op == "call_function"} == before
    verify(gm, plan)


def test_replayed_communication_is_the_spans_forward_again():
    plan, gm = _lowered()
    plain = comm_schedule(gm, plan, 0)
    plan.stats["recompute"] = "full"
    gm = recompute(gm, plan)
    sched = comm_schedule(gm, plan, 0)
    replay = [e for e in sched if e["phase"] == "recompute"]
    assert [e for e in sched if e["phase"] != "recompute"] == plain
    flat = inline(gm)
    in_span = {n.name: n.meta["recompute"] for n in flat.nodes if "recompute" in n.meta}
    fwd = [e for e in plain if e["phase"] == "fwd"]
    # per layer, its span's forward communication in forward order, replayed before its backward duals
    for layer in (1, 0):
        mine = [(e["node"], e["op"]) for e in fwd if in_span.get(e["node"]) == layer]
        assert mine and [(e["node"], e["op"]) for e in replay if in_span[e["node"]] == layer] == mine
    first_replay = {layer: min(i for i, e in enumerate(sched) if e["phase"] == "recompute"
                               and in_span[e["node"]] == layer) for layer in (0, 1)}
    assert first_replay[1] < first_replay[0]  # backward reaches the last layer first
    for layer, k in first_replay.items():  # no backward dual of a layer's span comes before its replay
        assert all(in_span.get(e["node"]) != layer for e in sched[:k] if e["phase"] == "bwd")


def test_interleaved_layers_are_refused_by_name():
    plan, gm = _lowered()
    plan.stats["recompute"] = "full"
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    first_of_1 = next(n for n in nodes if layer_of(n) == 1)
    last_of_0 = [n for n in nodes if layer_of(n) == 0][-1]
    last_of_0.meta["module"] = first_of_1.meta["module"]  # a layer-1 node inside layer 0's span
    first_of_1.meta["module"] = "layers.0.ln1"
    with pytest.raises(LoweringError, match=r"layers 0 and 1 interleave.*Fix: plan without recompute"):
        recompute(gm, plan)


def _saved_bytes(fn):
    """(output, bytes autograd keeps from forward to backward while ``fn`` runs)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def test_one_process_same_gradients_and_less_kept():
    """The traced single-device program, spans outlined, run for real: bit-identical loss
    and gradients, and what forward keeps for backward shrinks to the layers' inputs. With
    ``recompute_layers`` = k only the first k layers' spans are outlined: each one more
    keeps less."""
    torch.manual_seed(0)
    model = models.build("llama-tiny", n_layers=3)
    idx, tgt = models.example_inputs("llama-tiny", 4, 32, device="cpu")
    tg = stpc.trace(model, (idx, tgt))
    _, plan = traced_and_plan("llama-tiny", "2", "dp")
    params = dict(model.named_parameters())
    runs = []
    for count in (0, 1, 2, None):
        gm = copy.deepcopy(tg.gm)
        if count != 0:
            p = dataclasses.replace(plan, stats={**plan.stats, "recompute": "full", "recompute_layers": count})
            gm = recompute(gm, p)
            assert [gm.get_submodule(c.target).layer for c in _calls(gm)] == list(range(count or 3))
        leaves = {k: p.detach().clone().requires_grad_() for k, p in params.items()}
        args = [leaves[tg.param_fqns[n.name]] if n.name in tg.param_fqns else {"idx": idx, "targets": tgt}[n.name]
                for n in gm.graph.nodes if n.op == "placeholder"]
        out, kept = _saved_bytes(lambda: gm(*args))
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()
        runs.append((loss.detach(), {k: v.grad for k, v in leaves.items()}, kept))
    l0, g0, kept0 = runs[0]
    for l1, g1, _ in runs[1:]:
        assert torch.equal(l0, l1)
        assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    kept = [r[2] for r in runs]
    assert kept == sorted(kept, reverse=True) and len(set(kept)) == 4, kept
    assert kept[-1] < kept0 / 3, kept


class _LiveAfter(TorchDispatchMode):
    """Tracks the storages ops create under it; ``live_bytes()``: those still alive."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
                      for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def live_bytes(self) -> int:
        return sum(dict((w.cdata, n) for w, n in self.made if not w.expired()).values())


class _KernelCount(TorchDispatchMode):
    """Counts the matmul and fused-attention kernels that run under it."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in _KERNELS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,overrides", [("llama-tiny", {}), ("gpt-tiny", {"position": "alibi"})])
def test_selective_keeps_the_named_kernels_outputs_and_replays_the_rest(name, overrides):
    """Selective recomputation on the traced single-device program: the same loss and
    gradients as without recomputation; what forward keeps lies between full recomputation's
    and none's; and backward runs exactly one matmul or fused-attention kernel fewer per node
    the plan keeps than full recomputation's replay does (those outputs come from the cache).
    With ALiBi's float mask the CPU attention runs as bmm + softmax, no fused kernel: it is
    replayed, the rest as planned."""
    torch.manual_seed(0)
    model = models.build(name, n_layers=3, **overrides)
    idx, tgt = models.example_inputs(name, 4, 32, device="cpu")
    tg = stpc.trace(model, (idx, tgt))
    plan = search(tg, (2,), hints="dp", recompute="selective")
    kept = plan.stats["recompute_kept"]
    assert plan.stats["recompute"] == "selective" and len({layer_of(n) for n in tg.graph.nodes if n.name in kept}) == 3
    params = dict(model.named_parameters(remove_duplicate=False))  # (a tied head reads the embedding's)
    runs = {}
    for level in ("none", "selective", "full"):
        gm = copy.deepcopy(tg.gm)
        if level != "none":
            gm = recompute(gm, dataclasses.replace(plan, stats={**plan.stats, "recompute": level}))
            assert {gm.get_submodule(c.target).selective for c in _calls(gm)} == {level == "selective"}
        leaves = {k: p.detach().clone().requires_grad_() for k, p in params.items()}
        args = [leaves[tg.param_fqns[n.name]] if n.name in tg.param_fqns else {"idx": idx, "targets": tgt}[n.name]
                for n in gm.graph.nodes if n.op == "placeholder"]
        with _LiveAfter() as made:  # (what forward leaves alive for backward: saved and cached)
            out = gm(*args)
        nbytes = made.live_bytes()
        loss = out[0] if isinstance(out, (tuple, list)) else out
        with _KernelCount() as count:
            loss.backward()
        runs[level] = (loss.detach(), {k: v.grad for k, v in leaves.items()}, nbytes, count.n)
    (l0, g0, none_kept, _), (l1, g1, sel_kept, sel_n), (_, _, full_kept, full_n) = runs.values()
    assert torch.equal(l0, l1) and g0.keys() == g1.keys()
    assert all(torch.equal(g0[k], g1[k]) if g0[k] is not None else g1[k] is None for k in g0)
    assert full_kept < sel_kept < none_kept, (full_kept, sel_kept, none_kept)
    attention = {n.name for n in tg.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default}
    cached = [k for k in kept if k not in attention or not overrides]  # (ALiBi's attention: no fused kernel)
    assert full_n - sel_n == len(cached), (full_n, sel_n, kept)
    # through torch.compile the policy marks the same kernels: the backward graph the
    # partitioner cuts runs no more of them than the eager replay does (full's: more)
    for level in ("selective", "full"):
        gm = recompute(copy.deepcopy(tg.gm), dataclasses.replace(plan, stats={**plan.stats, "recompute": level}))
        backward = []

        def bw(g, _):
            backward.append(sum(n.op == "call_function" and n.target in _KERNELS for n in g.graph.nodes))
            return make_boxed_func(g.forward)
        torch._dynamo.reset()
        fn = torch.compile(gm, backend=aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                                   bw_compiler=bw, partition_fn=min_cut_rematerialization_partition))
        leaves = {k: p.detach().clone().requires_grad_() for k, p in params.items()}
        args = [leaves[tg.param_fqns[n.name]] if n.name in tg.param_fqns else {"idx": idx, "targets": tgt}[n.name]
                for n in gm.graph.nodes if n.op == "placeholder"]
        out = fn(*args)
        (out[0] if isinstance(out, (tuple, list)) else out).backward()
        assert torch.allclose((out[0] if isinstance(out, (tuple, list)) else out), l0)
        runs[level] = backward
    assert runs["selective"][0] <= sel_n < runs["full"][0], (runs["selective"], sel_n, runs["full"])


def test_selective_refuses_a_plan_naming_nodes_the_program_lacks():
    plan, gm = _lowered()
    plan.stats.update(recompute="selective", recompute_kept=["linear_99"])
    with pytest.raises(LoweringError, match=r"keeps the outputs of 1 nodes this program lacks \(linear_99\).*Fix"):
        recompute(gm, plan)


def _two_linears():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    h = g.call_function(torch.ops.aten.linear.default, (x, w))
    g.output((g.call_function(torch.ops.aten.linear.default, (torch.relu(fx.Proxy(h)).node, w)),))
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("keep", [(True,), (True, False, True)])
def test_a_span_running_another_number_of_kernels_than_listed_fails(keep):
    """The policy names kernels by their order: a span that runs more or fewer matmuls than
    its plan lists fails by name instead of keeping other outputs than the plan charged."""
    span = Recompute(_two_linears(), 3, (keep, ()))
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    ran = "more than 1" if len(keep) == 1 else "2"
    with pytest.raises(SelectiveMismatch, match=r"layer 3: its span ran %s matmul kernels, its plan lists %d matmul "
                                                r"kernels and at most 0 fused attentions .*Fix: "
                                                r"Hints\(recompute='full'\)" % (ran, len(keep))):
        span(x, w)
    # listed right, it runs, and backward replays only the one not kept (relu's input is
    # the first linear's output, kept; the second linear's is replayed for nothing else)
    (out,) = Recompute(_two_linears(), 3, ((True, False), ()))(x, w)
    with _KernelCount() as count:
        out.sum().backward()
    assert count.n == 1 + 4  # the second linear again, and each linear's two gradient matmuls
