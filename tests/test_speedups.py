"""nanolatent/speedups.py, the rule of every speed-up applied from outside the model files (cpu.training_kernels,
cpu.inference_linears, eve_bank.fused_banks): an edited module (a model file changed in a copy, an nn.Linear subclass,
a patched forward, a subclass's prior) keeps its own forward, says so in one line, and is what trains; a comment
changes nothing; --kernels=plain applies nothing. And the building blocks the four model files share are one code."""

import ast
import importlib.util
import os
import shutil
import subprocess

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model_eve
from nanolatent import cpu, eve_bank, models, speedups
from conftest import ROOT, records, run_script

TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_embd=32, n_head=2, n_kv_head=1)
NORM = "        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)"


def edited(tmp_path, model_type, old, new):
    """model_<type>.py with `old` replaced by `new`, imported as a module of its own (the repository's untouched)."""
    source = open(os.path.join(ROOT, f"model_{model_type}.py")).read()
    assert source.count(old) == 1, old
    path = tmp_path / f"model_{model_type}_edited_{abs(hash(new)) % 10**6}.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(module, **overrides):
    torch.manual_seed(0)
    return module.Model(module.Config(**{**TINY, **overrides})).train()


def step(model, dtype=torch.float32):
    """The loss and every parameter's gradient of one training step on fixed tokens and noise."""
    x = torch.randint(0, 64, (3, 32), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(1)  # the same noise (EVE's eps, Free's Z) in every model compared
    model.zero_grad(set_to_none=True)
    loss = model(x, x)[1]
    loss.backward()
    return loss.item(), {n.removeprefix("_orig_mod."): p.grad.clone()  # a compiled model's names too
                         for n, p in model.named_parameters() if p.grad is not None}


def swapped(model, attr="forward"):
    return [name for name, m in model.named_modules() if attr in vars(m)]


def close(a, b, tolerance):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert abs(loss_a - loss_b) <= tolerance * abs(loss_b) and grads_a.keys() == grads_b.keys()
    for name, g in grads_b.items():
        assert (grads_a[name] - g).abs().max() <= tolerance * g.abs().max() + 1e-12, name


@pytest.mark.parametrize("model_type", ["det", "eve", "free"])
def test_an_edited_norm_keeps_its_forward_and_training_follows_the_edit_a_comment_changes_nothing(model_type,
                                                                                                 tmp_path):
    """RMSNorm.forward times 2 in a copy of the model file: no norm takes the closed-form backward, one line names the
    speed-up, the modules and the difference, and a step with the kernels equals the edited file's plain step to
    float rounding (and not the unedited file's). A comment added to the same forward: every norm takes it again."""
    plain = importlib.import_module(f"model_{model_type}")
    doubled = edited(tmp_path, model_type, NORM, NORM.replace("return F", "return 2 * F"))
    commented = edited(tmp_path, model_type, NORM, "        # a comment, no change\n" + NORM)
    reference, edit_plain = step(build(plain)), step(build(doubled))
    lines = []
    model = cpu.training_kernels(build(doubled), log=lines.append)
    norms = [n for n, m in model.named_modules() if type(m).__name__ == "RMSNorm"]
    assert norms and not set(norms) & set(swapped(model))
    assert len(lines) == 1 and "RMSNorm backward" in lines[0] and norms[0] in lines[0] and "apart" in lines[0]
    close(step(model), edit_plain, 1e-4)
    assert abs(edit_plain[0] - reference[0]) > 1e-3
    fast = cpu.training_kernels(build(commented), log=lines.append)
    assert set(norms) <= set(swapped(fast)) and len(lines) == 1  # nothing more to say
    close(step(fast), reference, 1e-4)


class LoRALinear(nn.Linear):
    """The most common research edit: W x + s B A x, B zero at the start (so only the gradients tell it apart)."""

    def __init__(self, linear, rank=4, scale=2.0):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.load_state_dict(linear.state_dict())
        self.lora_a = nn.Parameter(torch.randn(rank, linear.in_features) / linear.in_features ** 0.5)
        self.lora_b = nn.Parameter(torch.zeros(linear.out_features, rank))
        self.scale = scale

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)


