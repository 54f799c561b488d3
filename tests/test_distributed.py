"""nanolatent/distributed.py and the multi-process runs (2 gloo processes on a CPU, as torchrun or tests/support/
forkrun.py starts them): DDP and FSDP2 give the weights of one process with the same micro-batches, for every model;
FSDP's sharded checkpoints resume on 2 processes and on 1 and export as docs/training.md shows; an error is printed
once, by rank 0; a WORLD_SIZE that is no number of processes is one line."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import FORKRUN, ROOT, TINY, assert_one_line_error, run_script, train_det, train_in_process

from nanolatent import ckpt


# ----------------------------------------------------------------------------------------------------------------
# errors: one line, printed by rank 0 alone; a WORLD_SIZE that is no number of processes


@pytest.mark.parametrize("rank, printed", [("0", "error: no such run\n"), ("3", "")])
def test_an_error_is_printed_by_rank_0_alone(rank, printed, monkeypatch, capsys):
    from nanolatent import common
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exit:
        common.die("no such run")
    assert exit.value.code == 2 and capsys.readouterr().err == printed


@pytest.mark.slow
def test_an_error_under_torchrun_is_one_line(tmp_path):
    """Both processes meet the missing dataset; the job fails with one line, rank 0's."""
    proc = run_script(FORKRUN, "--nproc_per_node=2", "train.py", "--dataset=no_such_data", *TINY,
                      "--gradient_accumulation_steps=2",
                      data_dir=tmp_path, check=False, timeout=300)
    assert proc.returncode != 0 and proc.stderr.count("error: ") == 1, proc.stderr[-2000:]
    assert "no_such_data" in proc.stderr


