"""evaluate.py: the Monte Carlo metrics on hand-built probabilities, the evaluation paths against direct forwards,
multiple-choice scoring, HellaSwag preprocessing, population metrics, and the script end to end: its results in
reduced precision, its refusals (one line, before any evaluation) and a full disk (the results printed, the old file
kept)."""

import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import LOCAL_DATA, ROOT, TINY, assert_one_line_error, needs_local, run_script, write

from nanolatent import ckpt, metrics, models, multiple_choice, sampling, tasks

TINY_MODEL = dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=1, block_size=24)
CHARS = " abcdefghijklmnopqrstuvwxyz.:"
STOI = {ch: i for i, ch in enumerate(CHARS)}


def encode(text):
    return [STOI[ch] for ch in text]


def decode(ids):
    return "".join(CHARS[i] for i in ids)


def tiny(model_type, **kwargs):
    torch.manual_seed(0)
    return models.build_model(model_type, {**TINY_MODEL, "vocab_size": len(CHARS), **kwargs}).eval()


def log(probs):
    return torch.tensor(probs, dtype=torch.float64).log()  # log 0 = -inf, as a log-softmax can give


def H(p):
    return -sum(x * math.log(x) for x in p if x > 0)


# ----------------------------------------------------------------------------------------------------------------
# Monte Carlo metrics on hand-built probabilities


def test_two_disagreeing_passes_give_mi_nll_and_cond_var_computed_by_hand():
    p1 = [[0.7, 0.2, 0.1], [1.0, 0.0, 0.0]]  # pass 1, two tokens; the second has exact zeros (xlogy)
    p2 = [[0.1, 0.2, 0.7], [0.0, 0.0, 1.0]]
    m = metrics.mc_metrics(torch.stack([log(p1), log(p2)]), torch.tensor([0, 0]))
    mean = [[(a + b) / 2 for a, b in zip(r1, r2)] for r1, r2 in zip(p1, p2)]  # [[.4 .2 .4], [.5 0 .5]]
    mi = [H(mean[i]) - (H(p1[i]) + H(p2[i])) / 2 for i in range(2)]
    assert m["mi"] == pytest.approx(sum(mi) / 2, abs=1e-12)
    assert mi[1] == pytest.approx(math.log(2))  # one-hot passes that disagree: one bit of information
    assert m["entropy"] == pytest.approx((H(mean[0]) + H(mean[1])) / 2, abs=1e-12)
    assert m["nll"] == pytest.approx(-(math.log(0.4) + math.log(0.5)) / 2, abs=1e-12)  # -log p̄(y), not mean NLL
    assert m["cond_var"] == pytest.approx((0.3 ** 2 + 0.5 ** 2) / 2, abs=1e-12)  # Var_m p_m(y): 0.09 and 0.25
    assert m["epistemic_ratio"] == pytest.approx(m["mi"] / m["entropy"])


def test_identical_passes_give_exactly_zero_mi_cond_var_and_flip_rate():
    torch.manual_seed(0)
    one = F.log_softmax(torch.randn(1, 50, 11), dim=-1)
    m = metrics.mc_metrics(one.expand(3, -1, -1), torch.randint(11, (50,)))
    assert m["mi"] == 0.0 and m["cond_var"] == 0.0 and m["flip_rate"] == 0.0
    assert m["passes"] == 3


def test_ece_is_zero_for_a_perfectly_calibrated_toy():
    # 10 tokens at confidence 0.8 of which 8 are right, 5 at confidence 0.6 of which 3 are right
    probs = [[0.8, 0.2]] * 10 + [[0.4, 0.6]] * 5
    targets = [0] * 8 + [1] * 2 + [1] * 3 + [0] * 2
    m = metrics.mc_metrics(log(probs)[None], torch.tensor(targets))
    assert m["ece"] == pytest.approx(0.0, abs=1e-12)
    assert m["acc"] == pytest.approx(11 / 15)


def test_confidence_of_exactly_one_lands_in_the_last_bin():
    stats = metrics.MCStats(n_bins=15).add(log([[1.0, 0.0], [0.55, 0.45]])[None], torch.tensor([1, 0]))
    assert stats.bins[0].tolist() == [0.0] * 8 + [1.0] + [0.0] * 5 + [1.0]  # 0.55 -> bin 8, 1.0 -> bin 14
    # token 1: confidence 1.0, wrong, |0 - 1|; token 2: confidence 0.55, right, |1 - 0.55|
    assert stats.result()["ece"] == pytest.approx((1.0 + 0.45) / 2)


