"""Cost models for the planner: devices, clusters, roofline compute, alpha-beta
communication, memory formulas, a symbolic closed-form memory estimator and
calibration profiles. Imports no pass, solver or runtime op.

Units throughout: seconds, bytes, bytes/s, FLOP/s.
"""
from .cluster import CLUSTERS, Cluster, Link, get_cluster
from .comm import CostModel
from .compute import PhaseCost, matmul_phase_cost, matmul_phase_flops, roofline
from .devices import DEVICES, DeviceSpec, canonical_dtype, get_device
from .memory import (LAYOUTS, MemoryParts, NodeMemory, adamw_step_transient_bytes, bytes_per_param,
                     node_memory, optimizer_state_bytes, sharded_bytes, training_step_peak)
from .profile import fit_alpha_beta, load_profile, save_profile

__all__ = [
    "CLUSTERS", "Cluster", "Link", "get_cluster", "CostModel", "PhaseCost", "matmul_phase_cost",
    "matmul_phase_flops", "roofline", "DEVICES", "DeviceSpec", "canonical_dtype", "get_device",
    "LAYOUTS", "MemoryParts", "NodeMemory", "adamw_step_transient_bytes", "bytes_per_param",
    "node_memory", "optimizer_state_bytes", "sharded_bytes", "training_step_peak",
    "fit_alpha_beta", "load_profile", "save_profile", "closed_form_memory",
]


def closed_form_memory(*args, **kwargs):
    """See :func:`stpc.cost_models.estimator.closed_form_memory` (imported lazily so the
    planner's hot path never pays for importing sympy)."""
    from .estimator import closed_form_memory as impl

    return impl(*args, **kwargs)
