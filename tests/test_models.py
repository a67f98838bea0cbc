import pytest
import torch

from stpc import models


@pytest.mark.parametrize("name", sorted(models.PUBLISHED_PARAMS))
def test_param_count_matches_published(name):
    with torch.device("meta"):
        m = models.build(name)
    n = models.num_params(m)
    assert abs(n / models.PUBLISHED_PARAMS[name] - 1) < 0.02, (name, n)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_tiny_models_train(name):
    torch.manual_seed(0)
    m = models.build(name)
    idx, tgt = models.example_inputs(name, 2, 16, device="cpu")
    loss = m(idx, tgt)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    # A fresh init predicts near-uniformly over the vocabulary.
    assert abs(loss.item() - torch.log(torch.tensor(float(m.cfg.vocab))).item()) < 0.5
    assert all(p.grad is not None for p in m.parameters())


def test_tied_head_shares_embedding():
    m = models.build("gpt-tiny")
    assert m.lm_head.weight is m.wte.weight
    u = models.build("gpt-tiny", tied_head=False)
    assert u.lm_head.weight is not u.wte.weight
    assert models.num_params(u) == models.num_params(m) + m.cfg.vocab * m.cfg.d_model


def test_alibi_gpt_runs():
    m = models.build("gpt-tiny", position="alibi", embed_norm=True)
    idx, tgt = models.example_inputs("gpt-tiny", 2, 8, device="cpu")
    assert torch.isfinite(m(idx, tgt))


def test_unknown_model_names_known_ones():
    with pytest.raises(KeyError, match="llama-tiny"):
        models.get_config("llama-huge")


def test_alibi_slopes_tensor_matches_reference():
    for h in (4, 8, 12, 32, 112):
        torch.testing.assert_close(models.alibi_slopes_tensor(h, "cpu", torch.float64),
                                   torch.tensor(models.alibi_slopes(h), dtype=torch.float64))
