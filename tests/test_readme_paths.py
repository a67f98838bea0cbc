"""Every file of this repository the README names exists: a user copies these paths into
commands (a calibration profile, a primepar checkpoint, a script), so a renamed or removed
file must take its README mention with it."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]

# a path under one of the repository's top-level folders, not part of a longer path or name
_PATH = re.compile(r"(?<![\w/.])((?:benchmarks|stpc|passes|cost_models|tests|notebooks|\.ci)/[\w./-]*\w)")


def named_paths(text: str) -> set[str]:
    return set(_PATH.findall(text))


def test_the_pattern_finds_paths_in_commands_and_prose():
    text = ("run `python benchmarks/cuda_check.py`; the profile benchmarks/data/x_s37.jsonl, "
            "(see stpc/planner/costs.py) but not torch/fx/passes/shape_prop.py or a.stpc/b")
    assert named_paths(text) == {"benchmarks/cuda_check.py", "benchmarks/data/x_s37.jsonl", "stpc/planner/costs.py"}


def test_every_path_the_readme_names_exists():
    paths = named_paths((ROOT / "README.md").read_text())
    assert len(paths) > 20, sorted(paths)  # the README names its scripts, data and modules
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README.md names files that do not exist: {missing}"
