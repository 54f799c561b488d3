"""train.py and the configurator, run as a user runs them (subprocesses on a tiny synthetic dataset), and train.py's
refusals: each mistake one line on stderr naming key and value, exit code 2, no traceback and nothing on disk changed
(run in this process, a few through a real one); then what it does when asked (eval_only, overwrite, a quick look)."""

import contextlib
import json
import math
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from conftest import (RUN_ARGS, TINY, assert_one_line_error, records, run_script, snapshot, train_det, train_in_process,
                      write)

from nanolatent import ckpt, models


@pytest.mark.slow
def test_unknown_config_key_is_one_clear_error(data_root, tmp_path):
    proc = train_det(data_root, tmp_path, "--n_layers=3", check=False)
    assert proc.returncode == 2
    assert "unknown config key 'n_layers' (did you mean n_layer" in proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.slow
def test_wrong_type_is_one_clear_error_but_an_int_may_stand_for_a_float(data_root, tmp_path):
    proc = train_det(data_root, tmp_path, "--batch_size=2.5", check=False)
    assert proc.returncode == 2 and "--batch_size expects an int" in proc.stderr
    proc = train_det(data_root, tmp_path, "--learning_rate=1", "--max_iters=1", "--eval_interval=1")
    assert "saved checkpoint" in proc.stdout


