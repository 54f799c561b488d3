"""experiments/eve_uncertainty.py: its AUROC against counting pairs, its per-token scores against evaluate.py's
definitions and evaluate_lm's means on the same windows and draws, and its encoding of out-of-domain text into a
run's --vocab=used ids."""

import itertools
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import LOCAL_DATA, local_skip

from experiments import eve_uncertainty as eu
from nanolatent import metrics, models, tokendata


def pairwise_auroc(scores, positive):
    """Every (positive, negative) pair counted: 1 where the positive scores higher, 1/2 for a tie."""
    pos = [s for s, p in zip(scores, positive) if p]
    neg = [s for s, p in zip(scores, positive) if not p]
    return sum((a > b) + 0.5 * (a == b) for a, b in itertools.product(pos, neg)) / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_auroc_equals_pairwise_counting_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 6, size=60).astype(float)  # 6 values among 60: ties everywhere
    positive = rng.random(60) < 0.3
    assert eu.auroc(scores, positive) == pytest.approx(pairwise_auroc(scores, positive), abs=1e-12)


def test_auroc_is_one_for_a_perfect_ranking_zero_reversed_and_a_half_for_one_value():
    positive = [0, 0, 0, 1, 1]
    assert eu.auroc([0.1, 0.2, 0.3, 0.4, 0.5], positive) == 1.0
    assert eu.auroc([0.5, 0.4, 0.3, 0.2, 0.1], positive) == 0.0
    assert eu.auroc([0.7] * 5, positive) == 0.5


def test_token_scores_are_evaluates_definitions_token_by_token():
    rng = np.random.default_rng(0)
    M, N, V = 5, 40, 7
    log_p = F.log_softmax(torch.tensor(rng.normal(size=(M, N, V)) * 2, dtype=torch.float32), -1)
    targets = torch.tensor(rng.integers(V, size=N))
    got = eu.token_scores(iter(log_p), targets)
    p = log_p.double().exp()  # (M, N, V)
    p_bar = p.mean(0)
    h = lambda q: -(q * q.log()).sum(-1)
    pred = p_bar.argmax(-1)
    want = {"mi": h(p_bar) - h(p).mean(0), "flip": (p.argmax(-1) != pred).double().mean(0),
            "one_minus_maxprob": 1 - p_bar.max(-1).values, "entropy": h(p_bar), "wrong": (pred != targets)}
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value.double().numpy(), atol=1e-6, err_msg=key)
    assert 0 < got["wrong"].mean() < 1 and got["flip"].max() > 0
    # and their means are evaluate.py's metrics of the same passes
    whole = metrics.mc_metrics(log_p, targets)
    for key, metric in (("mi", "mi"), ("flip", "flip_rate"), ("entropy", "entropy")):
        assert got[key].mean() == pytest.approx(whole[metric], abs=1e-6), key
    assert 1 - got["wrong"].mean() == pytest.approx(whole["acc"], abs=1e-12)


def test_identical_passes_give_exactly_zero_mi_and_flip():
    log_p = F.log_softmax(torch.randn(30, 11, generator=torch.Generator().manual_seed(1)), -1)
    got = eu.token_scores(iter([log_p] * 8), torch.zeros(30, dtype=torch.long))
    assert (got["mi"] == 0).all() and (got["flip"] == 0).all()


@pytest.mark.parametrize("model_type", ["det", "eve"])
def test_window_scores_average_to_evaluate_lm_on_the_same_windows_and_draws(model_type, monkeypatch):
    """The study's per-token values are the ones whose means evaluate.py prints for the same windows, batches and
    latent draws: here on a tiny model, on the primary setting's runs in assets/eve_uncertainty.json (checked in
    tests/test_results.py against assets/eve_primary_m8.json)."""
    torch.manual_seed(0)
    model = models.build_model(model_type, dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=1, block_size=16,
                                                vocab_size=29)).eval()
    data = np.random.default_rng(3).integers(29, size=200).astype(np.uint16)
    T, M, B = 16, 4, 3
    monkeypatch.setattr(eu, "seq_len", T)
    monkeypatch.setattr(eu, "mc_samples", M)
    monkeypatch.setattr(eu, "batch_size", B)
    starts = metrics.lm_windows(len(data), T)
    got = eu.window_scores(model, data, starts, torch.Generator().manual_seed(5))
    whole = metrics.evaluate_lm(model, data, starts, T, M, torch.Generator().manual_seed(5), batch_size=B)
    assert got["mi"].shape == (len(starts), T)
    for key, metric in (("mi", "mi"), ("flip", "flip_rate"), ("entropy", "entropy")):
        assert got[key].mean() == pytest.approx(whole[metric], abs=1e-6), key
    assert 1 - got["wrong"].mean() == pytest.approx(whole["acc"], abs=1e-12)
    assert (got["mi"].max() > 1e-4) == (model_type == "eve")


def test_out_of_domain_text_keeps_its_bytes_in_a_used_vocabulary():
    bpe = os.path.join(LOCAL_DATA, "gpt2", "gpt2.tiktoken")
    if not os.path.exists(bpe):
        pytest.skip(local_skip("gpt2/gpt2.tiktoken"))
    encoding = tokendata.gpt2_from_file(bpe)
    seen = "The cat sat on the mat. A dog ran in the park, and the cat ran too."
    used = sorted(set(encoding.encode_ordinary(seen)) | set(range(256)) | {encoding.eot_token})  # + GPT-2's bytes
    meta = {"token_ids": used, "bpe_file": bpe}
    text = "The catalogue sat on Wednesday's mat."
    ids, gpt2, respelled, dropped = eu.encode_into(text, meta)
    outside = [g for g in encoding.encode_ordinary(text) if g not in used]
    assert gpt2 == len(encoding.encode_ordinary(text)) and respelled == len(outside) > 0 and dropped == 0
    assert b"".join(encoding.decode_single_token_bytes(used[i]) for i in ids) == text.encode()
    assert len(ids) > gpt2  # the unseen tokens took several pieces each
    # a byte no vocabulary token holds is dropped, the rest kept in order
    meta = {"token_ids": sorted(set(encoding.encode_ordinary(seen))), "bpe_file": bpe}
    ids, _, _, dropped = eu.encode_into("The cat!", meta)
    assert dropped == 1 and b"".join(encoding.decode_single_token_bytes(meta["token_ids"][i]) for i in ids) == b"The cat"


def test_the_json_documents_give_its_document_aurocs():
    """Each run's out-of-domain AUROC recomputed from the per-document scores the JSON keeps (in domain first, then
    the out-of-domain text, as the study orders them)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "eve_uncertainty.json")
    with open(path) as f:
        record = json.load(f)
    for name, run in record["runs"].items():
        for text in eu.OOD:
            for key, value in run["document_auroc"][text].items():
                ind, ood = run["documents"]["wp_val"][key], run["documents"][text][key]
                assert len(ind) == record["protocol"]["windows"] and len(ood) == record["protocol"]["texts"][text][
                    "documents"]
                assert value == pytest.approx(pairwise_auroc(ind + ood, [0] * len(ind) + [1] * len(ood)), abs=1e-12)