def test_brier_score_matches_hand_computation():
    m = metrics.mc_metrics(log([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])[None], torch.tensor([1, 2]))
    by_hand = ((0.5 ** 2 + 0.7 ** 2 + 0.2 ** 2) + (0.1 ** 2 + 0.1 ** 2 + 0.2 ** 2)) / 2
    assert m["brier"] == pytest.approx(by_hand, abs=1e-12)


def test_cvar_nll_is_the_mean_of_the_worst_five_percent_by_sorting():
    torch.manual_seed(1)
    log_probs = F.log_softmax(torch.randn(2, 130, 7, dtype=torch.float64), dim=-1)
    targets = torch.randint(7, (130,))
    m = metrics.mc_metrics(log_probs, targets)
    p_bar = log_probs.exp().mean(0)
    nll = sorted((-p_bar[i, t].log().item() for i, t in enumerate(targets.tolist())), reverse=True)
    assert m["cvar_nll"] == pytest.approx(sum(nll[:7]) / 7, abs=1e-9)  # ceil(0.05 * 130) = 7
    assert m["nll"] == pytest.approx(sum(nll) / 130, abs=1e-9)


def test_flip_rate_counts_passes_whose_argmax_differs_from_that_of_the_mean():
    passes = [[[0.6, 0.3, 0.1], [0.5, 0.1, 0.4]],
              [[0.5, 0.4, 0.1], [0.1, 0.6, 0.3]],
              [[0.2, 0.7, 0.1], [0.1, 0.5, 0.4]]]
    # mean token 0: [.433 .467 .1] -> argmax 1, passes 0 0 1: two flips; token 1: [.233 .4 .367] -> 1, passes 0 1 1: one
    m = metrics.mc_metrics(log(passes), torch.tensor([1, 2]))
    assert m["flip_rate"] == pytest.approx(3 / 6)
    assert m["acc"] == pytest.approx(1 / 2)


# ----------------------------------------------------------------------------------------------------------------
# the evaluation paths against direct forwards


def windows(data, starts, T):
    xy = torch.stack([torch.from_numpy(data[s:s + T + 1].astype(np.int64)) for s in starts])
    return xy[:, :-1], xy[:, 1:]


def test_det_model_gives_exactly_zero_mi_and_flip_and_the_plain_cross_entropy():
    model = tiny("det")
    data = np.random.default_rng(0).integers(len(CHARS), size=400).astype(np.uint16)
    T = 20
    starts = metrics.lm_windows(len(data), T)
    out = metrics.evaluate_lm(model, data, starts, T, n_passes=4, generator=torch.Generator().manual_seed(0),
                               batch_size=3)
    assert out["mi"] == 0.0 and out["flip_rate"] == 0.0 and out["cond_var"] == 0.0 and out["passes"] == 1
    x, y = windows(data, starts, T)
    logits = model(x, y)[0]
    assert out["tokens"] == len(starts) * T == 19 * 20
    assert out["nll"] == pytest.approx(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item(), abs=1e-5)
    assert out["acc"] == pytest.approx((logits.argmax(-1) == y).float().mean().item())
    assert out["stats/ce"] == pytest.approx(out["nll"], abs=1e-5)


def test_btrans_metrics_average_the_softmaxes_of_one_fresh_mind_per_pass():
    model = tiny("btrans", sigma=1.0)
    data = np.random.default_rng(1).integers(len(CHARS), size=200).astype(np.uint16)
    T, M, B = 16, 3, 4
    starts = metrics.lm_windows(len(data), T)
    out = metrics.evaluate_lm(model, data, starts, T, M, torch.Generator().manual_seed(5), batch_size=B)
    gen = torch.Generator().manual_seed(5)  # the same minds, drawn in the same order: per batch, per pass
    x, y = windows(data, starts, T)
    probs = torch.cat([torch.stack([F.softmax(model(xb, yb, latents=model.sample_latents(xb.size(0), gen))[0], -1)
                                    for _ in range(M)]) for xb, yb in zip(x.split(B), y.split(B))], dim=1)
    p_bar = probs.mean(0)  # (N windows, T, V)
    ent = lambda p: -(p * p.log()).sum(-1)
    assert out["nll"] == pytest.approx(-p_bar.gather(-1, y[..., None]).log().mean().item(), abs=1e-5)
    assert out["mi"] == pytest.approx((ent(p_bar) - ent(probs).mean(0)).mean().item(), abs=1e-5)
    assert out["mi"] > 1e-3 and out["passes"] == M


