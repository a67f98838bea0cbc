"""Memory formulas (bytes, per device). Pure arithmetic: the torch-side measurement of
which tensors autograd saves lives in ``stpc.memory_estimate``.

Persistent state per parameter (``optimizer_state_bytes``):

* ``"fp32-adam"``: 4 B weight + 4 B grad + 8 B Adam state (m, v in fp32) = 16 B/param.
* ``"mixed-adam"``: 2 B bf16/fp16 weight + 4 B grad + 12 B optimizer (fp32 master
  weight + m + v) = 18 B/param, the figure of the 4D memory-estimator paper and of
  Megatron-LM. The grad is counted at 4 B because mixed-precision trainers accumulate
  gradients in an fp32 buffer (Megatron's ``main_grad``); the 2 B bf16 grad the
  backward produces is short-lived. Pass ``fp32_grad_accum=False`` for trainers that
  keep bf16 grads (2+2+12 = 16 B/param).

ZeRO sharding over ``zero_shards`` data-parallel ranks divides: stage 1 the optimizer
state, stage 2 also the grads, stage 3 also the weights. Megatron's distributed
optimizer is stage 1: 6 + 12/dp B/param.
"""
from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = {
    # layout: (weight B/param, grad B/param, optimizer B/param)
    "fp32-adam": (4, 4, 8),
    "mixed-adam": (2, 4, 12),
}


@dataclass(frozen=True)
class MemoryParts:
    """Bytes of weights, gradients and optimizer state."""

    weight: float
    grad: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weight + self.grad + self.optimizer


def bytes_per_param(layout: str = "fp32-adam", fp32_grad_accum: bool = True) -> tuple[int, int, int]:
    """(weight, grad, optimizer) bytes per parameter of ``layout``."""
    try:
        w, g, o = LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"unknown optimizer layout {layout!r}; known: {', '.join(LAYOUTS)}") from None
    if layout == "mixed-adam" and not fp32_grad_accum:
        g = 2
    return w, g, o


def optimizer_state_bytes(numel: float, layout: str = "fp32-adam", zero_shards: int = 1,
                          zero_stage: int = 2, fp32_grad_accum: bool = True) -> MemoryParts:
    """Per-device bytes for ``numel`` parameters (already divided by any tensor
    parallelism) under ``layout``, with ZeRO ``zero_stage`` sharding over ``zero_shards``
    ranks (``zero_shards=1``: no ZeRO)."""
    if zero_shards < 1 or zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_shards must be >= 1 and zero_stage 1, 2 or 3 "
                         f"(got {zero_shards}, {zero_stage})")
    w, g, o = bytes_per_param(layout, fp32_grad_accum)
    z = float(zero_shards)
    return MemoryParts(weight=numel * w / (z if zero_stage >= 3 else 1.0),
                       grad=numel * g / (z if zero_stage >= 2 else 1.0),
                       optimizer=numel * o / z)


def sharded_bytes(full_bytes: float, shards: float = 1) -> float:
    """Bytes one device holds of a tensor of ``full_bytes`` split ``shards`` ways
    (the product of the mesh sizes of the axes it is Shard()-ed on; 1 if replicated)."""
    return full_bytes / shards


@dataclass(frozen=True)
class NodeMemory:
    """Per-device memory of one graph node under a sharding.

    saved:         bytes the node keeps alive for its backward (until its backward runs)
    fwd_transient: working set while the forward runs: inputs + outputs (+ scratch)
    bwd_transient: working set while its backward runs: grads of outputs + grads of inputs
    """

    saved: float
    fwd_transient: float
    bwd_transient: float


def node_memory(input_bytes: float, output_bytes: float, saved_bytes: float,
                shards: float = 1, scratch_bytes: float = 0.0) -> NodeMemory:
    """Memory of a node whose full (unsharded) inputs, outputs and saved tensors have the
    given sizes, when its work is split ``shards`` ways (all sizes in bytes).

    A ring (spatial-temporal) schedule additionally holds one in-flight block per
    double buffer: pass it as ``scratch_bytes`` (already per device)."""
    s = float(shards)
    return NodeMemory(saved=saved_bytes / s,
                      fwd_transient=(input_bytes + output_bytes) / s + scratch_bytes,
                      bwd_transient=(output_bytes + input_bytes) / s + scratch_bytes)


def adamw_step_transient_bytes(param_bytes: list[float] | tuple[float, ...], impl: str = "single") -> float:
    """Scratch memory of one AdamW ``step()``.

    ``"single"`` (torch's per-tensor loop, the CPU default): for each parameter
    ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` makes two
    param-sized temporaries at once (the sqrt and the quotient), so the peak is twice
    the largest parameter. ``"foreach"`` (the CUDA default) takes the sqrt of the whole
    group at once: one temporary per parameter, alive together.
    """
    if not param_bytes:
        return 0.0
    if impl == "single":
        return 2.0 * max(param_bytes)
    if impl == "foreach":
        return float(sum(param_bytes))
    raise ValueError(f"unknown AdamW implementation {impl!r}; use 'single' or 'foreach'")


def training_step_peak(static_bytes: float, forward_peak: float, backward_peak: float,
                       grad_bytes: float, step_transient: float) -> float:
    """Peak of a steady-state training step (``zero_grad(set_to_none=True)`` each step).

    static_bytes:  weights + optimizer state (alive the whole step)
    forward_peak:  highest activations + temporaries during forward (beyond static)
    backward_peak: highest saved activations + grads + temporaries during backward
    grad_bytes:    all parameter grads (alive from backward through ``step()``)
    step_transient: optimizer scratch (:func:`adamw_step_transient_bytes`)
    """
    return static_bytes + max(forward_peak, backward_peak, grad_bytes + step_transient)
