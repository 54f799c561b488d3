"""nanolatent/sampling.py's measures of what the latents do, in-process: the Groups agreement and spread against
pair-by-pair counts on hand-built rows, a pinned mind, a given Z, each position's KL and the top tokens of each pass
against direct forwards of tiny models."""

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F

from nanolatent import models, sampling

TINY_MODEL = dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=1, block_size=24, vocab_size=29)
decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)


def tiny(model_type, **kwargs):
    torch.manual_seed(0)
    return models.build_model(model_type, {**TINY_MODEL, **kwargs}).eval()


def test_agreement_is_the_share_of_agreeing_pairs_counted_pair_by_pair():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 3, size=(6, 40)).tolist()
    pairs = list(itertools.combinations(rows, 2))
    expected = [sum(a[i] == b[i] for a, b in pairs) / len(pairs) for i in range(40)]
    assert np.allclose(sampling.agreement(rows), expected, rtol=0, atol=1e-15)
    assert sampling.agreement([[1, 2], [1, 3]]) == [1.0, 0.0]


def test_group_summary_of_identical_blocks_warns_and_of_shared_positions_agrees_more():
    prompt = [0, 1]
    independent = [prompt + [5, 6, 7], prompt + [5, 8, 9], prompt + [4, 8, 7]]
    same = sampling.group_summary([independent, independent], independent, 2, decode)
    assert same["identical"] and same["within"] == same["across"] and same["within_mean"] == same["across_mean"]
    assert sampling.summary_lines(same)[-2].startswith("warning: every group is identical")
    assert sampling.summary_lines(same)[-1] == ("no measurable effect of the latents on the agreement of pairs (d = 0 "
                                                "exactly at each of the 3 new positions)")
    shared = [[prompt + [5, 6, 7]] * 3, [prompt + [4, 8, 7], prompt + [4, 8, 9], prompt + [4, 8, 7]]]
    s = sampling.group_summary(shared, independent, 2, decode)
    assert s["within"] == [1.0, 1.0, (1 + 1 / 3) / 2] and s["across"] == [1 / 3, 1 / 3, 1 / 3]
    assert not s["identical"] and not any(line.startswith("warning") for line in sampling.summary_lines(s))
    assert sampling.summary_lines(s)[-1].startswith("the latents change the agreement of pairs by +0.5556 [")
    one = sampling.group_summary([[prompt + [5]]], [prompt + [6]], 2, decode)  # K = 1: no pairs
    assert one["within_mean"] is None and "n/a" in sampling.summary_lines(one)[0]


def test_letter_spread_is_the_sample_std_of_the_target_start_over_well_formed_texts():
    text = lambda start, letter="K": "_" * start + letter * 8 + "_" * (56 - start)
    groups = [[text(3), text(7), "not well formed"], [text(10), text(10)], [text(20)]]
    spread, formed = sampling.letter_spread(groups)
    assert formed == 5 and spread == np.mean([np.std([3, 7], ddof=1), 0.0])  # the one-text group has no spread
    assert sampling.letter_spread([["nothing"]]) == (None, 0)


def test_a_pinned_mind_is_that_draw_of_the_independent_ones_in_every_row():
    model = tiny("btrans", sigma=0.5)
    free, _ = sampling.sample(model, [1, 2], 4, 6, seed=3, latent_seed=9, temperature=0)
    pinned, latents = sampling.sample(model, [1, 2], 4, 6, seed=4, latent_seed=9, temperature=0, pin=2)
    assert all(torch.equal(latents[i], latents[2]) for i in range(4))
    assert pinned.tolist() == [free[2].tolist()] * 4  # greedy: the mind alone decides


def test_given_codes_replace_the_drawn_z_and_kl_bits_is_eq4_of_the_encoder():
    model = tiny("free")
    _, drawn = sampling.sample(model, [1, 2], 2, 5, seed=1, latents="shared", temperature=0)
    codes = [7, 200, 3]
    _, given = sampling.sample(model, [1, 2], 2, 5, seed=1, latents="shared", temperature=0, codes=codes)
    assert given[:, :3].tolist() == [codes, codes] and torch.equal(given[:, 3:], drawn[:, 3:])
    assert sampling.parse_bits(" ".join(sampling.code_bits(codes, 8)), 8) == codes
    ids = [1, 2, 3, 4, 5]
    q = torch.sigmoid(model.encoder_logits(torch.tensor([ids]))[0].double())  # (T, H): P(bit = 1)
    h = -(q * q.log() + (1 - q) * (1 - q).log()) / math.log(2)  # each bit's entropy in bits
    assert np.allclose(sampling.posterior_kl_bits(model, ids), (8 - h.sum(-1)).tolist(), atol=1e-5)