def test_free_iw_bound_and_elbo_are_reported_and_match_a_direct_computation():
    model = tiny("free", latent_bits=3)
    data = np.random.default_rng(2).integers(len(CHARS), size=100).astype(np.uint16)
    T, K = 16, 5
    x, y = windows(data, [0, 20], T)
    bound = metrics.iw_bound(model, x, y, K, torch.Generator().manual_seed(3))
    gen, log_w = torch.Generator().manual_seed(3), []
    for _ in range(K):
        codes, log_q = model.posterior(x, gen)
        log_py = F.log_softmax(model(x, y, latents=codes)[0], -1).gather(-1, y[..., None]).squeeze(-1).sum(1)
        log_w.append(log_py - T * 3 * math.log(2) - log_q.sum(1))  # uniform prior over 2^3 codes per token
    log_w = torch.stack(log_w)  # (K, 2)
    assert torch.allclose(bound, -(log_w.exp().mean(0).log()), atol=1e-4)

    torch.manual_seed(0)
    out = metrics.evaluate_lm(model, data, [0, 20], T, 2, torch.Generator().manual_seed(3), iw_samples=K)
    torch.manual_seed(0)
    assert out["neg_elbo"] == pytest.approx(model(x, y)[2]["elbo"].item(), abs=1e-5)  # posterior CE + full KL
    assert "stats/ce" not in out and "stats/ce_posterior" in out  # the posterior CE is never the model's loss
    assert out["iw_bound"] > 0 and out["iw_samples"] == K and out["latents"].startswith("every Z_t from the uniform prior")


@pytest.mark.parametrize("model_type", ["det", "eve", "free", "btrans"])
def test_per_token_values_of_one_text_average_to_the_lm_metrics_of_its_window(model_type, plain_kernels):
    """sampling.token_uncertainty (evaluate.py --task=tokens, the explorer's Uncertainty view): token by token, the
    quantities whose means evaluate_lm reports for the same window and the same draws; det's mi exactly 0."""
    net = tiny(model_type, sigma=1.0) if model_type == "btrans" else tiny(model_type)
    ids = np.random.default_rng(2).integers(len(CHARS), size=21).astype(np.uint16)
    per_token = sampling.token_uncertainty(net, ids.tolist(), 4, torch.Generator().manual_seed(5))
    whole = metrics.evaluate_lm(net, ids, [0], 20, n_passes=4, generator=torch.Generator().manual_seed(5))
    assert per_token["passes"] == whole["passes"] == (1 if model_type == "det" else 4)
    for key in ("nll", "entropy", "expected_entropy", "mi"):
        assert len(per_token[key]) == 20
        assert sum(per_token[key]) / 20 == pytest.approx(whole[key], abs=1e-5), key
    assert (max(per_token["mi"]) == 0.0) == (model_type == "det")


# ----------------------------------------------------------------------------------------------------------------
# multiple choice


def direct_loglik(model, ctx, cont, latents_list):
    """log p̄ of the continuation from one unpadded forward per pass (left-truncated to block_size + 1 tokens)."""
    ids = torch.tensor([(ctx + cont)[-(model.config.block_size + 1):]])
    n = min(len(cont), ids.size(1) - 1)
    lps = torch.stack([F.log_softmax(model(ids[:, :-1], ids[:, 1:], latents=lat)[0][0], -1) for lat in latents_list])
    lp_bar = torch.logsumexp(lps, 0) - math.log(len(latents_list))  # (L, V)
    L = ids.size(1) - 1
    return sum(lp_bar[t, ids[0, t + 1]].item() for t in range(L - n, L))


@pytest.mark.parametrize("model_type,passes", [("det", 1), ("btrans", 3)])
def test_choice_scores_equal_a_direct_per_choice_forward(model_type, passes):
    model = tiny(model_type, **({"sigma": 0.5} if model_type == "btrans" else {}))
    context = "the cat sat on the"
    choices = ["mat.", "moon", "a"]
    pairs = [multiple_choice.choice_tokens(encode, context, c) for c in choices]
    assert pairs[0] == (encode(context), encode(" mat."))
    ll, n_tokens, truncated = multiple_choice.score_choices(model, pairs, passes, torch.Generator().manual_seed(7))
    for (ctx, cont), got in zip(pairs, ll):
        gen = torch.Generator().manual_seed(7)  # the choices of an example share the latents of each pass
        latents = [model.sample_latents(1, gen) for _ in range(passes)]
        assert got == pytest.approx(direct_loglik(model, ctx, cont, latents), abs=1e-4)
    assert n_tokens == [5, 5, 2] and not truncated


def test_long_contexts_are_left_truncated_to_the_block_size():
    model = tiny("det")
    pairs = [multiple_choice.choice_tokens(encode, "a long context " * 4, c) for c in ("yes", "no")]  # 60 + tokens > 24
    ll, n_tokens, truncated = multiple_choice.score_choices(model, pairs, 1, None)
    assert truncated and n_tokens == [5, 4]  # "  yes": the context's trailing space moved onto the continuation
    assert ll[0] == pytest.approx(direct_loglik(model, *pairs[0], [None]), abs=1e-4)


