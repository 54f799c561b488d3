"""--optimizer=muon (nanolatent/optim.py): which parameters Muon trains, its state saved and restored exactly, and
train.py's runs with it: resumed, under DDP, refused under FSDP."""

import copy
import os
import re
import sys

import pytest
import torch

from conftest import FORKRUN, TINY, records, run_script, train_det

from nanolatent import models, optim

SMALL = {"vocab_size": 11, "block_size": 16, "n_layer": 2, "n_embd": 32, "n_head": 2, "n_kv_head": 1}
# The blocks' matrices by name: attention's four projections and the MLP's matrices (EVE's w_mu, w_logvar, w2), in
# the decoder's blocks and the Free Transformer's encoder block.
HIDDEN = re.compile(r"^(blocks\.\d+|encoder)\.(attn\.w[qkvo]|mlp\.w\w*)\.weight$")


def groups_by_name(model, optimizer):
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


@pytest.mark.parametrize("model_type,extra", [("det", {}), ("eve", {}), ("free", {}), ("btrans", {}),
                                              ("btrans", {"learn_mu": True})])
def test_every_trained_parameter_is_in_one_group_and_muon_gets_exactly_the_blocks_matrices(model_type, extra):
    torch.manual_seed(0)
    model = models.build_model(model_type, {**SMALL, **extra})
    optimizer = optim.MuonAdamW(model, 0.1, 1e-3, 0.02, (0.9, 0.95), "cpu")
    muon, *adamw = groups_by_name(model, optimizer)
    every = [name for group in (muon, *adamw) for name in group]
    trained = [name for name, p in model.named_parameters() if p.requires_grad]  # B-Trans's mu: frozen by default
    assert sorted(every) == sorted(trained)  # each once (a tied head once)
    assert muon == [name for name in trained if HIDDEN.match(name)]
    assert len(muon) >= 7 * SMALL["n_layer"]
    shapes = dict((name, p.shape) for name, p in model.named_parameters())
    assert all(len(shapes[name]) >= 2 for name in adamw[0]) and all(len(shapes[name]) < 2 for name in adamw[1])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1, 0.0]
    assert [g["lr_scale"] for g in optimizer.param_groups] == [20.0, 1.0, 1.0]


def test_a_frozen_embedding_is_in_no_group():
    model = models.build_model("det", SMALL)
    model.tok_emb.weight.requires_grad_(False)
    optimizer = optim.MuonAdamW(model, 0.1, 1e-3, 0.02, (0.9, 0.95), "cpu")
    assert "tok_emb.weight" not in [name for group in groups_by_name(model, optimizer) for name in group]


def test_adamw_is_the_models_own_configure_optimizers():
    model = models.build_model("det", SMALL)
    ours = optim.build("adamw", model, 0.1, 1e-3, 0.02, (0.9, 0.95), "cpu")
    theirs = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    assert type(ours) is torch.optim.AdamW
    assert groups_by_name(model, ours) == groups_by_name(model, theirs)


def steps(model, optimizer, n, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        idx = torch.randint(0, SMALL["vocab_size"], (4, SMALL["block_size"]), generator=generator)
        model(idx, idx)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("model_type", ["det", "free"])
def test_a_restored_state_dict_continues_exactly_as_the_uninterrupted_optimizer(model_type):
    torch.manual_seed(0)
    model = models.build_model(model_type, SMALL)
    optimizer = optim.MuonAdamW(model, 0.1, 1e-3, 0.02, (0.9, 0.95), "cpu")
    steps(model, optimizer, 2, seed=1)
    restored = copy.deepcopy(model)
    state = copy.deepcopy(optimizer.state_dict())
    again = optim.MuonAdamW(restored, 0.1, 1e-3, 0.02, (0.9, 0.95), "cpu")
    again.load_state_dict(state)
    assert len(again.muon.state) == len(optim.muon_params(restored))  # the momentum buffers came back
    torch.manual_seed(2)
    steps(model, optimizer, 2, seed=3)
    torch.manual_seed(2)
    steps(restored, again, 2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values()))