def with_lora(model):
    for block in model.blocks:
        block.attn.wq, block.attn.wv = LoRALinear(block.attn.wq), LoRALinear(block.attn.wv)
    return model


@pytest.mark.skipif(not cpu.ONEDNN_CPU, reason="oneDNN's x86 kernels are not here: no linear is swapped")
def test_an_nn_linear_subclass_keeps_its_forward_in_training_and_inference():
    """A LoRA subclass of nn.Linear: training_kernels leaves it (its B takes the gradient the model file gives it, which
    oneDNN's F.linear would drop) and swaps the plain linears; inference_linears leaves it (its logits follow B) and
    on leaving the model is as before."""
    lines = []
    model = with_lora(build(importlib.import_module("model_det")))
    lora = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    reference = step(model)
    cpu.training_kernels(model, log=lines.append)
    assert not set(lora) & set(swapped(model)) and "blocks.0.mlp.w1" in swapped(model)
    assert [line.split(":")[0] for line in lines] == ["cpu.training_kernels (oneDNN linears)"]
    assert "LoRALinear" in lines[0] and lora[0] in lines[0] and "3 more" in lines[0]
    fast = step(model)
    close(fast, reference, 1e-4)
    assert fast[1]["blocks.0.attn.wq.lora_b"].abs().max() > 0
    model.eval()
    with torch.no_grad():
        for name in lora:
            model.get_submodule(name).lora_b.normal_()
        x = torch.randint(0, 64, (2, 16))
        before, forwards = model(x, x)[0], {n: m.forward for n, m in model.named_modules()}
        with cpu.inference_linears(model, min_weights=0, log=lines.append):
            assert not {n for n in lora if model.get_submodule(n).forward != forwards[n]}
            assert model.blocks[0].mlp.w1.forward != forwards["blocks.0.mlp.w1"]
            torch.testing.assert_close(model(x, x)[0], before, rtol=1e-5, atol=1e-5)
        assert torch.equal(model(x, x)[0], before)
        assert all(m.forward == forwards[n] for n, m in model.named_modules())
    assert lines[-1].startswith("cpu.inference_linears: blocks.0.attn.wq (LoRALinear) and 3 more keep their own")


def test_a_patched_forward_keeps_it_and_gets_it_back_on_leaving_inference_linears():
    linear = nn.Linear(256, 256, bias=False)
    patch = linear.forward = lambda x: 2 * F.linear(x, linear.weight)
    lines = []
    cpu.training_kernels(linear, log=lines.append)
    assert linear.forward is patch
    with torch.no_grad(), cpu.inference_linears(linear, min_weights=0, log=lines.append):
        assert linear.forward is patch
    assert linear.forward is patch and linear.weight.numel() == 256 * 256
    assert len(lines) == cpu.ONEDNN_CPU + torch.backends.mkldnn.is_available()
    assert all("the model (Linear) keeps its own forward: it computes otherwise" in line for line in lines)


def test_a_float64_model_trains_through_the_kernels_to_float64_rounding():
    """RMSNormFunction in the input's precision (float32 at least): a float64 det's step within 1e-12 of the plain
    file's, every norm swapped."""
    det = importlib.import_module("model_det")
    reference = step(build(det).double())
    model = cpu.training_kernels(build(det).double())
    assert {n for n, m in model.named_modules() if isinstance(m, det.RMSNorm)} <= set(swapped(model))
    close(step(model), reference, 1e-12)


