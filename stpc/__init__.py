"""stpc: a spatial-temporal partitioning compiler for PyTorch training.

The pipeline, one subpackage a stage (data flows one way):
frontend (trace, annotate) -> planner (analyse, strategies, solve -> Plan)
-> passes (``stpc.passes``: Plan + graph -> SPMD graph) -> runtime (on every rank);
``stpc.compile`` strings them together, ``stpc.cli`` is ``python -m stpc``.
"""
from stpc.compile import compile, trace  # noqa: A004 (stpc.compile is the entry point)
from stpc.module import DistributedModel, ShapeMismatch
from stpc.validate import InvalidArgument, NotPlanned, PlanWarning
from stpc.frontend import TracedGraph, dump, models
from stpc.planner import Hints, Plan, search
from stpc.planner.summary import plan_diff

__all__ = ["compile", "trace", "DistributedModel", "ShapeMismatch", "InvalidArgument", "NotPlanned", "PlanWarning", "TracedGraph", "Plan", "Hints", "search", "plan_diff", "dump", "models"]
__version__ = "0.1.0"