def test_top_predictions_are_each_pass_probabilities_of_the_top_tokens_of_their_mean(plain_kernels):
    model, ids, M = tiny("eve"), [3, 1, 4, 1, 5, 9, 2, 6], 5
    top = sampling.top_predictions(model, ids, M, torch.Generator().manual_seed(7), decode, k=4)
    generator, x, y = torch.Generator().manual_seed(7), torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    with torch.no_grad():  # the passes directly; targets ask for every position's logits
        p = torch.stack([F.softmax(model(x, y, latents=model.sample_latents(1, generator))[0][0], -1)
                         for _ in range(M)])  # (M, T, V)
    scores = sampling.token_uncertainty(model, ids, M, torch.Generator().manual_seed(7))
    for t, position in enumerate(top):
        mean, order = p[:, t].mean(0).topk(4)
        assert position["tokens"] == [decode([i]) for i in order.tolist()]
        assert np.allclose(position["mean"], mean.tolist(), atol=1e-6)
        assert np.allclose(position["passes"], p[:, t, order].tolist(), atol=1e-6)
        assert np.allclose(position["spread"], p[:, t, order].std(0, unbiased=False).tolist(), atol=1e-6)
        if ids[t + 1] in order.tolist():  # p̄ of the text's token is token_uncertainty's exp(-nll)
            assert math.isclose(-math.log(position["mean"][order.tolist().index(ids[t + 1])]), scores["nll"][t],
                                abs_tol=1e-5)


def test_a_verdict_is_the_mean_change_with_a_bootstrap_interval_or_no_measurable_effect():
    d, lo, hi = sampling.interval([0.5] * 10)
    assert (d, lo, hi) == (0.5, 0.5, 0.5)
    values = np.random.default_rng(1).normal(0.2, 0.1, size=200)
    d, lo, hi = sampling.interval(values)
    # the percentile bootstrap of a mean is about the normal interval, 1.96 standard errors either side
    se = values.std() / math.sqrt(len(values))
    assert d == values.mean() and abs((hi - lo) / (2 * 1.96 * se) - 1) < 0.1
    assert sampling.verdict("X", values, "positions") == (f"the latents change X by {d:+.4f} [{lo:+.4f}, {hi:+.4f}] "
                                                          f"(95% bootstrap interval over 200 positions)")
    centred = values - values.mean()
    _, lo, hi = sampling.interval(centred)
    assert sampling.verdict("X", centred, "positions").startswith(f"no measurable effect of the latents on X (|d| <= "
                                                                  f"{max(-lo, hi):.4f}")
    assert sampling.verdict("X", [0.0] * 7, "positions") == \
        "no measurable effect of the latents on X (d = 0 exactly at each of the 7 positions)"


def test_minds_nll_is_each_minds_forward_on_one_text_and_one_model_at_sigma_0():
    ids = [1, 5, 3, 3, 7, 2, 9, 4]
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    for sigma in (0.0, 0.5):
        model = tiny("btrans", sigma=sigma)
        minds = model.sample_latents(4, torch.Generator().manual_seed(3))
        nll = sampling.minds_nll(model, ids, minds)
        assert nll == [F.cross_entropy(model(x, y, latents=minds[i:i + 1])[0][0], y[0]).item() for i in range(4)]
        if sigma == 0:  # every mind is the mean model: the same NLL to the last bit
            assert len(set(nll)) == 1 and sampling.minds_line(nll, 0.0).startswith("the minds are one model at σ = 0")
        else:
            assert np.std(nll) > 1e-4 and sampling.minds_line(nll, 0.5).startswith(
                f"the 4 minds on one text: NLL std {np.std(nll):.4f}")


def test_z_effect_is_the_nll_with_the_encoders_z_minus_the_priors_and_exactly_0_for_a_decoder_that_ignores_z():
    model = tiny("free", latent_bits=4)
    ids = [1, 5, 3, 3, 7, 2, 9, 4, 4, 4]
    effect = sampling.z_effect_bits(model, ids, 3, seed=5)
    nll = lambda posterior: sampling.token_uncertainty(model, ids, 3, torch.Generator().manual_seed(5),
                                                       posterior=posterior)["nll"]
    torch.manual_seed(5)
    prior = nll(False)
    torch.manual_seed(5)
    posterior = nll(True)
    assert effect == [(q - p) / math.log(2) for p, q in zip(prior, posterior)] and any(effect)
    with torch.no_grad():
        model.post_sampler.weight.zero_()  # R = 0: Z never reaches the decoder (§3.1)
    ignored = sampling.z_effect_bits(model, ids, 3, seed=5)
    assert ignored == [0.0] * (len(ids) - 1)
    kl = sampling.posterior_kl_bits(model, ids)
    lines = sampling.z_lines(kl, ignored)
    assert lines[0].startswith(f"Z carries {np.mean(kl):.4f} bits per position, {sum(kl):.2f} bits over the text's 10")
    assert lines[1] == ("no measurable effect of the latents on its NLL (d = 0 exactly at each of the 9 predicted "
                        "positions)")
