"""Run records (out_dir/metrics.jsonl, nanolatent/records.py): one per log step and per evaluation, those past the
checkpoint dropped at a resume, a partial last line dropped with a warning, an earlier run's records never replaced
unasked. (scripts/plot.py, which draws them: test_plot.py.)"""

import importlib.util
import json
import os
import shutil
import subprocess

import pytest

from conftest import assert_one_line_error, records, snapshot, train_det, train_in_process, write

from nanolatent import ckpt


@pytest.mark.slow
def test_training_writes_one_record_per_log_step_and_per_eval(data_root, tmp_path):
    train_det(data_root, tmp_path, "--max_iters=6", "--eval_interval=3", "--log_interval=2")
    logs = [r for r in records(tmp_path) if "loss" in r]
    evals = [r for r in records(tmp_path) if "val_loss" in r]
    assert [r["iter"] for r in logs] == [0, 2, 4] and [r["iter"] for r in evals] == [0, 3, 6]
    assert {"iter", "tokens", "lr", "loss", "ce", "tokens_per_s", "mfu", "nonfinite"} <= set(logs[0])
    assert {"train_loss", "val_loss", "train_ce", "val_ce"} <= set(evals[0])
    assert logs[1]["tokens"] == 3 * 4 * 66  # (iter + 1) steps of batch_size x block_size tokens


@pytest.mark.slow
def test_resume_drops_records_past_the_checkpoint(data_root, tmp_path):
    train_det(data_root, tmp_path, "--max_iters=4", "--eval_interval=2", "--always_save_checkpoint=True")
    with open(tmp_path / "metrics.jsonl", "a") as f:  # records a crashed run wrote after its last checkpoint
        f.write(json.dumps({"iter": 5, "loss": 9.0}) + "\n")
    train_det(data_root, tmp_path, "--max_iters=6", "--eval_interval=2", "--init_from=resume")
    for kind in ("loss", "val_loss"):
        iters = [r["iter"] for r in records(tmp_path) if kind in r]
        assert iters == sorted(set(iters)) and iters[-1] == 6 - (kind == "loss")
    assert 9.0 not in [r.get("loss") for r in records(tmp_path)]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_package_is_one_clear_error_before_training(data_root, tmp_path):
    proc = train_det(data_root, tmp_path, "--wandb_log=True", check=False)
    assert proc.returncode == 2 and "pip install wandb" in proc.stderr and "iter 0" not in proc.stdout


@pytest.mark.parametrize("init_from", ["scratch", "auto"])
def test_records_of_an_earlier_run_whose_checkpoints_were_deleted_are_kept(init_from, run, data_root, monkeypatch,
                                                                            capsys):
    """The run's checkpoints deleted by hand, its metrics.jsonl kept: a new run there is refused in one line (the
    records as they were) unless --overwrite=True replaces them."""
    shutil.rmtree(run / ckpt.CHECKPOINTS)
    os.remove(run / "ckpt.pt")
    before = snapshot(run)
    code, out, err = train_in_process(monkeypatch, capsys, data_root, run, f"--init_from={init_from}")
    assert_one_line_error(subprocess.CompletedProcess([], code, out, err), str(run / "metrics.jsonl"), "0 to 4",
                          "--overwrite=True")
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_partial_last_log_line_is_dropped_with_a_warning_on_resume(run, data_root):
    write(run / "metrics.jsonl", '{"iter": 5, "lo', mode="a")  # a crash mid-append
    proc = train_det(data_root, run, "--init_from=resume", "--max_iters=6", "--eval_interval=2")
    assert "ends in a partial line" in proc.stderr
    assert [r["iter"] for r in records(run) if "val_loss" in r] == [0, 2, 4, 6]
