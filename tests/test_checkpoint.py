"""Checkpoints across plans with torch.distributed.checkpoint: saved under one plan on 4
ranks (mesh 2x2), loaded under other plans on 2 ranks (mesh 2, the model built on meta and
materialised only by the load) and on 4 ranks (mesh 4, PrimePar grid layouts); parameters
and AdamW state come back bit for bit, and training goes on with the losses of the run that
was never interrupted."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import _rel, full_params, make_plan  # noqa: E402

from stpc.runtime.launch import spawn  # noqa: E402

pytestmark = pytest.mark.multirank

MODEL, B, S = "llama-tiny", 4, 16


def _batches(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (B, S), generator=g), torch.randint(0, vocab, (B, S), generator=g))
            for _ in range(n)]


def _full_state(pm, opt) -> dict:
    """FQN -> {exp_avg, exp_avg_sq, step} as full tensors (a collective)."""
    out = {}
    for k, p in pm.named_parameters():
        st = opt.state[p]
        out[k] = {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for n, v in st.items()}
    return out


def _train(pm, opt, batches) -> list[float]:
    losses = []
    for idx, tgt in batches:
        opt.zero_grad()
        loss = pm(idx, tgt)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _save(rank, world, plan_json, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    import stpc
    from stpc import models
    from stpc.planner import Plan

    torch.manual_seed(0)
    model = models.build(MODEL)
    batches = _batches(model.cfg.vocab, 6, seed=1)
    pm = stpc.compile(model, None, batches[0], plan=Plan.from_json(plan_json))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    _train(pm, opt, batches[:3])
    dcp.save({"model": get_model_state_dict(pm), "optim": get_optimizer_state_dict(pm, opt)}, checkpoint_id=path)
    saved = {"params": full_params(pm), "state": _full_state(pm, opt)}
    saved["losses"] = _train(pm, opt, batches[3:])  # the run that is never interrupted
    return saved if rank == 0 else None


def _load(rank, world, plan_json, path, on_meta):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    import stpc
    from stpc import models
    from stpc.module import local_bytes
    from stpc.planner import Plan

    torch.manual_seed(7)  # another init: only the load can make it equal
    if on_meta:
        with torch.device("meta"):
            model = models.build(MODEL)
    else:
        model = models.build(MODEL)
    batches = _batches(models.get_config(MODEL).vocab, 6, seed=1)
    pm = stpc.compile(model, None, batches[0], plan=Plan.from_json(plan_json))
    if on_meta:
        pm.to_empty(device="cpu")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    msd, osd = get_model_state_dict(pm), get_optimizer_state_dict(pm, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_model_state_dict(pm, msd)
    set_optimizer_state_dict(pm, opt, osd)
    got = {"params": full_params(pm), "state": _full_state(pm, opt), "local_bytes": local_bytes(pm)}
    got["losses"] = _train(pm, opt, batches[3:])
    return got


def _bitwise(a: dict, b: dict) -> list[str]:
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    return bad + [k for k in b if k not in a]


def test_checkpoint_saved_under_one_plan_loads_under_others(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = spawn(_save, 4, make_plan(MODEL, "2x2", "megatron", B, S).to_json(), path, timeout_s=300)[0]
    full_bytes = sum(v.numel() * v.element_size() for v in saved["params"].values())
    for world, mesh, family, on_meta in [(2, "2", "zero", True), (4, "4", "p2x2", False)]:
        got = spawn(_load, world, make_plan(MODEL, mesh, family, B, S).to_json(), path, on_meta, timeout_s=300)
        for r in got:
            assert not _bitwise(saved["params"], r["params"]), _bitwise(saved["params"], r["params"])
            for k, st in saved["state"].items():
                assert set(st) == set(r["state"][k]), k
                assert all(torch.equal(v, r["state"][k][n]) for n, v in st.items()), k
            assert all(_rel(torch.tensor(x), torch.tensor(y)) <= 1 for x, y in zip(r["losses"], saved["losses"])), \
                (family, r["losses"], saved["losses"])
            # ZeRO on 2 ranks: every weight stored sharded, each rank holds half the model
            if family == "zero":
                assert r["local_bytes"] == full_bytes // 2, (r["local_bytes"], full_bytes)
