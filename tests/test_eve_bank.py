"""nanolatent/eve_bank.py: EVE's fused neuron bank equals the model file's plain bank in float64 (values and every
gradient, the clip binding on both sides, every configuration, decode steps), and its written-out backward passes
gradcheck; its in-place scan equals the recurrence run either way."""

import functools

import pytest
import torch

import model_eve
from nanolatent import eve_bank
from test_eve import (BANKS, SMALL, gen, kv_decode, make, make_with_memory, sequential_scan, tokens,
                      with_clipped_logvar)


def fused_copy(model):
    """A deep copy of model with the fused bank in place of the current plain bank, put there without the probe of
    fused_banks (so that what is compared below is always the fused bank against model_eve.py's bank as it is now):
    the same parameters, values and buffers."""
    copy = model_eve.Model(model.config).to(next(model.parameters()).dtype)
    copy.load_state_dict(model.state_dict())
    for m in copy.modules():
        if isinstance(m, model_eve.VariationalMLP):
            m.bank = functools.partial(eve_bank.fused_bank, m)
    return copy.train(model.training)


def grads(scalar, params):
    return torch.autograd.grad(scalar, params, allow_unused=True, materialize_grads=True)


def test_in_place_scan_equals_the_per_position_loop_both_ways_in_float64():
    g = gen(0)
    for T in (1, 2, 5, 8, 16, 17, 37, 100):  # shorter than a chunk, whole chunks, a tail
        for k in (1, 3, 8):
            x = torch.randn(3, T, 6, dtype=torch.double, generator=g)
            a = torch.tanh(2 * torch.randn(6, dtype=torch.double, generator=g))
            for reverse in (False, True):
                assert torch.allclose(eve_bank.scan_(x.clone(), a, reverse, k), sequential_scan(x, a, reverse=reverse),
                                      rtol=0, atol=1e-12)


