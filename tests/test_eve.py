"""EVE (model_eve.py): KL and reparameterisation, causality of the model and its AR prior, the posterior reading the
neuron's memory, KV-cache decoding with pinned noise, the sigma -> 0 limit, the homeostat and beta controller,
diagnostics, loading checkpoints from before the memory term."""

import dataclasses
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Normal, kl_divergence

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import model_det  # noqa: E402
import model_eve  # noqa: E402
from conftest import config_values, records, train_in_process  # noqa: E402

SMALL = dict(block_size=32, vocab_size=17, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def make(seed=0, **overrides):
    torch.manual_seed(seed)
    return model_eve.Model(model_eve.Config(**{**SMALL, **overrides})).eval()


def tokens(B=3, T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (B, T), generator=g)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def kv_decode(model, idx, latents, P):
    """Logits (B, T - P + 1, V) of a KV-cache decode of idx (B, T): the prompt idx[:, :P] at once (its last position),
    then one token a step, with the latents pinned."""
    B, T = idx.shape
    model.setup_kv_cache(B, T)
    try:
        steps = [model(idx[:, :P], latents=latents, start_pos=0)[0]]
        steps += [model(idx[:, t:t + 1], latents=latents, start_pos=t)[0] for t in range(P, T)]
    finally:
        model.clear_kv_cache()
    return torch.cat(steps, dim=1)


def record_priors(model, monkeypatch):
    """Record each block's AR prior mean mu_p (B, T, D) at every forward: the scans the bank runs, by block."""
    records, current, scan = [[] for _ in model.blocks], [], model_eve.scan
    for i, block in enumerate(model.blocks):
        block.mlp.register_forward_pre_hook(lambda module, args, i=i: current.append(i))

    def recording(x, a):
        h = scan(x, a)
        records[current[-1]].append(h)
        return h
    monkeypatch.setattr(model_eve, "scan", recording)
    return records


def test_gaussian_kl_equals_torch_distributions_per_token_and_in_the_mean_over_tokens():
    g = gen(0)
    mu_q, mu_p = torch.randn(4, 7, 5, generator=g), torch.randn(4, 7, 5, generator=g)
    lv_q, lv_p = torch.randn(4, 7, 5, generator=g), torch.randn(5, generator=g)  # prior scale: per coordinate
    ref = kl_divergence(Normal(mu_q, (0.5 * lv_q).exp()), Normal(mu_p, (0.5 * lv_p).exp()))  # (4, 7, 5)
    ours = model_eve.gaussian_kl(lv_q, lv_q.exp(), (mu_q - mu_p).pow(2), lv_p)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)
    # linear in the three token statistics: their means over tokens give the mean KL, as the model uses it
    means = [t.mean((0, 1)) for t in (lv_q, lv_q.exp(), (mu_q - mu_p).pow(2))]
    assert torch.allclose(model_eve.gaussian_kl(*means, lv_p), ref.mean((0, 1)), atol=1e-5, rtol=1e-5)


def test_layer_kl_stat_equals_torch_distributions_kl_of_posterior_and_ar_prior():
    # the x-only posterior; with the memory term: test_posterior_memory_follows_the_papers_recurrence_...
    model, idx = make(ar_b_init=0.3, latent_dim=2, posterior_memory=False), tokens()
    latents = model.sample_latents(3, gen(0))
    inputs = []
    model.blocks[0].mlp.register_forward_hook(lambda m, args, out: inputs.append(args[:2]))  # (u, eps)
    _, _, stats = model(idx, targets=idx, latents=latents)
    u, eps = inputs[0]
    mlp = model.blocks[0].mlp
    mu_q = mlp.w_mu(u)
    sigma_q = (0.5 * mlp.w_logvar(u).clamp(-6, 2)).exp()
    drive = torch.cat([mlp.prior_m0.expand(3, 1, -1), mlp.ar_b * (mu_q + sigma_q * eps)[:, :-1]], dim=1)
    mu_p, logvar_p = sequential_scan(drive, torch.tanh(mlp.ar_a)), mlp.prior_logvar.clamp(-6, 2)
    ref = kl_divergence(Normal(mu_q, sigma_q), Normal(mu_p, (0.5 * logvar_p).exp()))  # (B, T, D)
    # per neuron: summed over its latent_dim = 2 coordinates, then averaged over tokens and neurons
    assert torch.allclose(stats["kl_0"], ref.view(3, 12, -1, 2).sum(-1).mean(), atol=1e-6)
    assert torch.allclose(stats["kl"], stats["kl_0"] + stats["kl_1"])


def test_fixed_prior_switch_gives_kl_to_standard_normal_and_no_ar_parameters():
    model, idx = make(ar_prior=False), tokens()
    assert not any("ar_" in name or "prior_" in name for name, _ in model.named_parameters())
    inputs = []
    model.blocks[0].mlp.register_forward_hook(lambda m, args, out: inputs.append(args[0]))
    _, _, stats = model(idx, targets=idx, latents=model.sample_latents(3, gen(0)))
    mlp = model.blocks[0].mlp
    q = Normal(mlp.w_mu(inputs[0]), (0.5 * mlp.w_logvar(inputs[0]).clamp(-6, 2)).exp())
    assert torch.allclose(stats["kl_0"], kl_divergence(q, Normal(0.0, 1.0)).mean(), atol=1e-6)
    assert stats["ar"].item() == 0.0


