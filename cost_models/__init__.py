"""cost_models (installed as ``stpc.cost_models``): what things cost. In: a cluster (preset or
calibrated profile), a mesh shape, FLOPs and bytes. Out: modelled seconds and per-device bytes.

Devices, clusters, roofline compute, alpha-beta communication, the overlap of parameter
synchronisation with compute (``overlap``), the one memory model (``MemoryModel``) and
calibration profiles. Imports nothing from the rest of stpc (no
planner, pass or runtime).

Units throughout: seconds, bytes, bytes/s, FLOP/s. The symbolic closed-form memory
estimator is ``stpc.cost_models.estimator`` (not imported here: it needs sympy, which
the planner's hot path never pays for).
"""
from .cluster import CLUSTERS, USABLE_MEMORY_FRACTION, Cluster, Link
from .comm import GRAD_BUCKET_BYTES, CostModel
from .compute import FUSED_OPTIMIZER_STEP_BYTES, OPTIMIZER_STEP_BYTES, PhaseCost, batched_weight_time, collective_output_bytes, fresh_alloc_time, gemm_time, matmul_phase_cost, matmul_phase_flops, optimizer_step_bytes, optimizer_step_time, roofline
from .devices import DEVICES, DeviceSpec, canonical_dtype, get_device
from .memory import (LAYOUTS, OPTIMIZER_IMPLS, MemoryModel, MemoryParts, adamw_step_transient_bytes, bytes_per_param,
                     keeps_grad_buckets, optimizer_state_bytes, training_step_peak)
from .overlap import OVERLAP_COMPUTE_SLOWDOWN, exposed
from .profile import default_profile_path, fit_alpha_beta, fit_gemm_curve, get_cluster, load_profile, save_profile, world_cluster

__all__ = [
    "CLUSTERS", "Cluster", "Link", "USABLE_MEMORY_FRACTION", "get_cluster", "CostModel", "GRAD_BUCKET_BYTES", "PhaseCost", "matmul_phase_cost",
    "matmul_phase_flops", "roofline", "gemm_time", "batched_weight_time", "collective_output_bytes", "fresh_alloc_time", "optimizer_step_time", "optimizer_step_bytes", "OPTIMIZER_STEP_BYTES", "FUSED_OPTIMIZER_STEP_BYTES", "DEVICES", "DeviceSpec", "canonical_dtype", "get_device",
    "LAYOUTS", "OPTIMIZER_IMPLS", "MemoryModel", "MemoryParts", "adamw_step_transient_bytes", "bytes_per_param",
    "keeps_grad_buckets",
    "optimizer_state_bytes", "training_step_peak", "fit_alpha_beta", "fit_gemm_curve", "load_profile", "save_profile",
    "world_cluster", "default_profile_path", "OVERLAP_COMPUTE_SLOWDOWN", "exposed",
]
