"""model_free.py, the Free Transformer: tiny models on CPU, each test pinning a number or an equality."""

import math

import pytest
import torch
import torch.nn.functional as F

import model_det
import model_free
from model_free import Config, FactoredBinaryMapper, Model, code_bits, dense_binary_mapper

TINY = dict(vocab_size=11, block_size=24, n_layer=4, n_embd=32, n_head=4, n_kv_head=2, latent_bits=6)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return Model(Config(**{**TINY, **overrides})).eval()


def random_tokens(B, T, seed=1, vocab=TINY["vocab_size"]):
    return torch.randint(vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_mapper_forward_value_is_exactly_one_hot():
    torch.manual_seed(0)
    H, C = 5, 7
    logits = 3 * torch.randn(4, 9, H, requires_grad=True)
    codes = model_free.sample_codes(logits)
    U = code_bits(torch.arange(2 ** H), H).float()  # (2^H, H)
    log_G = logits @ U.t() - F.softplus(logits).sum(-1, keepdim=True)
    G = log_G.exp()
    Y = F.one_hot(codes, 2 ** H).float()
    Z = Y + (G - G.detach())  # Eq. 8 exactly as in dense_binary_mapper
    assert torch.equal(Z, Y)
    assert torch.allclose(G.sum(-1), torch.ones(4, 9))  # G is a distribution over the 2^H codes
    W = torch.randn(C, 2 ** H)
    R_dense = dense_binary_mapper(logits, codes, W)
    R_factored = FactoredBinaryMapper.apply(logits.view(-1, H), codes.view(-1), W, 5).view(4, 9, C)
    assert torch.equal(R_dense, W.t()[codes])  # one-hot times W is exactly a column of W
    assert torch.equal(R_factored, W.t()[codes])


def test_bits_of_sampled_codes_follow_the_bit_probabilities():
    logits = torch.tensor([-2.0, 0.0, 1.0, 3.0])
    codes = model_free.sample_codes(logits.expand(200_000, 4), torch.Generator().manual_seed(0))
    freq = code_bits(codes, 4).float().mean(0)
    assert torch.allclose(freq, torch.sigmoid(logits), atol=5e-3)  # Eq. 6, bit h is code bit h (Eq. 7)


def test_encoder_receives_gradient_from_cross_entropy_through_G():
    model = tiny_model(kappa_bits=100.0).train()  # the free-bits hinge is 0 and has no gradient
    idx = random_tokens(4, 24)
    _, loss, stats = model(idx[:, :-1], idx[:, 1:])
    assert stats["free_bits"].item() == 0.0 and loss.item() == stats["ce"].item()
    loss.backward()
    for p in (model.encoder_readout.weight, model.zeta, model.encoder.attn.wq.weight):
        assert p.grad is not None and p.grad.abs().sum().item() > 0
    assert model.post_sampler.weight.grad.abs().sum().item() > 0


@pytest.mark.parametrize("H", [1, 3, 6])
def test_kl_matches_brute_force_enumeration_over_all_codes(H):
    logits = 2 * torch.randn(5, H, generator=torch.Generator().manual_seed(H), dtype=torch.float64)
    all_codes = torch.arange(2 ** H)
    log_q = model_free.log_q_codes(logits[:, None, :], all_codes[None, :])  # (5, 2^H)
    q = log_q.exp()
    assert torch.allclose(q.sum(-1), torch.ones(5, dtype=torch.float64))
    kl_brute = H * math.log(2) + (q * log_q).sum(-1)  # Eq. 4
    assert torch.allclose(model_free.kl_per_token(logits), kl_brute, rtol=1e-12, atol=1e-12)
    assert torch.allclose(model_free.kl_per_token(torch.zeros(3, H)), torch.zeros(3))  # Q uniform: KL = 0


def test_free_bits_term_is_zero_when_every_token_kl_is_below_kappa():
    model = tiny_model().train()
    idx = random_tokens(4, 24)
    _, _, stats = model(idx[:, :-1], idx[:, 1:])
    kl_max_bits = model_free.kl_per_token(model.encoder_logits(idx[:, :-1])).max().item() / math.log(2)
    model.config.kappa_bits, model.config.kappa_nats = kl_max_bits, kl_max_bits * math.log(2)
    torch.manual_seed(0)
    _, loss, stats = model(idx[:, :-1], idx[:, 1:])
    assert stats["free_bits"].item() == 0.0 and loss.item() == stats["ce"].item()
    assert stats["kl"].item() > 0 and stats["elbo"].item() > stats["ce"].item()  # the elbo keeps the full KL
    # Below the largest KL_t the hinge switches on: Eq. 5, the mean over tokens of max(0, KL_t - κ).
    kl = model_free.kl_per_token(model.encoder_logits(idx[:, :-1]))  # (B, T) nats
    kappa = kl.median().item()
    model.config.kappa_nats = kappa
    _, loss, stats = model(idx[:, :-1], idx[:, 1:])
    assert math.isclose(stats["free_bits"].item(), (kl - kappa).clamp_min(0).mean().item(), rel_tol=1e-5)
    assert math.isclose(stats["kl"].item(), kl.mean().item() / math.log(2), rel_tol=1e-5)
    assert math.isclose(stats["elbo"].item(), stats["ce"].item() + kl.mean().item(), rel_tol=1e-5)
    assert math.isclose(loss.item(), stats["ce"].item() + stats["free_bits"].item(), rel_tol=1e-6)


def test_decoder_is_causal_given_fixed_latents():
    model = tiny_model()
    idx = random_tokens(2, 24)
    z = model.sample_latents(2, torch.Generator().manual_seed(0))
    logits, _, _ = model(idx, idx, latents=z)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % TINY["vocab_size"]
    logits2, _, _ = model(changed, changed, latents=z)
    assert torch.allclose(logits[:, :10], logits2[:, :10], rtol=0, atol=1e-6)  # earlier positions see none of it
    assert (logits[:, 10:] - logits2[:, 10:]).abs().amax(-1).min().item() > 1e-4
    # Without pinned latents the encoder is non-causal: Z_t, hence position t < 10, depends on token 10.
    z_enc = model.encoder_logits(idx)
    z_enc2 = model.encoder_logits(changed)
    assert not torch.allclose(z_enc[:, :10], z_enc2[:, :10])


def test_encoder_queries_differ_by_position():
    model = tiny_model()
    bit_logits = model.encoder_logits(random_tokens(1, 24))[0]  # (T, H)
    assert (bit_logits[1:] - bit_logits[:-1]).abs().amax(-1).min().item() > 0  # RoPE on ζ: no two Z_t alike


def test_kv_cache_generation_matches_full_forward_with_pinned_latents():
    model = tiny_model()
    prompt = random_tokens(3, 5)
    z = model.sample_latents(3, torch.Generator().manual_seed(7))
    out = model.generate(prompt, 15, temperature=0, latents=z)
    idx = prompt
    with torch.no_grad():
        for _ in range(15):
            logits, _, _ = model(idx, latents=z)  # no cache: the whole sequence again
            idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, idx)
    # And the cached logits themselves agree with a full forward under the same Z.
    full, _, _ = model(out, out, latents=z)
    model.setup_kv_cache(3, 20)
    try:
        with torch.no_grad():
            cached = [model(out[:, :5], latents=z)[0]] + [model(out[:, p:p + 1], latents=z, start_pos=p)[0]
                                                          for p in range(5, 20)]
    finally:
        model.clear_kv_cache()
    assert torch.allclose(torch.cat(cached, 1), full[:, 4:], atol=1e-5)


