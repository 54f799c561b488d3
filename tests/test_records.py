"""Run records (out_dir/metrics.jsonl) and plot.py."""

import importlib.util
import json

import pytest

from conftest import records, run_script, train_det as train

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is optional (pip install matplotlib); CI installs it")


@pytest.mark.slow
def test_training_writes_one_record_per_log_step_and_per_eval(data_root, tmp_path):
    train(data_root, tmp_path, "--max_iters=6", "--eval_interval=3", "--log_interval=2")
    logs = [r for r in records(tmp_path) if "loss" in r]
    evals = [r for r in records(tmp_path) if "val_loss" in r]
    assert [r["iter"] for r in logs] == [0, 2, 4] and [r["iter"] for r in evals] == [0, 3, 6]
    assert {"iter", "tokens", "lr", "loss", "ce", "tokens_per_s", "mfu", "nonfinite"} <= set(logs[0])
    assert {"train_loss", "val_loss", "train_ce", "val_ce"} <= set(evals[0])
    assert logs[1]["tokens"] == 3 * 4 * 66  # (iter + 1) steps of batch_size x block_size tokens


@pytest.mark.slow
def test_resume_drops_records_past_the_checkpoint(data_root, tmp_path):
    train(data_root, tmp_path, "--max_iters=4", "--eval_interval=2", "--always_save_checkpoint=True")
    with open(tmp_path / "metrics.jsonl", "a") as f:  # records a crashed run wrote after its last checkpoint
        f.write(json.dumps({"iter": 5, "loss": 9.0}) + "\n")
    train(data_root, tmp_path, "--max_iters=6", "--eval_interval=2", "--init_from=resume")
    for kind in ("loss", "val_loss"):
        iters = [r["iter"] for r in records(tmp_path) if kind in r]
        assert iters == sorted(set(iters)) and iters[-1] == 6 - (kind == "loss")
    assert 9.0 not in [r.get("loss") for r in records(tmp_path)]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_package_is_one_clear_error_before_training(data_root, tmp_path):
    proc = train(data_root, tmp_path, "--wandb_log=True", check=False)
    assert proc.returncode == 2 and "pip install wandb" in proc.stderr and "iter 0" not in proc.stdout


@pytest.mark.slow
@needs_matplotlib
def test_plot_draws_two_runs_to_a_png(data_root, tmp_path):
    for run in ("a", "b"):
        train(data_root, tmp_path / run, "--max_iters=4", "--eval_interval=2")
    out = tmp_path / "curves.png"
    run_script("-m", "scripts.plot", tmp_path / "a", tmp_path / "b", "--keys=val_ce,loss", f"--out={out}", data_dir=tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    drawn = json.loads((tmp_path / "curves.json").read_text())  # the points drawn, beside the figure
    for run in ("a", "b"):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for key in ("val_ce", "loss"):
            assert drawn[key][run] == [[r["iter"], r[key]] for r in records if key in r]
    assert drawn["x"] == "iter" and len(drawn["val_ce"]["a"]) == 3  # evaluations at 0, 2, 4


@pytest.mark.slow
@needs_matplotlib
def test_plot_draws_evaluate_json_files_with_exact_zeros_on_a_floor(tmp_path):
    for name, mi in (("det", 0.0), ("eve", 0.03)):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"task": "lm", "results": {name: {"model_type": name, "nll": 1.2, "ece": 0.02, "mi": mi, "flip_rate": mi}}}))
    out = tmp_path / "eval.png"
    run_script("-m", "scripts.plot", tmp_path / "det.json", tmp_path / "eve.json", f"--out={out}", data_dir=tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.parametrize("case, message", [
    ("no_records", "has no metrics.jsonl"),
    ("empty", "is empty"),
    ("unknown_key", "unknown key 'val_cee'; the records have: "),
])
def test_plot_bad_input_is_one_clear_line(tmp_path, case, message):
    run = tmp_path / "run"
    run.mkdir()
    if case != "no_records":
        (run / "metrics.jsonl").write_text("" if case == "empty" else json.dumps({"iter": 0, "val_ce": 1.0}) + "\n")
    proc = run_script("-m", "scripts.plot", run, "--keys=val_cee", data_dir=tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1
