"""--optimizer=muon (nanolatent/optim.py): which parameters Muon trains, its Newton-Schulz against torch.optim.Muon's in
both precisions, its state saved and restored exactly, and train.py's runs with it: resumed, under DDP and FSDP; the
warmup-stable-decay schedule."""

import copy
import math
import os
import re
import types

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import FORKRUN, TINY, records, run_script, train_det

from nanolatent import ckpt, models, optim

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
    assert [g["muon"] for g in optimizer.param_groups] == [True, False, False]


def momentum_like(shape, seed):
    """A matrix with a spread spectrum, as a momentum is: a few strong directions over a noise floor."""
    generator = torch.Generator().manual_seed(seed)
    strong = torch.randn(shape[0], 4, generator=generator) @ torch.randn(4, shape[1], generator=generator)
    return strong + 0.3 * torch.randn(*shape, generator=generator)


@pytest.mark.parametrize("shape", [(32, 32), (128, 32), (32, 96), (5, 40)])
def test_newton_schulz_in_bfloat16_is_torchs_and_in_float32_orthogonalises_into_the_same_band(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz
    G = momentum_like(shape, seed=sum(shape))
    theirs = _zeropower_via_newtonschulz(G, optim.NS_COEFFICIENTS, 5, 1e-7)
    assert torch.equal(optim.orthogonalize(G, torch.bfloat16), theirs)
    ours = optim.orthogonalize(G, torch.float32)
    assert ours.dtype == torch.float32 and ours.shape == G.shape
    s_theirs, s_ours = torch.linalg.svdvals(theirs.float()), torch.linalg.svdvals(ours)
    # Keller Jordan's quintic brings G's singular values, spread over more than 10x, into about [0.7, 1.2]; five
    # steps leave the very smallest (a square matrix's noise floor) below it, in both precisions alike
    assert torch.linalg.svdvals(G).max() / torch.linalg.svdvals(G).min() > 10
    for s in (s_ours, s_theirs):
        assert s.max() < 1.25 and (s > 0.6).float().mean() > 0.9
    assert (s_ours - s_theirs).abs().max() < 0.03  # the same values up to bfloat16's rounding (8 bits)
    assert (ours - theirs.float()).norm() / ours.norm() < 0.03  # and the same directions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(32, 32), (96, 32), (32, 96)])
def test_a_stack_of_matrices_orthogonalises_each_as_alone_bit_for_bit(shape, dtype):
    """MuonAdamW orthogonalises the matrices of one shape as one stack (one batched product): each comes out as it
    would alone, in bfloat16 torch's own iteration's bits."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    stack = torch.stack([momentum_like(shape, seed) for seed in range(3)])
    together = optim.orthogonalize(stack, dtype)
    assert together.shape == stack.shape and together.dtype == dtype
    for G, ours in zip(stack, together):
        assert torch.equal(ours, optim.orthogonalize(G, dtype))
        if dtype == torch.bfloat16:
            assert torch.equal(ours, _zeropower_via_newtonschulz(G, optim.NS_COEFFICIENTS, 5, 1e-7))


def test_in_bfloat16_the_optimizer_steps_as_torchs_muon_and_adamw_bit_for_bit():
    torch.manual_seed(0)
    model = models.build_model("det", SMALL)
    twin = copy.deepcopy(model)
    ours = optim.MuonAdamW(model, 0.1, 1e-3, 0.02, (0.9, 0.95), "cpu", ns_dtype=torch.bfloat16)
    hidden = optim.muon_params(twin)
    rest = [p for p in twin.parameters() if all(p is not q for q in hidden)]
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2]},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    steps(model, ours, 3, seed=1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):  # steps() for the pair
        idx = torch.randint(0, SMALL["vocab_size"], (4, SMALL["block_size"]), generator=generator)
        twin(idx, idx)[1].backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_a_muon_save_of_two_optimizers_resumes_into_one_as_it_would_have_continued():
    """A Muon run saved before 2026-11-29 holds torch's Muon and AdamW side by side (the state of the b14c7e4 tree's
    MuonAdamW, its groups carrying lr_scale): optim.one_state makes it one state, and the optimizer that loads it
    (bfloat16 Newton-Schulz, as torch's) continues bit for bit as the two would have."""
    torch.manual_seed(0)
    model = models.build_model("det", SMALL)
    twin = copy.deepcopy(model)
    hidden = optim.muon_params(model)
    rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
    muon = torch.optim.Muon([{"params": hidden, "lr_scale": 20.0}], lr=0.02, weight_decay=0.1, momentum=0.95,
                            nesterov=True)
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1, "lr_scale": 1.0},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 1.0}],
                              lr=1e-3, betas=(0.9, 0.95), fused=True)
    pair = types.SimpleNamespace(step=lambda: (muon.step(), adamw.step()),
                                 zero_grad=lambda set_to_none: (muon.zero_grad(), adamw.zero_grad()))
    steps(model, pair, 2, seed=1)
    saved = copy.deepcopy({"muon": muon.state_dict(), "adamw": adamw.state_dict()})
    twin.load_state_dict(model.state_dict())
    ours = optim.MuonAdamW(twin, 0.1, 1e-3, 0.02, (0.9, 0.95), "cpu", ns_dtype=torch.bfloat16)
    ours.load_state_dict(optim.one_state(saved, ours))
    assert [g["lr_scale"] for g in ours.param_groups] == [20.0, 1.0, 1.0] and len(ours.state) == len(hidden + rest)
    steps(model, pair, 2, seed=3)
    steps(twin, ours, 2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_the_newton_schulz_precision_is_the_machines_fast_one_and_said():
    has_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert optim.fast_ns_dtype("cpu")[0] == (torch.bfloat16 if has_bf16 else torch.float32)
    assert optim.fast_ns_dtype("cuda")[0] == torch.bfloat16
    model = models.build_model("det", SMALL)
    line = optim.MuonAdamW(model, 0.1, 1e-3, 0.02, (0.9, 0.95), "cpu").describe()
    weights = sum(p.numel() for p in optim.muon_params(model))
    assert f"Muon on {weights:,} hidden-matrix weights" in line
    assert ("in bfloat16: this CPU has bfloat16" if has_bf16 else "in float32: this CPU has no bfloat16") in line
    forced = optim.MuonAdamW(model, 0.1, 1e-3, 0.02, (0.9, 0.95), "cpu", ns_dtype=torch.bfloat16)
    assert "in bfloat16: muon_dtype" in forced.describe()


@pytest.mark.slow
def test_float32_newton_schulz_trains_to_the_loss_of_bfloat16_within_seed_noise():
    """A short in-process training of a small model on a peaked bigram source, 3 seeds per precision: the mean final
    loss of float32 within the seeds' spread of bfloat16's, and both far below the start."""
    config = {**SMALL, "vocab_size": 16, "block_size": 32}
    source = torch.Generator().manual_seed(99)
    table = torch.softmax(3 * torch.randn(16, 16, generator=source), dim=-1)
    bank = [torch.randint(0, 16, (1024,), generator=source)]
    for _ in range(32):
        bank.append(torch.multinomial(table[bank[-1]], 1, generator=source).squeeze(1))
    bank = torch.stack(bank, 1)  # (1024, 33): sequences of the source

    def final_loss(dtype, seed):
        torch.manual_seed(seed)
        model = models.build_model("det", config)
        opt = optim.MuonAdamW(model, 0.0, 3e-3, 0.03, (0.9, 0.95), "cpu", ns_dtype=dtype)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(40):
            idx = bank[torch.randint(0, len(bank), (16,), generator=generator)]
            loss = model(idx[:, :-1], idx[:, 1:])[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.item()

    bf16 = [final_loss(torch.bfloat16, seed) for seed in range(3)]
    fp32 = [final_loss(torch.float32, seed) for seed in range(3)]
    entropy = -(table * table.log()).sum(-1).mean().item()
    assert max(bf16 + fp32) < math.log(16) - 0.8 and min(bf16 + fp32) > entropy - 0.05
    spread = max(bf16) - min(bf16)
    assert abs(sum(fp32) / 3 - sum(bf16) / 3) < spread + 0.02, (bf16, fp32)


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
    hidden = optim.muon_params(restored)
    assert all(set(again.state[p]) == {"momentum_buffer"} for p in hidden)  # the momentum buffers came back
    assert len(again.state) == len(optimizer.state) > len(hidden)
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
    momentum = [s["momentum_buffer"] for s in b["optimizer"]["state"].values() if "momentum_buffer" in s]
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


def fsdp_state(out_dir, tmp_path):
    """The model and optimizer state of the FSDP save out_dir/ckpt_meta.pt links to, gathered on this one process."""
    path = tmp_path / f"gathered_{out_dir.name}.pt"
    dcp_to_torch_save(os.path.dirname(os.path.realpath(out_dir / "ckpt_meta.pt")), path)
    return torch.load(path, weights_only=True)


@pytest.mark.slow
def test_muon_under_fsdp_gives_the_weights_of_one_process_and_resumes_across_fsdp_and_ddp(data_root, tmp_path):
    """Each process orthogonalises the whole matrix (gathered) and keeps its rows: 2 FSDP processes end where one
    process does with the same micro-batches; a sharded save resumes under DDP and a DDP save under FSDP."""
    def run(out, steps, *extra, nproc=2):
        torchrun = [FORKRUN, f"--nproc_per_node={nproc}"] if nproc else []
        return run_script(*torchrun, "train.py", "--model_type=det", f"--out_dir={tmp_path / out}", *TINY,
                          "--eval_interval=2", "--always_save_checkpoint=True", "--gradient_accumulation_steps=2",
                          "--optimizer=muon", f"--max_iters={steps}", *extra, data_dir=data_root).stdout

    assert "hidden-matrix weights (Newton-Schulz in " in run("single", 4, nproc=0)
    run("fsdp", 4, "--fsdp=True")
    run("fsdp_then_ddp", 2, "--fsdp=True")
    assert "an FSDP (sharded) save under DDP" in run("fsdp_then_ddp", 4, "--init_from=resume")
    run("ddp_then_fsdp", 2)
    assert "a full (DDP or one-process) save under FSDP" in run("ddp_then_fsdp", 4, "--fsdp=True",
                                                                 "--init_from=resume")
    one = torch.load(tmp_path / "single" / "ckpt.pt", weights_only=True)
    sharded = fsdp_state(tmp_path / "fsdp", tmp_path)
    for weights in (sharded["model"], fsdp_state(tmp_path / "ddp_then_fsdp", tmp_path)["model"],
                    torch.load(tmp_path / "fsdp_then_ddp" / "ckpt.pt", weights_only=True)["model"]):
        assert sorted(weights) == sorted(one["model"])
        assert all(torch.allclose(weights[k].float(), one["model"][k], atol=2e-6) for k in weights)
    at_2 = torch.load(tmp_path / "single" / ckpt.CHECKPOINTS / "iter_0000002" / "ckpt.pt", weights_only=True)
    assert (one["model"]["blocks.0.attn.wq.weight"] - at_2["model"]["blocks.0.attn.wq.weight"]).abs().max() > 1e-3
    momentum = [v["momentum_buffer"] for v in sharded["optimizer"]["state"].values() if "momentum_buffer" in v]
    assert len(momentum) == 7 * 2 and all(m.abs().sum() > 0 for m in momentum)


@pytest.mark.slow
def test_warmdown_holds_the_peak_then_falls_in_a_line_to_min_lr(data_root, tmp_path):
    """--warmdown_iters=3: nanochat's warmup-stable-decay, the multiplier (T - it) / W over the last W steps; Muon's
    group at muon_lr's scale of the same schedule."""
    train_det(data_root, tmp_path, "--max_iters=8", "--lr_decay_iters=8", "--warmup_iters=2", "--warmdown_iters=3",
              "--min_lr=1e-4", "--eval_interval=8", "--optimizer=muon", "--muon_lr=0.02")
    peak, floor = 1e-3, 1e-4
    expected = [peak / 3, 2 * peak / 3] + [peak] * 4 + [floor + (8 - it) / 3 * (peak - floor) for it in (6, 7)]
    assert [r["lr"] for r in records(tmp_path) if "lr" in r] == pytest.approx(expected)
    groups = torch.load(tmp_path / "ckpt.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == pytest.approx([floor * 20, floor, floor])  # set at iter 8, then saved