def record_codes(model):
    """Wrap model.post_sample to keep the codes of every call."""
    seen, post_sample = [], model.post_sample

    def spy(codes, bit_logits=None):
        seen.append(codes.clone())
        return post_sample(codes, bit_logits)

    model.post_sample = spy
    return seen


def test_shared_latents_reproduce_the_same_z():
    model = tiny_model()
    z1 = model.sample_latents(1, torch.Generator().manual_seed(3))
    assert z1.shape == (1, TINY["block_size"]) and z1.min() >= 0 and z1.max() < 2 ** TINY["latent_bits"]
    assert torch.equal(z1, model.sample_latents(1, torch.Generator().manual_seed(3)))
    group = z1.expand(4, -1)  # one Z for a group of 4 sequences
    seen = record_codes(model)
    out = model.generate(random_tokens(1, 4).expand(4, -1), 12, latents=group,
                         generator=torch.Generator().manual_seed(0))
    codes = torch.cat(seen, dim=1)  # (4, 4 + 11): the prompt at the prefill, then one per decode step
    assert torch.equal(codes, group[:, :15])
    assert len({tuple(row.tolist()) for row in out}) > 1  # the group shares Z, not its sampled tokens


def test_generation_draws_prompt_z_from_encoder_and_new_z_uniformly_once():
    model = tiny_model()
    prompt = random_tokens(2, 6)
    seen = record_codes(model)
    model.generate(prompt, 8, generator=torch.Generator().manual_seed(0))
    assert [c.shape for c in seen] == [(2, 6)] + [(2, 1)] * 7  # one Z_t per new token, never re-sampled
    torch.manual_seed(0)
    expected = model.posterior_latents(prompt, torch.Generator().manual_seed(0))
    assert torch.equal(seen[0], expected)  # the prefill's codes are the encoder's, same generator state
    out_a = model.generate(prompt, 8, generator=torch.Generator().manual_seed(5))
    out_b = model.generate(prompt, 8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(out_a, out_b)


def test_generation_pinned_to_a_reference_posterior_draws_uniform_z_past_its_end():
    model = tiny_model()
    z_ref = model.posterior_latents(random_tokens(1, 6), torch.Generator().manual_seed(0)).expand(2, -1)  # (2, 6)
    seen = record_codes(model)
    model.generate(random_tokens(2, 4), 8, latents=z_ref, generator=torch.Generator().manual_seed(1))
    codes = torch.cat(seen, dim=1)  # (2, 11)
    assert torch.equal(codes[:, :6], z_ref)
    extra = torch.randint(2 ** TINY["latent_bits"], (2, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(codes[:, 6:], extra[:, :5])  # drawn once, before decoding, from the token generator


def test_sample_latents_with_a_prompt_draws_its_z_from_the_encoder_and_the_rest_uniform():
    model = tiny_model()
    with torch.no_grad():
        model.encoder_readout.weight.mul_(100)  # bit probabilities far from 1/2, so prompts tell apart
    prompt, other = random_tokens(3, 7, seed=1), random_tokens(3, 7, seed=2)
    codes = model.sample_latents(3, torch.Generator().manual_seed(4), prompt=prompt)
    assert codes.shape == (3, TINY["block_size"]) and codes.min() >= 0 and codes.max() < 2 ** TINY["latent_bits"]
    # §3.2: positions < T from the encoder on the prompt, the same draw as posterior_latents from the same state
    assert torch.equal(codes[:, :7], model.posterior_latents(prompt, torch.Generator().manual_seed(4)))
    # positions >= T: uniform draws that do not depend on the prompt's tokens (another prompt, the same codes)
    codes_other = model.sample_latents(3, torch.Generator().manual_seed(4), prompt=other)
    assert not torch.equal(codes_other[:, :7], codes[:, :7])
    assert torch.equal(codes_other[:, 7:], codes[:, 7:])
    # prompt=None keeps the old behaviour: the uniform prior everywhere, the prompt's positions included
    assert torch.equal(model.sample_latents(3, torch.Generator().manual_seed(4)),
                       torch.randint(2 ** TINY["latent_bits"], (3, TINY["block_size"]),
                                     generator=torch.Generator().manual_seed(4)))


def test_sample_latents_prompt_codes_follow_the_encoder_distribution_one_independent_draw_per_row():
    model = tiny_model()
    with torch.no_grad():
        model.encoder_readout.weight.mul_(100)  # bit probabilities spread over (0, 1)
    prompt = random_tokens(1, 5)
    codes = model.sample_latents(20_000, torch.Generator().manual_seed(0), prompt=prompt)  # a batch-1 prompt
    p = torch.sigmoid(model.encoder_logits(prompt)[0])  # (5, H) Eq. 6 on the prompt alone
    assert p.min() < 0.2 and p.max() > 0.8
    freq = code_bits(codes[:, :5], TINY["latent_bits"]).float().mean(0)  # (5, H)
    assert torch.allclose(freq, p, atol=0.015)
    uniform = code_bits(codes[:, 5:], TINY["latent_bits"]).float().mean((0, 1))  # (H,) the prior: 1/2 per bit
    assert torch.allclose(uniform, torch.full_like(uniform, 0.5), atol=0.01)
    # --latents=independent: rows are separate draws; --latents=shared repeats one row (sample_latents(1, ...))
    assert len({tuple(row.tolist()) for row in codes[:50, :5]}) > 10


def test_sample_latents_never_reads_tokens_past_the_prompt():
    # MC scoring: the context is the prompt, the choice tokens get uniform codes; the non-causal encoder on
    # context + choice would read the answer. Z for the context is the same whichever choice follows.
    model = tiny_model()
    context, choice_a, choice_b = random_tokens(2, 6, seed=1), random_tokens(2, 4, seed=2), random_tokens(2, 4, seed=3)
    seen, encoder_logits = [], model.encoder_logits
    model.encoder_logits = lambda idx: seen.append(idx.clone()) or encoder_logits(idx)
    latents = model.sample_latents(2, torch.Generator().manual_seed(0), prompt=context)
    assert len(seen) == 1 and torch.equal(seen[0], context)  # the encoder ran on the context alone
    full_a, full_b = torch.cat((context, choice_a), 1), torch.cat((context, choice_b), 1)
    assert not torch.allclose(encoder_logits(full_a)[:, :6], encoder_logits(full_b)[:, :6])  # it would leak
    with torch.no_grad():  # scored with these latents, the context's logits are the same for both choices
        logits_a = model(full_a, full_a, latents=latents)[0]
        logits_b = model(full_b, full_b, latents=latents)[0]
    assert torch.equal(logits_a[:, :6], logits_b[:, :6])


def test_generate_with_prompt_latents_equals_generate_without_latents_given_the_same_codes():
    model = tiny_model()
    prompt = random_tokens(2, 5)
    seen = record_codes(model)
    free_run = model.generate(prompt, 10, temperature=0, generator=torch.Generator().manual_seed(3))
    prefill, decoded = seen[0], torch.cat(seen[1:], dim=1)  # (2, 5) encoder codes, (2, 9) uniform codes
    # sample_latents(prompt=...) from the same generator state draws the prefill's codes exactly ...
    latents = model.sample_latents(2, torch.Generator().manual_seed(3), prompt=prompt)  # (2, block_size)
    assert torch.equal(latents[:, :5], prefill)
    # ... and with the new tokens' uniform codes set to the ones generate drew, the pinned run is the same run
    latents[:, 5:14] = decoded
    seen.clear()
    pinned_run = model.generate(prompt, 10, temperature=0, latents=latents)
    assert torch.equal(torch.cat(seen, dim=1), latents[:, :14])
    assert torch.equal(pinned_run, free_run)


def test_mean_kl_and_free_bits_count_the_z_that_reach_a_scored_target():
    model = tiny_model().train()
    idx = random_tokens(2, 12)
    targets = random_tokens(2, 12, seed=5)
    targets[0, :4] = -1  # a masked prompt: its Z_t still reach the scored targets after it
    targets[0, 9:] = -1  # padding after the last scored target: its Z_t reach nothing scored
    targets[1, 6] = -1  # one masked target in the middle
    kl = model_free.kl_per_token(model.encoder_logits(idx)).detach()  # (2, 12) nats, the same in every draw
    kappa = kl.median().item()
    model.config.kappa_nats = kappa
    kept, encode = [], model.encode

    def keep(x, cos, sin):
        bit_logits = encode(x, cos, sin)
        bit_logits.retain_grad()
        kept.append(bit_logits)
        return bit_logits

    model.encode = keep
    _, loss, stats = model(idx, targets)
    # by hand: row 0 counts positions 0..8 (the last scored target is at 8), row 1 all 12; 5 + 11 predicted tokens
    counted = [(0, t) for t in range(9)] + [(1, t) for t in range(12)]
    n_pred = 5 + 11
    hinge = sum(max(0.0, kl[b, t].item() - kappa) for b, t in counted) / n_pred
    kl_per_pred = sum(kl[b, t].item() for b, t in counted) / n_pred
    assert math.isclose(stats["free_bits"].item(), hinge, rel_tol=1e-5)
    assert math.isclose(stats["kl"].item(), kl_per_pred / math.log(2), rel_tol=1e-5)
    assert math.isclose(stats["elbo"].item(), stats["ce"].item() + kl_per_pred, rel_tol=1e-5)
    assert math.isclose(loss.item(), stats["ce"].item() + hinge, rel_tol=1e-5)
    assert not math.isclose(hinge, F.relu(kl - kappa).mean().item(), rel_tol=1e-3)  # the old mean over all 24
    loss.backward()  # padding's Z_t get no gradient at all (neither term sees them); the masked prompt's do
    grad = kept[0].grad.abs().sum(-1)  # (2, 12)
    assert grad[0, 9:].max().item() == 0.0 and (grad[0, :9] > 0).all() and (grad[1] > 0).all()


def test_posterior_and_prior_give_log_probabilities_of_the_codes():
    model = tiny_model()
    idx = random_tokens(2, 24)
    codes, log_q = model.posterior(idx, torch.Generator().manual_seed(0))
    bit_logits = model.encoder_logits(idx)
    bits = code_bits(codes, TINY["latent_bits"]).float()
    expected = (bits * F.logsigmoid(bit_logits) + (1 - bits) * F.logsigmoid(-bit_logits)).sum(-1)
    assert torch.allclose(log_q, expected, atol=1e-6)
    assert torch.allclose(model.log_prior(codes), torch.full((2, 24), -TINY["latent_bits"] * math.log(2)))
    _, ce, stats = model(idx[:, :-1], idx[:, 1:], latents=codes)
    assert set(stats) == {"ce"} and ce.item() == stats["ce"].item()


def test_flops_per_token_counts_encoder_and_post_sampler():
    cfg = dict(TINY, latent_bits=8)
    det = model_det.Model(model_det.Config(**{k: v for k, v in cfg.items() if k != "latent_bits"}))
    C, T, H, K = cfg["n_embd"], cfg["block_size"], 8, 2 ** 8
    for mapper, mapper_flops in (("dense", 6 * C * K + 4 * H * K), ("factored", 2 * C * K + 4 * K + C)):
        free = Model(Config(**cfg, mapper=mapper))
        enc = free.encoder
        encoder_params = sum(p.numel() for p in enc.parameters()) + C + C * H  # block, encoder_norm, readout
        assert free.num_params() - det.num_params() == encoder_params + C + C * K  # + ζ + post-sampler
        extra = free.flops_per_token() - det.flops_per_token()
        assert extra == 6 * encoder_params + 12 * C * T + mapper_flops


def train_step(model, idx, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    _, loss, stats = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return loss, stats


@pytest.mark.parametrize("H", [4, 8, 10])
def test_factored_and_dense_mappers_give_identical_values_and_gradients(H):
    # κ above any KL: the encoder's whole gradient comes through G, the part the two mappers compute differently.
    dense = tiny_model(latent_bits=H, mapper="dense", kappa_bits=100.0).train()
    factored = tiny_model(latent_bits=H, mapper="factored", kappa_bits=100.0, mapper_chunk=3 * 2 ** H).train()
    factored.load_state_dict(dense.state_dict())
    with torch.no_grad():  # logits large enough that some bits are nearly certain and the G_d span decades
        dense.encoder_readout.weight.mul_(50)
        factored.encoder_readout.weight.copy_(dense.encoder_readout.weight)
    idx = random_tokens(3, 17)
    loss_d, stats_d = train_step(dense, idx, seed=11)
    loss_f, stats_f = train_step(factored, idx, seed=11)  # same seed: the same sampled codes
    assert loss_d.item() == loss_f.item() and stats_d["kl"].item() == stats_f["kl"].item() > 1
    grads_d = {n: p.grad for n, p in dense.named_parameters()}
    for name, p in factored.named_parameters():
        assert rel_err(p.grad, grads_d[name]) < 1e-5, name
    assert grads_d["encoder_readout.weight"].abs().sum() > 0


# chunk (values per piece of v) picks the pieces: H = 5 splits into 3 low and 2 high bits, so 24 gives pieces of 3, 3
# and 1 tokens by one high row, 48 at N = 2 gives both tokens by high rows {0, 1, 2} then {3}.
@pytest.mark.parametrize("H, C, N, chunk", [(1, 2, 3, 1), (3, 4, 5, 2), (5, 3, 7, 24), (5, 3, 2, 48),
                                            (6, 2, 4, 10 ** 6)])
def test_factored_mapper_gradcheck_float64(H, C, N, chunk):
    """The factored Function's forward is W[:, c], flat in the logits; its gradient for them is that of the
    expectation E_Q[W Z] = W G (Eq. 8). Adding W0 G(L) detached, with W0 a fixed copy of W, gives a function whose
    finite differences are exactly those gradients, so gradcheck pins both the gather's and G's backward."""
    torch.manual_seed(H)
    logits = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    W = torch.randn(C, 2 ** H, dtype=torch.float64, requires_grad=True)
    codes = torch.randint(2 ** H, (N,))
    W0 = W.detach().clone()
    U = code_bits(torch.arange(2 ** H), H).double()

    def f(L, W):
        G = (L @ U.t() - F.softplus(L).sum(-1, keepdim=True)).exp()  # (N, 2^H)
        return FactoredBinaryMapper.apply(L, codes, W, chunk) + (G @ W0.t()).detach()

    assert torch.autograd.gradcheck(f, (logits, W), eps=1e-6, atol=1e-8, rtol=1e-6)


def peak_cpu_bytes(fn):
    """Peak of live bytes allocated through torch's CPU allocator while fn runs (profiler allocation events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(nodes):
        for n in nodes:
            if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu":
                events.append((n.start_time_ns, n.extra_fields.alloc_size))
            walk(n.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def test_training_step_memory_at_16_bits_grows_only_by_the_post_sampler_weight():
    """One AdamW step at H = 16 (B*T = 132 tokens) vs the same model at H = 4: beyond the post-sampler's weight
    gradient, only one piece of v and a few (tokens, 2^8) factors; the fused AdamW adds no temporaries. Measured here:
    +5.5 MiB with a 4 MiB weight and a 1 MiB piece; the dense mapper: +160 MiB."""
    tiny = dict(vocab_size=11, block_size=33, n_layer=2, n_embd=16, n_head=2, n_kv_head=1, mapper_chunk=2 ** 18)
    idx = random_tokens(4, 33)

    def step_peak(H, mapper="factored"):
        model = Model(Config(**tiny, latent_bits=H, mapper=mapper)).train()
        opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
        train_step(model, idx, 0)
        opt.step()  # AdamW's state exists from here on; the measured step allocates what every step does

        def step():
            train_step(model, idx, 1)
            opt.step()

        return peak_cpu_bytes(step), model.post_sampler.weight.numel() * 4

    peak4, _ = step_peak(4)
    peak16, w_bytes = step_peak(16)
    piece = 2 ** 18 * 4  # mapper_chunk float32 values of v
    assert peak16 - peak4 < w_bytes + piece + 2 ** 20, (peak16 - peak4) / 2 ** 20
    dense16, _ = step_peak(16, "dense")  # the measurement does see (B, T, 2^H): 33 MiB for each such tensor
    assert dense16 - peak4 > 4 * w_bytes + 132 * 2 ** 16 * 4