def test_mc_accuracies_on_a_hand_made_jsonl_equal_direct_scoring(tmp_path):
    model = tiny("det")
    examples = [{"context": "the cat sat on the", "choices": ["mat.", "moon", "hat"], "label": 0},
                {"context": "one two", "choices": ["three", "four.", "a"], "label": 1},
                {"context": "x: y", "choices": ["zz", "y y y y"], "label": 1}]
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in examples) + "\n")
    loaded = multiple_choice.load_mc_examples(str(path))
    assert loaded == examples
    out = metrics.evaluate_mc(model, loaded, encode, decode, 1, None)
    hits = {"acc": 0, "acc_char": 0, "acc_completion": 0}
    for ex in examples:
        ll, n = [], []
        for c in ex["choices"]:
            cont = encode(ex["context"] + " " + c)[len(encode(ex["context"])):]
            ll.append(direct_loglik(model, encode(ex["context"]), cont, [None]))
            n.append(len(cont))
        hits["acc"] += int(np.argmax(ll)) == ex["label"]
        hits["acc_char"] += int(np.argmax([s / len(c) for s, c in zip(ll, ex["choices"])])) == ex["label"]
        hits["acc_completion"] += int(np.argmax([s / k for s, k in zip(ll, n)])) == ex["label"]
    for name, count in hits.items():
        assert out[name] == pytest.approx(count / 3)
    assert out["examples"] == 3 and out["truncated"] == 0


HELLASWAG = os.path.join(LOCAL_DATA, "hellaswag", "hellaswag_val_sample1000.jsonl")


@needs_local("hellaswag/hellaswag_val_sample1000.jsonl")
def test_the_hub_name_hellaswag_reads_the_local_copy_under_the_offline_variable(monkeypatch, capsys):
    monkeypatch.setenv("NANOLATENT_LOCAL_DATA", LOCAL_DATA)
    assert multiple_choice.load_mc_examples("hellaswag") == multiple_choice.load_mc_examples(HELLASWAG)
    assert f"hellaswag: reading {HELLASWAG} (NANOLATENT_LOCAL_DATA) in place of the hub" in capsys.readouterr().out


@needs_local("hellaswag/hellaswag_val_sample1000.jsonl")
def test_hellaswag_preprocessing_follows_the_harness_on_the_shared_sample():
    examples = multiple_choice.load_mc_examples(HELLASWAG)
    assert len(examples) == 1000 and all(len(e["choices"]) == 4 for e in examples)
    first = examples[0]  # ActivityNet: ctx_a + " " + ctx_b capitalized, after "activity_label: "
    assert first["context"] == ("Pole vault: Pole vault is a sport where you run with a pole and stop and swing your "
                                "body. A few women")
    assert first["choices"][3] == "are in the gym practicing to do this pole vault, trying to do their best."
    assert first["label"] == 3
    wikihow = examples[3]  # " [title]" -> ". ", other brackets dropped, then one pass of "  " -> " "
    assert wikihow["context"] == (
        "Sports and Fitness: How to bowl the leg spinner's variations. To bowl a googly, you grip the ball the same "
        "as you would for a leg break but hold it so your palm faces away from you. As you bowl, you bring your "
        "elbow close to your head and cock your wrist so that back of your hand faces the batsman. You spin the "
        "ball by rotating the fingers.")
    assert wikihow["choices"][0] == (" If you're outside, the batsman only looks at the batsman as they dribble.. "
                                     "If you're inside, the batsman lets you line up the batsman with you.")
    assert not any("[" in e["context"] for e in examples)


# ----------------------------------------------------------------------------------------------------------------
# population metrics


def test_pass_at_k_matches_brute_force_enumeration_of_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
                assert metrics.pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)
    assert metrics.pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))


@pytest.mark.slow
def test_pass_at_k_curve_averages_the_unbiased_estimator_over_prompts():
    # n = 4 samples; prompt A 1 correct, prompt B 4 correct, prompt C none
    curve = metrics.pass_at_k_curve([1, 4, 0], 4, (1, 2, 4))
    assert curve[1] == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    assert curve[2] == pytest.approx((1 - math.comb(3, 2) / math.comb(4, 2) + 1.0 + 0.0) / 3)  # A: 1 - 3/6
    assert curve[4] == pytest.approx(2 / 3)


