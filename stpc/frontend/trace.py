"""trace: a model and example inputs become an aten-level fx graph (torch.export training IR).

Split-like views that return tuples become slices, so the planner sees every piece, and a
written-out RMSNorm becomes one ``rms_norm`` node (``stpc.frontend.normalize``).

The graph takes parameters and buffers as placeholders (in the order of the
export signature), then the user inputs. Built on ``meta`` tensors it plans a
70B model without allocating a weight; every node carries its FakeTensor in
``node.meta["val"]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind

from stpc.frontend.annotate import annotate, source_of
from stpc.frontend.module_calls import recording
from stpc.frontend.normalize import fuse_rms_norm, split_to_slices


@dataclass
class TracedGraph:
    """The traced program and what its placeholders are.

    ``gm(*params_and_buffers, *user_inputs)`` runs it; ``param_fqns`` maps a
    placeholder name to the parameter's fully-qualified name in the model;
    ``tied_params`` maps the placeholder of a parameter that is the same tensor as an
    earlier one (a tied LM head) to that earlier placeholder. ``user_inputs`` are the
    placeholders of the flattened ``(args, kwargs)`` leaves in ``in_spec`` order (a
    non-tensor leaf has one too: export bakes its value into the graph, so a
    different value is a different graph); ``out_spec`` rebuilds the model's output
    structure (a tensor, a tuple, a dict, a Hugging Face ``ModelOutput``) from the
    graph's flat outputs.
    """

    gm: fx.GraphModule
    param_fqns: dict[str, str]
    buffer_fqns: dict[str, str]
    user_inputs: list[str]
    user_outputs: list[str]
    model_name: str = ""
    tied_params: dict[str, str] = field(default_factory=dict)
    in_spec: object = None   # torch.utils._pytree.TreeSpec of (args, kwargs)
    out_spec: object = None  # TreeSpec of the model's output
    meta: dict = field(default_factory=dict)
    facts: object = None  # the planner's mesh-independent analysis, cached (``stpc.planner.analyse``)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def placeholder_order(self) -> list[str]:
        return [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]

    def tied_copies(self) -> set[str]:
        """The placeholders of a tied parameter whose storage another of its names holds:
        every name of the tensor but one, the first the graph reads (export may read a
        tied weight through one name only, e.g. a GPT's LM head's, leaving the embedding's
        unread: its placement is not the one the runtime stores), else the first."""
        names: dict[str, list[str]] = {}
        for ph in self.placeholder_order():
            root = self.tied_params.get(ph, ph)
            if root != ph or ph in self.tied_params.values():
                names.setdefault(root, []).append(ph)
        read = {n.name for n in self.gm.graph.nodes if n.op == "placeholder" and n.users}
        copies = set()
        for group in names.values():
            holder = next((ph for ph in group if ph in read), group[0])
            copies |= set(group) - {holder}
        return copies

    def state_args(self, model: nn.Module) -> list[torch.Tensor]:
        """The parameter/buffer tensors of ``model`` in placeholder order."""
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(dict(model.named_buffers(remove_duplicate=False)))
        fqns = {**self.param_fqns, **self.buffer_fqns}
        return [named[fqns[n]] for n in self.placeholder_order() if n in fqns]

    def num_params(self) -> int:
        return sum(n.meta["val"].numel() for n in self.gm.graph.nodes
                   if n.op == "placeholder" and n.name in self.param_fqns)

    def total_flops(self) -> int:
        return sum(n.meta.get("flops", 0) for n in self.gm.graph.nodes)


def trace(model: nn.Module, example_inputs: tuple, name: str = "",
          example_kwargs: dict | None = None) -> TracedGraph:
    """Export ``model`` at the aten level (training IR) on ``example_inputs`` (positional)
    and ``example_kwargs`` (keyword) and annotate every node.

    Works with parameters and inputs on ``meta``: nothing is computed, shapes
    propagate through FakeTensors.
    """
    try:
        with recording(model) as calls:
            ep = torch.export.export(model, tuple(example_inputs), dict(example_kwargs or {}), strict=False)
    except Exception as e:  # export errors are long; keep the cause, add what to do
        raise RuntimeError(
            f"stpc.trace: torch.export could not capture {type(model).__name__} as one graph: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n"
            "Fix: give example inputs on the same device as the model's parameters (meta "
            "for planning), of fixed shape, and remove data-dependent Python control flow "
            "from forward()."
        ) from e
    sig = ep.graph_signature
    gm = ep.graph_module
    user_phs = [spec.arg.name for spec in sig.input_specs if spec.kind == InputKind.USER_INPUT]
    lifted = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    if lifted:
        ph = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name in lifted)
        user = next(iter(ph.users), ph)
        while not source_of(user) and user.users:  # lift_fresh_copy has no frame; its user does
            user = next(iter(user.users))
        raise ValueError(
            f"stpc.trace: {type(model).__name__}.forward creates a tensor constant ({ph.name}, used by "
            f"{user.name} at {source_of(user) or 'an unknown line'}), e.g. with torch.tensor(...). "
            "Fix: register it as a buffer (register_buffer(name, t, persistent=False)) or compute it "
            "with torch ops (torch.arange, ...), so every rank can place it.")
    tg = TracedGraph(
        gm=gm,
        param_fqns=dict(sig.inputs_to_parameters),
        buffer_fqns=dict(sig.inputs_to_buffers),
        user_inputs=user_phs,
        user_outputs=list(sig.user_outputs),
        model_name=name or type(model).__name__,
        tied_params=_tied(model, dict(sig.inputs_to_parameters)),
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        meta={"module_calls": calls},
    )
    split_to_slices(gm)
    fuse_rms_norm(gm)
    annotate(gm, tg.param_fqns, tg.buffer_fqns)
    return tg


def _tied(model: nn.Module, param_fqns: dict[str, str]) -> dict[str, str]:
    """Placeholder -> the earlier placeholder of the same parameter tensor (tied weights)."""
    tensor_of = dict(model.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    tied = {}
    for ph, fqn in param_fqns.items():
        key = id(tensor_of[fqn])
        if key in first:
            tied[ph] = first[key]
        else:
            first[key] = ph
    return tied
