"""stpc: a spatial-temporal partitioning compiler for PyTorch training.

Pipeline (one stage a module): trace -> annotate -> strategies -> solve -> passes -> lower -> run.
"""
from stpc.dump import dump
from stpc.trace import TracedGraph, trace
from stpc.compile import DistributedModel, compile  # noqa: A004 (stpc.compile is the entry point)

__all__ = ["trace", "TracedGraph", "dump", "compile", "DistributedModel"]
__version__ = "0.1.0"
