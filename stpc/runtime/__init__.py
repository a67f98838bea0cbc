"""runtime: what runs on every rank. In: local tensors, process-group names, a plan's hash.
Out: differentiable distributed functions (reshards, ring and PrimePar ops, a LayerNorm and an RMSNorm over a grid layout), the rank launcher.

It knows nothing of plans or graphs: reshard (autograd collectives and the tensor
helpers shard_tensor / unshard_tensor), agreement (ranks check they hold one plan),
ops (the ``torch.ops.stpc.*`` ring and P(2^k x 2^k) custom ops, the Triton step
kernel, selfcheck: the three checked against one plain matmul on real ranks), dtensors (stpc
placements stored as DTensor placements; a parameter's read), failure (a failed collective
or transfer named as such), grad_reducer (data-parallel gradients summed in buckets during
backward), lazy_wait (an output's collective waited where its value is first read), param_gather (parameter shards gathered in one collective, issued early; gathered
again in backward instead of kept), hook_taps
(submodules' forward hooks fired from the program), grid_norm (a LayerNorm, an RMSNorm, a bias add and a
grid column's slice over a P(2^k x 2^k) grid layout, the norms' statistics exchanged along the grid row), launch (real gloo/NCCL ranks in fresh processes, with deadlines).
"""
from stpc.runtime import dtensors, ops, reshard
from stpc.runtime.dtensors import read_param
from stpc.runtime.failure import CommFailure
from stpc.runtime.grad_reducer import GradReducer
from stpc.runtime.lazy_wait import LoadedLater, settle, wait_on_read
from stpc.runtime.param_gather import RegatherSaved, gather_start, gather_wait
from stpc.runtime.agreement import (PlanMismatch, ScheduleMismatch, TensorMismatch, TraceMismatch,
                                    check_plan_agreement, check_schedule_agreement, check_tensors_agree,
                                    check_traced_agreement, from_rank0)
from stpc.runtime.launch import SpawnError, SpawnTimeout, free_port, spawn
from stpc.runtime.reshard import *  # noqa: F401,F403  (the reshards, listed once in reshard.__all__)
from stpc.runtime.grid_loss import grid_cross_entropy
from stpc.runtime.grid_norm import grid_bias_add, grid_column, grid_layer_norm, grid_rms_norm

__all__ = ["ops", "dtensors", "read_param", "CommFailure", "GradReducer", "LoadedLater", "settle", "wait_on_read", "gather_start", "gather_wait", "RegatherSaved", "PlanMismatch", "check_plan_agreement", "TensorMismatch", "check_tensors_agree", "ScheduleMismatch", "check_schedule_agreement", "TraceMismatch", "check_traced_agreement", "from_rank0", "grid_layer_norm", "grid_rms_norm", "grid_bias_add", "grid_column", "grid_cross_entropy", "spawn", "free_port", "SpawnError", "SpawnTimeout",
           *reshard.__all__]
