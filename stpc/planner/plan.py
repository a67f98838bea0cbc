"""Plan: node -> strategy for one graph on one mesh, with its modelled costs.

JSON on disk (no pickle), a stable hash over what decides the program (mesh,
per-node placements, modelled costs — never timings), and readable views:
``plan.table()`` and ``plan.explain(node_name)``.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class NodePlan:
    """What one graph node does under the plan.

    role: ``decision`` (the solver chose it), ``follower`` (a view/unary op that
    follows its input), ``const`` (computed locally from no input), ``param``,
    ``input`` (a user input: each rank loads its own shard).
    """

    role: str
    op: str
    kind: str                      # spatial | ag_ring | rs_ring | p2x2 | replicate-fallback
    out: list[str]
    ins: list[list[str]] = field(default_factory=list)
    axis: int = -1
    time_s: float = 0.0            # modelled compute (+ overlapped ring) seconds of this node
    comm_s: float = 0.0            # modelled resharding seconds on its input edges
    mem_bytes: float = 0.0         # persistent bytes per device it accounts for
    tied_to: str = ""              # the representative node of an identical layer

    def describe(self) -> str:
        tag = "" if self.kind in ("spatial", "") else f"{self.kind}@{self.axis} "
        return tag + "(" + ",".join(self.out) + ")"


@dataclass
class Plan:
    model: str
    mesh_shape: list[int]
    cluster: str
    dtype: str
    budget_bytes: float | None
    nodes: dict[str, NodePlan]
    modelled_step_time_s: float
    peak_memory_bytes: float
    stats: dict = field(default_factory=dict)          # solve statistics and timings (not hashed)
    alternatives: dict = field(default_factory=dict)   # node -> [(strategy, modelled s), ...]

    # ------------------------------------------------------------------ views
    def describe(self, node_name: str) -> str:
        n = self.nodes.get(node_name)
        return n.describe() if n else ""

    def strategy_counts(self) -> dict[str, int]:
        """Per family, how many matmul-like/decision nodes use it (all layers counted)."""
        return dict(sorted(Counter(n.kind for n in self.nodes.values() if n.role == "decision").items()))

    def table(self) -> str:
        rows = [("node", "op", "strategy", "compute ms", "comm ms", "memory MiB")]
        for name, n in self.nodes.items():
            if n.role in ("follower", "const") and not n.comm_s:
                continue
            rows.append((name, n.op, n.describe(), f"{n.time_s * 1e3:.3f}", f"{n.comm_s * 1e3:.3f}",
                         f"{n.mem_bytes / 2**20:.1f}"))
        w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        head = (f"plan {self.hash()[:12]}  model {self.model}  mesh {'x'.join(map(str, self.mesh_shape))}  "
                f"cluster {self.cluster}  modelled step {self.modelled_step_time_s * 1e3:.3f} ms  "
                f"peak {self.peak_memory_bytes / 2**30:.3f} GiB/device\n")
        if self.stats.get("indivisible"):
            head += "dims no mesh axis divides (never split): " + ", ".join(
                f"{k} {v}" for k, v in self.stats["indivisible"].items()) + "\n"
        return head + "\n".join("  ".join(c.ljust(x) for c, x in zip(r, w)) for r in rows) + "\n"

    def explain(self, node_name: str) -> str:
        """The chosen strategy of ``node_name`` and its best alternatives, each with the
        modelled seconds of the node plus its input edges with the neighbours as planned."""
        if node_name not in self.nodes:
            raise KeyError(f"no node {node_name!r} in the plan")
        n = self.nodes[node_name]
        rep = n.tied_to or node_name
        lines = [f"{node_name} ({n.op}, {n.role}): {n.describe()}"
                 + (f"  [tied to {n.tied_to}]" if n.tied_to else "")]
        alts = self.alternatives.get(rep)
        if not alts:
            lines.append("  no alternatives: " + ("follows its input" if n.role == "follower" else
                                                  "a single choice"))
        else:
            lines.append("  alternatives (modelled ms: node + input edges, neighbours as planned):")
            for desc, secs in alts:
                mark = "*" if desc == n.describe() else " "
                lines.append(f"  {mark} {desc:40s} {secs * 1e3:10.4f}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ identity and disk
    def _canonical(self) -> dict:
        return {"model": self.model, "mesh_shape": list(self.mesh_shape), "cluster": self.cluster,
                "dtype": self.dtype, "budget_bytes": self.budget_bytes,
                "nodes": {k: [v.role, v.kind, v.out, v.ins, v.axis] for k, v in self.nodes.items()},
                "modelled_step_time_s": round(self.modelled_step_time_s, 12),
                "peak_memory_bytes": round(self.peak_memory_bytes)}

    def hash(self) -> str:
        blob = json.dumps(self._canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def to_json(self) -> str:
        d = asdict(self)
        d["plan_hash"] = self.hash()
        return json.dumps(d, indent=1, sort_keys=True)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = json.loads(text)
        want = d.pop("plan_hash", None)
        d["nodes"] = {k: NodePlan(**v) for k, v in d["nodes"].items()}
        d["alternatives"] = {k: [tuple(a) for a in v] for k, v in d.get("alternatives", {}).items()}
        plan = Plan(**d)
        if want is not None and plan.hash() != want:
            raise ValueError("plan file is corrupt: its content does not match its plan_hash")
        return plan

    @staticmethod
    def load(path: str) -> "Plan":
        with open(path) as f:
            return Plan.from_json(f.read())
