"""The torch side of the benchmark: DDP, TP(+SP, loss parallel), FSDP2 and FSDP2 x TP on real
gloo ranks compute the single-device model's training step.

One spawn of 4 ranks runs every case: the zoo model is built, parallelised by
``stpc.cli.bench_engines.build_engine`` and trained 2 AdamW steps on a fixed global batch, next
to single-device copies of it. Each step is checked in three parts, at rtol 1e-4:

* forward and backward: the loss and every full gradient against a *probe*, the single-device
  model holding the engine's current (gathered) parameters, on the whole batch;
* the optimizer step: every parameter after it against a *shadow*, the full parameters stepped
  by the same AdamW on the engine's own (gathered) gradients;
* the run: the loss against the single-device model trained alone from the same start.

Parameters are not held element by element against the model trained alone: AdamW divides by
the gradient's own magnitude, so an element whose true gradient is zero (a key bias's: softmax
ignores it) or rounding-sized turns the two programs' different summation orders into full
steps of either sign (DDP itself misses rtol 1e-4 so). The probe sees the same parameters and
the shadow the same gradients, so no such drift reaches them; and since an AdamW step is blind
to a gradient's scale, only the gradient check catches a wrongly scaled (summed, not averaged)
gradient.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from stpc.cli.bench_engines import build_engine
from stpc.frontend import models
from stpc.runtime.launch import spawn

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import _rel  # noqa: E402

pytestmark = pytest.mark.multirank

B, S, STEPS = 8, 16, 2

# (engine, mesh, model, overrides): gpt-tiny has d_model 32, 4 heads, ffn 128, vocab 128, so TP 4
# leaves one head per rank; the Llama case keeps GQA under TP 4 (8 query heads, 4 key/value heads)
CASES = [
    ("ddp", (4,), "gpt-tiny", {}),
    ("tp", (4,), "gpt-tiny", {}),
    ("fsdp", (4,), "gpt-tiny", {}),
    ("fsdp-tp", (2, 2), "gpt-tiny", {}),
    ("tp", (4,), "gpt-tiny", {"position": "alibi", "embed_norm": True}),  # BLOOM's shape
    ("tp", (4,), "llama-tiny", {"n_heads": 8, "n_kv_heads": 4}),
    ("fsdp-tp", (2, 2), "llama-tiny", {}),
]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _run_cases(rank, world, cases):
    results = []
    for name, mesh, model_name, overrides in cases:
        torch.manual_seed(0)
        model = models.build(model_name, **overrides)
        alone, probe = copy.deepcopy(model), copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, model.cfg.vocab, (B, S), generator=g)
        tgt = torch.randint(0, model.cfg.vocab, (B, S), generator=g)
        n_params = len(list(model.parameters()))
        engine = build_engine(name, model, idx, tgt, mesh)
        opt, alone_opt = _adamw(engine.parameters()), _adamw(alone.parameters())
        probe_params = dict(probe.named_parameters())
        shadow = {k: torch.nn.Parameter(p.detach().clone()) for k, p in probe_params.items()}
        shadow_opt = _adamw(shadow.values())
        out = {"case": f"{name} {mesh} {model_name} {overrides}", "layout": engine.layout,
               "same_params": len(list(engine.parameters())) == n_params,
               "loss": 0.0, "grad": (0.0, ""), "param": (0.0, ""), "losses": []}
        for step in range(STEPS):
            with torch.no_grad():  # the probe stands where the engine stands now
                for k, v in engine.full_parameters().items():
                    probe_params[k].copy_(v)
            probe.zero_grad()
            here = probe(idx, tgt)
            here.backward()
            opt.zero_grad()
            alone_opt.zero_grad()
            loss = engine.forward_backward()
            ref = alone(idx, tgt)
            ref.backward()
            out["losses"].append((float(loss), float(ref.detach())))
            out["loss"] = max(out["loss"], _rel(loss, here.detach()), _rel(loss, ref.detach()))
            grads = engine.full_gradients()
            out["missing"] = sorted(set(probe_params) ^ set(grads))
            for k, gr in grads.items():
                out["grad"] = max(out["grad"], (_rel(gr, probe_params[k].grad), f"{k}@{step}"))
            opt.step()
            alone_opt.step()
            for k, p in shadow.items():
                p.grad = grads[k]
            shadow_opt.step()
            for k, v in engine.full_parameters().items():
                out["param"] = max(out["param"], (_rel(v, shadow[k].detach()), f"{k}@{step}"))
        results.append(out)
    try:  # refused before the model is touched: 2 key/value heads cannot split over 4 TP ranks
        build_engine("tp", models.build("llama-tiny"), idx, tgt, (4,))
        results.append({"refused": None})
    except ValueError as e:
        results.append({"refused": str(e)})
    return results


@pytest.mark.slow  # 20 s on 4 ranks; bench runtime's tiny end-to-end run stays in the default suite
def test_torch_engines_train_like_one_device():
    per_rank = spawn(_run_cases, 4, CASES, timeout_s=240)
    layouts = [r["layout"] for r in per_rank[0][:-1]]
    assert layouts == ["dp 4", "tp 4 (+SP)", "fsdp 4", "fsdp 2 x tp 2 (+SP)", "tp 4 (+SP)", "tp 4 (+SP)",
                       "fsdp 2 x tp 2 (+SP)"], layouts
    for rank, results in enumerate(per_rank):
        assert "n_kv_heads (2)" in (results.pop()["refused"] or ""), results
        for r in results:
            where = f"rank {rank}, {r['case']}"
            assert r["same_params"] and not r["missing"], (where, r)  # the tied head stays one parameter
            assert r["loss"] <= 1, (where, r["losses"])
            assert r["grad"][0] <= 1, (where, r["grad"])
            assert r["param"][0] <= 1, (where, r["param"])
    # every rank reports the same global loss
    assert all([r["losses"] for r in rs] == [r["losses"] for r in per_rank[0]] for rs in per_rank)


def test_build_engine_refuses_what_it_cannot_run_faithfully():
    with pytest.raises(ValueError, match="unknown engine"):
        build_engine("zero", models.build("gpt-tiny"), torch.zeros(8, 16, dtype=torch.long),
                     torch.zeros(8, 16, dtype=torch.long), (4,))