def test_reparameterisation_gradients_reach_mu_and_sigma_params_through_the_cross_entropy_alone():
    # beta, control and L_AR off: every gradient below comes from CE through z = mu_q + sigma_q * eps (§3.2).
    model, idx = make(kl_beta=0.0, control_weight=0.0, alpha_ar=0.0), tokens()
    latents = model.sample_latents(3, gen(0))
    _, loss, stats = model(idx, targets=idx, latents=latents)
    assert torch.equal(loss, stats["ce"])
    loss.backward()
    for block in model.blocks:
        assert block.mlp.w_mu.weight.grad.abs().sum() > 0
        assert block.mlp.w_logvar.weight.grad.abs().sum() > 0  # zero at init, still reached by the gradient
        assert block.mlp.w_logvar.bias.grad.abs().sum() > 0
    # With eps = 0 pinned, sigma_q has no path to the output: its gradient is exactly zero, mu_q's is not.
    model.zero_grad()
    model(idx, targets=idx, latents=torch.zeros_like(latents))[1].backward()
    for block in model.blocks:
        assert block.mlp.w_logvar.weight.grad.abs().sum().item() == 0.0
        assert block.mlp.w_logvar.bias.grad.abs().sum().item() == 0.0
        assert block.mlp.w_mu.weight.grad.abs().sum() > 0


def test_kl_gradient_reaches_prior_parameters():
    model, idx = make(ar_b_init=0.3), tokens()
    model(idx, targets=idx, latents=model.sample_latents(3, gen(0)))[1].backward()
    for name in ("ar_a", "ar_b", "prior_m0", "prior_logvar"):
        assert getattr(model.blocks[0].mlp, name).grad.abs().sum() > 0, name


def test_changing_a_future_token_never_changes_past_logits_or_ar_prior(monkeypatch):
    model = make(ar_b_init=0.5)
    for block in model.blocks:
        torch.nn.init.normal_(block.mlp.prior_m0)  # a non-trivial prior at every position
    latents = model.sample_latents(2, gen(0))
    idx, k = tokens(B=2, T=16), 9
    changed = idx.clone()
    changed[:, k] = (idx[:, k] + 1) % SMALL["vocab_size"]
    records = record_priors(model, monkeypatch)
    logits_a = model(idx, targets=idx, latents=latents)[0]
    logits_b = model(changed, targets=changed, latents=latents)[0]
    assert torch.allclose(logits_a[:, :k], logits_b[:, :k], atol=1e-6)
    assert (logits_a[:, k] - logits_b[:, k]).abs().max() > 1e-4  # the change is seen from position k on
    for mu_a, mu_b in records:  # mu_p(t) depends on z(< t): positions <= k are untouched
        assert torch.allclose(mu_a[:, :k + 1], mu_b[:, :k + 1], atol=1e-6)
    mu_a, mu_b = records[0]
    assert (mu_a[:, k + 1] - mu_b[:, k + 1]).abs().max() > 1e-4  # ... and position k + 1 sees z(k)


