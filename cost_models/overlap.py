"""Parameter synchronisation overlapped with compute.

A parameter's collectives do not wait on activations: the gradient all-reduce of data
parallelism, the all-gather of a ZeRO-3/FSDP-sharded weight before its use and the
reduce-scatter of its gradient, any reshard of a stored weight to the layout its
consumer computes in. Frameworks run them on a separate stream beside compute: FSDP
prefetches layer i+1's all-gather while layer i computes, forward and backward (the
``torch.distributed.fsdp`` notes, "FSDP Prefetch Nuances"); DDP and Megatron-LM's
distributed optimizer reduce gradients in buckets behind the rest of backward. What
stays on the critical path is the part compute cannot cover, and compute overlapped
with communication runs slower:

    exposed(comm, window) = max(comm - window, 0) + slowdown * min(comm, window)

``window`` is the compute the collective runs beside. ``slowdown`` is
:data:`OVERLAP_COMPUTE_SLOWDOWN`.

The planner (``stpc.planner``) applies this to every edge out of a parameter, for every
plan alike: forward collectives against the consuming op's forward compute, backward
ones against its backward (dI + dW) compute, split between the op's parameters by size.
One op is a conservative stand-in for the layer a prefetch really spans; an op of a
spatial-temporal family offers no window (its compute already hides its ring transfers).
stpc's own runtime overlaps data-parallel gradient sums (bucketed, asynchronous, during
backward) and ZeRO gathers (coalesced per layer, one layer ahead, forward and backward);
other parameter reshards still run where they are used.
"""
from __future__ import annotations

import numpy as np

# Average slowdown of compute kernels overlapped with collectives: 18.9% (max 40.0%),
# GPT and Llama on A100, H100, MI250 and MI210 ("Characterizing Compute-Communication
# Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114, 2025).
OVERLAP_COMPUTE_SLOWDOWN = 0.189


def exposed(comm_s, window_s, slowdown: float = OVERLAP_COMPUTE_SLOWDOWN):
    """Seconds a collective of ``comm_s`` adds beside ``window_s`` of compute (floats, or
    numpy arrays that broadcast)."""
    hidden = np.minimum(comm_s, window_s)
    return comm_s - hidden + slowdown * hidden


__all__ = ["OVERLAP_COMPUTE_SLOWDOWN", "exposed"]
