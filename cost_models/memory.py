"""The memory model (bytes, per device): the one place that says what a plan holds.

:class:`MemoryModel` is what the planner charges every choice with, so it is what
``Plan.peak_memory_bytes``, ``plan.table()``, the CLI and the benchmarks report:

    peak = max(end of forward, last layer's backward, optimizer step)
    end of forward  = weights + optimizer state + saved activations + the largest transient
                      (+ a ZeRO-3 plan's head weights, kept whole for their backward)
    last layer's backward = the end of forward less the activations only the head saved,
                      with that layer's own largest working set for the transient, + the
                      gradients the head and the last layer compute + ZeRO-3 parameters
                      gathered again for it (``regathered_bytes``)
    optimizer step  = weights + gradients + optimizer state + the optimizer's scratch

* persistent: each parameter's weight and optimizer state under its placement, its
  gradient too where the trainer keeps gradients through forward
  (:meth:`MemoryModel.forward_param_bytes`, ``grads_at_forward``) or the runtime keeps a
  summed gradient's bucket from step to step (``kept_buckets``), and each tensor
  backward keeps, at its owner's placement (:meth:`MemoryModel.saved_bytes`; the end of
  forward is where all of them are alive, and the measured peak of every plan in the
  fidelity bench is there or at the start of backward, where gradients are still few);
* transient: while a node runs, its local inputs and output, plus for a ring
  (spatial-temporal) schedule the two in-flight blocks of its double buffer
  (:meth:`MemoryModel.transient_bytes`).

* last layer's backward: backward starts where forward ended, every saved activation
  still alive (the loss's backward working set is the end of forward's transient:
  ``planner.costs.WORKING_COPIES``). The head's backward (final norm, output projection,
  loss) runs first and frees what only its ops saved (``GraphFacts.head_saved``); then
  the first ops of the last layer's backward add
  their weights' gradients as computed (at the placement the op reads the weight in) and,
  for a ZeRO-3 parameter, its whole copy gathered again (``regathered_bytes``). Measured
  (fidelity bench, fsdp-tp on 4 gloo ranks) this is where a ZeRO-3 plan peaks; the
  gradients of earlier layers come as activations go, and are not added.
* optimizer step: activations are gone; weights, gradients and optimizer state are alive,
  and AdamW's scratch beside them (foreach: one fp32 temporary per element of state).

The solver encodes exactly this (``Problem.mem`` and ``Problem.transient`` per choice,
the end of forward = sum + max; ``Problem.bwd_mem`` per choice and ``Problem.mem_edges``
per pair of choices on top of it, the last layer's backward; ``Problem.step_mem`` and
``Problem.step_transient``, the optimizer step). The closed-form estimator (``estimator.py``) takes its
bytes per parameter from here and is held against the planner in the tests; measured
peaks (MemTracker) live with the benchmarks and tests that measure.

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

from .comm import GRAD_BUCKET_BYTES

LAYOUTS = {
    # layout: (weight B/param, grad B/param, optimizer B/param)
    "fp32-adam": (4, 4, 8),
    "mixed-adam": (2, 4, 12),
}


# Whole copies a ZeRO-3 parameter holds during its layer's backward, beyond the gradient the
# op computes: the copy gathered again for it, the previous layer's gathered ahead (in
# flight, ``passes.prefetch_params``), and the gradient laid out rank-major for the
# reduce-scatter (``runtime.param_gather.gather_wait``'s backward; FSDP2 copies into its
# reduce-scatter buffer alike). Read off the allocations alive at the measured backward
# peak of the fidelity bench's fsdp-tp plan (``MemoryModel.regathered_bytes``).
REGATHER_COPIES = 3

# AdamW implementations whose step scratch the model knows (``MemoryModel.step_scratch``).
OPTIMIZER_IMPLS = ("foreach", "single", "fused")


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


@dataclass(frozen=True)
class MemoryModel:
    """Per-device bytes of a training step under a plan (see the module docstring).

    ``layout`` is the optimizer layout of :data:`LAYOUTS` (``"fp32-adam"``: 16 B per
    parameter; ``"mixed-adam"``: 18 B).
    """

    layout: str = "fp32-adam"
    fp32_grad_accum: bool = True
    optimizer_impl: str = "foreach"
    grads_at_forward: bool = False
    # The runtime's data-parallel gradient buckets kept from step to step (``GradReducer``'s
    # ``keep_buffers``, DDP's way) rather than made in each backward and freed with the
    # gradients. None: as the device's allocator calls for (:func:`keeps_grad_buckets`).
    kept_buckets: bool | None = None
    # Bytes of the runtime's data-parallel gradient buckets (``stpc.compile``'s ``bucket_mb``:
    # each one's all-reduce launched as it fills, behind the rest of backward). None: no
    # buckets, each gradient all-reduced where it is made and waited on there.
    grad_bucket_bytes: float | None = GRAD_BUCKET_BYTES

    def __post_init__(self):
        bytes_per_param(self.layout, self.fp32_grad_accum)  # an unknown layout fails here, not mid-plan
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"unknown optimizer implementation {self.optimizer_impl!r}; "
                             f"known: {', '.join(OPTIMIZER_IMPLS)}")
        if self.grad_bucket_bytes is not None and not self.grad_bucket_bytes > 0:
            raise ValueError(f"grad_bucket_bytes={self.grad_bucket_bytes!r}: a positive number of bytes, "
                             f"or None for no buckets")

    def forward_param_bytes(self, numel: float, shards: float = 1, reduced: bool = False) -> float:
        """What a parameter holds at the end of forward: its weight and optimizer state, and
        its gradient only with ``grads_at_forward``, or where it is ``reduced`` (summed over
        ranks: its placement replicates it over an axis of more than one device) and the
        runtime keeps its bucket between steps (``kept_buckets``: the bucket the gradient
        is a view of outlives ``zero_grad``). ``zero_grad(set_to_none=True)`` (torch's
        default, and what stpc's benches and demo run) frees the gradients before forward;
        backward makes them again while it frees activations. A trainer that accumulates
        gradients over micro-batches, or zeroes them in place, keeps them."""
        if self.grads_at_forward or (reduced and self.kept_buckets):
            return self.param_bytes(numel, shards)
        w, g, o = bytes_per_param(self.layout, self.fp32_grad_accum)
        return numel * (w + o) / shards

    def step_scratch(self, numel: float, reduced: bool = False, tied: bool = False) -> tuple[float, float]:
        """The optimizer step's scratch for a parameter whose optimizer state this device
        holds ``numel`` elements of, as (bytes alive together with every other parameter's,
        bytes alive only while this parameter steps): :func:`adamw_step_transient_bytes`
        per element of the fp32 state. ``"foreach"`` (torch's CUDA default): ``sqrt(exp_avg_sq)``
        of the whole group at once, 4 B per element, all alive together; ``"single"`` (the
        per-tensor loop, torch's CPU default): two temporaries of one parameter at a time;
        ``"fused"`` (what stpc's benches run): none.

        The same phase holds the end of backward, whose state is the step's (every gradient
        made): a gradient summed over ranks (``reduced``: its placement replicates it over an
        axis of more than one device) is there twice for a moment, as autograd made it and as
        copied into its bucket or reduced into a new buffer (``runtime.GradReducer``'s hook),
        so the last gradient backward completes, the embedding table's (read first in
        forward), peaks the step's state by a gradient of it. Charged as one more copy of the
        largest reduced gradient (the table's in the built-in models; elsewhere an upper bound
        of the last one's), and only where the step's own scratch does not cover it: under
        ``"fused"``. A tied parameter (``tied``: one tensor read under two names, a GPT's
        embedding table and its LM head) is there three times at that moment, whether summed
        over ranks or not: autograd sums its two readers' gradients out of place, the two and
        their sum alive at once, before the bucket's copy (the fidelity bench's data-parallel
        recompute plan, sixty-first session: its state 904.3 MiB, its peak in backward 968.3,
        two copies of the tied table's 32 MiB gradient above it; a profile of the same GPT cut
        to one layer showed the ``aten::add`` under ``EmbeddingBackward0``), so it is charged
        two copies. Named simplification: a ZeRO-sharded tied parameter's readers sum their
        gradients at the size they read it, gathered, before the reduce-scatter; charged at the
        size stored."""
        if self.optimizer_impl == "foreach":  # every parameter's 4 B at once: more than one gradient
            return 4.0 * numel, 0.0
        if self.optimizer_impl == "single":  # 8 B of one parameter: two of its fp32 gradients
            return 0.0, 8.0 * numel
        copies = 2 if tied else 1 if reduced else 0
        return 0.0, copies * numel * bytes_per_param(self.layout, self.fp32_grad_accum)[1]

    @property
    def bytes_per_param(self) -> int:
        """Weight + gradient + optimizer bytes of one unsharded parameter."""
        return sum(bytes_per_param(self.layout, self.fp32_grad_accum))

    def param_bytes(self, numel: float, shards: float = 1) -> float:
        """Weight, gradient and optimizer state of a parameter of ``numel`` elements whose
        placement splits it ``shards`` ways (product of the mesh sizes of its split axes)."""
        return numel * self.bytes_per_param / shards

    @staticmethod
    def regathered_bytes(gathered: float, staging: int = 0) -> float:
        """Bytes a ZeRO-3 parameter whose whole copy (at the placement its op reads it in) is
        ``gathered`` bytes holds during its layer's backward: ``REGATHER_COPIES`` copies, plus
        ``staging`` more where the backend stages an all-gather's output in a buffer of its
        own (``Cluster.gather_staging``: gloo 1, NCCL 0)."""
        return gathered * (REGATHER_COPIES + staging)

    @staticmethod
    def saved_bytes(nbytes: float, shards: float = 1) -> float:
        """A tensor of ``nbytes`` kept for backward, split ``shards`` ways."""
        return nbytes / shards

    @staticmethod
    def transient_bytes(local_inputs, local_output: float, ring_block: float = 0.0) -> float:
        """Working set of a node while it runs: its local operands and output, plus two
        in-flight ring blocks of ``ring_block`` bytes (the double buffer of a temporal
        schedule; 0 for a spatial one)."""
        return sum(local_inputs, local_output) + 2 * ring_block


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


def keeps_grad_buckets(device) -> bool:
    """Whether the runtime keeps its data-parallel gradient buckets from step to step on
    ``device`` (``cost_models.DeviceSpec``): where its allocator hands freed memory back to
    the system (``fresh_page_bw`` known: glibc's malloc on a CPU), a bucket made in each
    backward is new memory each time, its pages faulted in anew: glibc trims the heap's free
    top, and a step's buckets, freed together by ``zero_grad``, are such a top (the fidelity
    bench's page-fault column: its data-parallel plan with selective recomputation, 202 MiB
    of buckets a rank, 22699 faults a step with them made in each backward, fid67, and 0 with
    them kept, fid68). A caching allocator (CUDA's) hands a freed block back warm, so there a
    kept bucket would only hold memory through forward that activations could use."""
    return getattr(device, "fresh_page_bw", None) is not None
