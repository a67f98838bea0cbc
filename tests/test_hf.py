"""Hugging Face models compile and train in parity, called as users call them:
``model(input_ids=..., labels=...)`` returning the output's ``.loss`` (small random
configs, no download). Labels carry -100 (ignored) positions that do not fall evenly
over the ranks, so a row-split loss must count them globally."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import _rel, full_grads, full_params  # noqa: E402

from stpc.runtime.launch import spawn  # noqa: E402

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

B, S, V = 4, 16, 128


def build(name: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name == "gpt2":
        cfg = GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, use_cache=False,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        cfg._attn_implementation = "sdpa"
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                      bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def batches(n: int):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (B, S), generator=g)
        labels = ids.clone()
        labels[0, :5] = -100  # a prompt that is not trained on, in the first sequence only
        labels[2, 9:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def plan_for(name: str, mesh: str, how: str):
    import stpc
    from stpc.planner import search

    with torch.device("meta"):
        model = build(name)
    ex = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batches(1)[0].items()}
    tg = stpc.trace(model, (), name, ex)
    shape = tuple(int(x) for x in mesh.split("x"))
    if how == "megatron":
        return search(tg, shape, hints="megatron")
    free = search(tg, shape)  # a third of the unconstrained peak: the solver has to shard
    # (CP-SAT's proof that no other candidate beats the plan found is not what parity needs:
    # tests/_multirank.SOLVED_BUDGET_TIME_LIMIT_S)
    return search(tg, shape, budget_bytes=free.peak_memory_bytes / 3, time_limit_s=5.0)


def _train(rank, world, name, plan_json, steps):
    import copy

    import stpc
    from stpc.planner import Plan

    torch.manual_seed(0)
    model = build(name)
    ref, probe = copy.deepcopy(model), copy.deepcopy(model)
    data = batches(steps)
    pm = stpc.compile(model, None, example_kwargs=data[0], plan=Plan.from_json(plan_json))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    probe_params = dict(probe.named_parameters())
    worst = {"loss": 0.0, "grad": 0.0, "logits": 0.0, "steps": 0}
    for batch in data:
        opt.zero_grad()
        ref_opt.zero_grad()
        probe.zero_grad()
        with torch.no_grad():
            for k, v in full_params(pm).items():
                probe_params[k].copy_(v)
        out = pm(**batch)  # as users call it: a CausalLMOutput with .loss and .logits
        out.loss.backward()
        here = probe(**batch)
        here.loss.backward()
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        worst["type"] = type(out).__name__
        worst["loss"] = max(worst["loss"], _rel(out.loss.detach(), here.loss.detach()),
                            _rel(out.loss.detach(), ref_loss.detach()))
        worst["logits"] = max(worst["logits"], _rel(out.logits.detach(), here.logits.detach()))
        grads = full_grads(pm)
        worst["grad"] = max([worst["grad"]] + [_rel(grads[k], p.grad) for k, p in probe_params.items()])
        opt.step()
        ref_opt.step()
        worst["steps"] += 1
    return worst


# (GPT-2 under a budget, 41 s on 2 cores, runs in the slow suite: the default run keeps one
# Hugging Face model in parity and stays under 25 minutes)
@pytest.mark.parametrize("name,mesh,how", [pytest.param("gpt2", "4", "budget", marks=pytest.mark.slow),
                                           ("llama", "2x2", "megatron")])
def test_hugging_face_models_train_in_parity(name, mesh, how):
    plan = plan_for(name, mesh, how)
    assert any(t != "R" for n in plan.nodes.values() if n.role == "param" for t in n.out), "nothing sharded"
    for r in spawn(_train, 4, name, plan.to_json(), 5, timeout_s=500):
        assert r["steps"] == 5 and r["type"].startswith("CausalLMOutput"), r
        assert r["loss"] <= 1 and r["grad"] <= 1 and r["logits"] <= 1, r
