import subprocess
import sys

import torch

from stpc import dump, models, trace


def test_dump_writes_table_and_dot(tmp_path):
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = trace(m, models.example_inputs("gpt-tiny", 2, 16))
    paths = dump(tg, str(tmp_path / "g.txt"))
    table = open(paths[0]).read().splitlines()
    assert table[0].split()[:6] == ["node", "op", "shape", "dtype", "flops", "bytes"]
    assert len(table) == len(tg.graph.nodes) + 1
    lin = next(l for l in table if l.startswith("linear "))
    assert "2x16x32" in lin and "float32" in lin and "models.py:" in lin
    dot = open(paths[1]).read()
    assert dot.startswith("digraph") and '"layer_norm" -> "linear"' in dot


def test_trace_cli(tmp_path):
    out = subprocess.run([sys.executable, "-m", "stpc", "trace", "--model", "llama-tiny", "--batch", "2",
                          "--seq", "16", "--dump", str(tmp_path / "l.txt")],
                         capture_output=True, text=True, check=True).stdout
    assert "parameters" in out and "nodes" in out and "FLOPs" in out
    assert (tmp_path / "l.txt").exists() and (tmp_path / "l.dot").exists()
    n_params = int(out.split("parameters")[1].split()[0].replace(",", ""))
    assert n_params == models.num_params(models.build("llama-tiny"))
