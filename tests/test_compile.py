"""torch.compile: the training forward of every model traces as one graph (no graph breaks)."""

import pytest
import torch
import torch._dynamo as dynamo

import common

TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_embd=32, n_head=2, n_kv_head=1)


@pytest.mark.parametrize("model_type, extra", [
    ("det", {}), ("btrans", {}), ("btrans", {"noise_mode": "token"}), ("eve", {}),
    ("free", {"latent_bits": 4, "mapper": "factored"}), ("free", {"latent_bits": 4, "mapper": "dense"}),
])
def test_training_forward_has_no_graph_breaks(model_type, extra):
    torch.manual_seed(0)
    model = common.build_model(model_type, {**TINY, **extra}).train()
    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    explanation = dynamo.explain(model)(x, y)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
