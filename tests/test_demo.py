"""The README's main job runs end to end: a spatial-temporal plan on 4 gloo ranks, its
summary, training that matches the single-device model, the modelled comparison with the
baselines, and the dumps. (Fewer steps and a tiny comparison model than the README's
command, to keep the default suite fast; the code path is the same.)"""
import re
import subprocess
import sys

import pytest


@pytest.mark.multirank
def test_demo_runs_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "stpc", "demo", "--steps", "3", "--out", str(tmp_path),
                          "--compare", "llama-tiny", "--compare-devices", "4"],
                         capture_output=True, text=True, timeout=600)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    assert "[check] MATCH" in text and "every rank agreed" in text
    # a spatial-temporal family in the plan that ran: the solver's own, or rings forced and said so
    own = re.search(r"the solver's own plan: .* families (.*)", text).group(1)
    if not re.search(r"ag_ring|rs_ring|p2x2", own):
        assert "the solver's own plan uses no ring here; forcing AG/RS rings to show them" in text
    assert re.search(r"families \(decision nodes, all layers\): .*(ag_ring|rs_ring|p2x2)", text)
    assert "step time, modelled" in text and "memory per device, modelled peak" in text  # the summary
    assert "MODELLED by stpc's cost model, not run" in text
    for row in ("stpc", "Megatron (best)", "FSDP+TP (best)", "spatial only"):
        assert re.search(rf"^  {re.escape(row)} +\d+\.\d ms +\d+\.\d\d GiB +\d+\.\d\dx  ", text, re.M), row
    assert "dp " in text and " x tp " in text  # the layouts the baselines chose
    assert "stpc against the best baseline that fits" in text
    for name in ("plan.json", "plan.txt", "summary.txt", "traced.txt"):
        assert (tmp_path / name).exists(), name
    assert sorted(p.name for p in (tmp_path / "passes").glob("*.txt"))[-1] == "10_read_params_at_use.txt"


def test_demo_usage_error_exits_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "stpc", "demo", "--model", "no-such-model", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "unknown model 'no-such-model'" in out.stderr and "gpt-tiny" in out.stderr
