"""model_det.py: the baseline's invariants, checked against independent computations."""

import math

import pytest
import torch
import torch.nn.functional as F

import model_det


def tiny(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    return model_det.Model(model_det.Config(**{**cfg, **kw})).eval()


def test_changing_a_future_token_never_changes_past_logits():
    model = tiny()
    idx = torch.randint(0, 50, (2, 20))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 50
    logits_a, _, _ = model(idx, targets=idx)
    logits_b, _, _ = model(changed, targets=changed)
    assert torch.equal(logits_a[:, :12], logits_b[:, :12])
    assert not torch.allclose(logits_a[:, 12:], logits_b[:, 12:])


def test_kv_cache_generation_equals_full_forward_greedy_generation():
    model = tiny()
    prompt = torch.randint(0, 50, (3, 5))
    cached = model.generate(prompt, 20, temperature=0)
    idx = prompt
    for _ in range(20):  # no cache: the whole sequence through forward at every step
        logits, _, _ = model(idx)
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, idx)


def test_kv_cache_sampling_is_reproducible_with_a_generator():
    model = tiny()
    prompt = torch.randint(0, 50, (2, 4))
    a = model.generate(prompt, 15, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 15, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_top_k_keeps_only_the_k_most_likely_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    draws = {model_det.sample_next_token(logits, 1.0, 2, torch.Generator().manual_seed(s)).item() for s in range(200)}
    assert draws == {1, 2}


def test_attention_equals_an_explicit_softmax_with_repeated_kv_heads():
    model = tiny()
    attn, cfg = model.blocks[0].attn, model.config
    x = torch.randn(2, 10, cfg.n_embd)
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    q = model_det.apply_rope(attn.wq(x).view(2, 10, 4, 8).transpose(1, 2), cos, sin)
    k = model_det.apply_rope(attn.wk(x).view(2, 10, 2, 8).transpose(1, 2), cos, sin).repeat_interleave(2, dim=1)
    v = attn.wv(x).view(2, 10, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(10, 10).triu(1).bool(), float("-inf"))
    expected = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, -1))
    assert torch.allclose(attn(x, cos, sin, 0), expected, atol=1e-6)


