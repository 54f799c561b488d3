"""cpu.py, the CPU speed the scripts apply from outside the model files: each swap computes what the plain model
computes (float64 or the model's own forward as the reference), and glibc keeps freed memory for the next step."""

import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nanolatent import cpu, models
from conftest import ROOT

TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_embd=32, n_head=2, n_kv_head=1)


def test_rms_norm_backward_in_closed_form_equals_torch_rms_norm_exactly_and_its_gradients_to_float_rounding():
    """cpu.training_kernels' RMSNorm (RMSNormFunction, closed-form backward): values equal F.rms_norm's exactly,
    both gradients equal autograd's through F.rms_norm to 1e-6 of their largest magnitude (measured: 1.2e-7)."""
    import model_det
    norm = cpu.training_kernels(model_det.RMSNorm(48))
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(4, 16, 48) * 3).requires_grad_()
    g = torch.randn(4, 16, 48)
    ours = norm(x)
    assert type(ours.grad_fn).__name__ == "RMSNormFunctionBackward"
    ours.backward(g)
    x_ref, w_ref = x.detach().clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    ref = F.rms_norm(x_ref, (48,), w_ref, norm.eps)
    ref.backward(g)
    assert torch.equal(ours, ref)
    for a, b in ((x.grad, x_ref.grad), (norm.weight.grad, w_ref.grad)):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def onednn_or_skip():
    if not cpu.ONEDNN_CPU:
        pytest.skip("oneDNN's x86 kernels are not here: training_kernels leaves nn.Linear as it is")


