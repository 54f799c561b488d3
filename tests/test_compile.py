"""torch.compile, as the scripts apply it: the training forward of every model traces as one graph (no graph
breaks), the Free Transformer's hand-written mapper backward compiles to the same gradients, and every model's
compiled decode step generates eager's tokens."""

import sys

import pytest
import torch
import torch._dynamo as dynamo

from nanolatent import models

pytestmark = pytest.mark.slow  # every test here starts processes (python -m pytest -m "not slow" skips them)

TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_embd=32, n_head=2, n_kv_head=1)


@pytest.mark.parametrize("model_type, extra", [
    ("det", {}), ("btrans", {"train_noise_mode": "sequence"}), ("btrans", {"train_noise_mode": "token"}), ("eve", {}),
    ("free", {"latent_bits": 4, "mapper": "factored"}), ("free", {"latent_bits": 4, "mapper": "dense"}),
])
def test_training_forward_has_no_graph_breaks(model_type, extra):
    torch.manual_seed(0)
    model = models.build_model(model_type, {**TINY, **extra}).train()
    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    explanation = dynamo.explain(model)(x, y)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_training_step_equals_eager_for_the_factored_mapper():
    """The hand-written backward of the Binary Mapper (model_free.FactoredBinaryMapper) traced by torch.compile gives
    eager's loss and gradients. fallback_random keeps eager's random numbers, so both sample the same codes."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = models.build_model("free", {**TINY, "latent_bits": 10, "mapper_chunk": 2 ** 12}).train()
    x, y = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))

    def step(fn):
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        _, loss, _ = fn(x, y)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_eager, grads_eager = step(model)
    with inductor_config.patch(fallback_random=True):
        loss_compiled, grads_compiled = step(torch.compile(model, dynamic=False))
    assert abs(loss_compiled - loss_eager) < 1e-5
    assert grads_eager["encoder_readout.weight"].abs().sum() > 0  # the encoder is trained through the mapper
    for name, grad in grads_eager.items():
        assert (grads_compiled[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-9, name


@pytest.mark.parametrize("model_type", ["det", "btrans", "eve", "free"])
def test_compiled_decode_step_gives_the_eager_tokens_greedy_and_sampled(model_type):
    """generate() with the one-token step compiled as sample.py --compile=True compiles it (torch.compile of the
    forward, dynamic positions) draws the tokens it draws eagerly, for the same seed, latents included (B-Trans's
    eps and EVE's eps drawn from the generator, Free's Z_t drawn per new token). A graph per sequence length: the
    KV cache is as long as the call's prompt + new tokens, and every step of a call reuses its graph."""
    torch.manual_seed(0)
    model = models.build_model(model_type, TINY).eval()
    prompts = torch.randint(0, 64, (2, 5)), torch.randint(0, 64, (2, 3))
    runs = [(prompts[0], dict(temperature=0)), (prompts[1], dict(temperature=1.0, top_k=20))]

    def generate_all(step=None):
        return [model.generate(p, 12, generator=torch.Generator().manual_seed(3), step=step, **kw) for p, kw in runs]

    eager = generate_all()
    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled = generate_all(torch.compile(model.forward, dynamic=True))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 2  # one for each call's length, 11 steps each


def test_btrans_token_mode_draws_every_steps_eps_from_the_generator_compiled_or_not():
    """In 'token' mode each decode step draws fresh eps (§6.1); generate() passes its generator to the compiled step as
    to the eager one, so a seed gives the same tokens either way."""
    torch.manual_seed(0)
    model = models.build_model("btrans", {**TINY, "noise_mode": "token", "sigma": 0.5}).eval()
    prompt = torch.randint(0, 64, (2, 5))
    eager, compiled = (model.generate(prompt, 8, generator=torch.Generator().manual_seed(3), step=step)
                       for step in (None, torch.compile(model.forward, dynamic=True)))
    assert torch.equal(eager, compiled)


def test_kv_cache_spans_the_sequence_and_each_step_attends_over_the_positions_so_far(monkeypatch):
    """Decoding attends over the positions filled so far: every step's keys are as many as the tokens so far, in a
    cache of prompt + new tokens, freed after the call."""
    torch.manual_seed(0)
    model = models.build_model("det", {**TINY, "block_size": 1024}).eval()
    KVCache = sys.modules[type(model).__module__].KVCache
    cache_lens, key_lens = [], []
    update = KVCache.update

    def recording(self, start_pos, k, v):
        out = update(self, start_pos, k, v)
        cache_lens.append(self.k.size(2))
        key_lens.append(out[0].size(2))
        return out

    monkeypatch.setattr(KVCache, "update", recording)
    prompt = torch.randint(0, 64, (2, 5))
    model.generate(prompt, 12, temperature=0)
    n_layer = TINY["n_layer"]
    assert set(cache_lens) == {17}
    assert key_lens == [n for n in range(5, 17) for _ in range(n_layer)]  # prefill 5, then one more per step
    assert model.blocks[0].attn.kv_cache is None