def test_letters_verifier_on_hand_made_strings():
    good = "_" * 10 + "K" * 8 + "_" * 46
    noisy = "_!__" + "KKK!KKKK" + "_" * 40 + "!" + "_" * 11  # '!' noise, also inside the target
    edge = "!" + "K" * 7 + "_" * 56  # the first target character replaced by noise
    for text in (good, good + "\n", noisy, edge, "_" * 56 + "K" * 8):
        assert tasks.verify_letters("K>", text), text
    bad = {"wrong letter": "_" * 10 + "J" * 8 + "_" * 46,
           "run of 9": "_" * 10 + "K" * 9 + "_" * 45,
           "run of 7": "_" * 10 + "K" * 7 + "_" * 47,
           "two runs": "K" * 8 + "_" * 8 + "K" * 8 + "_" * 40,
           "too short": "_" * 10 + "K" * 8 + "_" * 10,
           "two letters": "_" * 10 + "K" * 8 + "_" * 45 + "J",
           "other character": "_" * 10 + "K" * 8 + "_" * 45 + ".",
           "no letter": "_" * 64,
           "letter outside the window": "_" * 10 + "K" * 8 + "_" * 20 + "K" + "_" * 25}
    for reason, text in bad.items():
        assert not tasks.verify_letters("K>", text), reason
    assert tasks.letters_answer(bad["wrong letter"]) == "J"
    assert tasks.verify_letters("K>", good, strict=True) and not tasks.verify_letters("K>", noisy, strict=True)


def test_majority_answer_distinct_n_and_pairwise_distance_by_hand():
    assert metrics.majority_answer(["A", None, "B", "B", None, None]) == "B"  # None does not vote
    assert metrics.majority_answer(["A", "B"]) == "A" and metrics.majority_answer([None]) is None
    assert metrics.distinct_n(["abab", "abc"], 2) == pytest.approx(3 / 5)  # ab ba ab | ab bc
    assert metrics.edit_distance("kitten", "sitting") == 3
    assert metrics.pairwise_distance(["abcd", "abcd", "abxy"]) == pytest.approx((0 + 2 / 4 + 2 / 4) / 3)


def test_cosine_distance_is_the_mean_over_pairs_of_one_minus_cosine():
    e = np.array([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0]])  # lengths ignored: orthogonal, opposite, orthogonal
    assert metrics.cosine_distance(e) == pytest.approx((1 + 2 + 1) / 3)
    assert metrics.cosine_distance(np.array([[1.0, 1.0], [3.0, 3.0]])) == pytest.approx(0, abs=1e-12)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 7))
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    pairs = [1 - u[i] @ u[j] for i in range(5) for j in range(i + 1, 5)]
    assert metrics.cosine_distance(x) == pytest.approx(np.mean(pairs))


def test_greedy_det_minds_are_identical_and_scored_by_the_verifier():
    torch.manual_seed(0)
    chars = sorted(set("\n!>_" + tasks.LETTERS))
    model = models.build_model("det", {**TINY_MODEL, "block_size": 70, "vocab_size": len(chars)}).eval()
    enc = lambda s: [chars.index(ch) for ch in s]
    dec = lambda ids: "".join(chars[i] for i in ids)
    out = metrics.evaluate_population(model, ["K>", "B>"], enc, dec, 3, torch.Generator().manual_seed(0),
                                       temperature=0.0)
    texts = [dec(model.generate(torch.tensor([enc(p)]), 64, temperature=0.0)[0, 2:].tolist()) for p in ("K>", "B>")]
    correct = [tasks.verify_letters(p, t) for p, t in zip(("K>", "B>"), texts)]
    assert out["pairwise_edit"] == 0.0 and out["pass@1"] == out["pass@3"] == sum(correct) / 2
    assert out["distinct_4"] == pytest.approx(sum(metrics.distinct_n([t] * 3, 4) for t in texts) / 2)


# ----------------------------------------------------------------------------------------------------------------
# the script


