"""Runtime ops: plain differentiable distributed functions (no plans, no graphs).

Importing this package registers the ``torch.ops.stpc.*`` custom ops.
"""
from stpc.ops.kernels import ring_step_matmul, triton_ring_step_matmul
from stpc.ops.ring import (
    group_name_of,
    primepar_coords,
    primepar_linear,
    primepar_shard_input,
    primepar_shard_output,
    primepar_shard_weight,
    primepar_unshard_input,
    primepar_unshard_output,
    primepar_unshard_weight,
    ring_allgather_matmul,
    ring_matmul_reducescatter,
)

__all__ = [
    "ring_step_matmul",
    "triton_ring_step_matmul",
    "group_name_of",
    "ring_allgather_matmul",
    "ring_matmul_reducescatter",
    "primepar_linear",
    "primepar_coords",
    "primepar_shard_input",
    "primepar_shard_weight",
    "primepar_shard_output",
    "primepar_unshard_input",
    "primepar_unshard_weight",
    "primepar_unshard_output",
]