def test_rope_rotation_preserves_norms_and_depends_only_on_relative_position():
    cos, sin = model_det.precompute_rope(8, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    rot = lambda x, p: model_det.apply_rope(x, cos[p:p + 1], sin[p:p + 1])
    assert torch.allclose(rot(q, 5).norm(), q.norm(), atol=1e-6)
    assert torch.allclose((rot(q, 9) * rot(k, 4)).sum(), (rot(q, 20) * rot(k, 15)).sum(), atol=1e-5)


def test_rope_turns_each_channel_pair_by_its_angle_as_a_complex_product():
    """channels (j, j + hd/2) as the complex number x_j + i x_{j+hd/2}, times e^{i pos theta^(-2j/hd)}"""
    hd, T = 8, 12
    cos, sin = model_det.precompute_rope(hd, T, 10000.0)
    x = torch.randn(2, 3, T, hd)
    angles = torch.arange(T)[:, None] * 10000.0 ** (-torch.arange(0, hd, 2) / hd)  # (T, hd/2)
    expected = torch.complex(x[..., :hd // 2], x[..., hd // 2:]) * torch.polar(torch.ones(T, hd // 2), angles)
    assert torch.allclose(model_det.apply_rope(x, cos, sin), torch.cat([expected.real, expected.imag], -1), atol=1e-6)


def test_loss_at_init_is_close_to_log_vocab_size():
    model = tiny(vocab_size=256, block_size=64)
    idx = torch.randint(0, 256, (8, 64))
    targets = torch.randint(0, 256, (8, 64))
    _, loss, stats = model(idx, targets=targets)
    assert abs(loss.item() - math.log(256)) < 0.05 * math.log(256)
    assert stats["ce"] == loss


def test_loss_ignores_targets_equal_to_minus_one():
    model = tiny()
    idx = torch.randint(0, 50, (2, 16))
    targets = idx.roll(-1, dims=1)
    masked = targets.clone()
    masked[:, 8:] = -1
    logits, loss, _ = model(idx, targets=masked)
    expected = F.cross_entropy(logits[:, :8].reshape(-1, 50), targets[:, :8].reshape(-1))
    assert torch.allclose(loss, expected)


def test_generate_refuses_a_prompt_longer_than_the_context_with_a_clear_message():
    model = tiny()
    with pytest.raises(ValueError, match="exceeds the context"):
        model.generate(torch.zeros(1, 30, dtype=torch.long), 5)


def test_weight_decay_applies_to_matrices_only():
    model = tiny()
    groups = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu").param_groups
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and groups[0]["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in groups[1]["params"]) and groups[1]["weight_decay"] == 0.0
    assert sum(p.numel() for g in groups for p in g["params"]) == model.num_params()


def test_flops_per_token_counts_every_matmul():
    model = tiny()
    C, F_, V, L, T = 32, model.config.ffn_hidden, 50, 2, 32
    per_layer = C * C + 2 * C * (C // 2) + C * C + 3 * C * F_  # wq, wk+wv (2 of 4 heads), wo, SwiGLU
    weights = L * per_layer + V * C + L * 2 * C + C  # + tied head/embedding, norm gains
    assert model.num_params() == weights
    assert model.flops_per_token() == 6 * weights + 12 * L * C * T


def test_llama3_rope_keeps_short_wavelengths_stretches_long_ones_and_blends_between_as_meta_writes_it():
    """Llama 3.1's remap against Meta's apply_scaling (its reference code, frequency by frequency in floats)."""
    hd, theta, (factor, low, high, original) = 32, 500.0, (8.0, 1.0, 4.0, 64)
    plain = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    expected = []
    for freq in plain.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            expected.append(freq)
        elif wavelen > original / low:
            expected.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            expected.append((1 - smooth) * freq / factor + smooth * freq)
    kinds = [(w < original / high, w > original / low) for w in (2 * math.pi / plain).tolist()]
    assert {(True, False), (False, True), (False, False)} <= set(kinds)  # every branch taken
    cos, sin = model_det.precompute_rope(hd, 200, theta, (factor, low, high, original))
    angles = torch.arange(200, dtype=torch.float32)[:, None] * torch.tensor(expected)  # (T, hd/2)
    torch.testing.assert_close(cos, torch.cat([angles.cos()] * 2, -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, torch.cat([-angles.sin(), angles.sin()], -1), rtol=0, atol=1e-5)


def test_qk_norm_normalises_each_heads_queries_and_keys_before_rope_and_head_dim_is_free_of_n_embd():
    model = tiny(head_dim=12, qk_norm=True, n_embd=20)  # 4 heads of 12 in a width of 20
    attn = model.blocks[0].attn
    assert attn.wq.weight.shape == (48, 20) and attn.wk.weight.shape == (24, 20) and attn.wo.weight.shape == (20, 48)
    with torch.no_grad():
        attn.q_norm.weight.normal_(1.0, 0.3), attn.k_norm.weight.normal_(1.0, 0.3)
    x, cos, sin = torch.randn(2, 10, 20), model.rope_cos[:10], model.rope_sin[:10]
    rms = lambda t, w: t / t.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * w
    q = model_det.apply_rope(rms(attn.wq(x).view(2, 10, 4, 12), attn.q_norm.weight).transpose(1, 2), cos, sin)
    k = model_det.apply_rope(rms(attn.wk(x).view(2, 10, 2, 12), attn.k_norm.weight).transpose(1, 2), cos, sin)
    v = attn.wv(x).view(2, 10, 2, 12).transpose(1, 2)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(12)
    scores = scores.masked_fill(torch.ones(10, 10).triu(1).bool(), float("-inf"))
    expected = attn.wo((scores.softmax(-1) @ v.repeat_interleave(2, dim=1)).transpose(1, 2).reshape(2, 10, -1))
    torch.testing.assert_close(attn(x, cos, sin, 0), expected, rtol=1e-5, atol=1e-5)
    idx = torch.randint(0, 50, (2, 12))
    assert torch.equal(model.generate(idx[:, :4], 8, temperature=0)[:, 4:],  # the KV cache reads the normed keys
                       torch.stack([model.generate(idx[i:i + 1, :4], 8, temperature=0)[0, 4:] for i in range(2)]))


@pytest.mark.parametrize("values, named", [
    (dict(n_embd=30), "n_embd=30"),  # 30 / 4 heads, and no head_dim of its own
    (dict(head_dim=7), "head_dim=7"),
    (dict(rope_scaling=(0.5, 1.0, 4.0, 64)), "rope_scaling="),
    (dict(rope_scaling=(8.0, 4.0, 1.0, 64)), "rope_scaling="),
    (dict(rope_scaling=(8.0, 1.0, 4.0)), "rope_scaling="),
])
def test_a_head_width_or_rope_scaling_det_cannot_compute_is_one_value_error_naming_it(values, named):
    with pytest.raises(ValueError, match=named):
        model_det.Config(**{**dict(vocab_size=50, n_head=4, n_kv_head=2, n_embd=32), **values})


def test_the_shared_building_blocks_are_the_same_text_in_the_four_model_files():
    """nanoGPT-style repetition kept honest: what the four files share reads the same in each (the Free Transformer
    changes Attention and Block, and B-Trans Block, as their papers do)."""
    import ast
    import os
    from conftest import ROOT

    def blocks(name):
        with open(os.path.join(ROOT, f"model_{name}.py")) as f:
            source = f.read()
        return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
                if isinstance(node, (ast.ClassDef, ast.FunctionDef))}

    det = blocks("det")
    shared = ["RMSNorm", "precompute_rope", "apply_rope", "KVCache", "Attention", "MLP", "sample_next_token"]
    for name in ("eve", "free", "btrans"):
        other = blocks(name)
        for block in shared:
            if (name, block) not in {("free", "Attention"), ("eve", "MLP")}:
                assert other[block] == det[block], (name, block)
