"""Plan: node -> strategy for one graph on one mesh, with its modelled costs.

JSON on disk (no pickle), a stable hash over what decides the program (mesh,
per-node placements, modelled costs — never timings), and readable views:
``plan.summary()`` (the plan in a page), ``plan.explain(node_name)`` (a node's
strategies ranked by their full effect on the step time), ``plan.table()`` (every node);
``stpc.planner.summary`` writes the first two and ``plan_diff``.

A plan planned in this process keeps the problem it was solved from (``Plan.attach``:
not serialised, not in the hash), which the full-effect ranking re-solves; a plan
loaded from JSON has none and says so.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass, field

from stpc.cost_models import GRAD_BUCKET_BYTES
from stpc.planner.summary import Solved, explain, summary


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
    module: str = ""               # the nn.Module path it came from (not hashed: for reading)

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

    def explain(self, node_name: str, top: int = 6, time_limit_s: float = 10.0) -> str:
        """The chosen strategy of ``node_name`` and its best ``top`` alternatives ranked by
        full effect: the modelled step time of the best plan in which the node's group (it,
        its followers, its tied copies) takes each (the problem re-solved with the group
        fixed). A plan loaded from disk has no problem to re-solve: it gives the local
        ranking (node + input edges, neighbours as planned) and says so. Where the memory
        budget binds, each alternative is CP-SAT's, up to ``time_limit_s``."""
        return explain(self, node_name, top, time_limit_s)

    def summary(self) -> str:
        """The plan in a page: step time split into compute / exposed / hidden communication,
        per-device memory into parameters / gradients / optimizer / activations / transient,
        and per distinct layer each matmul-like node's strategy and its cheapest alternative
        (``stpc.planner.summary``)."""
        return summary(self)

    @property
    def solved(self):
        """The problem this plan was solved from (``summary.Solved``), or None (loaded from disk)."""
        return self.__dict__.get("_solved")

    def attach(self, builder, problem, solution) -> None:
        """Keep the problem this plan was solved from (the builder, its integer problem and
        the chosen assignment), for the full-effect views; also records each node's module
        path. Not serialised, not hashed."""
        self._solved = Solved(builder, problem, solution.choice, solution.objective_ns, solution.peak_bytes)
        for name, module in self._solved.modules().items():
            n = self.nodes.get(name)
            if n is not None:
                n.module = module

    def __getstate__(self):  # pickling / deepcopy leave the problem behind (it holds the graph)
        d = dict(self.__dict__)
        d.pop("_solved", None)
        return d

    # ------------------------------------------------------------------ identity and disk
    def _canonical(self) -> dict:
        out = {"model": self.model, "mesh_shape": list(self.mesh_shape), "cluster": self.cluster,
               "dtype": self.dtype, "budget_bytes": self.budget_bytes,
               "nodes": {k: [v.role, v.kind, v.out, v.ins, v.axis] for k, v in self.nodes.items()},
               "modelled_step_time_s": round(self.modelled_step_time_s, 12),
               "peak_memory_bytes": round(self.peak_memory_bytes)}
        if self.stats.get("recompute"):  # another program: the ranks must agree on it too
            out["recompute"] = self.stats["recompute"]
            if self.stats.get("recompute_layers") is not None:
                out["recompute_layers"] = self.stats["recompute_layers"]
        if self.stats.get("keep_grad_buckets"):  # the reducer's buffers held between steps: another peak
            out["keep_grad_buckets"] = True
        if self.stats.get("grad_bucket_bytes", GRAD_BUCKET_BYTES) != GRAD_BUCKET_BYTES:  # another reducer
            out["grad_bucket_bytes"] = self.stats["grad_bucket_bytes"]
        return out

    def hash(self) -> str:
        blob = json.dumps(self._canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def to_json(self) -> str:
        """Keys sorted, except the nodes (and their alternatives), which keep graph order:
        a loaded plan reads (``summary``, ``table``) in the order it was planned."""
        d = asdict(self)
        d["plan_hash"] = self.hash()
        ordered = {k: d.pop(k) for k in ("nodes", "alternatives")}
        out = json.loads(json.dumps(d, sort_keys=True))
        out.update(ordered)
        return json.dumps(out, indent=1)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"plan file is corrupt: not a plan object (JSON {type(d).__name__})")
        want = d.pop("plan_hash", None)
        try:
            d["nodes"] = {k: NodePlan(**v) for k, v in d["nodes"].items()}
            d["alternatives"] = {k: [tuple(a) for a in v] for k, v in d.get("alternatives", {}).items()}
            plan = Plan(**d)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"plan file is corrupt: {type(e).__name__}: {e}") from None
        if want is not None and plan.hash() != want:
            raise ValueError("plan file is corrupt: its content does not match its plan_hash")
        return plan

    @staticmethod
    def load(path: str) -> "Plan":
        with open(path) as f:
            return Plan.from_json(f.read())
