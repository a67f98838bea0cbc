"""How far the ops that are not GEMMs run from their roofline (``DeviceSpec.op_slowdown``).

The planner charges an op that is not a GEMM its roofline time: forward ``max(flops /
rate, bytes / mem_bw)``, backward the same over twice the bytes (``NodeTimer.phases``;
a follower's forward and backward together over three times the bytes). On a GPU an
elementwise kernel streams at close to its memory bandwidth. A CPU core runs erf (gelu;
its tanh approximation, GPT-2's, is probed on its own), exp (softmax, the loss's
log-probabilities), attention's blocked softmax and the embedding's scatter-add backward
far below it. Measured on the fidelity bench's plans before this calibration existed, these
ops took 0.5 s of a 3 s step the model put at 0.2 s.

``calibrate`` times each probe below, forward and backward, on every rank at once (as a
step runs them) and divides by the roofline time the planner charges the same call, with
the FLOPs and bytes taken from the same trace (``stpc.frontend.trace``) the planner plans
on. A probe's size is one activation of the fidelity bench's GPT (d_model 1024, seq 512)
split two ways, ``[2, 512, 1024]``: one size per op, not a curve over sizes (a named
simplification; the GEMMs have their curve in ``DeviceSpec.gemm_ramps``). Also named
simplifications: the factor, fitted on forward + backward, applies to an op's forward
alone where it has no backward (an add's 0.2x comes from a backward that passes its
gradient through), and the fp32 factor to every dtype. Measured on CPU profiles only: on
a GPU a probe this size times its kernel launch, not the kernel.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from stpc.cost_models import DeviceSpec
from stpc.cost_models.compute import GELU_TANH_OP, roofline
from stpc.frontend.trace import trace
from stpc.planner.costs import slowdown_key

ACTIVATION = (2, 512, 1024)      # [batch, seq, d_model]: one activation of the probe size
HEADS = (2, 8, 512, 64)          # [batch, heads, seq, head_dim] of attention's q, k, v
VOCAB = 8192


class _Fn(nn.Module):
    """A function of its inputs as a module (what ``trace`` takes)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _act(dev, positive: bool = False) -> torch.Tensor:
    x = torch.randn(ACTIVATION, device=dev)
    return (x.abs() + 1.0 if positive else x).requires_grad_()


@dataclass(frozen=True)
class Probe:
    """One aten op (``op``, as ``slowdown_key(node)`` names it in the planner's graph: the op,
    or its variant), made by ``module()`` from ``inputs(device)``."""

    op: str
    module: Callable[[], nn.Module]
    inputs: Callable[[torch.device], tuple]


PROBES = (
    Probe("aten.layer_norm.default", lambda: nn.LayerNorm(ACTIVATION[-1]), lambda d: (_act(d),)),
    Probe("aten.gelu.default", lambda: _Fn(F.gelu), lambda d: (_act(d),)),
    Probe(GELU_TANH_OP, lambda: nn.GELU(approximate="tanh"), lambda d: (_act(d),)),
    Probe("aten.silu.default", lambda: _Fn(F.silu), lambda d: (_act(d),)),
    Probe("aten.add.Tensor", lambda: _Fn(torch.add), lambda d: (_act(d), _act(d))),
    Probe("aten.mul.Tensor", lambda: _Fn(torch.mul), lambda d: (_act(d), _act(d))),
    Probe("aten.pow.Tensor_Scalar", lambda: _Fn(lambda x: x.pow(2)), lambda d: (_act(d),)),
    Probe("aten.mean.dim", lambda: _Fn(lambda x: x.mean(-1, keepdim=True)), lambda d: (_act(d),)),
    Probe("aten.rsqrt.default", lambda: _Fn(torch.rsqrt), lambda d: (_act(d, positive=True),)),
    Probe("aten.scaled_dot_product_attention.default",
          lambda: _Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
          lambda d: tuple(torch.randn(HEADS, device=d).requires_grad_() for _ in range(3))),
    Probe("aten.cross_entropy_loss.default", lambda: _Fn(F.cross_entropy),
          lambda d: (torch.randn(ACTIVATION[0] * ACTIVATION[1], VOCAB, device=d).requires_grad_(),
                     torch.randint(0, VOCAB, (ACTIVATION[0] * ACTIVATION[1],), device=d))),
    Probe("aten.embedding.default", lambda: nn.Embedding(VOCAB, ACTIVATION[-1]),
          lambda d: (torch.randint(0, VOCAB, ACTIVATION[:2], device=d),)),
)


def probe_step(probe: Probe, dev: torch.device) -> Callable[[], None]:
    """A closure running the probe's forward and backward once. Gradients are returned, not
    accumulated: an activation's gradient is not accumulated in a step either."""
    mod = probe.module().to(dev)
    xs = probe.inputs(dev)
    wrt = [t for t in (*xs, *mod.parameters()) if t.requires_grad]
    out = mod(*xs)
    grad_out = torch.ones_like(out)

    def step():
        torch.autograd.grad(mod(*xs), wrt, grad_out)
    return step


def probe_facts(probe: Probe) -> tuple[float, float]:
    """(FLOPs, bytes moved) of the probe's op as the planner reads them: its node in the
    trace of the probe on meta tensors (nothing allocated)."""
    meta = torch.device("meta")
    tg = trace(probe.module().to(meta), probe.inputs(meta))
    nodes = [n for n in tg.gm.graph.nodes if n.op == "call_function" and slowdown_key(n) == probe.op]
    if len(nodes) != 1:
        found = sorted({slowdown_key(n) for n in tg.gm.graph.nodes if n.op == "call_function"})
        raise RuntimeError(f"calibrate: the probe for {probe.op} traced to {found}, not one {probe.op} "
                           "(torch's decomposition changed?). Fix: update stpc.cli.calibrate_ops.PROBES.")
    m = nodes[0].meta
    return float(m["flops"]), float(m["bytes_read"] + m["bytes_written"])


def roofline_seconds(device: DeviceSpec, flops: float, moved: float) -> float:
    """What the planner charges the probe's forward and backward (slowdown 1)."""
    return roofline(device, flops, moved) + roofline(device, flops, 2 * moved)


def fit_op_slowdown(measured_s: dict[str, float], facts: dict[str, tuple[float, float]],
                    device: DeviceSpec) -> dict[str, dict]:
    """Per op: its measured forward + backward seconds, the roofline seconds the planner
    charges them on ``device`` (whose own ``op_slowdown`` is ignored) and their ratio."""
    plain = dataclasses.replace(device, op_slowdown={})
    out = {}
    for op, sec in measured_s.items():
        model = roofline_seconds(plain, *facts[op])
        if model > 0 and sec > 0:  # (an op that moves nothing has no roofline to scale)
            out[op] = {"measured_s": sec, "roofline_s": model, "slowdown": sec / model}
    return out
