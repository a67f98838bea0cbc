"""dump: a graph (and its plan, once one exists) as a readable table and as Graphviz DOT.

``dump(graph, "out.txt")`` writes the table; a path ending in ``.dot`` writes DOT;
any other path also gets a ``.dot`` twin beside it.
"""
from __future__ import annotations

import os

import torch
import torch.fx as fx


def _shape(node: fx.Node) -> tuple[str, str]:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return "x".join(map(str, v.shape)) or "scalar", str(v.dtype).removeprefix("torch.")
    if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
        return ",".join("x".join(map(str, t.shape)) for t in v if isinstance(t, torch.Tensor)), \
            str(v[0].dtype).removeprefix("torch.")
    return "", ""


def _op(node: fx.Node) -> str:
    if node.op == "call_function":
        return str(getattr(node.target, "__name__", node.target)).removeprefix("aten.")
    return node.op


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}E"


def _graph_of(graph) -> fx.Graph:
    if isinstance(graph, fx.Graph):
        return graph
    if isinstance(graph, fx.GraphModule):
        return graph.graph
    return graph.graph  # TracedGraph


def table(graph, plan=None) -> str:
    """One line per node: name, op, shape, dtype, FLOPs, bytes, placement, source line."""
    rows = [("node", "op", "shape", "dtype", "flops", "bytes r/w", "placement", "source")]
    for node in _graph_of(graph).nodes:
        shape, dtype = _shape(node)
        m = node.meta
        placement = plan.describe(node.name) if plan is not None else ""
        rows.append((node.name, _op(node), shape, dtype, _human(m.get("flops", 0)),
                      f"{_human(m.get('bytes_read', 0))}/{_human(m.get('bytes_written', 0))}",
                      placement, m.get("param") or m.get("source", "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    return "\n".join(lines) + "\n"


def dot(graph, plan=None) -> str:
    """Graphviz DOT: one box per node labelled with op, shape and placement."""
    out = ["digraph stpc {", "  rankdir=TB;", '  node [shape=box, fontname="monospace", fontsize=9];']
    for node in _graph_of(graph).nodes:
        shape, _ = _shape(node)
        label = f"{node.name}\\n{_op(node)} {shape}"
        if plan is not None and plan.describe(node.name):
            label += f"\\n{plan.describe(node.name)}"
        style = ', style=filled, fillcolor="#e8f0ff"' if node.meta.get("param") else ""
        out.append(f'  "{node.name}" [label="{label}"{style}];')
        for inp in node.all_input_nodes:
            out.append(f'  "{inp.name}" -> "{node.name}";')
    out.append("}")
    return "\n".join(out) + "\n"


def dump(graph, path: str, plan=None) -> list[str]:
    """Write the table (and a DOT twin) for ``graph``; returns the paths written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".dot"):
        paths = [path]
    else:
        paths = [path, os.path.splitext(path)[0] + ".dot"]
        with open(path, "w") as f:
            f.write(table(graph, plan))
    with open(paths[-1], "w") as f:
        f.write(dot(graph, plan))
    return paths