@pytest.fixture(scope="module")
def det_ckpt(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("det")
    run_script("train.py", "--model_type=det", f"--out_dir={out}", *TINY, "--max_iters=2", "--eval_interval=2",
               data_dir=data_root)
    return out


@pytest.mark.slow
def test_script_writes_json_whose_nll_is_the_models_cross_entropy_on_the_same_windows(data_root, det_ckpt, tmp_path):
    path = tmp_path / "eval.json"
    run_script("evaluate.py", f"--out_dir={det_ckpt}", "--max_tokens=300", f"--out_json={path}", data_dir=data_root)
    report = json.loads(path.read_text())
    assert report["task"] == "lm" and report["dataset"] == "synthetic" and report["seq_len"] == 66
    r = report["results"][str(det_ckpt)]
    expected = {"model_type", "latents", "nll", "ppl", "acc", "ece", "brier", "entropy", "expected_entropy", "mi",
                "epistemic_ratio", "cond_var", "flip_rate", "cvar_nll", "tokens", "passes", "stats/ce"}
    assert expected <= set(r)
    assert r["mi"] == 0.0 and r["flip_rate"] == 0.0 and r["passes"] == 1
    model, checkpoint = ckpt.load_model(det_ckpt)
    data = np.fromfile(data_root / "synthetic" / "val.bin", dtype=np.uint16)
    x, y = windows(data, [0, 67, 134, 201, 268], 66)  # ceil(300 / 66) = 5 whole sequences
    assert r["tokens"] == 5 * 66
    assert r["nll"] == pytest.approx(F.cross_entropy(model(x, y)[0].flatten(0, 1), y.flatten()).item(), abs=1e-5)
    assert r["ppl"] == pytest.approx(math.exp(r["nll"]))


@pytest.mark.slow
def test_population_task_runs_on_the_letters_prompts(data_root, det_ckpt, tmp_path):
    path = tmp_path / "pop.json"
    proc = run_script("evaluate.py", f"--out_dir={det_ckpt}", "--task=population", "--num_prompts=2", "--minds=2",
                      f"--out_json={path}", data_dir=data_root)
    r = json.loads(path.read_text())["results"][str(det_ckpt)]
    assert r["prompts"] == 2 and r["minds"] == 2 and 0.0 <= r["pass@1"] <= r["pass@2"] <= 1.0
    assert "majority_acc" in proc.stdout and "distinct_4" in proc.stdout


@pytest.mark.slow
def test_missing_checkpoint_is_one_clear_error(data_root, tmp_path):
    proc = run_script("evaluate.py", f"--out_dir={tmp_path / 'nowhere'}", data_dir=data_root, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no checkpoint at") and proc.stderr.count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("args, named", [
    (["--cvar_alpha=2"], ("cvar_alpha", "2")),
    (["--cvar_alpha=0"], ("cvar_alpha", "0")),
    (["--seq_len=1000"], ("seq_len=1000", "66")),
    (["--out_json=/no/such/folder/x.json"], ("--out_json=/no/such/folder/x.json",)),
    (["--out_json=/no/such/folder/x.json", "--dtype=float64"], ("dtype", "float64")),
])
def test_evaluate_mistake_is_one_line_before_any_evaluation(args, named, trained, data_root):
    proc = run_script("evaluate.py", f"--out_dir={trained}", *args, data_dir=data_root, check=False)
    assert_one_line_error(proc, *named)
    assert "lm:" not in proc.stdout  # refused before the evaluation started


@pytest.mark.slow
def test_evaluate_out_items_without_task_mc_is_one_line(trained, data_root, tmp_path):
    proc = run_script("evaluate.py", f"--out_dir={trained}", f"--out_items={tmp_path / 'items.jsonl'}",
                      data_dir=data_root, check=False)
    assert_one_line_error(proc, f"--out_items={tmp_path / 'items.jsonl'} writes the items of --task=mc, and "
                          "--task=lm has none")
    assert "lm:" not in proc.stdout and not (tmp_path / "items.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("line, phrase", [
    ('{"context": "a", "choices": ["x", "y"], "label": 2}', "label must be the index (0 to 1)"),
    ('{"context": "a", "choices": "sat", "label": 0}', "choices must be a list of at least two"),
    ('{"context": "a", "choices": [], "label": 0}', "choices must be a list of at least two"),
    ('{"context": "a", "choices": ["x", "y"], "label": "A"}', "label must be the index"),
    ('{"context": "a", "choices": ["x", "y"], "label": 0', "is not JSON"),
])
def test_evaluate_mc_bad_example_is_one_line_naming_the_line(line, phrase, trained, data_root, tmp_path):
    path = write(tmp_path / "mc.jsonl", '{"context": "K>", "choices": ["_", "!"], "label": 0}\n' + line + "\n")
    proc = run_script("evaluate.py", f"--out_dir={trained}", "--task=mc", f"--mc_file={path}", data_dir=data_root,
                      check=False)
    assert_one_line_error(proc, "mc.jsonl line 2", phrase)


