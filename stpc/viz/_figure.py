"""Figures drawn on matplotlib's Agg canvas: no display, no pyplot state, whatever backend the
session has chosen (a Figure built here shows in a notebook like any other)."""
from __future__ import annotations

import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# one colour per part, the same in every picture
COLORS = {"compute": "#4C72B0", "exposed": "#C44E52", "hidden": "#DD8452",
          "weights": "#4C72B0", "grads": "#8172B3", "optimizer": "#64B5CD", "activations": "#55A868",
          "transient": "#C44E52", "I": "#4C72B0", "W": "#DD8452", "O": "#55A868"}


def new_figure(width: float, height: float) -> Figure:
    """A Figure on its own Agg canvas (inches)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, out: str | os.PathLike | None) -> Figure:
    """Write ``fig`` to ``out`` (format from the suffix, PNG by default; missing folders are
    made) when given; return it."""
    if out is not None:
        folder = os.path.dirname(os.fspath(out))
        if folder:
            os.makedirs(folder, exist_ok=True)
        fig.savefig(out, dpi=110)
    return fig


def unit(values, kind: str) -> tuple[float, str]:
    """(divisor, unit name) that keeps the largest of ``values`` readable: bytes in KiB / MiB /
    GiB, seconds in µs / ms / s."""
    top = max((abs(v) for v in values), default=0.0)
    steps = ([(2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")] if kind == "bytes"
             else [(1.0, "s"), (1e-3, "ms"), (1e-6, "µs")])
    for size, name in steps:
        if top >= size:
            return size, name
    return steps[-1]