@pytest.mark.slow
def test_a_resumed_muon_run_equals_the_uninterrupted_run_bit_for_bit(data_root, tmp_path):
    full, part, adamw = tmp_path / "full", tmp_path / "part", tmp_path / "adamw"
    args = ["--max_iters=8", "--eval_interval=4", "--always_save_checkpoint=True"]
    train_det(data_root, full, *args, "--optimizer=muon")
    train_det(data_root, part, "--max_iters=4", "--eval_interval=4", "--always_save_checkpoint=True",
              "--optimizer=muon")
    train_det(data_root, part, *args, "--init_from=resume")  # the checkpoint's optimizer, without the flag
    train_det(data_root, adamw, *args)
    loss = lambda out: [(r["iter"], r["loss"]) for r in records(out) if "loss" in r]
    assert loss(part) == loss(full) and len(loss(full)) == 8
    assert loss(adamw)[0] == loss(full)[0] and loss(adamw)[1:] != loss(full)[1:]  # same start, another optimizer
    a, b = (torch.load(p / "ckpt.pt", weights_only=True) for p in (full, part))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["config"]["optimizer"] == b["config"]["optimizer"] == "muon"
    momentum = [s["momentum_buffer"] for s in b["optimizer"]["muon"]["state"].values()]
    assert len(momentum) == 7 * 2 and all(m.abs().sum() > 0 for m in momentum)


@pytest.mark.slow
def test_a_run_saved_before_the_optimizer_setting_resumes_with_adamw(data_root, tmp_path):
    """A checkpoint whose config has no "optimizer" (written before the setting existed) continues as the
    uninterrupted AdamW run."""
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["--max_iters=8", "--eval_interval=4", "--always_save_checkpoint=True"]
    train_det(data_root, full, *args)
    train_det(data_root, part, "--max_iters=4", "--eval_interval=4", "--always_save_checkpoint=True")
    saved = os.path.realpath(part / "ckpt.pt")
    checkpoint = torch.load(saved, weights_only=True)
    del checkpoint["config"]["optimizer"]
    torch.save(checkpoint, saved)
    train_det(data_root, part, *args, "--init_from=resume")
    loss = lambda out: [(r["iter"], r["loss"]) for r in records(out) if "loss" in r]
    assert loss(part) == loss(full) and len(loss(full)) == 8
    assert torch.load(part / "ckpt.pt", weights_only=True)["config"]["optimizer"] == "adamw"


@pytest.mark.slow
def test_frozen_embeddings_stay_frozen_over_two_resumes(data_root, tmp_path):
    """The run's freeze_embeddings is saved again at every resume, so a second resume builds the optimizer the
    checkpoint's state was made for: the same run as the uninterrupted one."""
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["--eval_interval=2", "--always_save_checkpoint=True"]
    train_det(data_root, full, "--max_iters=6", *args, "--freeze_embeddings=True")
    train_det(data_root, part, "--max_iters=2", *args, "--freeze_embeddings=True")
    for end in (4, 6):
        train_det(data_root, part, f"--max_iters={end}", *args, "--init_from=resume")
    loss = lambda out: [(r["iter"], r["loss"]) for r in records(out) if "loss" in r]
    assert loss(part) == loss(full) and len(loss(full)) == 6
    a, b = (torch.load(p / "ckpt.pt", weights_only=True) for p in (full, part))
    assert b["config"]["freeze_embeddings"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.slow
def test_two_process_ddp_with_muon_gives_the_weights_of_one_process_with_the_same_micro_batches(data_root, tmp_path):
    args = ["--max_iters=3", "--eval_interval=3", "--always_save_checkpoint=True", "--gradient_accumulation_steps=2",
            "--optimizer=muon"]
    train_det(data_root, tmp_path / "single", *args)
    run_script(FORKRUN, "--nproc_per_node=2", "train.py", "--model_type=det",
               f"--out_dir={tmp_path / 'ddp'}", *TINY, *args, data_dir=data_root)
    a, b = (torch.load(tmp_path / d / "ckpt.pt", weights_only=True)["model"] for d in ("single", "ddp"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.slow
def test_muon_under_fsdp_is_refused_in_one_line_before_anything_is_written(data_root, tmp_path):
    proc = run_script(sys.executable, FORKRUN, "--nproc_per_node=2", "train.py", "--model_type=det",
                      f"--out_dir={tmp_path / 'run'}", *TINY, "--fsdp=True", "--optimizer=muon", "--gradient_accumulation_steps=2",
                      data_dir=data_root,
                      check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) >= 1 and all("optimizer=muon" in line and "fsdp" in line
                                                             for line in errors)
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
