"""benchmarks/dp_gap_check.py on a tiny model: the four engines train from the same start,
the kept engines' gradients stay in one buffer step after step and the plain engine's
parameters are plain tensors (what it claims to measure), and the section it writes holds
every engine and the optimizer pair."""
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
                              "--warmup", "1", "--json", str(js), "--results", str(md),
                              "--timeout", "300"]) == 0  # a hang fails in minutes, with every rank's stacks
    res = json.loads(js.read_text())
    losses = [e["first_loss"] for e in res["engines"]]
    assert max(losses) - min(losses) < 1e-5, losses
    last = [e["last_loss"] for e in res["engines"]]  # the plain-parameter program trains alike too
    assert max(last) - min(last) < 1e-4 * abs(last[0]) and last != losses, last
    assert res["kept_buffers_reused"] and res["plain_parameters"]
    assert all(len(e["rounds"]) == 3 and e["peak_bytes"] > 0 for e in res["engines"])
    assert len(res["optimizer"]["dtensor_s"]) == len(res["optimizer"]["plain_s"]) == 3
    text = md.read_text()
    assert "<!-- bench:dp-gap -->" in text and "<!-- /bench:dp-gap -->" in text
    for name in dp_gap_check.ENGINES:
        assert f"| {name} |" in text
    assert "Taken apart:" in text and "as DTensors" in text and "neither of the two" in text
    # the shipped program reads its parameters where used, the fifth engine at the step's start;
    # both timed their bucket launches, every round, within the step
    assert res["read_at_use"][0] > 0 and res["read_at_use"][1] == 0, res["read_at_use"]
    for name in (dp_gap_check.ENGINES[0], dp_gap_check.ENGINES[4]):
        when = res["when"][name]
        assert len(when) == 3 and all(w["launches"] and w["forward_end"] < w["backward_end"] for w in when), when
    assert "When the gradients go out" in text and "Reading them where used moves the step by" in text


def test_plain_parameters_keep_ties_and_refuse_a_piece():
    """The swap the plain engine makes: every DTensor parameter becomes a plain one of its local
    tensor (the same storage), a tied parameter one object still; a sharded one is refused
    (its local tensor is a piece, not the parameter)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from stpc.runtime.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        emb, head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
        shared = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Replicate()]))
        emb.weight = head.weight = shared
        model = torch.nn.Sequential(emb, head)

        class Engine:
            pass

        engine = Engine()
        engine.model = model
        dp_gap_check._plain_parameters(engine)
        assert not isinstance(emb.weight, type(shared)) and emb.weight is head.weight
        assert emb.weight.data_ptr() == shared.to_local().data_ptr() and emb.weight.requires_grad
        head.weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        with pytest.raises(ValueError, match="not replicated"):
            dp_gap_check._plain_parameters(engine)
    finally:
        dist.destroy_process_group()
