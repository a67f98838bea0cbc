"""Hints: constraints users (and baselines) put on the search, and the presets.

``megatron(mesh_shape)`` reproduces Megatron-LM's tensor + sequence parallel
layout on the last (innermost) mesh axis and data parallelism on the first:
column-parallel q/k/v/fc1/gate/up projections and the vocab-parallel head and
embedding (weight Shard(0)), row-parallel o/fc2/down projections (weight
Shard(1)), no spatial-temporal families, replicated weights on the data axis
with the batch split there. The glue between them (norms, residual adds,
attention) is left to the solver, which on the same cost model picks the
sequence-parallel layout where it is cheaper.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class HintUnsatisfiable(ValueError):
    """A hint leaves some node without a strategy on this mesh."""


@dataclass
class Hints:
    """Constraints on the search.

    ``force`` maps a regular expression (matched against a node's name and its
    module path) to a predicate over :class:`Strategy`; matching decision nodes
    keep only the strategies the predicate accepts. ``param_force`` does the
    same for parameters, on their FQN and placement tuple. ``param_exact``
    (parameter FQN -> placement) and ``input_exact`` (user-input placeholder
    name -> placement) pin one placement each: where the mesh cannot hold it the
    search raises :class:`HintUnsatisfiable` (a compiled model re-planned for new
    input shapes keeps its parameters where they are; a data loader that feeds
    shards fixes its inputs' placements).
    """

    force: list[tuple[str, callable]] = field(default_factory=list)
    param_force: list[tuple[str, callable]] = field(default_factory=list)
    param_exact: dict[str, tuple[str, ...]] = field(default_factory=dict)
    input_exact: dict[str, tuple[str, ...]] = field(default_factory=dict)
    temporal: bool = True
    name: str = ""


COLUMN = r"(q_proj|k_proj|v_proj|fc1|gate_proj|up_proj|lm_head)$"
ROW = r"(o_proj|fc2|down_proj)$"
_LINEAR_NAME = r"^linear(_\d+)?$"


def megatron(mesh_shape: tuple[int, ...]) -> Hints:
    nd = len(mesh_shape)
    tp = nd - 1
    dp = 0 if nd > 1 else None

    def col(s):
        return s.kind == "spatial" and s.ins[1][tp] == "S0" and (dp is None or s.ins[0][dp] == "S0")

    def row(s):
        return s.kind == "spatial" and s.ins[1][tp] == "S1" and (dp is None or s.ins[0][dp] == "S0")

    def weight(p):  # parameters: never ZeRO/grid-sharded on the data axis
        return dp is None or p[dp] == "R"

    def not_temporal(s):
        return s.kind == "spatial" or s.kind == "replicate-fallback"

    return Hints(force=[(COLUMN, col), (ROW, row), (r".", not_temporal)],
                 param_force=[(r".", weight), (r"(embed|wte)\.weight$", lambda p: p[tp] in ("S0", "R"))],
                 temporal=False, name="megatron")


def data_parallel(mesh_shape: tuple[int, ...]) -> Hints:
    """Pure data parallelism: batch split on every axis, weights replicated."""
    return Hints(force=[(r".", lambda s: s.kind == "spatial")],
                 param_force=[(r".", lambda p: all(t == "R" for t in p))], temporal=False, name="dp")


PRESETS = {"megatron": megatron, "dp": data_parallel}


def preset(name: str, mesh_shape: tuple[int, ...]) -> Hints:
    try:
        return PRESETS[name](mesh_shape)
    except KeyError:
        raise ValueError(f"unknown hints preset {name!r}; known: {', '.join(PRESETS)}") from None
