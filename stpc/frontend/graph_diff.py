"""graph_diff: what a pass changed in a graph, as data, text and highlighted HTML.

A *snapshot* is a graph frozen as rows (one per node: name, op, args, local shape,
placement, communication note), taken before the graph is changed again: the passes
rewrite a GraphModule in place, so the rows are all that is left of an earlier state.
Two snapshots compare by node name (fx never hands a name out twice in one graph, so a
name that is gone was erased and a new one was created):

    log = PassLog()
    gm = stpc.compile.run_passes(tg.gm, plan, on_pass=log)   # a snapshot after each pass
    log.overview()                   # per pass: nodes, +added, -removed, ~changed, moved
    log.diff("insert_collectives")   # a GraphDiff; in a notebook, a table with the changes highlighted

``GraphDiff`` holds the added, removed, changed (field -> (old, new)) and moved nodes
(moved: out of the longest run of nodes both graphs keep in the same order, i.e. hoisted
or sunk). ``to_html`` renders the after-graph with added rows green, changed rows yellow
(the old value beside the new), moved rows blue and removed rows red and struck through,
in place, with runs of unchanged nodes folded; ``str()`` is the same as text.
"""
from __future__ import annotations

import bisect
import difflib
import html
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

__all__ = ["NodeRow", "snapshot", "GraphDiff", "diff", "PassLog"]

# the columns a snapshot keeps, in table order (name is the key; args, the widest, last)
FIELDS = ("op", "shape", "placement", "note", "args")


@dataclass(frozen=True)
class NodeRow:
    """One node of a snapshot. ``op``: the call's short target (``linear``,
    ``all_gather``), else the node kind (``placeholder``, ``output``); ``shape``: the local
    shape (what one device holds once the passes have sharded it); ``placement``: one token
    per mesh axis (``(S0,R)``); ``note``: what a communication node does
    (``all_gather@axis1 dim=1``) or the ring a node belongs to."""

    name: str
    op: str
    args: str
    shape: str
    placement: str
    note: str

    def get(self, column: str) -> str:
        return getattr(self, column)


def _target_name(node: fx.Node) -> str:
    if node.op in ("call_function", "call_method"):
        name = str(getattr(node.target, "__name__", node.target))
        return name.removeprefix("aten.").removesuffix(".default")
    if node.op == "call_module":
        return f"module:{node.target}"
    if node.op == "get_attr":
        return f"attr:{node.target}"
    return node.op


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_arg(v)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.dtype):
        return str(a).removeprefix("torch.")
    if isinstance(a, float):
        return f"{a:g}"
    return repr(a)


def _args(node: fx.Node) -> str:
    if node.op == "placeholder":
        return ""
    return ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])


def _shape(node: fx.Node) -> str:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return "x".join(map(str, v.shape)) or "scalar"
    if isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v):
        return ", ".join("x".join(map(str, t.shape)) if isinstance(t, torch.Tensor) else "-" for t in v)
    return ""


def _placement(p) -> str:
    if p is None:
        return ""
    if isinstance(p, str):
        return p
    return "(" + ",".join(map(str, p)) + ")"


def _note(node: fx.Node) -> str:
    comm, ring = node.meta.get("comm"), node.meta.get("ring")
    if comm:
        extra = "".join(f" {k}={v}" for k, v in comm.items()
                        if k not in ("op", "axis", "group", "edge", "p2p", "size", "linear"))
        return f"{comm.get('op')}@axis{comm.get('axis')}{extra}"
    if ring:
        return f"[{ring.get('kind')}@axis{ring.get('axis')}]"
    return ""


def _graph_of(graph) -> fx.Graph:
    if isinstance(graph, fx.Graph):
        return graph
    return graph.graph  # a GraphModule or a TracedGraph


def snapshot(graph, placements: Mapping[str, object] | None = None) -> tuple[NodeRow, ...]:
    """The rows of ``graph`` (an fx Graph, GraphModule or TracedGraph) as they are now.
    A node's placement is its ``meta["placement"]`` (set by the passes); ``placements``
    (node name -> tokens or text, e.g. the plan's) fills it in for nodes that have none yet,
    such as those of the traced graph."""
    rows = []
    for n in _graph_of(graph).nodes:
        p = n.meta.get("placement")
        if p is None and placements is not None:
            p = placements.get(n.name)
        rows.append(NodeRow(n.name, _target_name(n), _args(n), _shape(n), _placement(p), _note(n)))
    return tuple(rows)