def test_ar_prior_decode_steps_reproduce_the_parallel_scan(monkeypatch):
    model = make(ar_b_init=0.4)
    mlp = model.blocks[0].mlp
    with torch.no_grad():
        mlp.ar_a.normal_()
        mlp.prior_m0.normal_()
    records = record_priors(model, monkeypatch)
    u = torch.randn(2, 20, SMALL["n_embd"], generator=gen(3))
    eps = torch.randn(2, 20, mlp.config.n_latent, generator=gen(4))
    full = mlp(u, eps)[0]
    mlp.prior_cache = model_eve.PriorCache(2, mlp.config.n_latent, u.device, u.dtype)
    steps = [mlp(u[:, :5], eps[:, :5], 0)[0]]  # prefill of 5 positions, then one position per call
    steps += [mlp(u[:, t:t + 1], eps[:, t:t + 1], t)[0] for t in range(5, 20)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-6)  # the memory reaches the update (mu_q = m + c h)
    e = mlp.w_mu(u) + (0.5 * mlp.w_logvar(u).clamp(-6, 2)).exp() * eps  # the innovations that drive the prior
    mu_p = records[0][0]  # the full forward's scan
    assert torch.allclose(mlp.prior_cache.mean, torch.tanh(mlp.ar_a) * mu_p[:, -1] + mlp.ar_b * e[:, -1], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_cache_decode_in_reduced_precision_gives_float32s_logits_to_its_rounding(dtype):
    """sample.py --dtype=bfloat16 casts the weights: the AR prior's state (PriorCache) follows them, so a decode step
    meets no float32 tensor and gives float32's logits to the dtype's rounding."""
    model = make(ar_b_init=0.3)
    B, T, P = 2, 12, 5
    idx = tokens(B=B, T=T)

    def decode():
        return kv_decode(model, idx, model.sample_latents(B, gen(0)), P).float()

    reference = decode()
    for p in model.parameters():  # as sample.py casts them
        p.data = p.data.to(dtype)
    reduced = decode()
    assert reduced.shape == reference.shape == (B, T - P + 1, model.config.vocab_size)
    assert (reduced - reference).abs().max() < 0.05 * reference.abs().max()


def test_kv_cache_matches_full_forward_with_pinned_latents():
    model = make(ar_b_init=0.3)
    B, T, P = 2, 20, 6
    idx, latents = tokens(B=B, T=T), model.sample_latents(B, gen(0))
    full = model(idx, targets=idx, latents=latents)[0]  # (B, T, V)
    assert torch.allclose(kv_decode(model, idx, latents, P), full[:, P - 1:], atol=1e-5)


def test_generate_with_same_latents_is_reproducible_and_equals_greedy_full_forwards():
    model = make()
    prompt, latents = tokens(B=2, T=4), model.sample_latents(2, gen(0))
    out = model.generate(prompt, 12, temperature=0, latents=latents)
    assert torch.equal(out, model.generate(prompt, 12, temperature=0, latents=latents))
    seq = prompt
    for _ in range(12):  # no cache: the whole sequence again at every step, same pinned eps
        seq = torch.cat([seq, model(seq, latents=latents)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    sampled = [model.generate(prompt, 12, temperature=1.0, generator=gen(7)) for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])  # the generator pins both the eps and the token draws


def test_pinned_latents_give_identical_logits_and_fresh_noise_differs():
    model, idx = make(), tokens()
    latents = model.sample_latents(3, gen(0))
    assert torch.equal(model(idx, targets=idx, latents=latents)[0], model(idx, targets=idx, latents=latents)[0])
    assert (model(idx, targets=idx)[0] - model(idx, targets=idx)[0]).abs().max() > 1e-3


def test_sigma_to_zero_without_control_is_deterministic():
    # sigma_q = 1e-30: z = mu_q + sigma_q * eps rounds to mu_q in float32, so the eps drawn no longer matter.
    model, idx = make(sigma_init=1e-30, logvar_min=-150.0, control_weight=0.0, homeostat=False), tokens()
    model.train()  # training mode: fresh eps from the global RNG at every pass
    torch.manual_seed(1)
    logits_a, loss_a, _ = model(idx, targets=idx)
    torch.manual_seed(2)
    logits_b, loss_b, _ = model(idx, targets=idx)
    assert torch.equal(logits_a, logits_b)
    assert torch.equal(loss_a, loss_b)
    zeros = torch.zeros_like(model.sample_latents(3))
    assert torch.equal(logits_a, model(idx, targets=idx, latents=zeros)[0])  # = the eps = 0 network


def train_toy(homeostat, steps=50):
    """A tiny model on one fixed batch, mu_q of every neuron started at twice the target's scale (mu^2 ~ 0.4)."""
    model = make(homeostat=homeostat, homeostat_warmup=5, homeostat_every=1, control_weight=0.0).train()
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.w_mu.weight.mul_(2.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the shakespeare config's rate
    idx = tokens(B=4, T=16)
    torch.manual_seed(0)
    for _ in range(steps):
        _, loss, stats = model(idx, targets=idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.update_controllers()
    return model, model(idx, targets=idx)[2]


def test_homeostat_moves_mu2_toward_target_on_a_toy_problem():
    start = train_toy(homeostat=True, steps=0)[1]
    on_model, on = train_toy(homeostat=True)
    off = train_toy(homeostat=False)[1]
    assert start["target_gap"] > 0.2 and start["band_high"] > 0.9  # every neuron starts far above the band
    assert on["target_gap"] < 0.25 * start["target_gap"]
    assert on["target_gap"] < 0.5 * off["target_gap"]
    assert on["band_in"] > 0.5 and on["band_in"] > off["band_in"] + 0.3
    assert abs(on["mu2_0"] - 0.10) < 0.03
    assert int(on_model.ctrl_step) == 50


def test_homeostat_rescale_is_bounded_per_step_and_waits_for_warmup():
    model = make(homeostat_warmup=2, homeostat_every=1, homeostat_max_step=0.05).train()
    idx = tokens()
    w0 = model.blocks[0].mlp.w_mu.weight.clone()
    with torch.no_grad():
        model.blocks[0].mlp.w_mu.weight.mul_(3.0)
    for step in range(3):
        before = model.blocks[0].mlp.w_mu.weight.clone()
        model(idx, targets=idx)
        model.update_controllers()
        ratio = model.blocks[0].mlp.w_mu.weight / before  # (D, C), one factor per neuron
        if step < 2:
            assert torch.equal(ratio, torch.ones_like(ratio))  # warm-up: no rescale
        else:  # mu^2 ~ 0.9 >> 0.1: every neuron scaled down by the bound 1 / 1.05
            assert torch.allclose(ratio, torch.full_like(ratio, 1 / 1.05), atol=1e-6)
    assert torch.allclose(model.blocks[0].mlp.w_mu.weight, w0 * 3.0 / 1.05)


def test_beta_controller_moves_beta_per_unit_and_its_state_is_checkpointed():
    model, idx = make(beta_control=True, kl_band=(0.05, 0.30), beta_rate=0.1, homeostat=False).train(), tokens()
    model(idx, targets=idx)
    kl_u = model.blocks[0].mlp.stash[0]  # (N,) the measured per-unit KL
    model.update_controllers()
    beta = model.blocks[0].mlp.beta_unit
    expected = torch.where(kl_u > 0.30, 0.2 * 1.1, torch.where(kl_u < 0.05, 0.2 / 1.1, 0.2))
    assert torch.allclose(beta, expected)
    assert (kl_u < 0.05).any() or (kl_u > 0.30).any() or torch.allclose(beta, torch.full_like(beta, 0.2))
    state = model.state_dict()
    for key in ("blocks.0.mlp.mu2_ema", "blocks.0.mlp.beta_unit", "ctrl_step"):
        assert key in state
    assert int(state["ctrl_step"]) == 1
    fresh = make(beta_control=True)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.blocks[0].mlp.beta_unit, beta)
    assert model.blocks[0].mlp.stash is None  # consumed by update_controllers


def test_update_controllers_under_torch_distributed_equals_single_process(tmp_path):
    import torch.distributed as dist
    idx = tokens()
    solo = make(homeostat_warmup=0, homeostat_every=1).train()
    torch.manual_seed(0)
    solo(idx, targets=idx)
    solo.update_controllers()
    ranked = make(homeostat_warmup=0, homeostat_every=1).train()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ranked(idx, targets=idx)
        ranked.update_controllers()
    finally:
        dist.destroy_process_group()
    assert torch.allclose(ranked.blocks[1].mlp.w_mu.weight, solo.blocks[1].mlp.w_mu.weight)
    assert torch.allclose(ranked.blocks[1].mlp.mu2_ema, solo.blocks[1].mlp.mu2_ema)


def test_diagnostics_have_the_right_ranges():
    model, idx = make(n_layer=3), tokens()
    logits, loss, stats = model(idx, targets=idx, latents=model.sample_latents(3, gen(0)))
    for name, value in stats.items():
        assert value.dim() == 0 and not value.requires_grad, name
    for name in ("band_in", "band_low", "band_high", "active_frac"):
        assert 0.0 <= stats[name].item() <= 1.0, name
    assert abs(stats["band_in"] + stats["band_low"] + stats["band_high"] - 1.0) < 1e-6
    assert abs(sum(stats[f"w_{i}"] for i in range(3)) - 1.0) < 1e-6
    assert torch.allclose(stats["w_0"], torch.tensor(1 / 3))  # uniform layer weights at init
    assert torch.allclose(stats["kl"], sum(stats[f"kl_{i}"] for i in range(3)))
    assert stats["active_frac"].item() == 1.0  # sigma_q = 0.8 vs sigma_p = 1: every unit has KL > 1e-4
    assert stats["nonfinite"].item() == 0
    assert torch.allclose(stats["sigma"], torch.tensor(0.8))  # sigma_init, w_logvar = 0 at init
    # the initialisation puts every layer's energy at the target: E[mu_q^2] = C * std^2 = mu2_target
    assert abs(stats["mu2_0"].item() - 0.10) < 0.02
    expected = stats["ce"] + 0.2 * stats["kl"] + stats["control"] + 0.1 * stats["ar"]  # §3.6 with the defaults
    assert torch.allclose(loss, expected)


def test_layer_weights_off_reads_the_last_block_and_drops_w_stats():
    model, idx = make(layer_weights=False), tokens()
    stats = model(idx, targets=idx, latents=model.sample_latents(3, gen(0)))[2]
    assert model.layer_logits is None and "w_0" not in stats


def test_n_samples_averages_the_objective_and_returns_mc_predictive_logits():
    model, idx = make(n_samples=3).train(), tokens()
    torch.manual_seed(0)
    logits, loss, stats = model(idx, targets=idx)
    assert logits.shape == (3, 12, SMALL["vocab_size"])
    assert torch.allclose(logits.exp().sum(-1), torch.ones(3, 12), atol=1e-5)  # log of a mean of softmaxes
    assert model.blocks[0].mlp.stash.shape == (2, model.config.n_neurons)
    # the same draws, run as three separate batches, average to the same CE
    model.eval()
    torch.manual_seed(0)
    eps = torch.randn(9, 12, 2, model.config.n_latent)
    padded = F.pad(eps, (0, 0, 0, 0, 0, SMALL["block_size"] - 12))  # (9, block_size, L, D)
    ces = [model(idx, targets=idx, latents=padded[3 * s:3 * s + 3])[2]["ce"] for s in range(3)]
    assert torch.allclose(stats["ce"], sum(ces) / 3, atol=1e-5)


def test_parameters_match_det_at_equal_width_and_flops_count_the_variational_work():
    eve, det = make(), model_det.Model(model_det.Config(**SMALL))
    cfg = eve.config
    N, D, L = cfg.n_neurons, cfg.n_latent, cfg.n_layer
    assert N == det.config.ffn_hidden  # latent_dim = 1: one neuron per SwiGLU hidden unit
    # w_mu, w_logvar, w2 replace w1, w3, w2; new: logvar bias, decoder gain and bias, AR a, b, m0, log sigma_p^2,
    # the posterior's memory gain c
    extra = L * (D + 2 * N + 5 * D) + L  # + the layer-weight logits
    assert eve.num_params() - det.num_params() == extra
    prior = 4 + 8 + 3  # the chunked AR scan, its drive, KL distance and L_AR, c h
    assert eve.flops_per_token() == det.flops_per_token() + 6 * extra + 3 * (17 + prior) * L * D
    assert make(n_samples=2).flops_per_token() == 2 * eve.flops_per_token()


# ----------------------------------------------------------------------------------------------------------------
# §3.2/§3.4 q(z | x, h): the posterior mean reads the neuron's memory h = mu_p (posterior_memory, on by default).


def make_with_memory(seed=0, **overrides):
    """A model whose memory is non-trivial everywhere: AR coefficients, m0 and the posterior's gain c all random."""
    model = make(seed, **overrides)
    g = gen(seed + 100)
    with torch.no_grad():
        for block in model.blocks:
            mlp = block.mlp
            for p in (getattr(mlp, name, None) for name in ("ar_a", "ar_b", "prior_m0", "mem_gain")):
                if p is not None:  # present unless the config turns the AR prior or the memory off
                    p.copy_(torch.randn(p.shape, generator=g))
    return model


def test_posterior_memory_follows_the_papers_recurrence_run_as_a_sequential_loop():
    # The definitions, one position at a time: h(t) = mu_p(t) = a mu_p(t-1) + b z(t-1), mu_p(0) = m0 (§3.3);
    # mu_q(t) = w_mu u(t) + c h(t) (§3.2 q(z | x, h)); z(t) = mu_q(t) + sigma_q(t) eps(t); KL(q(t) || p(t)).
    model, idx = make_with_memory(latent_dim=2), tokens()
    latents = model.sample_latents(3, gen(0))
    inputs = []
    mlp = model.blocks[0].mlp
    mlp.register_forward_hook(lambda m, args, out: inputs.append((*args[:2], out[0])))  # (u, eps, update)
    _, _, stats = model(idx, targets=idx, latents=latents)
    u, eps, update = inputs[0]
    alpha, b, c = torch.tanh(mlp.ar_a), mlp.ar_b, torch.tanh(mlp.mem_gain)
    a = alpha - b * c  # the prior's own coefficient: alpha is the pole of the loop prior <-> posterior
    sigma_q = (0.5 * mlp.w_logvar(u).clamp(-6, 2)).exp()
    mu_p, mu_q, z = [], [], []
    h = mlp.prior_m0.expand(3, -1)
    for t in range(idx.size(1)):
        if t > 0:
            h = a * h + b * z[-1]
        mu_p.append(h)
        mu_q.append(mlp.w_mu(u[:, t]) + c * h)
        z.append(mu_q[-1] + sigma_q[:, t] * eps[:, t])
    mu_p, mu_q, z = (torch.stack(v, dim=1) for v in (mu_p, mu_q, z))  # (B, T, D)
    y = F.silu((z.view(3, 12, -1, 2) * mlp.dec_gain).sum(-1) + mlp.dec_bias)
    assert torch.allclose(update, mlp.w2(y), atol=1e-5)
    sigma_p = (0.5 * mlp.prior_logvar.clamp(-6, 2)).exp()
    ref = kl_divergence(Normal(mu_q, sigma_q), Normal(mu_p, sigma_p))  # (B, T, D)
    assert torch.allclose(stats["kl_0"], ref.view(3, 12, -1, 2).sum(-1).mean(), atol=1e-5)
    assert (c * mu_p).abs().mean() > 0.1  # the memory term is far from negligible here


def test_posterior_memory_lets_the_ar_prior_change_the_logits_and_off_it_cannot():
    idx = tokens()
    for memory in (True, False):
        model = make_with_memory(posterior_memory=memory) if memory else make(posterior_memory=False, ar_b_init=0.3)
        latents = model.sample_latents(3, gen(0))
        before = model(idx, targets=idx, latents=latents)[0]
        changes = []
        for name in ("ar_a", "ar_b", "prior_m0"):
            p = getattr(model.blocks[0].mlp, name)
            saved = p.detach().clone()
            with torch.no_grad():
                p.add_(0.5)
            changes.append((model(idx, targets=idx, latents=latents)[0] - before).abs().max().item())
            with torch.no_grad():
                p.copy_(saved)
        if memory:
            assert min(changes) > 1e-3, changes
        else:  # q(z | x): the prior reaches the loss through the KL and L_AR only, never the logits
            assert changes == [0.0, 0.0, 0.0]
    assert not hasattr(model.blocks[0].mlp, "mem_gain") or model.blocks[0].mlp.mem_gain is None


def test_posterior_memory_is_causal_in_the_tokens(monkeypatch):
    model = make_with_memory()
    latents = model.sample_latents(2, gen(0))
    idx, k = tokens(B=2, T=16), 9
    changed = idx.clone()
    changed[:, k] = (idx[:, k] + 1) % SMALL["vocab_size"]
    records = record_priors(model, monkeypatch)
    logits_a = model(idx, targets=idx, latents=latents)[0]
    logits_b = model(changed, targets=changed, latents=latents)[0]
    assert torch.allclose(logits_a[:, :k], logits_b[:, :k], atol=1e-6)
    assert (logits_a[:, k] - logits_b[:, k]).abs().max() > 1e-4
    mu_a, mu_b = records[1]  # block 1's memory: untouched up to k, changed from k + 1
    assert torch.allclose(mu_a[:, :k + 1], mu_b[:, :k + 1], atol=1e-6)
    assert (mu_a[:, k + 1] - mu_b[:, k + 1]).abs().max() > 1e-4


def test_posterior_memory_cached_decode_equals_the_full_forward_with_pinned_eps():
    model = make_with_memory()
    B, T, P = 2, 20, 6
    idx, latents = tokens(B=B, T=T), model.sample_latents(B, gen(0))
    full = model(idx, targets=idx, latents=latents)[0]  # (B, T, V)
    assert torch.allclose(kv_decode(model, idx, latents, P), full[:, P - 1:], atol=1e-5)
    out = model.generate(idx[:, :P], 10, temperature=0, latents=latents)
    seq = idx[:, :P]
    for _ in range(10):  # no cache: the whole sequence at every step
        seq = torch.cat([seq, model(seq, latents=latents)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_memory_gain_receives_gradient_and_the_loop_stays_stable_for_any_b_and_c():
    model, idx = make_with_memory(), tokens()
    with torch.no_grad():
        for block in model.blocks:  # large b and c; the pole alpha = tanh(ar_a) near 1
            block.mlp.ar_b.fill_(5.0)
            block.mlp.mem_gain.fill_(3.0)
            block.mlp.ar_a.fill_(3.0)
    _, loss, stats = model(idx, targets=idx, latents=model.sample_latents(3, gen(0)))
    assert torch.isfinite(loss) and stats["nonfinite"].item() == 0
    loss.backward()
    assert model.blocks[0].mlp.mem_gain.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------
# The matched comparison (§3.7, §4.1: attention and the head kept fixed) and frozen embeddings (§1).


def test_the_experiments_twin_differs_from_eve_in_the_feed_forward_neurons_alone():
    twin_values, eve_values = config_values("config/det_wp_sample.py"), config_values("config/eve_wp_sample.py")
    fields = {f.name for f in dataclasses.fields(model_eve.Config)}
    # the same training: data, batches, optimiser, schedule, selection (only the neurons and the folder differ)
    train_keys = set(twin_values) - fields - {"out_dir"}
    assert {k: twin_values[k] for k in train_keys} == {k: eve_values[k] for k in train_keys}
    assert twin_values["variational"] is False and eve_values["variational"] is True
    built = []
    for values in (twin_values, eve_values):
        torch.manual_seed(0)
        built.append(model_eve.Model(model_eve.Config(**{**{k: v for k, v in values.items() if k in fields},
                                                         "vocab_size": 97})))
    twin, eve = built
    shapes = [{n: tuple(p.shape) for n, p in m.named_parameters()} for m in (twin, eve)]
    outside = [{n: s for n, s in sh.items() if ".mlp." not in n} for sh in shapes]
    assert outside[0] == outside[1]  # embedding, attention, norms, head and its layer weights: name and shape
    assert "layer_logits" in outside[0]  # EVE's head layer weights (§4.2) in both arms
    inside = [{n for n in sh if ".mlp." in n} for sh in shapes]
    assert inside[0] == {f"blocks.{i}.mlp.{w}.weight" for i in range(3) for w in ("w1", "w2", "w3")}
    assert inside[0] != inside[1]  # the feed-forward is what differs
    # equal width: EVE's bank has as many neurons as det's SwiGLU has hidden units, both project back from it
    assert eve.config.n_neurons == twin.config.ffn_hidden
    assert shapes[0]["blocks.0.mlp.w2.weight"] == shapes[1]["blocks.0.mlp.w2.weight"]


def test_the_twin_is_det_under_a_head_that_mixes_the_blocks():
    """variational=False: with all the head's weight on the last block the twin computes det's logits from the same
    weights; otherwise its head reads the softmax mix sum_l w_l x^(l) of the blocks' outputs (§4.2)."""
    torch.manual_seed(0)
    twin = model_eve.Model(model_eve.Config(**SMALL, variational=False)).eval()
    det = model_det.Model(model_det.Config(**SMALL)).eval()
    det.load_state_dict({k: v for k, v in twin.state_dict().items() if k not in ("layer_logits", "ctrl_step")})
    idx = tokens()
    assert twin.sample_latents(3) is None and twin.latent_kind == "none"
    with torch.no_grad():
        twin.layer_logits.copy_(torch.tensor([-1e4, 0.0]))  # all weight on the last block: det's own head
        assert torch.allclose(twin(idx, targets=idx)[0], det(idx, targets=idx)[0], atol=1e-5)
        assert torch.allclose(twin(idx)[0], det(idx)[0], atol=1e-5)  # the inference path too
        assert torch.equal(twin.generate(idx[:, :4], 6, temperature=0.0), det.generate(idx[:, :4], 6, temperature=0.0))
        twin.layer_logits.copy_(torch.tensor([0.3, -0.2]))
        outs = []  # the softmax mix of the blocks' outputs, computed here from det's blocks
        x = det.tok_emb(idx)
        cos, sin = det.rope_cos[:idx.size(1)], det.rope_sin[:idx.size(1)]
        for block in det.blocks:
            x = block(x, cos, sin, 0)
            outs.append(x)
        w = torch.softmax(torch.tensor([0.3, -0.2]), 0)
        expected = det.lm_head(det.norm_f(w[0] * outs[0] + w[1] * outs[1]))
        logits, loss, stats = twin(idx, targets=idx)
        assert torch.allclose(logits, expected, atol=1e-5) and set(stats) == {"ce"} and loss == stats["ce"]
    assert twin.flops_per_token() == det.flops_per_token() + 6 * SMALL["n_layer"]  # det's, and the L layer weights
    twin.train()(idx, targets=idx)
    twin.update_controllers()  # nothing to control: no neurons, no state


# ----------------------------------------------------------------------------------------------------------------
# The bank's chunked scan against the recurrence one position at a time, and the whole bank against the paper's
# definitions run as a per-position loop, in float64, values and gradients (nanolatent/eve_bank.py's fused bank is
# held to the model's in tests/test_eve_bank.py).


def doubling_scan(x, a):
    """h[t] = a h[t-1] + x[t] in ceil(log2 T) doubling steps (Hillis & Steele 1986), through autograd."""
    h, a_k, k = x, a, 1
    while k < h.size(1):
        h = torch.cat([h[:, :k], h[:, k:] + a_k * h[:, :-k]], dim=1)
        a_k, k = a_k * a_k, 2 * k
    return h


def sequential_scan(x, a, reverse=False):
    """The recurrence one position at a time: h[t] = a h[t-1] + x[t] (reverse: h[t] = a h[t+1] + x[t])."""
    h, out = torch.zeros_like(x[:, 0]), []
    for t in (reversed(range(x.size(1))) if reverse else range(x.size(1))):
        h = a * h + x[:, t]
        out.append(h)
    return torch.stack(out[::-1] if reverse else out, dim=1)


def loop_bank(mlp, u, eps):
    """VariationalMLP.forward's update and aux from the paper's definitions, one position at a time: mu_q(t) = w_mu u(t)
    + c h(t) (§3.2 q(z | x, h)), z(t) = mu_q(t) + sigma_q(t) eps(t), the prior's mean h(t) = mu_p(t) = a mu_p(t-1)
    + b z(t-1), mu_p(0) = m0, a = alpha - b c (§3.3), the KL, mu^2 and L_AR (with its stop-gradient) from every
    position's values; with or without the AR prior and the memory."""
    cfg = mlp.config
    B, T, _ = u.shape
    N, dz, D = cfg.n_neurons, cfg.latent_dim, cfg.n_latent
    logvar_q = mlp.w_logvar(u).clamp(cfg.logvar_min, cfg.logvar_max)  # (B, T, D)
    sigma_q = torch.exp(0.5 * logvar_q)
    c = torch.tanh(mlp.mem_gain) if mlp.mem_gain is not None else torch.zeros(D, dtype=u.dtype)
    alpha, b = (torch.tanh(mlp.ar_a), mlp.ar_b) if cfg.ar_prior else (None, None)
    mu_p, mu_q, z = [], [], []
    for t in range(T):
        if not cfg.ar_prior:
            h = torch.zeros(B, D, dtype=u.dtype)  # the fixed prior N(0, I)
        elif t == 0:
            h = mlp.prior_m0.expand(B, -1)
        else:
            h = (alpha - b * c) * h + b * z[-1]
        mu_p.append(h)
        mu_q.append(mlp.w_mu(u[:, t]) + c * h)
        z.append(mu_q[-1] + sigma_q[:, t] * eps[:, t])
    mu_p, mu_q, z = (torch.stack(v, dim=1) for v in (mu_p, mu_q, z))  # (B, T, D)
    y = F.silu((z.view(B, T, N, dz) * mlp.dec_gain).sum(-1) + mlp.dec_bias)
    logvar_p = mlp.prior_logvar.clamp(cfg.logvar_min, cfg.logvar_max) if cfg.ar_prior else u.new_zeros(())
    kl = model_eve.gaussian_kl(logvar_q, sigma_q.pow(2), (mu_q - mu_p).pow(2), logvar_p)  # (B, T, D)
    ar = (mu_p - mu_q.detach()).pow(2).mean() if cfg.ar_prior else torch.zeros((), dtype=u.dtype)
    return mlp.w2(y), {"kl_u": kl.mean((0, 1)).view(N, dz).sum(-1), "ar": ar, "sigma": sigma_q.detach().mean(),
                       "mu2_u": mu_q.pow(2).mean((0, 1)).view(N, dz).mean(-1)}


def test_chunked_scan_equals_the_per_position_loop_and_the_doubling_scan_in_float64():
    g = gen(0)
    for T in (1, 2, 5, 16, 17, 37, 100):  # one chunk, whole chunks, a partial last chunk
        x = torch.randn(3, T, 6, dtype=torch.double, generator=g)
        a = torch.tanh(2 * torch.randn(6, dtype=torch.double, generator=g))  # poles near +-1 too
        assert torch.allclose(model_eve.scan(x, a), sequential_scan(x, a), rtol=0, atol=1e-12)
        assert torch.allclose(model_eve.scan(x, a), doubling_scan(x, a), rtol=0, atol=1e-12)


BANKS = [dict(latent_dim=1), dict(latent_dim=2), dict(posterior_memory=False), dict(ar_prior=False, latent_dim=2)]


def with_clipped_logvar(mlp):
    """w_logvar large enough that the clip of log sigma_q^2 to [logvar_min, logvar_max] binds at many coordinates."""
    with torch.no_grad():
        mlp.w_logvar.weight.normal_(0.0, 0.5, generator=gen(7))
    return mlp


@pytest.mark.parametrize("overrides", BANKS, ids=str)
def test_neuron_bank_equals_the_per_position_loop_in_float64_values_and_gradients(overrides):
    model = make_with_memory(**overrides).double().train()
    mlp = with_clipped_logvar(model.blocks[0].mlp)
    u = torch.randn(3, 20, SMALL["n_embd"], dtype=torch.double, generator=gen(1), requires_grad=True)
    eps = torch.randn(3, 20, mlp.config.n_latent, dtype=torch.double, generator=gen(2))
    r = mlp.w_logvar(u)
    assert (r < -6).any() and (r > 2).any() and ((r > -6) & (r < 2)).any()  # the clip binds on both sides
    params = [u, *mlp.parameters()]
    results = []
    for bank in (lambda: mlp(u, eps, 0, True), lambda: loop_bank(mlp, u, eps)):
        out, aux = bank()
        # every output reaches the gradients, each with its own random weight
        w = torch.randn(out.shape, dtype=torch.double, generator=gen(3))
        scalar = (out * w).sum() + aux["kl_u"].pow(2).sum() + (aux["mu2_u"] * 3).sin().sum() + 5 * aux["ar"]
        results.append([out, aux["kl_u"], aux["mu2_u"], aux["ar"], aux["sigma"],
                        *torch.autograd.grad(scalar, params, allow_unused=True, materialize_grads=True)])
    for ours, ref in zip(*results):
        assert torch.allclose(ours, ref, rtol=1e-10, atol=1e-12)


def test_update_controllers_runs_on_a_model_cast_to_float64_and_equals_float32s():
    """The stash follows the model's dtype, update_controllers reads it in its buffers' (a second call: the EMA)."""
    idx, models = tokens(), []
    for dtype in (torch.float32, torch.float64):
        model = make(homeostat_warmup=1, homeostat_every=1, beta_control=True).to(dtype).train()
        for step in range(3):  # pinned eps, drawn in float32 and cast (sample_latents): the same in both dtypes
            model(idx, targets=idx, latents=model.sample_latents(3, gen(step)))
            model.update_controllers()
        models.append(model)
    single, double = (m.blocks[1].mlp for m in models)
    assert double.mu2_ema.dtype == torch.float64 and int(models[1].ctrl_step) == 3
    for name in ("mu2_ema", "beta_unit"):
        assert torch.allclose(getattr(double, name).float(), getattr(single, name), rtol=1e-4), name
    assert torch.allclose(double.w_mu.weight.float(), single.w_mu.weight, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# a step train.py skips as non-finite


def nth_training_call(method, n, replace):
    """method, wrapped: on the instance's training calls numbered in n (from 1), replace(self, *args) stands in."""
    def wrapped(self, *args, **kwargs):
        if self.training:
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls in n:
                return replace(self, *args, **kwargs)
        return method(self, *args, **kwargs)
    return wrapped


@pytest.mark.slow
def test_a_step_skipped_as_non_finite_leaves_no_trace_in_the_controllers(data_root, tmp_path, monkeypatch, capsys):
    """Step 3's second micro-batch measures NaN (every neuron bank's input NaN there, as a NaN draw would make it):
    train.py skips the step, and the run then trains exactly as one whose step 3 ran no forward at all (a NaN loss in
    its place): the same weights, controllers (mu2_ema, beta_unit, ctrl_step; the homeostat rescales after the skip)
    and optimizer state at the end, bit for bit, and the same records but step 3's."""
    args = ["--model_type=eve", "--max_iters=6", "--eval_interval=6", "--gradient_accumulation_steps=2",
            "--homeostat_warmup=1", "--homeostat_every=2"]
    bank, model = model_eve.VariationalMLP.forward, model_eve.Model.forward
    runs = {"nan measured": (model_eve.VariationalMLP, "forward", nth_training_call(
                bank, {8}, lambda self, u, *rest, **kw: bank(self, u * float("nan"), *rest, **kw))),
            "no forward": (model_eve.Model, "forward", nth_training_call(
                model, {7, 8}, lambda *_, **__: (None, torch.full((), float("nan"), requires_grad=True), {})))}
    saved, logged = {}, {}
    for name, (cls, attr, patched) in runs.items():
        with monkeypatch.context() as patch:
            patch.setattr(cls, attr, patched)
            code, out, err = train_in_process(monkeypatch, capsys, data_root, tmp_path / name, *args)
        assert code == 0 and "skipped 1" in out, err[-2000:]
        saved[name] = torch.load(tmp_path / name / "checkpoints" / "iter_0000006" / "ckpt.pt", weights_only=True)
        logged[name] = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")}
                        for r in records(tmp_path / name) if r["iter"] != 3]
    a, b = saved.values()
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.isfinite(v).all() for v in a["model"].values()) and int(a["model"]["ctrl_step"]) == 5
    state = lambda s: [t for v in s["optimizer"]["state"].values() for t in v.values()]
    assert len(state(a)) == len(state(b)) > 0 and all(torch.equal(x, y) for x, y in zip(state(a), state(b)))
    assert logged["nan measured"] == logged["no forward"]