@pytest.mark.parametrize("overrides", BANKS, ids=str)
def test_fused_bank_equals_the_plain_bank_in_float64_values_and_every_gradient(overrides):
    plain = make_with_memory(**overrides).double().train()
    with_clipped_logvar(plain.blocks[0].mlp)
    fused = fused_copy(plain)
    assert fused.blocks[0].mlp.bank.func is eve_bank.fused_bank  # swapped
    assert plain.blocks[0].mlp.bank.__func__ is model_eve.VariationalMLP.bank  # the original untouched
    u = torch.randn(3, 20, SMALL["n_embd"], dtype=torch.double, generator=gen(1))
    eps = torch.randn(3, 20, plain.config.n_latent, dtype=torch.double, generator=gen(2))
    r = plain.blocks[0].mlp.w_logvar(u)
    assert (r < -6).any() and (r > 2).any() and ((r > -6) & (r < 2)).any()  # the clip binds on both sides
    results = []
    for model in (plain, fused):
        mlp, x = model.blocks[0].mlp, u.clone().requires_grad_()
        out, aux = mlp(x, eps, 0, True)
        w = torch.randn(out.shape, dtype=torch.double, generator=gen(3))  # every output weighted on its own
        scalar = (out * w).sum() + aux["kl_u"].pow(2).sum() + (aux["mu2_u"] * 3).sin().sum() + 5 * aux["ar"]
        results.append([out, aux["kl_u"], aux["mu2_u"], aux["ar"], aux["sigma"], mlp.stash,
                        *grads(scalar, [x, *mlp.parameters()])])
    assert len(results[0]) == 6 + 1 + len(list(plain.blocks[0].mlp.parameters()))
    for ours, ref in zip(results[1], results[0]):
        assert torch.allclose(ours, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("overrides", BANKS, ids=str)
def test_fused_model_equals_the_plain_model_in_loss_statistics_and_every_parameters_gradient(overrides):
    """The whole model in float64, two blocks, the objective's every term: the same loss, stats and gradients."""
    plain = make_with_memory(**overrides).double().train()
    for block in plain.blocks:
        with_clipped_logvar(block.mlp)
    fused = fused_copy(plain)
    idx = tokens()
    results = []
    for model in (plain, fused):
        logits, loss, stats = model(idx, targets=idx, latents=model.sample_latents(3, gen(0)))
        results.append((logits, loss, stats, grads(loss, list(model.parameters()))))
    (logits_p, loss_p, stats_p, grads_p), (logits_f, loss_f, stats_f, grads_f) = results
    assert torch.allclose(logits_f, logits_p, rtol=1e-10, atol=1e-12)
    assert torch.allclose(loss_f, loss_p, rtol=1e-10, atol=1e-12)
    assert stats_f.keys() == stats_p.keys()
    for name in stats_p:
        assert torch.allclose(stats_f[name], stats_p[name], rtol=1e-10, atol=1e-12), name
    assert stats_p["ar"] > 0 if plain.config.ar_prior else stats_p["ar"] == 0
    for (name, _), ours, ref in zip(plain.named_parameters(), grads_f, grads_p):
        assert torch.allclose(ours, ref, rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("overrides", [b for b in BANKS if b.get("ar_prior", True)], ids=str)
def test_fused_bank_at_a_decode_step_equals_the_plain_bank_values_next_memory_and_gradients(overrides):
    """A decode step: one position, its memory mu_p from the cache, in float64; and whole KV-cache decodes."""
    plain = make_with_memory(**overrides).double()
    mlp_p = with_clipped_logvar(plain.blocks[0].mlp)
    fused = fused_copy(plain)
    mlp_f = fused.blocks[0].mlp
    D, g = plain.config.n_latent, gen(4)
    m, r, eps, mu_p = (torch.randn(3, 1, D, dtype=torch.double, generator=g) * s for s in (1.0, 4.0, 1.0, 1.0))
    assert (r < -6).any() and (r > 2).any()  # the clip binds on both sides here too
    results = []
    for mlp in (mlp_p, mlp_f):
        leaves = [t.clone().requires_grad_() for t in (m, r, mu_p)]
        y, means, following = mlp.bank(leaves[0], leaves[1], eps, leaves[2])
        assert means.keys() == {"logvar_q", "var_q", "mu2", "sq_dist", "ar", "sigma_q"}
        means = [means[name] for name in sorted(means)]  # by name
        w = torch.randn(y.shape, dtype=torch.double, generator=gen(5))
        scalar = (y * w).sum() + sum((i + 1) * v.sin().sum() for i, v in enumerate(means))
        results.append([y, *means, following, *grads(scalar, [*leaves, *mlp.parameters()])])
    for ours, ref in zip(results[1], results[0]):
        assert torch.allclose(ours, ref, rtol=1e-10, atol=1e-12)
    B, T, P = 2, 20, 6  # whole decodes through the KV cache and PriorCache: the same logits at every step
    idx, latents = tokens(B=B, T=T), plain.sample_latents(B, gen(0))
    decoded = [kv_decode(model, idx, latents, P) for model in (plain, fused)]
    assert torch.allclose(decoded[1], decoded[0], rtol=1e-10, atol=1e-12)
    assert torch.allclose(decoded[0], plain(idx, targets=idx, latents=latents)[0][:, P - 1:], atol=1e-10)


@pytest.mark.parametrize("overrides", BANKS, ids=str)
def test_neuron_bank_backward_passes_gradcheck_with_the_scan_and_at_a_cached_decode_step(overrides):
    """NeuronBank's written-out backward against finite differences (float64), on every input with a gradient:
    through the AR prior's scan (11 positions: a chunk and part of one), and at a decode step given its memory mu_p.
    L_AR's row of the means is left out: its stop-gradient is no derivative (the tests above hold it to autograd's)."""
    cfg = make(**overrides).config
    N, dz, g = 3, cfg.latent_dim, gen(5)

    def leaf(*shape, scale=1.0):
        return (scale * torch.randn(*shape, dtype=torch.double, generator=g)).requires_grad_()
    m, r, eps = leaf(2, 11, N * dz), leaf(2, 11, N * dz, scale=4.0), torch.randn(2, 11, N * dz, dtype=torch.double,
                                                                                 generator=g)
    prior = (torch.tanh(leaf(N * dz)), leaf(N * dz), leaf(N * dz)) if cfg.ar_prior else (None, None, None)
    c = torch.tanh(leaf(N * dz)) if cfg.ar_prior and cfg.posterior_memory else None
    rest = (c, leaf(N, dz), leaf(N), cfg.logvar_min, cfg.logvar_max)

    def bank(m, r, eps, mu_p, *args):
        y, means, _ = eve_bank.NeuronBank.apply(m, r, eps, mu_p, *args)
        return y, means[[0, 1, 2, 3, 5]]
    assert torch.autograd.gradcheck(lambda m, r, *x: bank(m, r, eps, None, *x), (m, r, *prior, *rest))
    if cfg.ar_prior:  # a decode step: one position, its memory from the cache
        one = [t[:, :1].detach().requires_grad_() for t in (m, r)]
        assert torch.autograd.gradcheck(lambda m, r, mu_p, *x: bank(m, r, eps[:, :1], mu_p, *x),
                                        (*one, leaf(2, 1, N * dz), *prior, *rest))


def test_fused_banks_leaves_a_model_without_neurons_unchanged():
    twin = make(variational=False)
    state = {k: v.clone() for k, v in twin.state_dict().items()}
    assert eve_bank.fused_banks(twin) is twin
    assert not any("bank" in vars(m) for m in twin.modules())
    assert all(torch.equal(v, state[k]) for k, v in twin.state_dict().items())


@pytest.mark.parametrize("overrides", BANKS, ids=str)
def test_fused_banks_swaps_every_bank_of_model_eve_as_it_is_in_float32_and_float64(overrides):
    """fused_banks' probe passes the model file's own bank in every configuration (the memory, the clip and the AR
    prior all active), so train.py trains the fused bank; nothing is said."""
    for dtype in (torch.float32, torch.float64):
        model = make_with_memory(**overrides).to(dtype)
        assert eve_bank.fused_banks(model, log=pytest.fail) is model
        assert all(isinstance(vars(block.mlp).get("bank"), functools.partial) for block in model.blocks)
