"""The house rules of the source tree, read from the code with ``ast``.

* No import cycle between stpc modules (imports inside functions count too: that is
  where cycles hide).
* Dependencies point one way: cli -> compile -> passes -> planner -> frontend, with
  passes -> runtime and planner -> cost_models. The runtime knows nothing of plans or
  graphs, the planner never imports passes or the runtime, cost_models imports nothing
  from stpc, and passes never call the solver. ``stpc.placement`` (the placement
  vocabulary, DTensor's tokens) is a leaf every stage may read.
* Imports sit at the top of the module; one inside a function must say why on its line
  (``# lazy: <the cost it saves>``).
* No name is used that its module never defines or imports (pyflakes: what a move of
  code between modules most easily breaks, on paths no other test takes).
* ``stpc/`` holds at most six modules directly; every subpackage says in its docstring
  what goes in and what comes out.
"""
from __future__ import annotations

import ast
import pathlib

import pytest
from pyflakes import messages
from pyflakes.api import check
from pyflakes.reporter import Reporter

import stpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
# on-disk folder -> installed package name (pyproject's package-dir)
SOURCES = {"stpc": "stpc", "passes": "stpc.passes", "cost_models": "stpc.cost_models"}

# stage -> stages it may import (besides itself)
ALLOWED = {
    "placement": set(),
    "cost_models": set(),
    "frontend": set(),
    "planner": {"frontend", "cost_models", "placement"},
    "runtime": {"placement"},
    "passes": {"planner", "runtime", "frontend", "placement"},
    "api": {"passes", "planner", "runtime", "frontend", "cost_models", "placement"},
    "viz": {"planner", "runtime", "frontend", "cost_models", "placement"},
    "cli": {"api", "passes", "planner", "runtime", "frontend", "cost_models", "placement", "viz"},
    "main": {"cli"},
}
# the solver side of the planner, which passes must never reach
SOLVER = ("stpc.planner.solver", "stpc.planner.elimination", "stpc.planner.search", "stpc.planner.builder")


def stage(module: str) -> str:
    parts = module.split(".")
    if module in ("stpc", "stpc.compile", "stpc.module", "stpc.validate"):
        return "api"
    if module == "stpc.__main__":
        return "main"
    return {"passes": "passes", "cost_models": "cost_models", "frontend": "frontend", "planner": "planner",
            "runtime": "runtime", "cli": "cli", "placement": "placement", "viz": "viz"}[parts[1]]


def source_modules() -> dict[str, pathlib.Path]:
    """Installed module name -> file, for every product module."""
    out = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports_of(module: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, int, bool, str]]:
    """(imported stpc module, line, inside a function, source line) for every import of
    ``module``. ``from a import b`` names the module ``a.b`` where that is a module."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    is_package = path.name == "__init__.py"
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            if t == "stpc" or t.startswith("stpc."):
                found.append((t, node.lineno, id(node) in inner, lines[node.lineno - 1]))
    return found


def import_graph() -> dict[str, list[tuple[str, int, bool, str]]]:
    mods = source_modules()
    known = set(mods)
    graph = {}
    for m, p in mods.items():
        deps = []
        for t, line, inside, src in imports_of(m, p, known):
            while t not in known:  # an attribute of a module: the module
                t = t.rsplit(".", 1)[0]
            deps.append((t, line, inside, src))
        graph[m] = deps
    return graph


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path a -> ... -> a), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                got = visit(d)
                if got:
                    return got
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            got = visit(m)
            if got:
                return got
    return None


def direction_violations(graph) -> list[str]:
    bad = []
    for m, deps in graph.items():
        for t, line, _, src in deps:
            a, b = stage(m), stage(t)
            if a != b and b not in ALLOWED[a]:
                bad.append(f"{m}:{line} ({a}) imports {t} ({b}): {src.strip()}")
            if a == "passes" and t.startswith(SOLVER):
                bad.append(f"{m}:{line}: a pass imports the solver side of the planner ({t})")
    return bad


def test_no_import_cycles():
    graph = import_graph()
    edges = {m: {t for t, *_ in deps if t != m} for m, deps in graph.items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dependencies_point_one_way():
    assert direction_violations(import_graph()) == []


def test_imports_at_module_top():
    late = [f"{m}:{line}: {src.strip()}" for m, deps in import_graph().items()
            for t, line, inside, src in deps if inside and "# lazy:" not in src]
    for m, p in source_modules().items():  # third-party imports inside functions too
        tree = ast.parse(p.read_text())
        lines = p.read_text().splitlines()
        for f in ast.walk(tree):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(f):
                    if isinstance(n, (ast.Import, ast.ImportFrom)) and "# lazy:" not in lines[n.lineno - 1]:
                        late.append(f"{m}:{n.lineno}: {lines[n.lineno - 1].strip()}")
    assert sorted(set(late)) == [], "move these to the module top (or say '# lazy: why' on the line)"


def test_no_undefined_names():
    class Collect(Reporter):
        def __init__(self):
            self.found = []

        def flake(self, message):
            if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal)):
                self.found.append(str(message))

        def unexpectedError(self, filename, message):
            self.found.append(f"{filename}: {message}")

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.found.append(f"{filename}:{lineno}: {msg}")

    report = Collect()
    for path in source_modules().values():
        check(path.read_text(), str(path.relative_to(ROOT)), report)
    assert report.found == []
    check("def f():\n    return HintUnsatisfiable\n", "probe.py", report)  # the check can fail
    assert report.found and "HintUnsatisfiable" in report.found[0]


def test_the_rules_catch_what_they_forbid():
    # a cycle, a planner importing the runtime, cost_models importing stpc, a pass
    # importing the solver: each is caught
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    fake = {
        "stpc.planner.builder": [("stpc.runtime.reshard", 3, False, "from stpc.runtime import reshard")],
        "stpc.cost_models.comm": [("stpc.placement", 4, False, "from stpc.placement import parse")],
        "stpc.runtime.reshard": [("stpc.planner.plan", 5, False, "from stpc.planner.plan import Plan")],
        "stpc.passes.verify": [("stpc.planner.solver", 6, False, "from stpc.planner.solver import solve")],
        "stpc.planner.costs": [("stpc.cost_models.comm", 7, False, "from stpc.cost_models import CostModel")],
    }
    bad = direction_violations(fake)
    assert len(bad) == 4 and not any("stpc.planner.costs" in b for b in bad), bad


def test_stpc_holds_few_modules_and_subpackages_say_what_they_do():
    loose = sorted(p.name for p in (ROOT / "stpc").glob("*.py"))
    assert len(loose) <= 6, loose
    packages = [ROOT / "stpc" / d for d in ("frontend", "planner", "runtime", "cli", "viz")] + [ROOT / "passes",
                                                                                     ROOT / "cost_models"]
    for pkg in packages:
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and "In:" in doc and "Out:" in doc, f"{pkg.name}/__init__.py: say what goes in and what comes out"


@pytest.mark.parametrize("name", ["compile", "trace", "Plan", "Hints", "DistributedModel", "TracedGraph", "search",
                                  "dump", "models"])
def test_public_names(name):
    assert hasattr(stpc, name)
