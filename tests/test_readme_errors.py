"""The README's "When things go wrong" table names every error class stpc defines, and every
name in it resolves to a real class."""
import importlib
import inspect
import pathlib
import pkgutil
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _table() -> str:
    text = README.read_text()
    start = text.index("## When things go wrong")
    return text[start:text.index("\n## ", start + 1)]


def _stpc_modules() -> set[str]:
    """Every module of every package pyproject installs: ``stpc.passes`` and
    ``stpc.cost_models`` live in folders of their own (package-dir), which walking
    ``stpc.__path__`` never reaches in an editable install."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    names = set(packages)
    for package in packages:
        names |= {mod.name for mod in pkgutil.walk_packages(importlib.import_module(package).__path__, package + ".")}
    return {n for n in names if not n.startswith(("stpc.cli", "stpc.__main__"))}


def test_every_package_is_walked():
    modules = _stpc_modules()
    assert {"stpc.passes._common", "stpc.passes.verify", "stpc.cost_models.profile", "stpc.planner.solver",
            "stpc.runtime.agreement", "stpc.validate"} <= modules, sorted(modules)


def _stpc_exceptions() -> set[str]:
    found = set()
    for name in sorted(_stpc_modules()):
        m = importlib.import_module(name)
        for name, obj in vars(m).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == m.__name__:
                found.add(name)
    return found


def test_every_error_named_in_the_table_resolves():
    names = re.findall(r"`(stpc(?:\.\w+)*\.[A-Z]\w*)`", _table())
    assert names
    for dotted in names:
        mod, _, attr = dotted.rpartition(".")
        obj = getattr(importlib.import_module(mod), attr)
        assert inspect.isclass(obj) and issubclass(obj, (BaseException, Warning)), dotted


def test_every_error_stpc_defines_is_in_the_table():
    table = _table()
    internal = {"NoBetterPlan", "TooWide"}  # the solver's own control flow: caught inside the search
    missing = sorted(n for n in _stpc_exceptions() - internal if n not in table)
    assert not missing, f"README 'When things go wrong' does not list {missing}"
