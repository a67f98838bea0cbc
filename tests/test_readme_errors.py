"""The README's "When things go wrong" table names every error class stpc defines, and every
name in it resolves to a real class."""
import importlib
import inspect
import pathlib
import pkgutil
import re

import stpc

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _table() -> str:
    text = README.read_text()
    start = text.index("## When things go wrong")
    return text[start:text.index("\n## ", start + 1)]


def _stpc_exceptions() -> set[str]:
    found = set()
    for mod in pkgutil.walk_packages(stpc.__path__, "stpc."):
        if mod.name.startswith(("stpc.cli", "stpc.__main__")):
            continue
        m = importlib.import_module(mod.name)
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