def _kept_in_order(positions: list[int]) -> set[int]:
    """Indices (into ``positions``) of one longest strictly increasing subsequence."""
    tails: list[int] = []      # tails[k]: the smallest last value of an increasing run of length k+1
    tail_at: list[int] = []    # ... and its index
    parent = [-1] * len(positions)
    for i, v in enumerate(positions):
        k = bisect.bisect_left(tails, v)
        if k == len(tails):
            tails.append(v)
            tail_at.append(i)
        else:
            tails[k], tail_at[k] = v, i
        parent[i] = tail_at[k - 1] if k else -1
    keep, i = set(), tail_at[-1] if tail_at else -1
    while i >= 0:
        keep.add(i)
        i = parent[i]
    return keep


@dataclass(repr=False)
class GraphDiff:
    """What changed between two snapshots (``diff(before, after)``).

    ``added`` / ``removed``: node names, in graph order; ``changed``: name -> {column:
    (old, new)} for nodes both graphs have; ``moved``: kept nodes whose place among the
    kept nodes changed (hoisted or sunk by the pass)."""

    before: tuple[NodeRow, ...]
    after: tuple[NodeRow, ...]
    title: str = ""
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    moved: list[str] = field(default_factory=list)

    def __post_init__(self):
        old = {r.name: r for r in self.before}
        new = {r.name: r for r in self.after}
        self.added = [r.name for r in self.after if r.name not in old]
        self.removed = [r.name for r in self.before if r.name not in new]
        for r in self.after:
            if r.name in old:
                delta = {c: (old[r.name].get(c), r.get(c)) for c in FIELDS if old[r.name].get(c) != r.get(c)}
                if delta:
                    self.changed[r.name] = delta
        kept = [r.name for r in self.before if r.name in new]
        where = {r.name: i for i, r in enumerate(self.after)}
        stay = _kept_in_order([where[n] for n in kept])
        moved = {n for i, n in enumerate(kept) if i not in stay}
        self.moved = [r.name for r in self.after if r.name in moved]

    # ------------------------------------------------------------------ numbers
    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.moved)

    def counts(self) -> dict[str, int]:
        return {"nodes": len(self.after), "added": len(self.added), "removed": len(self.removed),
                "changed": len(self.changed), "moved": len(self.moved)}

    def ops_added(self) -> Counter:
        """How many nodes of each op the pass added."""
        new = {r.name: r for r in self.after}
        return Counter(new[n].op for n in self.added)

    def ops_removed(self) -> Counter:
        old = {r.name: r for r in self.before}
        return Counter(old[n].op for n in self.removed)

    def columns_changed(self) -> Counter:
        """How many kept nodes changed in each column (``shape``, ``placement``, ``args``, ...)."""
        return Counter(c for delta in self.changed.values() for c in delta)

    # ------------------------------------------------------------------ rows
    def rows(self, context: int | None = 1) -> list[tuple[str, NodeRow | int]]:
        """The after-graph in order with the removed nodes at their old places, as
        ``(status, row)``: status ``added``, ``removed``, ``changed``, ``moved`` or ``same``
        (a node both changed and moved shows as changed).
        With ``context`` (an int), unchanged rows further than that from any change are
        folded into ``("folded", how many)``; ``None`` keeps them all."""
        new = {r.name for r in self.after}
        removed = set(self.removed)
        after_anchor: dict[str | None, list[NodeRow]] = {}
        anchor = None
        for r in self.before:  # each removed node goes after the last kept node before it
            if r.name in removed:
                after_anchor.setdefault(anchor, []).append(r)
            elif r.name in new:
                anchor = r.name
        added, moved = set(self.added), set(self.moved)
        out: list[tuple[str, NodeRow | int]] = [("removed", r) for r in after_anchor.get(None, [])]
        for r in self.after:
            status = ("added" if r.name in added else "changed" if r.name in self.changed
                      else "moved" if r.name in moved else "same")
            out.append((status, r))
            out.extend(("removed", x) for x in after_anchor.get(r.name, []))
        if context is None:
            return out
        hot = [i for i, (s, _) in enumerate(out) if s != "same"]
        show = set()
        for i in hot:
            show.update(range(max(0, i - context), min(len(out), i + context + 1)))
        folded: list[tuple[str, NodeRow | int]] = []
        for i, item in enumerate(out):
            if i in show:
                folded.append(item)
            elif folded and folded[-1][0] == "folded":
                folded[-1] = ("folded", folded[-1][1] + 1)
            else:
                folded.append(("folded", 1))
        return folded

    def _headline(self) -> str:
        c = self.counts()
        parts = [f"{c['nodes']} nodes"] + [f"{c[k]} {k}" for k in ("added", "removed", "changed", "moved")]
        ops = self.ops_added()
        if ops:
            parts.append("added: " + ", ".join(f"{k} x{v}" for k, v in ops.most_common()))
        ops = self.ops_removed()
        if ops:
            parts.append("removed: " + ", ".join(f"{k} x{v}" for k, v in ops.most_common()))
        cols = self.columns_changed()
        if cols:
            parts.append("changed: " + ", ".join(f"{k} x{v}" for k, v in cols.most_common()))
        return (f"{self.title}: " if self.title else "") + "; ".join(parts)

    # ------------------------------------------------------------------ text
    def to_text(self, context: int | None = 1, limit: int | None = 200) -> str:
        """A line per shown row: ``+`` added, ``-`` removed, ``~`` changed (``old -> new``),
        ``^`` moved, two spaces unchanged; ``...`` where unchanged rows are folded."""
        mark = {"added": "+", "removed": "-", "changed": "~", "moved": "^", "same": " "}
        if self.empty:
            return self._headline() + ": no change\n"
        lines = [self._headline()]
        rows = self.rows(context)
        for status, r in rows[:limit]:
            if status == "folded":
                lines.append(f"  ... {r} unchanged node{'s' if r != 1 else ''}")
                continue
            cells = []
            for c in FIELDS:
                if status == "changed" and c in self.changed[r.name]:
                    o, n = self.changed[r.name][c]
                    cells.append(f"{o or '∅'} -> {n or '∅'}")
                elif r.get(c):
                    cells.append(r.get(c))
            lines.append(f"{mark[status]} {r.name}: " + "  ".join(cells))
        if limit is not None and len(rows) > limit:
            lines.append(f"  ... {len(rows) - limit} more rows")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<GraphDiff {self._headline()}>"

    # ------------------------------------------------------------------ HTML
    def to_html(self, context: int | None = 1, limit: int | None = 200) -> str:
        """An HTML table of :meth:`rows`: added rows green, changed rows yellow (the
        changed cells bold, the old value struck through beside the new), moved rows blue,
        removed rows red and struck through; folded runs of unchanged rows in grey."""
        esc = html.escape
        if self.empty:
            return f"<div><b>{esc(self._headline())}</b>: no change</div>"
        td = 'style="padding:1px 8px;text-align:left;font-family:monospace;white-space:nowrap"'
        out = [f'<div><b>{esc(self._headline())}</b>',
               '<table style="border-collapse:collapse;font-size:12px">',
               "<tr>" + "".join(f"<th {td}>{c}</th>" for c in ("", "node", *FIELDS)) + "</tr>"]
        mark = {"added": "+", "removed": "−", "changed": "~", "moved": "↑↓", "same": ""}
        rows = self.rows(context)
        for status, r in rows[:limit]:
            if status == "folded":
                out.append(f'<tr style="color:#888"><td {td}></td><td {td} colspan="{len(FIELDS) + 1}">'
                           f"… {r} unchanged node{'s' if r != 1 else ''}</td></tr>")
                continue
            style = _ROW_STYLE[status]
            cells = [mark[status], r.name]
            for c in FIELDS:
                if status == "changed" and c in self.changed[r.name]:
                    o, n = self.changed[r.name][c]
                    cells.append(_changed_html(o, n, by_token=c == "args"))
                else:
                    cells.append(esc(r.get(c)))
            cells[1] = esc(cells[1])
            out.append(f'<tr style="{style}">' + "".join(f"<td {td}>{x}</td>" for x in cells) + "</tr>")
        if limit is not None and len(rows) > limit:
            out.append(f'<tr><td {td} colspan="{len(FIELDS) + 2}">… {len(rows) - limit} more rows</td></tr>')
        out.append("</table></div>")
        return "\n".join(out)

    def _repr_html_(self) -> str:
        return self.to_html()