@pytest.mark.parametrize("model_type", ["det", "eve", "free", "btrans"])
def test_kernels_plain_applies_no_speed_up_and_fast_swaps_every_module_of_the_plain_files(model_type, monkeypatch):
    """--kernels=plain (speedups.use): no module swapped, nothing said. 'fast' on the model files as they are: every
    nn.Linear (with oneDNN) and every RMSNorm, and EVE's every bank, in float32 and float64; B-Trans's norms (a
    forward(x, eps)) keep theirs, in one line."""
    monkeypatch.setattr(speedups, "enabled", True)
    lines = []
    speedups.use("plain")
    model = models.build_model(model_type, TINY)
    eve_bank.fused_banks(cpu.training_kernels(model, log=lines.append), log=lines.append)
    with cpu.inference_linears(model, min_weights=0, log=lines.append):
        assert not swapped(model) and not swapped(model, "bank") and not lines
    speedups.use("fast")
    for dtype in (torch.float32, torch.float64):
        model = models.build_model(model_type, TINY).to(dtype)
        eve_bank.fused_banks(cpu.training_kernels(model, log=lines.append), log=lines.append)
        expected = {n for n, m in model.named_modules() if type(m).__name__ == "RMSNorm"
                    or cpu.ONEDNN_CPU and isinstance(m, nn.Linear)}
        assert expected and set(swapped(model)) == expected
        assert len(swapped(model, "bank")) == (TINY["n_layer"] if model_type == "eve" else 0)
    assert lines == (2 * ["cpu.training_kernels (RMSNorm backward): blocks.0.attn_norm (BayesianBiasNorm) and 4 more "
                          "keep their own forward: its forward takes (x, eps), not the 1 argument(s) the probe covers"]
                     if model_type == "btrans" else [])


class HalfStepPrior(model_eve.VariationalMLP):
    """A subclass's prior: mu_p(t) = alpha mu_p(t-1) + b e(t-1) / 2."""

    def prior_mean(self, e, mu_p=None):
        return super().prior_mean(e / 2, mu_p)


BANK = "        y = F.silu((z * self.dec_gain.view(D)).view(B, T, N, -1).sum(-1) + self.dec_bias)"


def test_an_edited_bank_prior_or_scan_keeps_its_own_bank_and_training_follows(tmp_path, monkeypatch):
    """EVE: a subclass overriding prior_mean, the decoder's silu made a gelu in a copy of model_eve.py, model_eve.scan
    replaced: the fused bank steps aside (one line each), and the step equals the edited plain model's to float
    rounding (and its gradients not the unedited model's). A comment in prior_mean's source: every bank fused."""
    gelu = edited(tmp_path, "eve", BANK, BANK.replace("F.silu", "F.gelu"))
    commented = edited(tmp_path, "eve", "        alpha, b = torch.tanh(self.ar_a), self.ar_b  # (D,) each",
                       "        # a comment, no change\n        alpha, b = torch.tanh(self.ar_a), self.ar_b")
    sub = build(model_eve)
    for block in sub.blocks:
        block.mlp.__class__ = HalfStepPrior
    scan = model_eve.scan
    cases = {"subclass": (sub, lambda: None), "file": (build(gelu), lambda: None),
             "scan": (build(model_eve), lambda: monkeypatch.setattr(model_eve, "scan", lambda x, a: scan(x, a) / 2))}
    reference = step(build(model_eve))
    for case, (model, edit) in cases.items():
        edit()
        lines, plain = [], step(model)
        eve_bank.fused_banks(model, log=lines.append)
        assert not swapped(model, "bank"), case
        assert len(lines) == 1 and lines[0].startswith("eve_bank.fused_banks: blocks.0.mlp (") and "1 more" in lines[0]
        close(step(model), plain, 1e-5)
        assert max((plain[1][n] - g).abs().max() / g.abs().max() for n, g in reference[1].items()) > 1e-2, case
    monkeypatch.undo()
    model = eve_bank.fused_banks(build(commented), log=pytest.fail)
    assert swapped(model, "bank") == ["blocks.0.mlp", "blocks.1.mlp"]
    close(step(model), reference, 1e-5)