@pytest.mark.slow
@pytest.mark.parametrize("content, phrase", [
    ("caf\xe9 au lait\n".encode("latin-1"), "is not UTF-8 text (byte 3: invalid continuation byte)"),
    (None, "is a folder"),
])
def test_evaluate_text_file_that_is_not_utf8_text_is_one_line_as_in_sample(content, phrase, trained, data_root,
                                                                           tmp_path):
    path = tmp_path / "latin1.txt" if content is not None else tmp_path
    if content is not None:
        path.write_bytes(content)
    proc = run_script("evaluate.py", f"--out_dir={trained}", "--task=tokens", f"--text=FILE:{path}",
                      data_dir=data_root, check=False)
    assert_one_line_error(proc, f"--text=FILE:{path} {phrase}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["metrics.jsonl", "notes.json"])
def test_evaluate_never_replaces_a_file_it_did_not_write(name, trained, data_root, tmp_path):
    """--out_json=RUN/metrics.jsonl (the run's training log), or any JSON of another writer: one line before the
    evaluation, the file as it was; evaluate.py's own results file is replaced."""
    shutil.copytree(trained, tmp_path / "run")
    path = tmp_path / "run" / name
    if name == "notes.json":
        write(path, '{"task": "mine", "results": {}}')  # evaluate.py's keys, not its layout
    before = path.read_bytes()
    proc = run_script("evaluate.py", f"--out_dir={tmp_path / 'run'}", "--max_tokens=256", f"--out_json={path}",
                      data_dir=data_root, check=False)
    assert_one_line_error(proc, f"--out_json={path}", "did not write it")
    assert "lm:" not in proc.stdout and path.read_bytes() == before
    ours = tmp_path / "eval.json"
    for _ in range(2):  # written, then replaced
        run_script("evaluate.py", f"--out_dir={tmp_path / 'run'}", "--max_tokens=256", f"--out_json={ours}",
                   data_dir=data_root)
        assert json.loads(ours.read_text())["task"] == "lm"


FULL_DISK_JSON = """
import builtins, errno, os
_open = builtins.open
def open(file, mode="r", *args, **kwargs):  # the disk is full by the time the evaluation ends
    if "w" in mode and ".json.tmp" in str(file):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
    return _open(file, mode, *args, **kwargs)
builtins.open = open
"""


@pytest.mark.slow
def test_evaluate_on_a_full_disk_prints_the_results_keeps_the_old_file_and_says_so_in_one_line(trained, data_root,
                                                                                              tmp_path):
    write(tmp_path / "hook" / "sitecustomize.py", FULL_DISK_JSON)
    write(tmp_path / "eval.json", '{\n "task": "lm", "earlier": "results"}')  # evaluate.py's: it may replace it
    env = {**os.environ, "NANOLATENT_DATA": str(data_root), "PYTHONPATH": str(tmp_path / "hook"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "evaluate.py", f"--out_dir={trained}", "--max_tokens=256",
                           f"--out_json={tmp_path / 'eval.json'}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert_one_line_error(proc, str(tmp_path / "eval.json"), "No space left on device")
    printed = json.loads(proc.stdout[proc.stdout.index('{\n "task"'):])  # nothing lost: the file's text, on stdout
    assert printed["task"] == "lm" and printed["results"][str(trained)]["nll"] > 0
    assert (tmp_path / "eval.json").read_text() == '{\n "task": "lm", "earlier": "results"}'
    assert sorted(os.listdir(tmp_path)) == ["eval.json", "hook"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kernels", ["fast", "plain"])
def test_evaluate_in_reduced_precision_on_a_cpu_gives_the_float32_numbers_to_its_rounding(dtype, kernels, trained,
                                                                                          data_root):
    """--dtype=bfloat16/float16 on a CPU: through oneDNN (bfloat16 weights packed for it; float16, which it lacks
    here, through autocast's kernels) or torch's own kernels, the nll is float32's to the dtype's rounding."""
    nll = lambda *args: float(re.search(r"^nll +(\S+)", run_script(
        "evaluate.py", f"--out_dir={trained}", "--max_tokens=512", *args, data_dir=data_root).stdout, re.M).group(1))
    assert nll(f"--dtype={dtype}", f"--kernels={kernels}") == pytest.approx(nll("--dtype=float32"), abs=0.02)


def test_choice_tokens_follow_the_harness_encode_pair():
    """lm-evaluation-harness _encode_pair: trailing whitespace of the context moves onto the continuation; an empty
    context conditions on the end-of-text token, or is refused when the tokenizer has none."""
    assert multiple_choice.choice_tokens(encode, "the cat ", "sat") == (encode("the cat"), encode("  sat"))
    assert multiple_choice.choice_tokens(encode, "", "sat", eot=0) == ([0], encode(" sat"))


def test_acc_char_divides_by_the_characters_actually_scored():
    """A choice cut to its tail by the context window is normalised by the tail's length, as it is scored."""
    model = tiny("det")
    examples = [{"context": "ab", "choices": ["c" * 30, "d"], "label": 0}]  # 30 + 1 characters > block_size 24
    pairs = [multiple_choice.choice_tokens(encode, ex["context"], c) for ex in examples for c in ex["choices"]]
    ll, n_tokens, truncated = multiple_choice.score_choices(model, pairs, 1, None)
    out = metrics.evaluate_mc(model, examples, encode, decode, 1, None)
    chars = [n_tokens[0], 2]  # the char tokenizer: a token is a character; " d" is two
    expected = max(range(2), key=lambda i: ll[i] / chars[i]) == 0
    assert truncated and n_tokens[0] == 24 and out["acc_char"] == float(expected)


def test_sequence_mixture_is_the_likelihood_of_a_frozen_mind():
    """mixture='sequence': log mean_m prod_t p_m(y_t) over minds shared by the choices (B-Trans Eq. 3)."""
    model = tiny("btrans", sigma=0.5)
    pairs = [multiple_choice.choice_tokens(encode, "the cat sat on the", c) for c in ("mat.", "moon")]
    ll, _, _ = multiple_choice.score_choices(model, pairs, 3, torch.Generator().manual_seed(7), mixture="sequence")
    for (ctx, cont), got in zip(pairs, ll):
        gen = torch.Generator().manual_seed(7)
        per_mind = [direct_loglik(model, ctx, cont, [model.sample_latents(1, gen)]) for _ in range(3)]
        assert got == pytest.approx(torch.logsumexp(torch.tensor(per_mind), 0).item() - math.log(3), abs=1e-4)


def test_no_mixture_gives_each_minds_own_likelihood_of_each_choice():
    """mixture='none': pass m's summed log-likelihood of every choice, mind m the m-th draw from the generator (the
    population experiments/btrans_passk_pretrained.py's minds answer with); 'sequence' is their log mean exp."""
    model = tiny("btrans", sigma=0.5)
    pairs = [multiple_choice.choice_tokens(encode, "the cat sat on the", c) for c in ("mat.", "moon", "rug")]
    per_pass, _, _ = multiple_choice.score_choices(model, pairs, 3, torch.Generator().manual_seed(7), mixture="none")
    gen = torch.Generator().manual_seed(7)
    minds = [model.sample_latents(1, gen) for _ in range(3)]
    assert len(per_pass) == 3 and all(len(row) == 3 for row in per_pass)
    for m, row in enumerate(per_pass):
        for (ctx, cont), got in zip(pairs, row):
            assert got == pytest.approx(direct_loglik(model, ctx, cont, [minds[m]]), abs=1e-4)
    mixed, _, _ = multiple_choice.score_choices(model, pairs, 3, torch.Generator().manual_seed(7), mixture="sequence")
    assert mixed == pytest.approx((torch.logsumexp(torch.tensor(per_pass), 0) - math.log(3)).tolist(), abs=1e-5)


def test_free_choices_take_the_context_z_from_the_encoder_on_the_context_alone():
    """The choices' codes at context positions are the encoder's on the context (never on context + choice), the
    same for every choice; the choice positions get uniform codes, also shared."""
    model = tiny("free", latent_bits=4)
    pairs = [multiple_choice.choice_tokens(encode, "the cat sat", c) for c in ("on", "under the")]
    contexts = [ctx for ctx, _ in pairs]
    codes = multiple_choice.example_latents(model, contexts, torch.Generator().manual_seed(3))
    expected = model.sample_latents(1, torch.Generator().manual_seed(3), prompt=torch.tensor([contexts[0]]))
    assert torch.equal(codes, expected.expand(2, -1))


@pytest.mark.parametrize("name, doc, expected", [
    ("piqa", {"goal": "open a jar", "sol1": "twist", "sol2": "bite", "label": 0},
     {"context": "Question: open a jar\nAnswer:", "choices": ["twist", "bite"], "label": 0}),
    ("arc_easy", {"question": "2+2?", "choices": {"text": ["3", "4"], "label": ["A", "B"]}, "answerKey": "B"},
     {"context": "Question: 2+2?\nAnswer:", "choices": ["3", "4"], "label": 1}),
])
def test_hub_sets_load_through_datasets_in_their_hub_schema(name, doc, expected, monkeypatch):
    """The hub ids are parquet sets current datasets loads (PIQA moved to baber/piqa); offline, a local copy in the
    same schema stands in for the download."""
    import datasets
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda path, config, split: calls.append(path) or [doc])
    assert multiple_choice.load_mc_examples(name) == [expected]
    assert calls == [multiple_choice.HF_TASKS[name][0]] and multiple_choice.HF_TASKS["piqa"][0] == "baber/piqa"
