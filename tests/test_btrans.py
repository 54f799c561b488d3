"""B-Trans (model_btrans.py): the det model at sigma = 0, per-sequence minds, KV-cache consistency, learned sigma,
training on the mean offset (§5), the final-norm ablation."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Normal, kl_divergence

import model_btrans
import model_det

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(block_size=32, vocab_size=17, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def make(seed=0, **overrides):
    torch.manual_seed(seed)
    return model_btrans.Model(model_btrans.Config(**{**SMALL, **overrides})).eval()


def tokens(B=3, T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (B, T), generator=g)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def record_offsets(model):
    """Hooks that store, per wrapped norm, what it added to RMSNorm(x): output - RMSNorm(x), (B, T, C)."""
    offsets, handles = [], []
    for norm in model.norms():
        def hook(module, args, out):
            offsets.append(out - F.rms_norm(args[0], (args[0].size(-1),), module.weight, module.eps))
        handles.append(norm.register_forward_hook(hook))
    return offsets, handles


def test_sigma_zero_logits_equal_det_model_exactly():
    torch.manual_seed(0)
    det = model_det.Model(model_det.Config(**SMALL)).eval()
    for overrides in (dict(sigma=0.0), dict(sigma=0.0, final_norm_noise=False), dict(sigma=0.0, noise_mode="token"),
                      dict(sigma=0.02, noise_mode="mean"), dict(sigma=0.02, noise_mode="mean", final_norm_noise=False),
                      dict(sigma=0.0, sigma_scale="absolute"), dict(sigma=0.0, sigma_scale="mean_gain")):
        btrans = make(**overrides)
        btrans.load_state_dict(det.state_dict(), strict=False)
        idx = tokens()
        logits_det, loss_det, _ = det(idx, targets=idx)
        logits_bt, loss_bt, stats = btrans(idx, targets=idx, latents=btrans.sample_latents(3, gen(0)))
        assert torch.equal(logits_bt, logits_det)
        assert torch.equal(loss_bt, loss_det)
        assert list(stats) == ["ce"]
        assert torch.equal(btrans(idx)[0], det(idx)[0])  # last-position logits, no targets
        assert torch.equal(btrans.generate(idx[:, :4], 8, temperature=0), det.generate(idx[:, :4], 8, temperature=0))


def test_training_uses_the_mean_offset_alone_so_the_loss_of_a_fixed_batch_is_deterministic():
    # §5: "keeping the update phase deterministic by using the mean shift only" (train_noise_mode = 'mean' default)
    torch.manual_seed(0)
    det = model_det.Model(model_det.Config(**SMALL))
    model = make(sigma=0.5)
    model.load_state_dict(det.state_dict(), strict=False)
    idx = tokens()
    model.train()
    assert model.noise_mode == "mean" and model.sample_latents(3, gen(0)) is None
    losses = [model(idx, targets=idx)[1] for _ in range(3)]  # a fresh global-RNG state each call changes nothing
    assert all(torch.equal(loss, losses[0]) for loss in losses)
    assert torch.equal(losses[0], det(idx, targets=idx)[1])  # mu = 0: the det model, to the bit
    losses[0].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(idx, targets=idx)[1].backward()
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if p.grad is not None)
    # eval() mode draws the minds (noise_mode = 'sequence'): other losses, one per draw
    model.eval()
    assert model.noise_mode == "sequence"
    evals = [model(idx, targets=idx)[1] for _ in range(2)]
    assert (evals[0] - losses[0]).abs() > 1e-3 and (evals[0] - evals[1]).abs() > 1e-4
    # the ablation: train_noise_mode = 'sequence' trains under a fresh mind per row at every call
    ablation = make(sigma=0.5, train_noise_mode="sequence").train()
    assert (ablation(idx, targets=idx)[1] - ablation(idx, targets=idx)[1]).abs() > 1e-4
    with pytest.raises(ValueError, match="train_noise_mode='dropout'"):
        model_btrans.Config(**SMALL, train_noise_mode="dropout")


@pytest.mark.parametrize("noise_mode", ["sequence", "token"])
def test_final_norm_noise_off_leaves_norm_f_with_mu_and_the_other_norms_with_the_same_draws(noise_mode):
    idx, offsets = tokens(), {}
    for flag in (True, False):
        model = make(sigma=0.3, noise_mode=noise_mode, final_norm_noise=flag)
        recorded, handles = record_offsets(model)
        model(idx, latents=model.sample_latents(3, gen(0)), generator=gen(1))
        for h in handles:
            h.remove()
        offsets[flag] = recorded
    for on, off in zip(offsets[True][:-1], offsets[False][:-1]):  # attn and mlp norms: the same eps either way
        assert torch.allclose(on, off, atol=1e-6) and on.abs().max() > 0.1
    assert offsets[True][-1].abs().max() > 0.1  # norm_f: sigma * eps (a per-sequence logit bias) ...
    assert offsets[False][-1].abs().max() < 1e-6  # ... or nothing (mu = 0)


def test_sequence_mode_offset_is_the_same_at_every_position_and_differs_across_rows():
    model = make(sigma=0.1)
    latents = model.sample_latents(3, gen(0))  # (3, n_norms, C)
    offsets, handles = record_offsets(model)
    model(tokens(), latents=latents)
    for h in handles:
        h.remove()
    assert len(offsets) == model.config.n_norms == 5
    for k, offset in enumerate(offsets):  # (B, T, C)
        assert torch.allclose(offset, offset[:, :1].expand_as(offset), atol=1e-6)  # frozen across positions
        assert torch.allclose(offset[:, 0], 0.1 * latents[:, k], atol=1e-6)  # = mu + sigma * eps with mu = 0
        assert (offset[0, 0] - offset[1, 0]).abs().max() > 0.05  # each row is its own mind
        assert (offset[1, 0] - offset[2, 0]).abs().max() > 0.05


@pytest.mark.parametrize("scale", ["absolute", "gain", "mean_gain"])
def test_sigma_scale_multiplies_each_norms_eps_by_one_its_gains_or_their_mean(scale):
    model = make(sigma=0.1, sigma_scale=scale)
    with torch.no_grad():  # gains far from 1, some negative, as in a pretrained model
        for norm in model.norms():
            norm.weight.uniform_(-0.5, 2.0, generator=gen(len(norm.weight)))
    latents = model.sample_latents(3, gen(0))
    offsets, handles = record_offsets(model)
    model(tokens(), latents=latents)
    for h in handles:
        h.remove()
    for k, (norm, offset) in enumerate(zip(model.norms(), offsets)):
        w = norm.weight.detach()
        scale_of = {"absolute": torch.ones_like(w), "gain": w.abs(), "mean_gain": w.abs().mean().expand_as(w)}[scale]
        assert torch.allclose(offset[:, 0], 0.1 * scale_of * latents[:, k], atol=1e-5)
    with pytest.raises(ValueError, match="learn_sigma.*sigma_scale='absolute'"):
        model_btrans.Config(**SMALL, learn_sigma=True, sigma_scale="gain")
    with pytest.raises(ValueError, match="sigma_scale='rms'"):
        model_btrans.Config(**SMALL, sigma_scale="rms")


def test_sequence_mode_pinned_latents_give_identical_logits_and_fresh_latents_differ():
    model, idx = make(sigma=0.1), tokens()
    latents = model.sample_latents(3, gen(0))
    assert torch.equal(model(idx, targets=idx, latents=latents)[0], model(idx, targets=idx, latents=latents)[0])
    torch.manual_seed(5)
    a = model(idx, targets=idx)[0]  # latents=None: a fresh mind per row from the global RNG
    b = model(idx, targets=idx)[0]
    assert (a - b).abs().max() > 1e-4


def test_token_mode_offset_changes_with_every_position_and_every_call():
    model, idx = make(sigma=0.1, noise_mode="token"), tokens()
    assert model.sample_latents(3, gen(0)) is None  # nothing to pin
    offsets, handles = record_offsets(model)
    a = model(idx, targets=idx)[0]
    b = model(idx, targets=idx)[0]
    for h in handles:
        h.remove()
    assert (a - b).abs().max() > 1e-4  # a new draw at every call (§6.1, Eq. 2)
    first = offsets[0]  # (B, T, C) of block 0's attn_norm, first call
    assert (first[:, 1:] - first[:, :1]).abs().amax(dim=-1).min() > 0.05  # every position differs from position 0
    assert (offsets[0] - offsets[model.config.n_norms]).abs().max() > 0.05  # same norm, next call


def test_token_mode_noise_is_drawn_from_the_generator_so_a_seed_reproduces_the_generation():
    model = make(sigma=0.5, noise_mode="token")
    with torch.no_grad():  # larger weights than at init, so that the noise decides the greedy tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=gen(9))
    prompt = tokens(B=4, T=5)
    # temperature 0: the only randomness is the per-token eps, every draw of it from `generator`
    a, b, c = (model.generate(prompt, 20, temperature=0, generator=gen(s)) for s in (5, 5, 6))
    assert torch.equal(a, b)
    assert (a != c).any(dim=1).all()
    # forward with a generator: the same eps as drawn by hand from that generator, on its device
    idx = tokens()
    offsets, handles = record_offsets(model)
    logits = model(idx, targets=idx, generator=gen(3))[0]
    for h in handles:
        h.remove()
    eps = torch.randn(3, model.config.n_norms, 12, model.config.n_embd, generator=gen(3))
    assert torch.allclose(offsets[0], 0.5 * eps[:, 0], atol=1e-5)
    assert torch.allclose(offsets[-1], 0.5 * eps[:, -1], atol=1e-5)
    assert torch.equal(logits, model(idx, targets=idx, generator=gen(3))[0])
    # and in 'sequence' mode a forward without latents draws its minds from the generator, as sample_latents does
    model.config.noise_mode = "sequence"
    assert torch.equal(model(idx, targets=idx, generator=gen(3))[0],
                       model(idx, targets=idx, latents=model.sample_latents(3, gen(3)))[0])


def test_kv_cache_generation_matches_full_forward_greedy_generation_with_pinned_latents():
    model = make(sigma=0.5)
    with torch.no_grad():  # larger weights than at init, so that greedy decoding does not just repeat a token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    prompt = tokens(B=4, T=5)
    latents = model.sample_latents(4, gen(3))
    cached = model.generate(prompt, 20, temperature=0, latents=latents)
    idx = prompt
    for _ in range(20):  # no cache: re-run the whole sequence with the same minds at every step
        logits, _, _ = model(idx, latents=latents)  # (B, 1, V)
        idx = torch.cat((idx, logits[:, -1].argmax(dim=-1, keepdim=True)), dim=1)
    assert torch.equal(cached, idx)
    # The minds matter: other eps give other continuations from the same prompt.
    other = model.generate(prompt, 20, temperature=0, latents=model.sample_latents(4, gen(4)))
    assert (cached != other).any(dim=1).all()


def test_kv_cache_decode_step_without_latents_is_refused_in_sequence_mode():
    model = make()
    model.setup_kv_cache(2, 8)
    model(tokens(B=2, T=4), latents=model.sample_latents(2, gen(0)))
    with pytest.raises(ValueError, match="reuse the prefill's latents"):
        model(tokens(B=2, T=1), start_pos=4)
    model.clear_kv_cache()


def test_same_generator_seed_reproduces_the_same_minds_and_generations():
    model = make(sigma=0.5)
    a, b, c = (model.sample_latents(64, gen(s)) for s in (123, 123, 124))
    assert a.shape == (64, model.config.n_norms, model.config.n_embd)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert abs(a.std().item() - 1.0) < 0.05  # eps ~ N(0, I)
    prompt = tokens(B=4, T=5)
    # generate() with latents=None draws the minds from `generator` once, before any token.
    drawn = model.generate(prompt, 10, temperature=0, generator=gen(7))
    assert torch.equal(drawn, model.generate(prompt, 10, temperature=0, generator=gen(7)))
    assert torch.equal(drawn, model.generate(prompt, 10, temperature=0, latents=model.sample_latents(4, gen(7))))
    sampled = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=gen(8))
    assert torch.equal(sampled, model.generate(prompt, 10, temperature=1.0, top_k=5, generator=gen(8)))


def test_det_state_dict_loads_with_no_unexpected_keys_and_only_offset_params_missing():
    torch.manual_seed(0)
    det = model_det.Model(model_det.Config(**SMALL))
    for learn_sigma in (False, True):
        model = make(seed=1, learn_sigma=learn_sigma, sigma_scale="absolute")
        result = model.load_state_dict(det.state_dict(), strict=False)
        assert result.unexpected_keys == []
        new = {"mu", "log_sigma"} if learn_sigma else {"mu"}
        assert {k.rsplit(".", 1)[1] for k in result.missing_keys} == new
        assert len(result.missing_keys) == len(new) * model.config.n_norms
        assert "blocks.0.attn_norm.weight" in model.state_dict()
        for k, v in det.state_dict().items():
            assert torch.equal(model.state_dict()[k], v)


def test_mu_is_frozen_by_default_and_trained_with_learn_mu():
    assert not any(n.mu.requires_grad for n in make().norms())
    opt = make().configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    frozen = {id(n.mu) for n in make().norms()}
    assert not any(id(p) in frozen for group in opt.param_groups for p in group["params"])
    model = make(learn_mu=True, noise_mode="mean")
    idx = tokens()
    model(idx, targets=idx)[1].backward()
    assert all(n.mu.grad is not None and n.mu.grad.abs().max() > 0 for n in model.norms())


def test_sigma_per_layer_sets_each_wrapped_norm_in_forward_order():
    sigmas = (0.0, 0.0, 0.0, 0.0, 0.3)  # only norm_f is noisy
    model = make(sigma_per_layer=sigmas)
    assert [n.sigma for n in model.norms()] == list(sigmas)
    latents = model.sample_latents(3, gen(0))
    offsets, handles = record_offsets(model)
    model(tokens(), latents=latents)
    for h in handles:
        h.remove()
    assert all(torch.equal(o, torch.zeros_like(o)) for o in offsets[:4])
    assert torch.allclose(offsets[4][:, 0], 0.3 * latents[:, 4], atol=1e-6)
    with pytest.raises(ValueError, match="2 \\* n_layer \\+ 1"):
        model_btrans.Config(**SMALL, sigma_per_layer=(0.1, 0.1))


def test_learned_sigma_kl_equals_torch_distributions_kl_and_is_added_to_the_loss():
    model = make(sigma=0.05, learn_sigma=True, sigma_scale="absolute", learn_mu=True, prior_sigma=0.1, kl_weight=1e-3)
    with torch.no_grad():
        for k, norm in enumerate(model.norms()):
            norm.mu.normal_(0.0, 0.03)
            norm.log_sigma.fill_(-3.0 + 0.2 * k)
    expected = sum(kl_divergence(Normal(n.mu, n.log_sigma.exp().expand_as(n.mu)), Normal(0.0, 0.1)).sum()
                   for n in model.norms())
    idx = tokens()
    _, loss, stats = model(idx, targets=idx, latents=model.sample_latents(3, gen(0)))
    assert sorted(stats) == ["ce", "kl"]
    assert torch.allclose(stats["kl"], expected, rtol=1e-5)
    assert torch.allclose(loss, stats["ce"] + 1e-3 * expected, rtol=1e-6)
    loss.backward()
    assert all(n.log_sigma.grad is not None and n.log_sigma.grad.abs().item() > 0 for n in model.norms())
    # At initialisation with prior_sigma = sigma and mu = 0 the posterior is the prior: KL = 0.
    fresh = make(learn_sigma=True, sigma_scale="absolute")
    assert fresh(idx, targets=idx)[2]["kl"].item() == 0.0


def test_flops_per_token_adds_only_the_offset_elementwise_cost_to_det():
    torch.manual_seed(0)
    det = model_det.Model(model_det.Config(**SMALL))
    for overrides in (dict(), dict(learn_sigma=True, sigma_scale="absolute")):
        model = make(**overrides)
        n_norms, C = model.config.n_norms, model.config.n_embd
        assert model.flops_per_token() - det.flops_per_token() == 3 * n_norms * C


def test_shakespeare_config_builds_a_small_sequence_mode_btrans_model():
    settings = {}
    with open(os.path.join(ROOT, "config", "btrans_shakespeare_char.py")) as f:
        exec(f.read(), settings)
    assert settings["model_type"] == "btrans" and settings["dataset"] == "shakespeare_char"
    assert settings["out_dir"] == "out-btrans-shakespeare-char"
    fields = model_btrans.Config.__dataclass_fields__
    config = model_btrans.Config(**{k: v for k, v in settings.items() if k in fields})
    assert (config.n_layer, config.n_embd, config.n_head, config.n_kv_head, config.block_size) == (4, 128, 4, 2, 128)
    assert config.sigmas == (0.02,) * 9 and config.noise_mode == "sequence"
    assert config.train_noise_mode == "mean" and config.final_norm_noise  # §5: trained on the mean offset
