"""recompute: each repeated layer's forward replayed in backward instead of keeping what
its ops saved (activation checkpointing, at graph level).

Expects: a graph after ``cleanup`` (and ``defer_grad_sync``), before ``prefetch_params``.
Runs only for a plan that asks for it (``plan.stats["recompute"]`` is ``"full"`` or
``"selective"``, written by the search, ``Hints.recompute``); any other plan's graph is
returned unchanged. ``plan.stats["recompute_layers"]`` = k (``Hints.recompute_layers``):
only the first k layers in index order are recomputed, the others run as they are.

For each layer (the nodes whose module path names an indexed module such as
``layers.3``: ``planner.analysis.layer_of``), the span of the graph from its first node to
its last, the communication the earlier passes put between them included, becomes one
submodule ``recompute_layer3`` (a :class:`Recompute`) called in its place:

  * forward runs the span under ``torch.utils.checkpoint.checkpoint`` (non-reentrant): what
    its ops save for backward is dropped; only what the span reads from before it is kept
    (the residual stream entering the layer; parameters and constants are held anyway);
  * backward replays the whole span (early stop off, so every rank replays every
    collective of it, the ones after its last saved tensor included, as the cost model
    charges and ``verify`` lists) to rebuild the saved tensors, then runs the layer's
    backward as before. RNG state is restored for the replay (dropout draws the same mask).

A parameter gathered whole inside a span (ZeRO/FSDP) is gathered again by the replay,
FSDP's regather; ``prefetch_params`` sees the top-level graph only, so those gathers are
neither coalesced nor issued a layer ahead (the cost model charges them so:
``planner.builder``).

Under ``"selective"`` the checkpoint caches the outputs of the nodes the plan names
(``plan.stats["recompute_kept"]``: the layers' plain matmuls and attentions whose outputs
backward keeps anyway, ``planner.analysis.kept_when_selective``): kept from forward to
backward, not computed again. The replay reruns everything else (norms, activations, the
other matmuls, communication) to rebuild what the span's ops saved
(``torch.utils.checkpoint``'s selective checkpointing). Its policy names the kernels by
their order: each matmul node runs one ``mm``/``addmm`` kernel, each attention at most one
fused-attention kernel, so the span's k-th kernel of a class is its k-th node's of that
class. A span that runs another number of matmul kernels, or more fused attentions than it
has attentions, fails (``SelectiveMismatch``) rather than keep other outputs than the plan
charged; an attention that runs as bmm + softmax (on CPU with a float mask or dropout: no
fused kernel) is replayed, less memory and more time than the plan says. The order holds
under ``torch.compile`` too, whose partitioner saves what the policy marks. A ring's
custom op is replayed whole, its transfers too.

Guarantees: the same values and gradients (the replay reruns the same ops on the same
inputs); every rank runs the same spans and replays the same collectives in the same
order (the graph is one SPMD program). The span's nodes keep their names inside the
submodule (``inline`` restores the flat graph, e.g. for ``verify``).
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from ._common import LoweringError, fail, finish
from stpc.planner.analysis import kept_when_selective, layer_of


aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default}
_FUSED_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default,
                    aten._scaled_dot_product_flash_attention.default,
                    aten._scaled_dot_product_efficient_attention.default,
                    aten._scaled_dot_product_cudnn_attention.default}
_KERNELS = _MATMULS | _FUSED_ATTENTION  # the kernels a kept node's output comes from


class SelectiveMismatch(RuntimeError):
    """A span ran another number of matmul kernels (or more fused attentions) than its plan lists."""


def _selective_contexts(keep: tuple[tuple[bool, ...], tuple[bool, ...]], layer: int, seen: dict | None = None):
    """Selective checkpointing's contexts for one run of layer ``layer``'s span. ``keep``:
    (per matmul node, per attention node) of the span, in order, whether its output is
    cached. The k-th ``mm``/``addmm`` kernel the span runs (forward, and again in the
    replay) is the k-th matmul node's, the k-th fused-attention kernel the k-th attention
    node's; each is cached if its node is kept, replayed otherwise, as is every other op.
    (SAC's cache pairs forward and replay calls by their order itself: the numbering here
    decides which outputs are kept, never which value a replayed call gets.) ``seen``: the
    kernels counted per class and pass, for the caller's check."""
    seen = {} if seen is None else seen

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func not in _KERNELS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        cls = 0 if func in _MATMULS else 1
        k = seen.get((cls, ctx.is_recompute), 0)
        seen[cls, ctx.is_recompute] = k + 1
        if k >= len(keep[cls]):
            raise SelectiveMismatch(_mismatch(layer, keep, f"more than {len(keep[cls])} {_CLASS[cls]}"))
        return CheckpointPolicy.MUST_SAVE if keep[cls][k] else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


_CLASS = ("matmul kernels", "fused attentions")


def _mismatch(layer: int, keep, ran: str) -> str:
    return (f"stpc: selective recomputation of layer {layer}: its span ran {ran}, its plan lists "
            f"{len(keep[0])} {_CLASS[0]} and at most {len(keep[1])} {_CLASS[1]} (one per linear or 2-D "
            f"matmul, one per attention). Fix: Hints(recompute='full'), or report the model")


