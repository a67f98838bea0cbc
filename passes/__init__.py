"""passes (installed as ``stpc.passes``): Plan + graph -> SPMD graph. In: the traced aten
GraphModule and its Plan. Out: one rank's program of local shards, collectives and ring ops.

Each pass is a documented ``GraphModule -> GraphModule`` function, run in this order by
``stpc.compile``:

  shard_params       placeholders become the local shards of their plan placement
  insert_collectives functional collectives wherever placements change; local rewrites
  ring_decompose     AG->matmul / matmul->RS / P2x2 become P2P ring schedules
  cleanup            drop asserts, merge duplicate reshards, cancel gather/slice pairs, DCE
  defer_grad_sync    data-parallel gradient all-reduces leave the graph for the bucketed,
                     overlapped ``runtime.GradReducer`` (when the caller asks for buckets)
  recompute          each layer's span replayed in backward instead of keeping its saved
                     activations (plans that recompute: ``plan.stats["recompute"]``)
  prefetch_params    ZeRO/FSDP parameter gathers coalesced per layer, issued one layer ahead
  issue_early        forward-only all-reduces of the step's inputs (a loss's target count)
                     issued at the start of the step, waited where used
  verify             static check: all ranks issue matching collectives and P2P transfers
  read_params_at_use eager programs: each parameter's local tensor read right before its first
                     use, so backward hands its gradient on (to the reducer) as soon as it is done

and, on a finished program whose model has hooked submodules:

  tap_hooks          a copy that hands each hooked submodule call its values (the hooks fire)
"""
from ._common import LoweringError
from .cleanup import cleanup
from .defer_grad_sync import defer_grad_sync
from .insert_collectives import insert_collectives, reshard_steps
from .issue_early import issue_early
from .prefetch_params import prefetch_params
from .read_params_at_use import read_params_at_use
from .recompute import Recompute, SelectiveMismatch, recompute
from .ring_decompose import ring_decompose
from .shard_params import shard_params
from .tap_hooks import tap_hooks
from .verify import VerifyError, comm_schedule, verify

PIPELINE = ("shard_params", "insert_collectives", "ring_decompose", "cleanup", "defer_grad_sync", "recompute",
            "prefetch_params",
            "issue_early", "verify", "read_params_at_use")

__all__ = ["LoweringError", "shard_params", "insert_collectives", "ring_decompose", "cleanup", "defer_grad_sync",
           "recompute", "Recompute", "SelectiveMismatch", "prefetch_params", "issue_early", "read_params_at_use", "tap_hooks",
           "verify", "VerifyError",
           "comm_schedule", "reshard_steps", "PIPELINE"]
