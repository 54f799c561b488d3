"""multiple_choice.score_choices puts every pass and choice of an example in one batch and, for det and B-Trans minds,
reads the choices' shared context from a KV cache: its scores equal a straightforward computation, one pass and one
choice at a time, each a forward over the whole sequence, for all four models and both mixtures."""

import math

import pytest
import torch
import torch.nn.functional as F

from nanolatent import models, multiple_choice

TINY = dict(vocab_size=50, block_size=24, n_layer=2, n_embd=32, n_head=4, n_kv_head=2)


def reference(model, pairs, n_passes, generator, mixture):
    """The scores by definition: pass by pass (latents drawn as score_choices draws them), choice by choice."""
    T = model.config.block_size
    seqs = [(ctx + cont)[-(T + 1):] for ctx, cont in pairs]
    n_cont = [min(len(cont), len(seq) - 1) for (_, cont), seq in zip(pairs, seqs)]
    contexts = [seq[:len(seq) - n] for seq, n in zip(seqs, n_cont)]
    per_pass = []  # [pass][choice] -> log p of each continuation token, (n,)
    for _ in range(n_passes):
        latents = multiple_choice.example_latents(model, contexts, generator)
        row = []
        for i, (seq, n) in enumerate(zip(seqs, n_cont)):
            lat = None if latents is None else latents[i:i + 1]
            x = torch.tensor([seq[:-1]])
            logits = model(x, x, latents=lat)[0][0].double()  # (len - 1, V): targets only ask for every position
            log_p = F.log_softmax(logits, dim=-1)[len(seq) - 1 - n:]  # the positions predicting the continuation
            row.append(log_p.gather(-1, torch.tensor(seq[len(seq) - n:])[:, None]).squeeze(1))
        per_pass.append(row)
    scores = []
    for i in range(len(seqs)):
        lp = torch.stack([p[i] for p in per_pass])  # (passes, n)
        if mixture == "sequence":
            scores.append((torch.logsumexp(lp.sum(1), 0) - math.log(n_passes)).item())
        else:
            scores.append((torch.logsumexp(lp, 0) - math.log(n_passes)).sum().item())
    return scores, n_cont


@pytest.mark.parametrize("model_type, extra, n_passes", [
    ("det", {}, 1), ("btrans", {"sigma": 0.5}, 3), ("btrans", {"sigma": 0.5, "noise_mode": "mean"}, 1),
    ("eve", {}, 3), ("free", {"latent_bits": 4}, 3),
])
@pytest.mark.parametrize("mixture", ["token", "sequence"])
@pytest.mark.parametrize("logits_per_forward", [2 ** 25, 1])  # all passes in one forward, or one pass at a time
def test_batched_scores_equal_the_one_by_one_reference(model_type, extra, n_passes, mixture, logits_per_forward,
                                                       monkeypatch):
    monkeypatch.setattr(multiple_choice, "MC_LOGITS", logits_per_forward)
    torch.manual_seed(0)
    model = models.build_model(model_type, {**TINY, **extra}).eval()
    tok = lambda *n: torch.randint(0, 50, n).tolist()
    context, long_context = tok(7), tok(20)
    examples = [
        [(context, tok(1)), (context, tok(3)), (context, tok(5)), (context, tok(2))],  # a shared context
        [([7], tok(4)), ([7], tok(2))],  # a one-token context (an end-of-text token): nothing to cache
        [(long_context, tok(3)), (long_context, tok(8))],  # past block_size + 1: left-truncated, contexts differ
    ]
    for pairs in examples:
        want, want_n = reference(model, pairs, n_passes, torch.Generator().manual_seed(5), mixture)
        got, got_n, truncated = multiple_choice.score_choices(model, pairs, n_passes, torch.Generator().manual_seed(5),
                                                              mixture=mixture)
        assert got_n == want_n
        assert truncated == any(len(c) + len(d) > TINY["block_size"] + 1 for c, d in pairs)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
        assert model.blocks[0].attn.kv_cache is None  # the cache is gone after scoring


def test_det_and_minds_read_the_context_from_the_cache_once_per_pass(monkeypatch):
    """The shared context goes through the model once per pass (a prefill of n_passes rows); the choices' rows carry
    only their continuations. EVE and Free score whole sequences (their latents read the tokens or their positions)."""
    calls = []
    for model_type, n_passes in (("det", 1), ("btrans", 3), ("eve", 2)):
        torch.manual_seed(0)
        model = models.build_model(model_type, TINY).eval()
        forward = model.forward
        monkeypatch.setattr(model, "forward", lambda idx, *a, **k: (calls.append((model_type, tuple(idx.shape))),
                                                                  forward(idx, *a, **k))[1])
        context = list(range(10))
        pairs = [(context, [11, 12]), (context, [13]), (context, [14, 15, 16])]
        multiple_choice.score_choices(model, pairs, n_passes, torch.Generator().manual_seed(0))
    assert calls == [("det", (1, 9)), ("det", (3, 3)), ("btrans", (3, 9)), ("btrans", (9, 3)), ("eve", (6, 12))]
