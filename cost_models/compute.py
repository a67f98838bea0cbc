"""Roofline compute cost.

An operator that does ``flops`` floating-point operations and moves ``bytes_moved``
bytes between device memory and the cores takes

    t = max(flops / (peak_flops[dtype] * efficiency), bytes_moved / mem_bw)   [seconds]

i.e. it is bound by whichever of compute and memory traffic is slower (the two
overlap on real hardware), times the op's measured slowdown where the device has one
(``DeviceSpec.op_slowdown``: what ``calibrate`` found the op takes over this bound). A GEMM (:func:`gemm_time`) also pays its size's place on the
device's efficiency curve: ``flops / rate + gemm_ramp_s``. Plain float math: the planner
calls this per strategy.
"""
from __future__ import annotations

from dataclasses import dataclass

from .devices import DeviceSpec, canonical_dtype


# The op name a device's measured slowdown of a copy into a new buffer goes under
# (``DeviceSpec.op_slowdown``; ``CostModel.copy``, measured by ``calibrate``).
COPY_OP = "aten.clone.default"


# Attention given an additive mask (BLOOM's ALiBi bias) runs other kernels than causal
# attention (torch's SDPA on CUDA: memory-efficient attention, where causal attention without
# a mask runs flash or cuDNN's), so its measured slowdown goes under a name of its own;
# where a device has none for it, the plain op's applies (``slowdown``).
MASKED_ATTENTION_OP = "aten.scaled_dot_product_attention.default[attn_mask]"
# GPT-2's gelu (``approximate="tanh"``, stpc's GPT models) and the exact one (erf) trace to
# the same aten op but run other kernels: on a CPU core tanh's polynomial and erf's cost
# differently (the fifty-first session's profile of the Megatron plan put gelu at 3.5x its
# modelled time under the erf probe's factor). Its own name; the plain op's factor where a
# device has none for it.
GELU_TANH_OP = "aten.gelu.default[tanh]"


def slowdown(device: DeviceSpec, op: str) -> float:
    """The measured slowdown of ``op`` on ``device`` (``DeviceSpec.op_slowdown``): a variant's
    (``op[...]``) own, else its op's, else 1."""
    got = device.op_slowdown.get(op)
    if got is None and op.endswith("]"):
        got = device.op_slowdown.get(op[:op.index("[")])
    return 1.0 if got is None else got


def roofline(device: DeviceSpec, flops: float, bytes_moved: float, dtype="fp32", op: str = "") -> float:
    """Seconds for one kernel doing ``flops`` FLOPs and ``bytes_moved`` bytes of traffic;
    ``op`` (an aten op name) applies that op's measured slowdown, if the device has one."""
    rate = device.peak_flops[canonical_dtype(dtype)] * device.efficiency
    return max(flops / rate, bytes_moved / device.mem_bw) * slowdown(device, op)


def gemm_time(device: DeviceSpec, flops: float, bytes_moved: float, dtype="fp32") -> float:
    """Seconds for one GEMM: the roofline with the compute side at the GEMM's own size on
    the device's efficiency curve (``DeviceSpec.gemm_ramp_s``: a smaller GEMM reaches less
    of the large-GEMM rate)."""
    if flops <= 0:
        return bytes_moved / device.mem_bw
    rate = device.peak_flops[canonical_dtype(dtype)] * device.efficiency
    return max(flops / rate + device.ramp_s(dtype), bytes_moved / device.mem_bw)


def batched_weight_time(device: DeviceSpec, batch: int, weight_bytes: float) -> float:
    """Seconds a GEMM batched ``batch`` ways over one shared weight of ``weight_bytes`` takes
    beyond the single GEMM of the same FLOPs: the weight read again for every element past
    the first, at ``DeviceSpec.batch_reread_bw`` (0 where the device has no such figure),
    less the ``DeviceSpec.batch_reread_cached_bytes`` of it the cache serves."""
    if batch <= 1 or device.batch_reread_bw is None:
        return 0.0
    return (batch - 1) * max(0.0, weight_bytes - device.batch_reread_cached_bytes) / device.batch_reread_bw


def fresh_alloc_time(device: DeviceSpec, nbytes: float) -> float:
    """Seconds a new tensor of ``nbytes`` costs beyond writing it, where the allocator hands
    a block that size fresh memory every time (``DeviceSpec.fresh_alloc_bytes``): its
    pages first touched at ``DeviceSpec.fresh_page_bw``. 0 below that size, and on a device
    whose allocator caches every size."""
    if device.fresh_page_bw is None or device.fresh_alloc_bytes is None or nbytes < device.fresh_alloc_bytes:
        return 0.0
    return nbytes / device.fresh_page_bw