class Recompute(nn.Module):
    """One layer's span: run under non-reentrant checkpointing where autograd records.
    ``keep`` (selective recomputation): per matmul node and per attention node of the span,
    in order, whether its output is cached rather than replayed (None: full)."""

    def __init__(self, body: fx.GraphModule, layer: int,
                 keep: tuple[tuple[bool, ...], tuple[bool, ...]] | None = None):
        super().__init__()
        self.body, self.layer, self.keep = body, layer, keep

    @property
    def selective(self) -> bool:
        return self.keep is not None

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)
        if torch.compiler.is_compiling():  # traced whole: AOTAutograd replays the span in the backward graph
            kw = {"context_fn": functools.partial(_selective_contexts, self.keep, self.layer)} if self.selective else {}
            return checkpoint(self.body, *args, use_reentrant=False, **kw)
        seen = {}
        kw = {"context_fn": functools.partial(_selective_contexts, self.keep, self.layer, seen)} if self.selective else {}
        with set_checkpoint_early_stop(False):  # replay every collective of the span
            out = checkpoint(self.body, *args, use_reentrant=False, **kw)
        # (an attention may run no fused kernel: bmm + softmax, replayed; a matmul node runs one)
        if self.selective and seen.get((0, False), 0) != len(self.keep[0]):
            raise SelectiveMismatch(_mismatch(self.layer, self.keep, f"{seen.get((0, False), 0)} {_CLASS[0]}"))
        return out


def _spans(gm: fx.GraphModule) -> dict[int, tuple[int, int]]:
    """Per layer, (first, last) position of its compute nodes in graph order."""
    spans: dict[int, tuple[int, int]] = {}
    for i, n in enumerate(gm.graph.nodes):
        if n.op != "call_function" or (layer := layer_of(n)) is None:
            continue
        a, b = spans.get(layer, (i, i))
        spans[layer] = (min(a, i), max(b, i))
    return spans


def _outline(gm: fx.GraphModule, region: list[fx.Node], layer: int, kept: set[str] | None) -> None:
    """Move ``region`` into a :class:`Recompute` submodule called in its place; ``kept``
    (selective): the names of the nodes whose outputs it caches."""
    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    # (the nodes whose outputs the planner could keep, ``kept_when_selective``: each matmul node
    # runs one mm/addmm kernel, each attention at most one fused kernel)
    keep = None
    if kept is not None:
        can = [n for n in region if kept_when_selective(n)]
        attention = aten.scaled_dot_product_attention.default
        keep = (tuple(n.name in kept for n in can if n.target is not attention),
                tuple(n.name in kept for n in can if n.target is attention))
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta.update(a.meta)
    for n in region:
        env[n] = body.node_copy(n, env.__getitem__)
    body.output(tuple(env[o] for o in outputs))
    name = f"recompute_layer{layer}"
    gm.add_submodule(name, Recompute(fx.GraphModule(gm, body, class_name=f"Layer{layer}"), layer, keep))
    with gm.graph.inserting_after(region[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    call.meta["recompute"] = layer
    last = call
    for k, o in enumerate(outputs):
        with gm.graph.inserting_after(last):
            last = gm.graph.call_function(operator.getitem, (call, k))
        # (the value as the layer hands it on: no module of its own, no communication)
        last.meta.update({key: v for key, v in o.meta.items() if key not in ("comm", "ring", "module")})
        o.replace_all_uses_with(last, delete_user_cb=lambda u: u not in inside)
    for n in reversed(region):
        gm.graph.erase_node(n)


def recompute(gm: fx.GraphModule, plan) -> fx.GraphModule:
    """Outline each layer's span into a :class:`Recompute` submodule (module docstring), for
    a plan with ``stats["recompute"]`` ``"full"`` or ``"selective"``; other plans' graphs are
    returned as they are."""
    level = (plan.stats or {}).get("recompute")
    if level not in ("full", "selective"):
        return gm
    spans = sorted(_spans(gm).items(), key=lambda kv: kv[1])
    count = plan.stats.get("recompute_layers")
    chosen = set(sorted(layer for layer, _ in spans)[:count])  # (None: every layer)
    for (la, (_, end)), (lb, (start, _)) in zip(spans, spans[1:]):
        if start <= end:
            node = list(gm.graph.nodes)[start]
            raise fail(node, f"layers {la} and {lb} interleave in the program, so neither is one span to "
                             f"recompute", "plan without recompute (Hints(recompute='none'))")
    kept = set(plan.stats.get("recompute_kept", ())) if level == "selective" else None
    nodes = list(gm.graph.nodes)
    if kept is not None and (lost := kept - {n.name for n in nodes}):
        raise LoweringError(f"stpc: the plan's selective recomputation keeps the outputs of {len(lost)} nodes "
                            f"this program lacks ({', '.join(sorted(lost)[:3])}): a plan of another model. "
                            f"Fix: plan this model (stpc.compile does), or Hints(recompute='full')")
    for layer, (a, b) in spans:
        if layer in chosen:
            _outline(gm, [n for n in nodes[a:b + 1] if n.op == "call_function"], layer, kept)
    gm.delete_all_unused_submodules()
    return finish(gm)


def inline(gm: fx.GraphModule) -> fx.Graph:
    """The flat graph of ``gm``: each :class:`Recompute` call replaced by its span's nodes
    (their own names), each ``getitem`` of it by the span's node; a node copied out of a
    span carries ``meta["recompute"] = layer`` (``verify`` replays those in backward)."""
    flat = fx.Graph()
    env: dict[fx.Node, object] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(mod := gm.get_submodule(n.target), Recompute):
            inner: dict[fx.Node, object] = {}
            args = iter(n.args)
            for m in mod.body.graph.nodes:
                if m.op == "placeholder":
                    inner[m] = env[next(args)]
                elif m.op == "output":
                    env[n] = tuple(inner[o] for o in m.args[0])
                else:
                    inner[m] = c = flat.node_copy(m, inner.__getitem__)
                    c.meta["recompute"] = mod.layer
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0] in env \
                and isinstance(env[n.args[0]], tuple):
            env[n] = env[n.args[0]][n.args[1]]
        else:
            env[n] = flat.node_copy(n, env.__getitem__)
    return flat


__all__ = ["recompute", "Recompute", "SelectiveMismatch", "inline"]