@pytest.mark.slow
def test_config_file_and_model_fields_reach_the_model_and_the_command_line_wins(data_root, tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text("n_layer = 3\nrope_theta = 500000\nmax_iters = 2\neval_interval = 2\n")
    train_det(data_root, tmp_path, config, "--ffn_multiple_of=16")  # TINY's --n_layer=2 comes after the file
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model_config = checkpoint["model_config"]
    assert model_config["n_layer"] == 2 and model_config["rope_theta"] == 500000.0
    assert model_config["ffn_multiple_of"] == 16 and model_config["ffn_hidden"] == 96
    assert checkpoint["iter_num"] == 2 and checkpoint["config"]["max_iters"] == 2


@pytest.mark.slow
def test_missing_data_prints_the_prepare_command(tmp_path):
    proc = run_script("train.py", "--dataset=tinystories", f"--out_dir={tmp_path}", data_dir=tmp_path, check=False)
    assert proc.returncode == 2 and "run `python prepare.py tinystories`" in proc.stderr


@pytest.mark.slow
def test_checkpoint_round_trip_gives_identical_logits(data_root, tmp_path):
    train_det(data_root, tmp_path, "--max_iters=3", "--eval_interval=3")
    model, checkpoint = ckpt.load_model(tmp_path)
    assert not any(k.startswith(("_orig_mod", "module")) for k in checkpoint["model"])
    fresh = models.build_model("det", checkpoint["model_config"])
    fresh.load_state_dict(checkpoint["model"])
    idx = torch.randint(0, checkpoint["model_config"]["vocab_size"], (2, 10))
    assert torch.equal(model(idx)[0], fresh(idx)[0])
    assert not os.path.exists(tmp_path / "ckpt.pt.tmp")


@pytest.mark.slow
def test_corrupt_checkpoint_is_one_clear_error(data_root, tmp_path):
    # no older save to resume
    train_det(data_root, tmp_path, "--max_iters=2", "--eval_interval=2", "--keep_checkpoints=1")
    with open(tmp_path / "ckpt.pt", "r+b") as f:
        f.truncate(1000)
    proc = train_det(data_root, tmp_path, "--init_from=resume", check=False)
    assert proc.returncode == 2 and "is unreadable" in proc.stderr and "truncated" in proc.stderr


@pytest.mark.slow
def test_resumed_run_logs_the_same_losses_as_the_uninterrupted_run(data_root, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["--max_iters=8", "--eval_interval=4", "--always_save_checkpoint=True"]
    train_det(data_root, full, *args)
    train_det(data_root, part, "--max_iters=4", "--eval_interval=4", "--always_save_checkpoint=True")
    train_det(data_root, part, *args, "--init_from=resume")
    loss = lambda out: [(r["iter"], r["loss"]) for r in records(out) if "loss" in r]
    assert loss(part) == loss(full) and len(loss(full)) == 8
    iters = [r["iter"] for r in records(part) if "loss" in r]
    assert iters == sorted(set(iters))
    a, b = (torch.load(p / "ckpt.pt", weights_only=True)["model"] for p in (full, part))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------------------------
# refusals: one line naming key and value, exit code 2, nothing on disk changed


FRESH, FREE = "--out_dir={tmp}/fresh", ["--out_dir={tmp}/fresh", "--model_type=free"]  # a new out_dir
# name: (extra arguments, what the line must name: the key and the value, or the file, and what to do); {tmp} is a
# scratch folder, {run} the trained run. Not the wording: a case passes whatever sentence carries these.
TRAIN_CASES = {
    "scratch over a trained run": ([], ("{run}", "--overwrite=True", "--init_from=resume")),
    "max_iters negative": (["--init_from=resume", "--max_iters=-5"], ("max_iters", "-5")),
    "eval_interval zero": (["--init_from=resume", "--eval_interval=0"], ("eval_interval", "0")),
    "log_interval zero": (["--init_from=resume", "--log_interval=0"], ("log_interval", "0")),
    "eval_iters zero": (["--init_from=resume", "--eval_iters=0"], ("eval_iters", "0")),
    "batch_size zero": (["--init_from=resume", "--batch_size=0"], ("batch_size", "0")),
    "dtype float64": (["--init_from=resume", "--dtype=float64"], ("dtype", "float64", "bfloat16")),
    "init_from unknown": (["--init_from=latest"], ("init_from", "latest", "resume")),
    "resume in an empty out_dir": ([FRESH, "--init_from=resume"], ("{tmp}/fresh", "no checkpoint")),
    "keep_checkpoints zero": (["--init_from=auto", "--keep_checkpoints=0"], ("keep_checkpoints", "0")),
    "shape-changing override on resume": (["--init_from=resume", "--n_layer=3"], ("n_layer", "3", "shape")),
    "resume on another vocabulary": (["--init_from=resume", "--dataset=tiny_vocab"], ("tiny_vocab", "--dataset=")),
    "resume as another model type": (["--init_from=resume", "--model_type=free"], ("det run", "--model_type=det")),
    # the optimizer state a save holds is of its optimizer and its groups of parameters
    "resume with another optimizer": (["--init_from=resume", "--optimizer=muon"], ("--optimizer=muon",
                                                                                  "optimizer=adamw")),
    "resume with embeddings frozen": (["--init_from=resume", "--freeze_embeddings=True"],
                                      ("--freeze_embeddings=True", "freeze_embeddings=False")),
    "config file with a syntax error": (["{tmp}/bad_syntax.py"], ("{tmp}/bad_syntax.py", "line 1")),
    "config file with a NameError": (["{tmp}/bad_name.py"], ("{tmp}/bad_name.py", "NameError")),
    "config file that is a directory": (["{tmp}"], ("{tmp}", "directory")),
    "config file that exits": (["{tmp}/exits.py"], ("{tmp}/exits.py", "sys.exit")),
    "config file value a dict": ([FRESH, "{tmp}/lr_dict.py"], ("{tmp}/lr_dict.py", "learning_rate",
                                                              "{{'peak': 0.003}}")),
    "config file value a torch dtype": ([FRESH, "{tmp}/dtype_torch.py"], ("{tmp}/dtype_torch.py", "dtype",
                                                                           "torch.bfloat16")),
    "config file value of another type": ([FRESH, "{tmp}/iters_str.py"], ("{tmp}/iters_str.py", "max_iters", "'300'")),
    "config file value None": (["{tmp}/out_dir_none.py"], ("{tmp}/out_dir_none.py", "out_dir", "None")),
    "config file value beyond 64 bits": ([FRESH, "{tmp}/iters_huge.py"], ("max_iters", "1329 bits", "2**63")),
    "out_dir under a file": (["--out_dir={tmp}/a_file/run"], ("{tmp}/a_file/run",)),
    "dataset too small": ([FRESH, "--dataset=tiny_vocab"], ("tiny_vocab", "block_size")),
    "dataset not prepared": ([FRESH, "--dataset=mystuff"], ("mystuff", "python prepare.py")),
    # model values, checked by each Config's __post_init__ and printed as one line
    "n_head zero": ([FRESH, "--n_head=0"], ("n_head=0",)),
    "block_size zero": ([FRESH, "--block_size=0"], ("block_size=0",)),
    "block_size negative": ([FRESH, "--block_size=-5"], ("block_size=-5",)),
    "n_embd zero": ([FRESH, "--n_embd=0"], ("n_embd=0",)),
    "n_layer zero": ([FRESH, "--n_layer=0"], ("n_layer=0",)),
    "ffn_hidden not a number": ([FRESH, "--ffn_hidden=abc"], ("ffn_hidden", "abc")),
    "rope_theta zero": ([FRESH, "--rope_theta=0"], ("rope_theta=0",)),
    "norm_eps negative": ([FRESH, "--norm_eps=-1"], ("norm_eps=-1",)),
    "rope_theta nan in a config file": ([FRESH, "{tmp}/nan_theta.py"], ("rope_theta=nan",)),
    "latent_bits zero": ([*FREE, "--latent_bits=0"], ("latent_bits=0",)),
    "latent_bits negative": ([*FREE, "--latent_bits=-3"], ("latent_bits=-3",)),
    "latent_bits 30": ([*FREE, "--latent_bits=30"], ("latent_bits=30",)),
    "kappa_bits negative": ([*FREE, "--kappa_bits=-1"], ("kappa_bits=-1",)),
    "kappa_bits nan in a config file": ([*FREE, "{tmp}/nan_kappa.py"], ("kappa_bits=nan",)),
    "shape-keeping override out of range on resume": (["--init_from=resume", "--rope_theta=-1"], ("rope_theta=-1",)),
    # values the data fixes, and the machine
    "vocab_size below the data's": ([FRESH, "--vocab_size=10"], ("vocab_size=10",)),
    "block_size above a sequence": ([FRESH, "--block_size=80"], ("block_size", "66")),
    "batch_size beyond memory": ([FRESH, "--batch_size=1000000"], ("batch_size=1000000",)),
    # script values
    "beta1 above 1": ([FRESH, "--beta1=1.5"], ("beta1", "1.5")),
    "learning_rate nan in a config file": ([FRESH, "{tmp}/nan_lr.py"], ("learning_rate", "nan")),
    "seed negative": ([FRESH, "--seed=-1"], ("seed", "-1")),
    "resume with max_iters below its step": (["--init_from=resume", "--max_iters=3"], ("max_iters=3",)),
    "val split empty": ([FRESH, "--dataset=no_val"], ("val.bin",)),
    "init_embeddings a text file named .npy": ([FRESH, "--init_embeddings={tmp}/notes.npy"],
                                               ("init_embeddings={tmp}/notes.npy",)),
    "init_embeddings an .npz archive": ([FRESH, "--init_embeddings={tmp}/emb.npz"], ("{tmp}/emb.npz", ".npz")),
    "init_embeddings strings": ([FRESH, "--init_embeddings={tmp}/words.npy"], ("{tmp}/words.npy", "<U5")),
    "init_embeddings a folder": ([FRESH, "--init_embeddings={tmp}"], ("{tmp}", "folder")),
    "a dry run of 100,000 layers": ([FRESH, "--dry_run=True", "--n_layer=100000"], ("n_layer=100000",)),
    # the world sizes the run refuses (each process an equal share of the micro-batches), refused by its plan too
    "a dry run on 3 processes": ([FRESH, "--dry_run=True", "--dry_run_world_size=3", "--gradient_accumulation_steps=4"],
                                 ("gradient_accumulation_steps=4", "3 processes")),
    "a dry run on 1,024 processes": ([FRESH, "--dry_run=True", "--dry_run_world_size=1024",
                                      "--gradient_accumulation_steps=512"], ("gradient_accumulation_steps=512", "1024")),
    "auto with overwrite": (["--init_from=auto", "--overwrite=True"], ("init_from=auto", "overwrite=True",
                                                                     "--init_from=scratch --overwrite=True")),
    "out_dir the checkpoint's path on resume": (["--init_from=resume", "--out_dir={run}/ckpt.pt"],
                                                ("--out_dir={run}/ckpt.pt", "--out_dir={run}")),
    "out_dir the checkpoint's path, eval_only": (["--eval_only=True", "--out_dir={run}/ckpt.pt"],
                                                 ("--out_dir={run}/ckpt.pt", "--out_dir={run}")),
}


if not torch.cuda.is_available():
    TRAIN_CASES["cuda without a GPU"] = (["--out_dir={tmp}/fresh", "--device=cuda"], ("device", "cuda"))


# the same mistakes through a real train.py process, end to end (the rest run in this process: much faster)
SPAWNED = ["scratch over a trained run", "config file with a syntax error", "config file that exits",
           "shape-changing override on resume", "batch_size beyond memory"]


@pytest.fixture(scope="module")
def tiny_vocab(data_root):
    """A second dataset beside the synthetic one: 3 characters, 40 tokens; and a copy of the synthetic one whose
    val split is empty, as prepare.py --val_fraction=0 used to write it."""
    write(data_root / "tiny.txt", "ab\n" * 20)
    run_script("prepare.py", "text", f"--input={data_root / 'tiny.txt'}", "--tokenizer=char", "--name=tiny_vocab",
               data_dir=data_root)
    shutil.copytree(data_root / "synthetic", data_root / "no_val", dirs_exist_ok=True)
    (data_root / "no_val" / "val.bin").write_bytes(b"")


def mistakes(tmp_path):
    """The files TRAIN_CASES' arguments name, in tmp_path."""
    write(tmp_path / "bad_syntax.py", "n_layer = = 3\n")
    write(tmp_path / "bad_name.py", "n_layer = undefined_name\n")
    write(tmp_path / "exits.py", "import sys\nsys.exit(0)\n")
    write(tmp_path / "lr_dict.py", "learning_rate = {'peak': 3e-3}\n")
    write(tmp_path / "dtype_torch.py", "import torch\ndtype = torch.bfloat16\n")
    write(tmp_path / "iters_str.py", "max_iters = '300'\n")
    write(tmp_path / "out_dir_none.py", "out_dir = None\n")
    write(tmp_path / "iters_huge.py", "max_iters = 10**400\n")
    write(tmp_path / "a_file", "")
    write(tmp_path / "nan_theta.py", "rope_theta = float('nan')\n")
    write(tmp_path / "nan_kappa.py", "kappa_bits = float('nan')\n")
    write(tmp_path / "nan_lr.py", "learning_rate = float('nan')\n")
    write(tmp_path / "notes.npy", "my embeddings, to do\n")
    np.savez(tmp_path / "emb.npz", emb=np.zeros((3, 32), dtype=np.float32))
    np.save(tmp_path / "words.npy", np.array(["alpha", "beta"]))


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_mistake_is_one_line_naming_key_and_value_and_changes_nothing(case, run, tmp_path, data_root,
                                                                            tiny_vocab, monkeypatch, capsys):
    args, named = TRAIN_CASES[case]
    mistakes(tmp_path)
    before = snapshot(run)
    code, out, err = train_in_process(monkeypatch, capsys, data_root, run,
                                      *[a.format(tmp=tmp_path, run=run) for a in args])
    assert_one_line_error(subprocess.CompletedProcess([], code, out, err), *[n.format(tmp=tmp_path, run=run)
                                                                             for n in named])
    assert snapshot(run) == before
    assert not (tmp_path / "fresh" / "ckpt.pt").exists() and not (tmp_path / "fresh" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", SPAWNED)
def test_train_mistake_is_one_line_in_a_real_process(case, run, tmp_path, data_root, tiny_vocab):
    args, named = TRAIN_CASES[case]
    mistakes(tmp_path)
    before = snapshot(run)
    proc = train_det(data_root, run, *[a.format(tmp=tmp_path, run=run) for a in args], check=False)
    assert_one_line_error(proc, *[n.format(tmp=tmp_path, run=run) for n in named])
    assert snapshot(run) == before and proc.stdout == ""
    assert not (tmp_path / "fresh" / "ckpt.pt").exists() and not (tmp_path / "fresh" / "metrics.jsonl").exists()


@contextlib.contextmanager
def read_only(folder):
    """folder made read-only: its mode, and for root (whom modes do not stop) the immutable attribute."""
    os.chmod(folder, 0o555)
    immutable = os.geteuid() == 0
    if immutable and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        os.chmod(folder, 0o755)
        pytest.skip("root, and chattr +i (which stops root) does not work here")
    try:
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        os.chmod(folder, 0o755)


@pytest.mark.parametrize("fault", ["a file", "read-only"])
def test_a_checkpoints_folder_that_cannot_be_written_is_one_line_before_any_step(fault, run, data_root, tmp_path,
                                                                                  monkeypatch, capsys):
    """A fresh run whose out_dir holds a file named checkpoints, or a run resumed where checkpoints/ is read-only:
    one line naming the folder, before any step is trained, and nothing there changes."""
    out_dir, args = (tmp_path / "fresh", []) if fault == "a file" else (run, ["--init_from=resume", "--max_iters=6"])
    if fault == "a file":
        write(out_dir / ckpt.CHECKPOINTS, "not a folder")
    before = snapshot(out_dir)
    with contextlib.nullcontext() if fault == "a file" else read_only(run / ckpt.CHECKPOINTS):
        code, out, err = train_in_process(monkeypatch, capsys, data_root, out_dir, *args)
    assert_one_line_error(subprocess.CompletedProcess([], code, out, err), str(out_dir / ckpt.CHECKPOINTS), fault)
    assert snapshot(out_dir) == before


@pytest.fixture(scope="module")
def trained_muon(data_root, tmp_path_factory):
    """A finished tiny det run trained with --optimizer=muon: 4 steps, saved at 0, 2 and 4."""
    out = tmp_path_factory.mktemp("trained_muon")
    train_det(data_root, out, *RUN_ARGS, "--optimizer=muon")
    return out


def test_a_muon_run_resumed_with_adamw_is_one_line_and_changes_nothing(trained_muon, data_root, tmp_path,
                                                                       monkeypatch, capsys):
    """The reverse of TRAIN_CASES' "resume with another optimizer": not Muon kept without a word."""
    run = tmp_path / "run"
    shutil.copytree(trained_muon, run)
    before = snapshot(run)
    code, out, err = train_in_process(monkeypatch, capsys, data_root, run, "--init_from=resume", "--max_iters=6",
                                      "--optimizer=adamw")
    assert_one_line_error(subprocess.CompletedProcess([], code, out, err), "--optimizer=adamw", "optimizer=muon",
                          "--optimizer=muon")
    assert snapshot(run) == before


@pytest.mark.slow
def test_train_refuses_init_embeddings_of_the_wrong_shape_in_one_line(data_root, tmp_path):
    np.save(tmp_path / "emb.npy", np.zeros((5, 32), dtype=np.float32))
    proc = run_script("train.py", "--model_type=det", f"--out_dir={tmp_path / 'det'}", *TINY, "--max_iters=1",
                      f"--init_embeddings={tmp_path / 'emb.npy'}", data_dir=data_root, check=False)
    assert proc.returncode == 2 and "(5, 32) matrix" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_script("train.py", "--model_type=det", f"--out_dir={tmp_path / 'det'}", *TINY, "--max_iters=1",
                      f"--init_embeddings={tmp_path / 'none.npy'}", data_dir=data_root, check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------------------------
# what train.py does when asked


@pytest.mark.slow
def test_eval_only_evaluates_the_checkpoint_and_leaves_the_log_alone(run, data_root):
    before = snapshot(run)
    proc = train_det(data_root, run, "--eval_only=True")
    val_loss = float(proc.stdout.split("val_loss ")[1].split()[0])
    saved_at = torch.load(run / "ckpt.pt", weights_only=True)["iter_num"]
    logged = next(r for r in records(run) if r["iter"] == saved_at and "val_loss" in r)
    assert val_loss == pytest.approx(logged["val_loss"], abs=1e-4)  # the same weights on the same eval batches
    assert snapshot(run) == before


@pytest.mark.slow
def test_overwrite_replaces_a_trained_run_when_asked(run, data_root):
    train_det(data_root, run, "--max_iters=2", "--eval_interval=2", "--overwrite=True")
    assert torch.load(run / "ckpt.pt", weights_only=True)["iter_num"] == 2
    assert max(r["iter"] for r in records(run)) == 2
    assert sorted(ckpt.saved_steps(run)) == [0, 2]  # the old run's iter 4 is gone: a resume never picks it up


@pytest.mark.slow
def test_log_lines_show_progress_and_fit_120_columns(data_root, tmp_path):
    proc = run_script("train.py", "--model_type=eve", f"--out_dir={tmp_path}", *TINY, "--max_iters=3", "--eval_interval=3",
                      data_dir=data_root)  # EVE logs the most stats
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iter ")]
    assert lines and all(len(line) <= 120 for line in lines), max(lines, key=len)
    assert any("iter 1/3: loss" in line and "elapsed, ETA" in line for line in lines)


@pytest.mark.slow
def test_a_quick_look_decays_its_learning_rate_over_its_own_steps(data_root, tmp_path):
    proc = run_script("train.py", "--model_type=det", f"--out_dir={tmp_path}", *[a for a in TINY if "lr_decay" not in a],
                      "--max_iters=6", "--eval_interval=6", "--min_lr=1e-4", data_dir=data_root)
    assert "lr_decay_iters = max_iters = 6 (was 600)" in proc.stdout
    cosine = lambda it: 1e-4 + 0.5 * (1 + math.cos(math.pi * (it - 2) / (6 - 2))) * (1e-3 - 1e-4)  # warmup_iters=2
    assert [r["lr"] for r in records(tmp_path) if "lr" in r][2:] == pytest.approx([cosine(it) for it in range(2, 6)])
    lines = proc.stdout.splitlines()  # the first lines come before the first evaluation's
    assert lines.index(next(l for l in lines if l.startswith("evaluating at iter 0"))) < \
        lines.index(next(l for l in lines if l.startswith("iter 0/6 eval")))


@pytest.mark.slow
@pytest.mark.parametrize("refusal, phrase", [
    (["--dataset=mystuff"], "dataset 'mystuff' is not prepared"),
    (["--batch_size=1000000"], "GiB activations at batch_size=1000000"),
])
def test_the_lr_decay_note_comes_after_the_checks_not_above_a_refusal(data_root, tmp_path, refusal, phrase):
    """A quick look (--max_iters below lr_decay_iters, which is not set) prints lr_decay_iters = max_iters when it
    trains; a run refused for another reason prints only its one line."""
    proc = run_script("train.py", "--model_type=det", f"--out_dir={tmp_path}", *[a for a in TINY if "lr_decay" not in a],
                      "--max_iters=6", *refusal, data_dir=data_root, check=False)
    assert_one_line_error(proc, phrase)
    assert proc.stdout == ""


@pytest.mark.slow
@pytest.mark.parametrize("select_by", ["ce", "loss"])
def test_train_keeps_the_checkpoint_of_best_validation_ce_or_loss(data_root, tmp_path, select_by):
    # EVE's loss adds beta KL and control terms to the CE, so the two criteria are distinct numbers
    out = tmp_path / "eve"
    run_script("train.py", "--model_type=eve", f"--out_dir={out}", *TINY, "--max_iters=8", "--eval_interval=1",
               "--learning_rate=3e-3", f"--select_by={select_by}", data_dir=data_root)
    evals = [r for r in records(out) if "val_ce" in r]  # step 0's evaluation included: the first save
    best = min(evals, key=lambda r: r[f"val_{select_by}"])
    checkpoint = ckpt.load_checkpoint(out / "ckpt.pt")
    assert checkpoint["iter_num"] == best["iter"]
    assert checkpoint["best_val_loss"] == pytest.approx(best[f"val_{select_by}"])
    assert any(r["val_ce"] != r["val_loss"] for r in evals)


# --init_embeddings and --freeze_embeddings: EVE's matched comparison with frozen pretrained embeddings
# (experiments/eve_paper_protocol.py)
@pytest.mark.slow
def test_train_init_embeddings_are_held_frozen_and_kept_in_the_checkpoint(data_root, tmp_path):
    with open(data_root / "synthetic" / "meta.json") as f:
        vocab = json.load(f)["vocab_size"]
    embedding = np.random.default_rng(0).normal(0, 0.05, (vocab, 32)).astype(np.float32)
    np.save(tmp_path / "emb.npy", embedding)
    out = tmp_path / "eve"
    run_script("train.py", "--model_type=eve", f"--out_dir={out}", *TINY, "--max_iters=6", "--eval_interval=3",
               f"--init_embeddings={tmp_path / 'emb.npy'}", "--freeze_embeddings=True", "--always_save_checkpoint=True",
               data_dir=data_root)
    checkpoint = ckpt.load_checkpoint(out / "ckpt.pt")
    assert checkpoint["iter_num"] == 6 and checkpoint["config"]["freeze_embeddings"] is True
    assert torch.equal(checkpoint["model"]["tok_emb.weight"], torch.from_numpy(embedding))  # 6 steps later
    assert torch.equal(checkpoint["model"]["lm_head.weight"], torch.from_numpy(embedding))  # the tied head
    # a resumed run keeps it frozen: the flag comes back with the model's config
    run_script("train.py", "--model_type=eve", f"--out_dir={out}", *TINY, "--max_iters=9", "--eval_interval=3",
               "--init_from=resume", "--always_save_checkpoint=True", data_dir=data_root)
    checkpoint = ckpt.load_checkpoint(out / "ckpt.pt")
    assert checkpoint["iter_num"] == 9
    assert torch.equal(checkpoint["model"]["tok_emb.weight"], torch.from_numpy(embedding))
