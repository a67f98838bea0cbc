"""benchmarks/dp_gap_check.py on a tiny model: the three engines train from the same start,
the kept engine's gradients stay in one buffer step after step (what it claims to measure),
and the section it writes holds every engine and the optimizer pair."""
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import dp_gap_check  # noqa: E402

pytestmark = pytest.mark.multirank


def test_tiny_run_writes_its_section(tmp_path):
    js, md = tmp_path / "gap.json", tmp_path / "RESULTS.md"
    assert dp_gap_check.main(["--model", "gpt-tiny", "--layers", "1", "--batch", "4", "--seq", "16", "--steps", "3",
                              "--warmup", "1", "--json", str(js), "--results", str(md)]) == 0
    res = json.loads(js.read_text())
    losses = [e["first_loss"] for e in res["engines"]]
    assert max(losses) - min(losses) < 1e-5, losses
    assert res["kept_buffers_reused"]
    assert all(len(e["rounds"]) == 3 and e["peak_bytes"] > 0 for e in res["engines"])
    assert len(res["optimizer"]["dtensor_s"]) == len(res["optimizer"]["plain_s"]) == 3
    text = md.read_text()
    assert "<!-- bench:dp-gap -->" in text and "<!-- /bench:dp-gap -->" in text
    for name in dp_gap_check.ENGINES:
        assert f"| {name} |" in text
    assert "Taken apart:" in text and "as DTensors" in text
