"""torch.compile: the training forward of every model traces as one graph (no graph breaks), the Free
Transformer's hand-written mapper backward compiles to the same gradients, and every model's compiled decode step
generates eager's tokens."""

import sys

import pytest
import torch
import torch._dynamo as dynamo

import common

TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_embd=32, n_head=2, n_kv_head=1)


@pytest.mark.parametrize("model_type, extra", [
    ("det", {}), ("btrans", {"train_noise_mode": "sequence"}), ("btrans", {"train_noise_mode": "token"}), ("eve", {}),
    ("free", {"latent_bits": 4, "mapper": "factored"}), ("free", {"latent_bits": 4, "mapper": "dense"}),
])
def test_training_forward_has_no_graph_breaks(model_type, extra):
    torch.manual_seed(0)
    model = common.build_model(model_type, {**TINY, **extra}).train()
    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    explanation = dynamo.explain(model)(x, y)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_training_step_equals_eager_for_the_factored_mapper():
    """The hand-written backward of the Binary Mapper (model_free.FactoredBinaryMapper) traced by torch.compile gives
    eager's loss and gradients. fallback_random keeps eager's random numbers, so both sample the same codes."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = common.build_model("free", {**TINY, "latent_bits": 10, "mapper_chunk": 2 ** 12}).train()
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
    """compile_decode(): generate() with the compiled one-token step draws the tokens it draws eagerly, for the same
    seed, latents included (B-Trans's eps and EVE's eps drawn from the generator, Free's Z_t drawn per new token).
    The second compiled call, with another prompt length, reuses the compiled step (no recompilation)."""
    torch.manual_seed(0)
    model = common.build_model(model_type, TINY).eval()
    prompts = torch.randint(0, 64, (2, 5)), torch.randint(0, 64, (2, 3))
    runs = [(prompts[0], dict(temperature=0)), (prompts[1], dict(temperature=1.0, top_k=20))]

    def generate_all():
        return [model.generate(p, 12, generator=torch.Generator().manual_seed(3), **kw) for p, kw in runs]

    eager = generate_all()
    dynamo.reset()
    dynamo.utils.counters.clear()
    model.compile_decode()
    compiled = generate_all()
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph for every step of both calls


def test_kv_cache_spans_the_sequence_eager_and_a_few_rounded_lengths_compiled(monkeypatch):
    """Eager decoding attends over the positions filled so far: every step's keys are as many as the tokens so far,
    in a cache of prompt + new tokens. The compiled step's cache is that length rounded up to a power of two, at least
    64 and at most block_size (KVCache.padded_len), never block_size when the sequence is shorter; same tokens."""
    torch.manual_seed(0)
    model = common.build_model("det", {**TINY, "block_size": 1024}).eval()
    KVCache = sys.modules[type(model).__module__].KVCache
    assert [KVCache.padded_len(n, 1024) for n in (1, 17, 64, 65, 129, 1000)] == [64, 64, 64, 128, 256, 1024]
    assert KVCache.padded_len(700, 512) == 512
    cache_lens, key_lens = [], []
    update = KVCache.update

    def recording(self, start_pos, k, v):
        out = update(self, start_pos, k, v)
        cache_lens.append(self.k.size(2))
        key_lens.append(out[0].size(2))
        return out

    monkeypatch.setattr(KVCache, "update", recording)
    prompt = torch.randint(0, 64, (2, 5))
    eager = model.generate(prompt, 12, temperature=0)
    n_layer = TINY["n_layer"]
    assert set(cache_lens) == {17}
    assert key_lens == [n for n in range(5, 17) for _ in range(n_layer)]  # prefill 5, then one more per step
    monkeypatch.undo()
    setup, setups = model.setup_kv_cache, []
    monkeypatch.setattr(model, "setup_kv_cache", lambda B, n: (setups.append(n), setup(B, n)))
    dynamo.reset()
    model.compile_decode()
    assert torch.equal(model.generate(prompt, 12, temperature=0), eager)
    assert setups == [64] and model.blocks[0].attn.kv_cache is None  # and freed after the call


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("model_type", ["det", "btrans", "eve", "free"])
def test_onednn_linears_give_eager_logits_and_tokens_and_restore_the_model(model_type):
    """common.onednn_linears (sample.py's CPU decoding): every model's logits within float rounding of F.linear's,
    the same greedy tokens with pinned latents, the plain weights released inside, and on leaving, the modules' own
    forward and weights back (bit-equal logits)."""
    torch.manual_seed(0)
    model = common.build_model(model_type, {**TINY, "n_layer": 4}).eval()
    x = torch.randint(0, 64, (3, 20))
    latents = model.sample_latents(3, torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x, x, latents=latents)[0]
        tokens = model.generate(x[:, :5], 12, temperature=0, latents=latents)
        with common.onednn_linears(model):
            inside = model(x, x, latents=latents)[0]
            assert torch.equal(model.generate(x[:, :5], 12, temperature=0, latents=latents), tokens)
            linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
            assert "forward" in vars(linear)  # the oneDNN call is in place, so the comparison above compares it
            # a called, untied weight is held once, packed; a tied head's stays (the embedding reads it)
            assert model.blocks[0].attn.wq.weight.numel() == 0
            assert model.lm_head.weight.shape == model.tok_emb.weight.shape
        after = model(x, x, latents=latents)[0]
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(after, before)
    torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", ["det", "btrans", "eve", "free"])
def test_onednn_linears_under_autocast_give_autocasts_logits_and_restore_the_model(model_type, dtype):
    """evaluate.py --dtype=bfloat16/float16 on a CPU: inside common.onednn_linears(model, dtype) and autocast, the
    logits are autocast's own to the dtype's rounding. bfloat16 runs through oneDNN where it has the kernels (its
    packed copies beside the float32 weights); float16, which oneDNN lacks on CPUs without AVX512-FP16, through
    autocast's kernels, every module left as it is. On leaving, the float32 model is as before, bit for bit."""
    torch.manual_seed(0)
    model = common.build_model(model_type, {**TINY, "n_layer": 4}).eval()
    x = torch.randint(0, 64, (3, 20))
    latents = model.sample_latents(3, torch.Generator().manual_seed(1))
    packs = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
             torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}[dtype]
    linear = model.blocks[0].attn.wq
    with torch.no_grad():
        before = model(x, x, latents=latents)[0]
        with torch.autocast("cpu", dtype=dtype):
            plain = model(x, x, latents=latents)[0]
        with common.onednn_linears(model, dtype), torch.autocast("cpu", dtype=dtype):
            inside = model(x, x, latents=latents)[0]
            assert ("forward" in vars(linear)) == packs and linear.weight.dtype == torch.float32
        after = model(x, x, latents=latents)[0]
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(after, before)
    torch.testing.assert_close(inside.float(), plain.float(), rtol=0.05, atol=0.05)
