"""Runtime ops: plain differentiable distributed functions (no plans, no graphs).

Importing this package registers the ``torch.ops.stpc.*`` custom ops. ``selfcheck`` (imported
on its own) runs the three primitives on real ranks against one plain matmul.
"""
from stpc.runtime.ops import ring
from stpc.runtime.ops.kernels import ring_step_matmul, set_ring_kernel, triton_ring_step_matmul
from stpc.runtime.ops.ring import *  # noqa: F401,F403  (the ring ops, listed once in ring.__all__)

__all__ = ["ring_step_matmul", "set_ring_kernel", "triton_ring_step_matmul", *ring.__all__]
