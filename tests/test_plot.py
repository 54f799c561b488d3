"""scripts/plot.py: runs' curves and evaluate.py's JSON files drawn to a figure, the points drawn written beside it, a
partial last line skipped; and its refusals, each one line that writes and replaces no file."""

import importlib.util
import json
import os
import shutil

import pytest

from conftest import assert_one_line_error, run_script, train_det, write

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is optional (pip install matplotlib); CI installs it")


@pytest.mark.slow
@needs_matplotlib
def test_plot_draws_two_runs_to_a_png(data_root, tmp_path):
    for run in ("a", "b"):
        train_det(data_root, tmp_path / run, "--max_iters=4", "--eval_interval=2")
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


def fake_run(folder, losses):
    """A run folder as plot.py reads it: metrics.jsonl with an evaluation per loss."""
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"iter": 2 * i, "val_loss": v}) + "\n"
                                                  for i, v in enumerate(losses)))


@pytest.mark.slow
@needs_matplotlib
def test_plot_draws_two_runs_of_the_same_name_as_two_curves_and_redraws_its_own_file(tmp_path):
    fake_run(tmp_path / "a" / "run", [3.0, 2.0])
    fake_run(tmp_path / "b" / "run", [3.5, 1.5])
    out = tmp_path / "curves.png"
    for _ in range(2):  # the second time over the files the first wrote
        run_script("-m", "scripts.plot", tmp_path / "a" / "run", tmp_path / "b" / "run", f"--out={out}",
                   data_dir=tmp_path)
    drawn = json.loads((tmp_path / "curves.json").read_text())
    assert drawn["val_loss"] == {str(tmp_path / "a" / "run"): [[0, 3.0], [2, 2.0]],
                                 str(tmp_path / "b" / "run"): [[0, 3.5], [2, 1.5]]}


@pytest.mark.slow
@pytest.mark.parametrize("taken", ["curves.json", "curves.png"])
def test_plot_never_replaces_a_file_it_did_not_write(taken, tmp_path):
    """evaluate.py --out_json=curves.json, or a study's figure, where --out=curves.png would write: refused, kept."""
    fake_run(tmp_path / "run", [3.0, 2.0])
    (tmp_path / taken).write_text('{"task": "lm", "results": {"run": {"nll": 1.2}}}')
    proc = run_script("-m", "scripts.plot", tmp_path / "run", f"--out={tmp_path / 'curves.png'}", data_dir=tmp_path,
                      check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{tmp_path / taken}" in proc.stderr and "--out" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run", taken])
    assert (tmp_path / taken).read_text() == '{"task": "lm", "results": {"run": {"nll": 1.2}}}'


@pytest.mark.slow
@pytest.mark.parametrize("args, named", [
    (["{tmp}/run", "{tmp}/run/"], ("{tmp}/run", "twice")),
    (["{tmp}/run", "--out={tmp}/curves.json"], ("--out={tmp}/curves.json", ".png")),
    (["{tmp}/run", "--keys=", "--out={tmp}/p.png"], ("--keys=", "names no key")),
])
def test_plot_run_given_twice_an_out_that_is_no_figure_or_no_keys_is_one_line(args, named, tmp_path):
    fake_run(tmp_path / "run", [3.0, 2.0])
    proc = run_script("-m", "scripts.plot", *[a.format(tmp=tmp_path) for a in args], data_dir=tmp_path, check=False)
    assert_one_line_error(proc, *[n.format(tmp=tmp_path) for n in named])
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no figure written


@pytest.mark.slow
def test_plot_skips_a_partial_last_line(trained, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional (pip install matplotlib); CI installs it")
    shutil.copytree(trained, tmp_path / "run")
    write(tmp_path / "run" / "metrics.jsonl", '{"iter": 9, "val_lo', mode="a")
    proc = run_script("-m", "scripts.plot", tmp_path / "run", f"--out={tmp_path / 'p.png'}", data_dir=tmp_path)
    assert "ends in a partial line" in proc.stderr and (tmp_path / "p.png").exists()
    assert json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())["iter"] == 0
