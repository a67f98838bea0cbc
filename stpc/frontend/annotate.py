"""annotate: write per-node cost facts into ``node.meta``.

After this pass every node has
  val          FakeTensor (already written by export; checked here)
  flops        forward FLOPs, from torch.utils.flop_counter's formulas (0 where torch has none)
  bytes_read   bytes of tensor inputs an op reads (0 for views: they move nothing)
  bytes_written bytes of the outputs it writes (0 for views)
  param        the parameter/buffer FQN a placeholder is, else None
  module       the innermost nn.Module path it came from ("" for the root)
  source       "file:line" of the user's source line, when known
"""
from __future__ import annotations

import os
import re

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _vals(x):
    """Replace fx Nodes in args by their FakeTensor values."""
    return fx.node.map_arg(x, lambda n: n.meta.get("val"))


def _key(x):
    """A hashable stand-in for an op's arguments: shapes/dtypes of tensors, the rest as is."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_key(y) for y in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _key(v)) for k, v in x.items()))
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)) else repr(x)


_composite_flops: dict = {}


def node_flops(node: fx.Node) -> int:
    """Forward FLOPs of one aten node by torch's own formulas (torch.utils.flop_counter).

    Ops the registry knows (mm, addmm, bmm, attention kernels) use their
    formula directly. Composite ops (aten.linear, aten.scaled_dot_product_attention)
    are re-run once per distinct signature on their FakeTensors under a
    FlopCounterMode, so they decompose into the kernels torch counts. The cache
    keeps this cheap for repeated layers.
    """
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    if is_view(node) or node.target.overloadpacket in _NO_FLOPS:
        return 0
    args, kwargs = _vals(node.args), _vals(node.kwargs)
    if node.target.overloadpacket is torch.ops.aten.scaled_dot_product_attention:
        # On CPU the composite lowers to a kernel the registry does not list; count it
        # with torch's fused-attention formula (q, k, v shapes), as on GPU.
        sdpa = flop_registry[torch.ops.aten._scaled_dot_product_efficient_attention]
        return int(sdpa(*args[:3], out_val=node.meta.get("val")))
    formula = flop_registry.get(node.target.overloadpacket)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    key = (node.target, _key(args), _key(kwargs))
    if key not in _composite_flops:
        fake = next((t.fake_mode for t in _tensors((args, kwargs)) if hasattr(t, "fake_mode")), None)
        if fake is None:
            _composite_flops[key] = 0
        else:
            with fake, FlopCounterMode(display=False) as counter:
                node.target(*args, **kwargs)
            _composite_flops[key] = counter.get_total_flops()
    return _composite_flops[key]


# Ops that do no multiply-accumulate work: skip the fake re-run for them.
_NO_FLOPS = {getattr(torch.ops.aten, n) for n in (
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "mean", "sum", "cat", "clone", "copy",
    "embedding", "arange", "ones", "zeros", "full", "tril", "masked_fill", "where", "gelu", "relu",
    "silu", "sigmoid", "tanh", "exp", "log", "cos", "sin", "layer_norm", "rms_norm", "cross_entropy",
    "_to_copy", "to", "repeat_interleave", "contiguous", "lift_fresh_copy", "scalar_tensor",
    "log_softmax", "softmax", "_log_softmax", "_softmax", "nll_loss", "nll_loss_forward",
) if hasattr(torch.ops.aten, n)}


def is_view(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.is_view


_TORCH_DIR = os.path.dirname(torch.__file__)


def source_of(node: fx.Node) -> str:
    """The user's line that made this node: the innermost stack frame outside torch itself."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
    return f"{user[-1][0]}:{user[-1][1]}" if user else ""


def annotate(gm: fx.GraphModule, param_fqns: dict[str, str], buffer_fqns: dict[str, str]) -> fx.GraphModule:
    state = {**param_fqns, **buffer_fqns}
    for node in gm.graph.nodes:
        meta = node.meta
        if node.op in ("placeholder", "call_function") and "val" not in meta:
            raise RuntimeError(f"stpc.annotate: node {node.name} has no FakeTensor value "
                               f"({source_of(node) or 'no source line'}); was the graph made by stpc.trace?")
        meta["param"] = state.get(node.name) if node.op == "placeholder" else None
        stack = meta.get("nn_module_stack") or {}
        meta["module"] = list(stack.values())[-1][0] if stack else ""
        meta["source"] = source_of(node)
        if node.op != "call_function":
            meta["flops"] = meta["bytes_read"] = meta["bytes_written"] = 0
            continue
        meta["flops"] = node_flops(node)
        if is_view(node):
            meta["bytes_read"] = meta["bytes_written"] = 0
        else:
            meta["bytes_read"] = sum(t.nbytes for t in _tensors(_vals((node.args, node.kwargs))))
            meta["bytes_written"] = sum(t.nbytes for t in _tensors(meta["val"]))
        if node.target is torch.ops.aten.rms_norm.default:
            # aten's rms_norm without a fused kernel (CPU, eager) is its composite: pow, mean,
            # add, rsqrt, mul, which read the input twice and the squares once, and write the
            # squares and the result (the statistics are 1/d of that): what frontend.normalize
            # fused is charged as what runs (a weight: one more mul, in place)
            weighted = len(node.args) > 2 and node.args[2] is not None
            meta["bytes_read"] = (3 + weighted) * meta["val"].nbytes
            meta["bytes_written"] = (2 + weighted) * meta["val"].nbytes
    return gm
