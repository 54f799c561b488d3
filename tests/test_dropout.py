"""Residual dropout (nanoGPT's resid_dropout), the same in all four model files: dropout=0 computes exactly what the
blocks computed without it and draws no random numbers; dropout>0 acts only in train() mode."""

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import model_btrans  # noqa: E402
import model_det  # noqa: E402
import model_eve  # noqa: E402
import model_free  # noqa: E402

MODELS = [(model_det, {}), (model_eve, {}), (model_eve, {"variational": False}), (model_free, {}),
          (model_btrans, {})]  # model_eve with variational=False: EVE's deterministic twin
SMALL = dict(block_size=32, vocab_size=17, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def build(module, **overrides):
    torch.manual_seed(0)
    return module.Model(module.Config(**{**SMALL, **overrides}))


def loss(model, seed=1):
    """The training loss on fixed tokens, with the global RNG (the models' latents in train mode) seeded."""
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, SMALL["vocab_size"], (3, 12), generator=g)
    torch.manual_seed(seed)
    return model(idx[:, :-1], idx[:, 1:])[1]


@pytest.mark.parametrize("module, kind", MODELS, ids=lambda m: getattr(m, "__name__", str(m)))
def test_dropout_zero_is_bit_identical_to_the_blocks_without_it_in_train_mode(module, kind):
    model = build(module, **kind).train()
    with_dropout = loss(model)
    for block in model.modules():  # the computation before dropout existed: each branch added as it is
        if hasattr(block, "dropout") and isinstance(block.dropout, nn.Dropout):
            block.dropout = nn.Identity()
    assert torch.equal(with_dropout, loss(model))


@pytest.mark.parametrize("module, kind", MODELS, ids=lambda m: getattr(m, "__name__", str(m)))
def test_dropout_in_eval_mode_is_identical_to_no_dropout_and_differs_in_train_mode(module, kind):
    plain, dropped = build(module, **kind), build(module, **kind, dropout=0.3)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), dropped.state_dict().values()))
    assert torch.equal(loss(plain.eval()), loss(dropped.eval()))
    assert not torch.equal(loss(plain.train()), loss(dropped.train()))


def test_dropout_out_of_range_is_refused():
    with pytest.raises(ValueError, match="dropout"):
        build(model_det, dropout=1.5)