def _split_args(s: str) -> list[str]:
    """``"a, [1, 2], b=c"`` -> ``["a", "[1, 2]", "b=c"]``: split at commas outside brackets
    and quotes."""
    out, depth, start, quote = [], 0, 0, ""
    for i, ch in enumerate(s):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(s[start:i].strip())
            start = i + 1
    out.append(s[start:].strip())
    return [t for t in out if t]


def _changed_html(old: str, new: str, by_token: bool) -> str:
    """The new value bold with the old struck through before it; for argument lists only the
    arguments that differ are marked."""
    esc = html.escape
    strike = "<s style='color:#999'>{}</s>"
    if not by_token:
        return (strike.format(esc(old)) + " " if old else "") + f"<b>{esc(new)}</b>"
    a, b = _split_args(old), _split_args(new)
    parts = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            parts.extend(esc(t) for t in a[i1:i2])
            continue
        parts.extend(strike.format(esc(t)) for t in a[i1:i2])
        parts.extend(f"<b>{esc(t)}</b>" for t in b[j1:j2])
    return ", ".join(parts)


_ROW_STYLE = {"added": "background:#e6ffec", "removed": "background:#ffebe9;text-decoration:line-through",
              "changed": "background:#fff8c5", "moved": "background:#ddf4ff", "same": ""}


