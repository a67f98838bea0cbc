"""The README's main job runs and its distributed run matches the single-device model."""
import subprocess
import sys


def test_demo_matches_single_device(tmp_path):
    out = subprocess.run([sys.executable, "-m", "stpc", "demo", "--steps", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "-> MATCH" in out.stdout and "(agreed)" in out.stdout
    assert (tmp_path / "plan.json").exists()
    assert sorted(p.name for p in (tmp_path / "passes").glob("*.txt"))[-1] == "07_verify.txt"
