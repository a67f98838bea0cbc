"""planner: graph -> Plan. In: a TracedGraph (annotated aten graph), a mesh (or device count),
a cluster cost model and a memory budget. Out: a Plan (node -> strategy, modelled time and memory).

Stages, one module each: analysis (mesh-independent facts), strategies (candidate
partitions per node), costs (time and bytes of a strategy, of a reshard), builder
(the integer Problem of one mesh shape, and its solution read back as a Plan),
sharing (a reshard several consumers read, paid once), elimination and solver (exact
solve; CP-SAT where the budget binds), search (every mesh shape, or every layout of a
baseline), hints (constraints and presets), baselines (the layout spaces of the
presets stpc is compared with), plan (the Plan itself), report (what a plan leaves out:
replicated fallbacks, hints without effect, indivisible dims), cache (plans on disk).
"""
from stpc.planner.analysis import GraphFacts, analyse
from stpc.planner.baselines import BASELINES, Layout
from stpc.planner.builder import build_problem, plan_graph
from stpc.planner.hints import PRESETS, HintUnsatisfiable, Hints, preset
from stpc.planner.plan import NodePlan, Plan
from stpc.planner.search import SearchProgress, mesh_shapes, search
from stpc.planner.solver import InfeasibleBudget, NoBetterPlan

__all__ = ["analyse", "GraphFacts", "BASELINES", "Layout", "build_problem", "plan_graph", "Hints", "HintUnsatisfiable", "PRESETS",
           "preset", "Plan", "NodePlan", "search", "SearchProgress", "mesh_shapes", "InfeasibleBudget", "NoBetterPlan"]