def diff(before, after, title: str = "") -> GraphDiff:
    """The :class:`GraphDiff` between two snapshots (or graphs, snapshotted now)."""
    as_rows = (lambda g: tuple(g) if isinstance(g, (tuple, list)) else snapshot(g))  # noqa: E731
    return GraphDiff(as_rows(before), as_rows(after), title)


class PassLog:
    """A snapshot after each pass: give it to ``run_passes`` as ``on_pass``. ``placements``
    (node name -> tokens, e.g. ``{n: p.out for n, p in plan.nodes.items()}``) fills in the
    placement of nodes that carry none yet (the traced graph's)."""

    def __init__(self, placements: Mapping[str, object] | None = None):
        self.placements = placements
        self.snapshots: list[tuple[str, tuple[NodeRow, ...]]] = []

    def __call__(self, name: str, graph) -> None:
        self.snapshots.append((name, snapshot(graph, self.placements)))

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.snapshots]

    def diff(self, name: str) -> GraphDiff:
        """What the pass ``name`` changed: its snapshot against the one before it."""
        i = self.names.index(name)
        if i == 0:
            raise ValueError(f"{name!r} is the first snapshot: nothing before it to compare with")
        return diff(self.snapshots[i - 1][1], self.snapshots[i][1], title=name)

    def diffs(self) -> list[GraphDiff]:
        return [self.diff(n) for n in self.names[1:]]

    def overview(self) -> list[dict]:
        """Per pass: nodes after it, how many added / removed / changed / moved, and the
        ops it added and removed."""
        out = []
        for d in self.diffs():
            row = {"pass": d.title, **d.counts()}
            row["ops added"] = ", ".join(f"{k} x{v}" for k, v in d.ops_added().most_common())
            row["ops removed"] = ", ".join(f"{k} x{v}" for k, v in d.ops_removed().most_common())
            out.append(row)
        return out

    def overview_text(self) -> str:
        return _text_table(self.overview())

    def __repr__(self) -> str:
        return f"<PassLog {' -> '.join(self.names)}>\n" + self.overview_text()

    def _repr_html_(self) -> str:
        return _html_table(self.overview())


def _text_table(rows: Iterable[dict]) -> str:
    rows = list(rows)
    if not rows:
        return ""
    cols = list(rows[0])
    cells = [cols] + [[str(r[c]) for c in cols] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip() for r in cells) + "\n"


def _html_table(rows: Iterable[dict], cell: Callable[[object], str] = lambda v: html.escape(str(v))) -> str:
    rows = list(rows)
    if not rows:
        return ""
    td = 'style="padding:1px 8px;text-align:left;font-family:monospace"'
    cols = list(rows[0])
    head = "<tr>" + "".join(f"<th {td}>{html.escape(c)}</th>" for c in cols) + "</tr>"
    body = ["<tr>" + "".join(f"<td {td}>{cell(r[c])}</td>" for c in cols) + "</tr>" for r in rows]
    return '<table style="border-collapse:collapse;font-size:12px">' + head + "".join(body) + "</table>"
