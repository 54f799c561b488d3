"""train.py, sample.py and the configurator, run as a user runs them (subprocesses on a tiny synthetic dataset)."""

import os
import sys

import pytest
import torch

from conftest import FORKRUN, TINY, records, run_script, train_det as train

from nanolatent import ckpt, models

pytestmark = pytest.mark.slow  # every test here starts processes (python -m pytest -m "not slow" skips them)


def test_unknown_config_key_is_one_clear_error(data_root, tmp_path):
    proc = train(data_root, tmp_path, "--n_layers=3", check=False)
    assert proc.returncode == 2
    assert "unknown config key 'n_layers' (did you mean n_layer" in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_wrong_type_is_one_clear_error_but_an_int_may_stand_for_a_float(data_root, tmp_path):
    proc = train(data_root, tmp_path, "--batch_size=2.5", check=False)
    assert proc.returncode == 2 and "--batch_size expects an int" in proc.stderr
    proc = train(data_root, tmp_path, "--learning_rate=1", "--max_iters=1", "--eval_interval=1")
    assert "saved checkpoint" in proc.stdout


def test_config_file_and_model_fields_reach_the_model_and_the_command_line_wins(data_root, tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text("n_layer = 3\nrope_theta = 500000\nmax_iters = 2\neval_interval = 2\n")
    train(data_root, tmp_path, config, "--ffn_multiple_of=16")  # TINY's --n_layer=2 comes after the file
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model_config = checkpoint["model_config"]
    assert model_config["n_layer"] == 2 and model_config["rope_theta"] == 500000.0
    assert model_config["ffn_multiple_of"] == 16 and model_config["ffn_hidden"] == 96
    assert checkpoint["iter_num"] == 2 and checkpoint["config"]["max_iters"] == 2


def test_missing_data_prints_the_prepare_command(tmp_path):
    proc = run_script("train.py", "--dataset=tinystories", f"--out_dir={tmp_path}", data_dir=tmp_path, check=False)
    assert proc.returncode == 2 and "run `python prepare.py tinystories`" in proc.stderr


def test_checkpoint_round_trip_gives_identical_logits(data_root, tmp_path):
    train(data_root, tmp_path, "--max_iters=3", "--eval_interval=3")
    model, checkpoint = ckpt.load_model(tmp_path)
    assert not any(k.startswith(("_orig_mod", "module")) for k in checkpoint["model"])
    fresh = models.build_model("det", checkpoint["model_config"])
    fresh.load_state_dict(checkpoint["model"])
    idx = torch.randint(0, checkpoint["model_config"]["vocab_size"], (2, 10))
    assert torch.equal(model(idx)[0], fresh(idx)[0])
    assert not os.path.exists(tmp_path / "ckpt.pt.tmp")


def test_corrupt_checkpoint_is_one_clear_error(data_root, tmp_path):
    train(data_root, tmp_path, "--max_iters=2", "--eval_interval=2", "--keep_checkpoints=1")  # no older save to resume
    with open(tmp_path / "ckpt.pt", "r+b") as f:
        f.truncate(1000)
    proc = train(data_root, tmp_path, "--init_from=resume", check=False)
    assert proc.returncode == 2 and "is unreadable" in proc.stderr and "truncated" in proc.stderr


def test_resumed_run_logs_the_same_losses_as_the_uninterrupted_run(data_root, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["--max_iters=8", "--eval_interval=4", "--always_save_checkpoint=True"]
    train(data_root, full, *args)
    train(data_root, part, "--max_iters=4", "--eval_interval=4", "--always_save_checkpoint=True")
    train(data_root, part, *args, "--init_from=resume")
    loss = lambda out: [(r["iter"], r["loss"]) for r in records(out) if "loss" in r]
    assert loss(part) == loss(full) and len(loss(full)) == 8
    iters = [r["iter"] for r in records(part) if "loss" in r]
    assert iters == sorted(set(iters))
    a, b = (torch.load(p / "ckpt.pt", weights_only=True)["model"] for p in (full, part))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_process_ddp_averages_gradients_like_one_process_with_the_same_micro_batches(data_root, tmp_path):
    args = ["--max_iters=3", "--eval_interval=3", "--always_save_checkpoint=True", "--gradient_accumulation_steps=2"]
    train(data_root, tmp_path / "single", *args)
    run_script(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
               "--model_type=det", f"--out_dir={tmp_path / 'ddp'}", *TINY, *args, data_dir=data_root)
    a, b = (torch.load(tmp_path / d / "ckpt.pt", weights_only=True)["model"] for d in ("single", "ddp"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_sample_refuses_a_prompt_longer_than_the_context(data_root, tmp_path):
    train(data_root, tmp_path, "--max_iters=2", "--eval_interval=2")
    proc = run_script("sample.py", f"--out_dir={tmp_path}", "--start=" + "_" * 60, "--max_new_tokens=10",
                      data_dir=data_root, check=False)
    assert proc.returncode == 2 and "exceeds the context (block_size=66)" in proc.stderr


def test_sample_is_reproducible_with_a_seed(data_root, tmp_path):
    train(data_root, tmp_path, "--max_iters=2", "--eval_interval=2")
    a, b = (run_script("sample.py", f"--out_dir={tmp_path}", "--start=K>", "--seed=3", data_dir=data_root).stdout
            for _ in range(2))
    assert a == b and a.count("K>") == 4


@pytest.mark.parametrize("model_type", ["free", "eve", "btrans"])
def test_a_stochastic_model_trains_to_the_same_weights_on_one_and_two_processes(model_type, data_root, tmp_path):
    """The model's noise is seeded by the micro-batch's index in the step, as its batch is, not by the process: two
    DDP processes with one micro-batch each train as one process with both (as det does above). B-Trans with noise in
    training (its default trains on the mean shift, §5); EVE with its controllers, which measure the step's whole batch
    (model_eve.update_controllers)."""
    args = [f"--model_type={model_type}", *TINY, "--max_iters=3", "--eval_interval=3", "--gradient_accumulation_steps=2",
            *{"eve": ["--homeostat_warmup=1", "--homeostat_every=1"], "btrans": ["--train_noise_mode=sequence"]}.get(
                model_type, [])]
    run_script("train.py", f"--out_dir={tmp_path / 'single'}", *args, data_dir=data_root)
    run_script(FORKRUN, "--nproc_per_node=2", "train.py", f"--out_dir={tmp_path / 'ddp'}", *args,
               data_dir=data_root)
    a, b = (torch.load(tmp_path / d / "ckpt.pt", weights_only=True)["model"] for d in ("single", "ddp"))
    assert sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
