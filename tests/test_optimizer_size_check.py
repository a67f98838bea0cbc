"""benchmarks/optimizer_size_check.py on real gloo ranks, tiny sizes: a row per size, each
timed on every rank, and bad sizes refused."""
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import optimizer_size_check  # noqa: E402

pytestmark = pytest.mark.multirank


def test_a_row_per_size_with_a_positive_rate(capsys):
    assert optimizer_size_check.main(["--ranks", "2", "--numels", "4000,40000", "--window", "0.05",
                                      "--timeout", "120"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4")]
    assert [r.split("|")[1].strip() for r in rows] == ["4000", "40000"]
    assert all(float(r.split("|")[3]) > 0 and float(r.split("|")[4]) > 0 for r in rows)


def test_sizes_that_do_not_split_evenly_are_refused():
    with pytest.raises(SystemExit, match="multiple of 4"):
        optimizer_size_check.main(["--numels", "4001"])