# The building blocks every model file repeats (model_det.py's section "Building blocks"), and the Model methods they
# share; what a paper changes is listed: Free's attention reads a latent-free encoder too, EVE's caches hold its prior.
SHARED = ("RMSNorm", "precompute_rope", "apply_rope", "KVCache", "Attention", "MLP", "sample_next_token",
          "Model._init_weights", "Model.num_params", "Model.setup_kv_cache", "Model.clear_kv_cache",
          "Model.repeat_kv_cache", "Model.configure_optimizers")
DIFFERS = {("free", "Attention"), ("eve", "Model.setup_kv_cache"), ("eve", "Model.clear_kv_cache")}


def definitions(model_type):
    tree = ast.parse(open(os.path.join(ROOT, f"model_{model_type}.py")).read())
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = ast.dump(node)
        if isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{f.name}": ast.dump(f) for f in node.body if isinstance(f, ast.FunctionDef)})
    return found


@pytest.mark.parametrize("model_type", ["eve", "free", "btrans"])
def test_the_building_blocks_repeat_model_det_verbatim_but_for_what_the_paper_changes(model_type):
    """Compared by syntax tree (comments and docstrings' wrapping aside, docstrings included): the blocks listed in
    SHARED are det's, except the differences DIFFERS lists, which do differ."""
    det, other = definitions("det"), definitions(model_type)
    for name in SHARED:
        assert (other[name] != det[name]) == ((model_type, name) in DIFFERS), name


@pytest.mark.slow
def test_train_py_trains_an_edited_model_file_as_edited_and_kernels_plain_agrees(data_root, tmp_path):
    """train.py in a copy of the repository whose model_det.py doubles RMSNorm's output: its losses are not the
    unedited file's, equal --kernels=plain's to float rounding, and the run names the speed-up that stepped aside."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    copy = tmp_path / "repo"
    for name in files:
        if name.endswith(".py"):
            os.makedirs(copy / os.path.dirname(name), exist_ok=True)
            shutil.copy(os.path.join(ROOT, name), copy / name)
    source = (copy / "model_det.py").read_text()
    (copy / "model_det.py").write_text(source.replace(NORM, NORM.replace("return F", "return 2 * F")))
    args = ("train.py", "--model_type=det", "--max_iters=4", "--eval_interval=4", "--log_interval=1")
    losses = {}
    for name, cwd, extra in (("unedited", ROOT, ()), ("fast", copy, ()), ("plain", copy, ("--kernels=plain",))):
        proc = run_script(*args, *extra, f"--out_dir={tmp_path / name}", data_dir=data_root, cwd=cwd)
        losses[name] = [r["loss"] for r in records(tmp_path / name) if "loss" in r]
        assert ("RMSNorm backward): blocks.0.attn_norm (RMSNorm)" in proc.stdout) == (name == "fast"), proc.stdout
    assert len(losses["fast"]) == 4 and losses["fast"] == pytest.approx(losses["plain"], rel=1e-4)
    assert all(abs(a - b) > 1e-3 for a, b in zip(losses["fast"], losses["unedited"]))


@pytest.mark.slow
def test_under_compile_an_edited_bank_trains_as_edited_and_the_model_files_bank_fused(tmp_path):
    """train.py applies fused_banks before torch.compile: an edited bank (its decoder a gelu) stays the model file's
    and the compiled step equals its eager plain step; the bank as model_eve.py has it is fused and compiles to the
    plain step's loss and gradients (fallback_random: eager's noise)."""
    import torch._inductor.config as inductor_config
    gelu = edited(tmp_path, "eve", BANK, BANK.replace("F.silu", "F.gelu"))
    for module, fused in ((gelu, False), (model_eve, True)):
        eager = step(build(module))
        model = eve_bank.fused_banks(build(module), log=None)
        assert bool(swapped(model, "bank")) == fused
        with inductor_config.patch(fallback_random=True):
            close(step(torch.compile(model)), eager, 1e-4)