@pytest.mark.parametrize("world_size", ["0", "-2", "two"])
def test_a_dry_run_under_a_world_size_that_is_no_number_of_processes_is_one_line(world_size, data_root, tmp_path,
                                                                                   monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    code, out, err = train_in_process(monkeypatch, capsys, data_root, tmp_path / "fresh", "--dry_run=True")
    assert_one_line_error(subprocess.CompletedProcess([], code, out, err), f"WORLD_SIZE={world_size!r}",
                          "--dry_run_world_size")


# ----------------------------------------------------------------------------------------------------------------
# DDP: one process's weights, every model


@pytest.mark.slow
def test_two_process_ddp_averages_gradients_like_one_process_with_the_same_micro_batches(data_root, tmp_path):
    args = ["--max_iters=3", "--eval_interval=3", "--always_save_checkpoint=True", "--gradient_accumulation_steps=2"]
    train_det(data_root, tmp_path / "single", *args)
    run_script(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
               "--model_type=det", f"--out_dir={tmp_path / 'ddp'}", *TINY, *args, data_dir=data_root)
    a, b = (torch.load(tmp_path / d / "ckpt.pt", weights_only=True)["model"] for d in ("single", "ddp"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.slow
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


# ----------------------------------------------------------------------------------------------------------------
# FSDP2: sharded checkpoints, resumed and exported


# an evaluation and a checkpoint every 3 steps; 2 micro-batches per step, one per process on 2 processes
STEPS = ["--eval_interval=3", "--always_save_checkpoint=True", "--gradient_accumulation_steps=2"]


def train(data_root, out_dir, *args, nproc=0):
    """train.py on a tiny model: one plain process, or nproc processes as torchrun starts them (support/forkrun.py)."""
    torchrun = [FORKRUN, f"--nproc_per_node={nproc}"]
    return run_script(*(torchrun if nproc else []), "train.py", f"--out_dir={out_dir}", *TINY, *STEPS, *args,
                      data_dir=data_root)


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [(r["iter"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def sharded_weights(out_dir, tmp_path):
    """The full state dict of the FSDP checkpoint out_dir/ckpt_meta.pt links to, gathered on this one process."""
    path = tmp_path / f"gathered_{os.path.basename(out_dir)}.pt"
    dcp_to_torch_save(os.path.dirname(os.path.realpath(os.path.join(out_dir, "ckpt_meta.pt"))), path)
    return torch.load(path, weights_only=True)


def plain_weights(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)["model"]


def assert_same_weights(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-6), k


@pytest.fixture(scope="module")
def det_runs(data_root, tmp_path_factory):
    """A tiny det model for 6 steps: on one process; under FSDP on 2; under FSDP stopped at step 3 and resumed on 2
    processes, and on 1."""
    root, det = tmp_path_factory.mktemp("det_runs"), ["--model_type=det", "--max_iters=6"]
    train(data_root, root / "single", *det)
    train(data_root, root / "fsdp", *det, "--fsdp=True", nproc=2)
    train(data_root, root / "part", "--model_type=det", "--max_iters=3", "--fsdp=True", nproc=2)
    shutil.copytree(root / "part", root / "part_on_1")
    train(data_root, root / "part_on_1", *det, "--fsdp=True", "--init_from=resume", nproc=1)
    train(data_root, root / "part", *det, "--fsdp=True", "--init_from=resume", nproc=2)
    return root


@pytest.mark.slow
def test_fsdp_gives_the_same_weights_as_one_process_with_the_same_micro_batches(det_runs, tmp_path):
    assert os.readlink(det_runs / "fsdp" / "ckpt_meta.pt") == os.path.join(ckpt.CHECKPOINTS, "iter_0000006",
                                                                          "ckpt_meta.pt")
    assert_same_weights(sharded_weights(det_runs / "fsdp", tmp_path)["model"], plain_weights(det_runs / "single"))
    assert sorted(os.listdir(det_runs / "fsdp" / ckpt.CHECKPOINTS)) == ["iter_0000003", "iter_0000006"]
    assert not os.path.exists(det_runs / "fsdp" / "ckpt.pt")


@pytest.mark.slow
def test_activation_checkpointing_under_fsdp_and_ddp_gives_the_same_weights(det_runs, data_root, tmp_path):
    """Each block recomputed in the backward: FSDP x 2 still gives the 1-process weights; EVE under DDP x 2 (noise
    drawn, homeostat statistics all-reduced) the weights of the same run without it."""
    train(data_root, tmp_path / "fsdp", "--model_type=det", "--max_iters=6", "--fsdp=True",
          "--activation_checkpointing=True", nproc=2)
    for name, flag in (("plain", "False"), ("checkpointed", "True")):
        train(data_root, tmp_path / name, "--model_type=eve", "--max_iters=4", "--homeostat=True",
              "--homeostat_warmup=1", "--homeostat_every=1", f"--activation_checkpointing={flag}", nproc=2)
    assert_same_weights(sharded_weights(tmp_path / "fsdp", tmp_path)["model"], plain_weights(det_runs / "single"))
    assert_same_weights(plain_weights(tmp_path / "checkpointed"), plain_weights(tmp_path / "plain"))


@pytest.mark.slow
def test_fsdp_meta_checkpoint_holds_plain_types_and_the_run(det_runs):
    meta = torch.load(det_runs / "fsdp" / "ckpt_meta.pt", weights_only=True)
    assert sorted(meta) == ["best_val_loss", "config", "iter_num", "meta", "model_config", "model_type",
                            "selected_iter"]
    assert meta["model_type"] == "det" and meta["iter_num"] == 6 and meta["config"]["fsdp"] is True
    assert meta["model_config"]["n_embd"] == 32 and meta["meta"]["vocab_size"] == meta["model_config"]["vocab_size"]


@pytest.mark.slow
def test_fsdp_run_resumed_from_its_sharded_checkpoint_logs_the_same_losses(det_runs, tmp_path):
    full, part = losses(det_runs / "fsdp"), losses(det_runs / "part")
    assert part == full and [i for i, _ in full] == list(range(6))
    assert_same_weights(sharded_weights(det_runs / "part", tmp_path)["model"],
                        sharded_weights(det_runs / "fsdp", tmp_path)["model"])


@pytest.mark.slow
def test_fsdp_checkpoint_of_2_processes_resumes_on_1_with_the_same_weights(det_runs, tmp_path):
    assert_same_weights(sharded_weights(det_runs / "part_on_1", tmp_path)["model"],
                        sharded_weights(det_runs / "fsdp", tmp_path)["model"])


@pytest.mark.slow
def test_the_docs_export_of_a_sharded_checkpoint_loads_with_the_runs_weights(det_runs, tmp_path):
    """docs/training.md's gathering snippet, run as written in a folder whose out/ is an FSDP run."""
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        snippet = re.search(r"^python - <<'PY'\n(.*?)^PY\n", f.read(), re.S | re.M).group(1)
    shutil.copytree(det_runs / "fsdp", tmp_path / "out", symlinks=True)  # as cp -r and rsync -a copy a run
    run_script(sys.executable, "-c", snippet, cwd=tmp_path, data_dir=tmp_path)
    model, checkpoint = ckpt.load_model(tmp_path / "out-export")
    assert checkpoint["iter_num"] == 6 and "optimizer" not in checkpoint
    assert_same_weights(model.state_dict(), sharded_weights(det_runs / "fsdp", tmp_path)["model"])


@pytest.mark.slow
@pytest.mark.parametrize("model_type,extra", [
    ("eve", ["--homeostat_warmup=1", "--homeostat_every=1", "--beta_control=True"]),  # controllers at every step
    ("free", ["--latent_bits=4"]),  # the encoder block is an FSDP unit, the post-sampler in the root
])
def test_fsdp_gives_the_same_weights_as_ddp_for_stochastic_models(model_type, extra, data_root, tmp_path):
    """Noise is drawn per process, so a stochastic model is compared with DDP on as many processes."""
    args = [f"--model_type={model_type}", "--max_iters=3", *extra]
    train(data_root, tmp_path / "ddp", *args, nproc=2)
    train(data_root, tmp_path / "fsdp", *args, "--fsdp=True", nproc=2)
    sharded = sharded_weights(tmp_path / "fsdp", tmp_path)["model"]
    assert_same_weights(sharded, plain_weights(tmp_path / "ddp"))
    if model_type == "eve":  # three controller updates; the homeostat rescaled sharded weights at steps 1 and 2
        assert int(sharded["ctrl_step"]) == 3