def collective_output_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes of the output a functional collective of ``kind`` allocates on each of its ``n``
    ranks, its full tensor ``nbytes`` as in ``CostModel``: an all-gather's and an all-reduce's
    whole tensor, a reduce-scatter's and an all-to-all's one piece; a P2P receives into a
    buffer of its own (none)."""
    if kind in ("all_gather", "all_reduce"):
        return float(nbytes)
    if kind in ("reduce_scatter", "all_to_all"):
        return nbytes / n
    return 0.0


# Bytes one optimizer step moves per parameter element, by optimizer layout
# (``cost_models.memory.LAYOUTS``). It does no matmul: memory traffic bounds it. torch's
# foreach AdamW (torch/optim/adamw.py: decoupled weight decay, no amsgrad) makes eight passes
# over fp32 tensors: p *= 1 - lr*wd (read and write p, 8 B), m.lerp_(g) (read m, g, write m:
# 12), v *= beta2 (8), v.addcmul_(g, g) (read v, g, write v: 12), t = sqrt(v) (8), t /= bias
# correction (8), t += eps (8), p.addcdiv_(m, t) (read p, m, t, write p: 16) = 80 B; the
# per-tensor loop (``"single"``) runs the same passes one parameter at a time. Mixed precision
# runs them on the fp32 master weight and copies it to the bf16/fp16 weight (read 4, write
# 2): 86 B. Counted from the implementation, held against measured optimizer steps by
# ``python -m stpc bench fidelity``.
OPTIMIZER_STEP_BYTES = {"fp32-adam": 80.0, "mixed-adam": 86.0}

# The same for torch's fused AdamW (``AdamW(fused=True)``, the ``_fused_adamw_`` kernel, and
# TorchTitan's default ``implementation="fused"``): one pass that reads p, g, m, v and writes p,
# m, v, 28 B; mixed precision adds the master weight's copy to the low-precision one (6 B).
FUSED_OPTIMIZER_STEP_BYTES = {"fp32-adam": 28.0, "mixed-adam": 34.0}

# The op name a device's measured slowdown of the optimizer step goes under
# (``DeviceSpec.op_slowdown``, measured by ``calibrate``: torch's foreach AdamW over a
# layer's worth of parameters against the roofline of its bytes above). Held against the
# fidelity bench's steps, the roofline alone over-charged every plan's step 1.7-1.9x on
# the 2-core VM (0.112 s modelled, 0.061-0.067 s measured: eight passes over tensors of a
# few MiB run faster than one copy of 64 MiB, the mem_bw probe). None on the GPU presets.
# The fused kernel's own goes under ``OPTIMIZER_OP[fused]`` (a variant: a profile made
# before ``calibrate`` timed it falls back to the foreach step's, ``slowdown``).
OPTIMIZER_OP = "optimizer.adamw"
FUSED_OPTIMIZER_OP = OPTIMIZER_OP + "[fused]"


def optimizer_step_bytes(layout: str = "fp32-adam", impl: str = "foreach") -> float:
    """Bytes one AdamW step moves per parameter element it updates, for the optimizer
    ``layout`` and implementation ``impl`` (``cost_models.memory.OPTIMIZER_IMPLS``)."""
    table = FUSED_OPTIMIZER_STEP_BYTES if impl == "fused" else OPTIMIZER_STEP_BYTES
    return table.get(layout, table["fp32-adam"])


def optimizer_step_time(device: DeviceSpec, numel: float, layout: str = "fp32-adam", impl: str = "foreach") -> float:
    """Seconds of one optimizer step over ``numel`` parameter elements held on the device,
    by AdamW implementation ``impl`` (``"foreach"``, ``"single"``, ``"fused"``)."""
    return roofline(device, 0.0, numel * optimizer_step_bytes(layout, impl),
                    op=FUSED_OPTIMIZER_OP if impl == "fused" else OPTIMIZER_OP)


@dataclass(frozen=True)
class PhaseCost:
    """Seconds for the three phases of one operator: forward (O = I.W), backward
    (dI = dO.W^T) and gradient (dW = I^T.dO)."""

    fwd: float
    bwd: float
    grad: float

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.grad


def matmul_phase_flops(m: float, n: float, k: float) -> tuple[float, float, float]:
    """FLOPs of forward, backward and gradient of ``O[m,k] = I[m,n] . W[n,k]``
    (batch dims folded into m). Each is one GEMM of 2*m*n*k FLOPs."""
    f = 2.0 * m * n * k
    return f, f, f


def matmul_phase_bytes(m: float, n: float, k: float, itemsize: float) -> tuple[float, float, float]:
    """Bytes each phase reads and writes once: fwd reads I, W, writes O; bwd reads dO, W,
    writes dI; grad reads I, dO, writes dW."""
    i, w, o = m * n, n * k, m * k
    return ((i + w + o) * itemsize, (o + w + i) * itemsize, (i + o + w) * itemsize)


def matmul_phase_cost(device: DeviceSpec, m: float, n: float, k: float, dtype="fp32",
                      itemsize: float | None = None) -> PhaseCost:
    """Roofline seconds of the fwd/bwd/grad GEMMs of a linear layer on one device
    (pass the *local* shard sizes)."""
    if itemsize is None:
        itemsize = 2.0 if canonical_dtype(dtype) in ("bf16", "fp16") else 4.0
    fl = matmul_phase_flops(m, n, k)
    by = matmul_phase_bytes(m, n, k, itemsize)
    return PhaseCost(*(roofline(device, f, b, dtype) for f, b in zip(fl, by)))