def test_linear_in_cpu_training_runs_onednn_and_equals_f_linear_to_float_rounding():
    """training_kernels' nn.Linear: with gradients, LinearFunction (oneDNN's products); its output and the gradients
    of input, weight and bias equal float64 F.linear's to 1e-6 of their largest magnitude (measured: 1-2e-7,
    float32 rounding). No gradient is computed for what does not need one (a frozen weight)."""
    onednn_or_skip()
    torch.manual_seed(0)
    linear = cpu.training_kernels(torch.nn.Linear(96, 40, bias=True))
    x = torch.randn(3, 17, 96, requires_grad=True)
    g = torch.randn(3, 17, 40)
    y = linear(x)
    assert type(y.grad_fn).__name__ == "LinearFunctionBackward"
    y.backward(g)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, linear.weight, linear.bias))
    y64 = F.linear(x64, w64, b64)
    y64.backward(g.double())
    for ours, ref in ((y, y64), (x.grad, x64.grad), (linear.weight.grad, w64.grad), (linear.bias.grad, b64.grad)):
        assert (ours.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    x.grad = linear.weight.grad = linear.bias.grad = None
    linear.weight.requires_grad_(False)
    linear(x).backward(g)
    assert linear.weight.grad is None and x.grad is not None and linear.bias.grad is not None


def test_linear_without_gradients_or_under_autocast_is_f_linear_exactly():
    """Inference and CPU autocast (bfloat16 products) take F.linear inside training_kernels."""
    onednn_or_skip()
    linear = cpu.training_kernels(torch.nn.Linear(32, 8, bias=False))
    x = torch.randn(4, 32, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(linear(x), F.linear(x, linear.weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x)
        assert y.dtype == torch.bfloat16 and type(y.grad_fn).__name__ != "LinearFunctionBackward"
        assert torch.equal(y, F.linear(x, linear.weight))


@pytest.mark.parametrize("model_type", ["det", "btrans", "eve", "free"])
def test_training_kernels_give_every_model_its_plain_loss_and_gradients_to_float_rounding(model_type):
    """A training step of each model with cpu.training_kernels (as train.py applies them on a CPU) against the same
    model without: the loss within 1e-5 and every gradient within 1e-4 of its largest magnitude (another summation
    order; measured: 1e-7 and 1e-6), the same parameters, state dict keys and checkpoint."""
    def step(model):
        torch.manual_seed(1)  # the same noise draws (EVE's eps, Free's Z) in both
        model.zero_grad(set_to_none=True)
        _, loss, _ = model(x, y)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    torch.manual_seed(0)
    model = models.build_model(model_type, TINY).train()
    x, y = torch.randint(0, 64, (3, 32)), torch.randint(0, 64, (3, 32))
    keys = list(model.state_dict())
    loss, grads = step(model)
    cpu.training_kernels(model)
    assert any("forward" in vars(m) for m in model.modules())
    loss_fast, grads_fast = step(model)
    assert abs(loss_fast - loss) <= 1e-5 * abs(loss)
    assert grads_fast.keys() == grads.keys() and list(model.state_dict()) == keys
    for name, grad in grads.items():
        assert (grads_fast[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-9, name


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("batch_size", [None, 1])
@pytest.mark.parametrize("model_type", ["det", "btrans", "eve", "free"])
def test_inference_linears_give_eager_logits_and_tokens_and_restore_the_model(model_type, batch_size):
    """cpu.inference_linears (sample.py's CPU decoding), in oneDNN's layout and in the one-sequence, one-thread
    matrix-vector layout: every model's logits within float rounding of F.linear's, the same greedy tokens with
    pinned latents, the plain weights released inside, and on leaving, the modules' own forward and weights back
    (bit-equal logits)."""
    torch.manual_seed(0)
    model = models.build_model(model_type, {**TINY, "n_layer": 4}).eval()
    x = torch.randint(0, 64, (3, 20))
    latents = model.sample_latents(3, torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            before = model(x, x, latents=latents)[0]
            tokens = model.generate(x[:, :5], 12, temperature=0, latents=latents)
            with cpu.inference_linears(model, batch_size=batch_size, min_weights=0):
                inside = model(x, x, latents=latents)[0]
                assert torch.equal(model.generate(x[:, :5], 12, temperature=0, latents=latents), tokens)
                linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
                assert "forward" in vars(linear)  # the new call is in place, so the comparison above compares it
                # a called, untied weight is held once, laid out; a tied head's stays (the embedding reads it)
                assert model.blocks[0].attn.wq.weight.numel() == 0
                wide = next(m for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)
                            and m.out_features > m.in_features)  # column-major in the vector layout
                assert wide.weight.numel() == 0
                assert model.lm_head.weight.shape == model.tok_emb.weight.shape
            after = model(x, x, latents=latents)[0]
    finally:
        torch.set_num_threads(threads)
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(after, before)
    assert all(p.is_contiguous() for p in model.parameters())
    torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_inference_linears_leave_small_linears_to_f_linear():
    """A Linear of fewer than min_weights weights (2^16 by default) keeps its own forward, F.linear bit for bit;
    a larger one is laid out (its plain weight released inside), within float rounding of F.linear."""
    torch.manual_seed(0)
    small, large = torch.nn.Linear(64, 512), torch.nn.Linear(512, 512)  # 32,768 and 262,144 weights
    model = torch.nn.Sequential(small, large).eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = small(x), model(x)
        with cpu.inference_linears(model):
            assert "forward" not in vars(small) and "forward" in vars(large)
            inside = small(x), model(x)
            assert large.weight.numel() == 0 and small.weight.shape == (512, 64)
    assert torch.equal(inside[0], before[0])
    torch.testing.assert_close(inside[1], before[1], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="this CPU or torch build has no oneDNN bfloat16 kernels")
@pytest.mark.parametrize("model_type", ["det", "btrans", "eve", "free"])
def test_inference_linears_on_bfloat16_weights_pack_them_as_they_are(model_type):
    """sample.py --dtype=bfloat16 on a CPU: the model's weights in bfloat16, packed for oneDNN as they are (released
    inside, no float32 copy): logits within bfloat16 rounding of F.linear's on the same weights, the same greedy
    tokens, and on leaving, the bfloat16 weights back bit for bit."""
    torch.manual_seed(0)
    model = models.build_model(model_type, {**TINY, "n_layer": 4}).eval().to(torch.bfloat16)
    x = torch.randint(0, 64, (3, 20))
    latents = model.sample_latents(3, torch.Generator().manual_seed(1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(x, x, latents=latents)[0]
        with cpu.inference_linears(model, torch.bfloat16, batch_size=1, min_weights=0):
            inside = model(x, x, latents=latents)[0]
            assert model.blocks[0].attn.wq.weight.numel() == 0
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert inside.dtype == torch.bfloat16
    torch.testing.assert_close(inside.float(), before.float(), rtol=0.02, atol=0.02)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", ["det", "btrans", "eve", "free"])
def test_inference_linears_under_autocast_give_autocasts_logits_and_restore_the_model(model_type, dtype):
    """evaluate.py --dtype=bfloat16/float16 on a CPU: inside cpu.inference_linears(model, dtype) and autocast, the
    logits are autocast's own to the dtype's rounding. bfloat16 runs through oneDNN where it has the kernels (its
    packed copies beside the float32 weights); float16, which oneDNN lacks on CPUs without AVX512-FP16, through
    autocast's kernels, every module left as it is. On leaving, the float32 model is as before, bit for bit."""
    torch.manual_seed(0)
    model = models.build_model(model_type, {**TINY, "n_layer": 4}).eval()
    x = torch.randint(0, 64, (3, 20))
    latents = model.sample_latents(3, torch.Generator().manual_seed(1))
    packs = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
             torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}[dtype]
    linear = model.blocks[0].attn.wq
    with torch.no_grad():
        before = model(x, x, latents=latents)[0]
        with torch.autocast("cpu", dtype=dtype):
            plain = model(x, x, latents=latents)[0]
        with cpu.inference_linears(model, dtype, min_weights=0), torch.autocast("cpu", dtype=dtype):
            inside = model(x, x, latents=latents)[0]
            assert ("forward" in vars(linear)) == packs and linear.weight.dtype == torch.float32
        after = model(x, x, latents=latents)[0]
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(after, before)
    torch.testing.assert_close(inside.float(), plain.float(), rtol=0.05, atol=0.05)


STEP_OF_FREES = """
import ctypes, resource, sys, torch
sys.path.insert(0, sys.argv[1])
from nanolatent import cpu
if sys.argv[2] == "keep":
    kept = cpu.keep_freed_memory()
else:  # the control: glibc's starting mmap threshold, 128 KiB, held fixed: every large block unmapped when freed
    kept = ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10) == 1  # M_MMAP_THRESHOLD
def step():  # a training step's pattern: activations allocated, used for gradients, freed, allocated again next step
    acts = [torch.ones(n) for n in (2 << 20, 3 << 19, 2 << 20, 5 << 18)]  # 8, 6, 8 and 5 MB
    grads = [a * 2 for a in reversed(acts)]
    del acts
    return sum(float(g.sum()) for g in grads)
step()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
def test_kept_freed_memory_is_reused_without_page_faults():
    """cpu.keep_freed_memory(), which train.py calls on a CPU: once two steps have touched their memory, the next
    ones reuse it (0-7,400 faults in 20 steps, measured: a block placed anew now and then). The control, glibc's
    starting mmap threshold held fixed, faults on every page of the 54 MB every step (13,800 pages a step, 276,640 in
    20), which shows the count sees what it is meant to. glibc's own adaptive thresholds fall anywhere between the two
    (measured 9,952 to 275,840, by the number of threads), so they make no control. In child processes: the setting
    holds for the whole process."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip(f"keep_freed_memory sets glibc's malloc, absent here ({platform.libc_ver()[0] or 'no glibc'})")
    out = {mode: subprocess.run([sys.executable, "-c", STEP_OF_FREES, ROOT, mode], capture_output=True, text=True,
                                check=True).stdout.split() for mode in ("keep", "unmap")}
    assert out["keep"][0] == out["unmap"][0] == "True", out
    pages = 20 * 13_800
    assert int(out["keep"][1]) < pages // 10, out  # under 10% of the steps' pages
    assert int(out["unmap"][1]) > pages * 9 // 10, out
