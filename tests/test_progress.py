"""Progress lines (nanolatent/common.py progress, phase, first_call) on the phases that take more than ~10 s on a
2-core CPU: quiet outside a terminal unless NANOLATENT_PROGRESS=S asks for a line every S seconds (0: every item, how
these tests see them), off under --quiet; and a line in each phase's own output."""

import json
import os
import subprocess
import sys
import urllib.request

import pytest

import configurator
from conftest import ROOT, run_script, start_script, train_det, wait_for_line
from nanolatent import common

EVERY_ITEM = {common.PROGRESS_ENV: "0"}


@pytest.fixture
def lines(monkeypatch, capsys):
    """The progress lines (stderr) of what the test ran, with NANOLATENT_PROGRESS as set."""
    monkeypatch.delenv(common.PROGRESS_ENV, raising=False)
    return lambda: capsys.readouterr().err.splitlines()


def test_progress_is_quiet_outside_a_terminal(lines):
    assert list(common.progress(range(3), desc="items")) == [0, 1, 2] and lines() == []


def test_progress_lines_every_item_when_asked(lines, monkeypatch):
    monkeypatch.setenv(common.PROGRESS_ENV, "0")
    assert list(common.progress(iter("abcd"), desc="letters", total=4)) == list("abcd")
    out = lines()
    assert [line.split(",")[0] for line in out] == ["letters: 1/4 (25%)", "letters: 2/4 (50%)", "letters: 3/4 (75%)",
                                                    "letters: 4/4 (100%)"]
    assert all("s elapsed, ETA " in line for line in out)


def test_progress_is_a_bar_on_a_terminal_and_off_under_off(lines, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert list(common.progress(range(5), desc="on a terminal")) == list(range(5))
    assert "on a terminal" in "".join(lines())  # tqdm's bar
    monkeypatch.setenv(common.PROGRESS_ENV, "off")
    with common.phase("loading"):
        assert list(common.progress(range(5), desc="off")) == list(range(5))
    assert lines() == []


def test_a_phase_says_its_name_then_its_time_and_first_call_only_the_first(lines, monkeypatch):
    monkeypatch.setenv(common.PROGRESS_ENV, "0")
    square = common.first_call(lambda x: x * x, "compiling")
    assert [square(3), square(4)] == [9, 16]
    out = lines()
    assert len(out) == 2 and out[0] == "compiling ..." and out[1].startswith("compiling: done in ")


def test_scoring_a_text_shows_its_passes(lines, monkeypatch):
    import torch
    from nanolatent import models, sampling
    monkeypatch.setenv(common.PROGRESS_ENV, "0")
    model = models.build_model("eve", dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=1, block_size=16, vocab_size=11))
    scores = sampling.token_uncertainty(model.eval(), [1, 2, 3, 4, 5], 3, torch.Generator().manual_seed(0))
    assert scores["passes"] == 3 and [line.split(",")[0] for line in lines()] == [
        "passes over the text: 1/3 (33%)", "passes over the text: 2/3 (67%)", "passes over the text: 3/3 (100%)"]


def test_quiet_turns_progress_off_here_and_in_the_processes_started(lines, monkeypatch):
    monkeypatch.setenv(common.PROGRESS_ENV, "0")
    namespace = {"__file__": os.path.join(ROOT, "sample.py"), "num_samples": 4}
    config, _ = configurator.apply(namespace, ["--quiet", "--num_samples=2"])
    assert config == {"num_samples": 2} and os.environ[common.PROGRESS_ENV] == "off"
    assert list(common.progress(range(3), desc="quiet")) == [0, 1, 2] and lines() == []


# ----------------------------------------------------------------------------------------------------------------
# each long phase's output


@pytest.fixture(scope="module")
def det_run(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("progress") / "det"
    train_det(data_root, out, "--max_iters=2", "--eval_interval=2")
    return out


@pytest.mark.slow
def test_sample_shows_its_loading_and_the_first_call_compilation(det_run, data_root):
    proc = run_script("sample.py", f"--out_dir={det_run}", "--start=K>", "--num_samples=1", "--max_new_tokens=3",
                      "--compile=True", data_dir=data_root, env=EVERY_ITEM)
    err = proc.stderr.splitlines()
    for name in (f"loading {det_run}", "compiling the decode step"):
        assert f"{name} ..." in err and any(line.startswith(f"{name}: done in ") for line in err), proc.stderr
    # a line per new token fed back, block by block, with the samples unchanged
    summary = run_script("sample.py", f"--out_dir={det_run}", "--start=K>", "--num_samples=2", "--max_new_tokens=4",
                         "--summary=True", "--groups=1", data_dir=data_root, env=EVERY_ITEM)
    ticks = [line.split(",")[0] + "," + line.split(",")[1] for line in summary.stderr.splitlines() if
             line.startswith("block ")]
    assert ticks == [f"block {b} of 2, new tokens: {i}/3 ({i / 3:.0%})" for b in (1, 2) for i in (1, 2, 3)]
    assert summary.stdout == run_script("sample.py", f"--out_dir={det_run}", "--start=K>", "--num_samples=2",
                                        "--max_new_tokens=4", "--summary=True", "--groups=1", data_dir=data_root).stdout
    quiet = run_script("sample.py", f"--out_dir={det_run}", "--start=K>", "--num_samples=1", "--max_new_tokens=3",
                       data_dir=data_root)  # a log: no variable, no line
    assert "loading" not in quiet.stderr and quiet.stdout.count("---------------") == 1


@pytest.mark.slow
def test_train_shows_its_first_compiled_step(data_root, tmp_path):
    from conftest import TINY
    args = ("train.py", "--model_type=det", *TINY, "--max_iters=2", "--eval_interval=2", "--compile=True")
    proc = run_script(*args, f"--out_dir={tmp_path / 'shown'}", data_dir=data_root, env=EVERY_ITEM)
    err, name = proc.stderr.splitlines(), "first training step (torch.compile compiles it)"
    assert f"{name} ..." in err and sum(line.startswith(f"{name}: done in ") for line in err) == 1, proc.stderr
    quiet = run_script(*args, f"--out_dir={tmp_path / 'quiet'}", data_dir=data_root)  # a log: no variable, no line
    assert name not in quiet.stderr and "done. Sample from" in quiet.stdout


@pytest.mark.slow
def test_evaluate_shows_loading_and_its_batches(det_run, data_root):
    proc = run_script("evaluate.py", f"--out_dir={det_run}", "--max_tokens=600", "--batch_size=2", "--seq_len=64",
                      data_dir=data_root, env=EVERY_ITEM)
    err = proc.stderr.splitlines()
    assert f"loading {det_run} ..." in err
    batches = [line for line in err if line.startswith("lm batches: ")]
    assert batches[-1].startswith("lm batches: 5/5 (100%)"), proc.stderr  # 600 tokens, windows of 64, 2 a batch


@pytest.mark.slow
def test_a_studys_grid_shows_its_runs(det_run, data_root, tmp_path, monkeypatch, capsys):
    from experiments import study
    monkeypatch.setenv(common.PROGRESS_ENV, "0")
    study.train_all_missing({str(det_run): [], str(det_run) + "/": []})  # both finished: nothing to train
    assert [line.split(",")[0] for line in capsys.readouterr().err.splitlines()] == [
        "training runs started: 1/2 (50%)", "training runs started: 2/2 (100%)"]


@pytest.mark.slow
def test_the_explorer_shows_its_start_up_before_it_serves_and_each_model_it_loads(det_run, data_root, tmp_path):
    """The start-up loads the run the page opens with (its first view then loads nothing); a view that needs the run
    as another model type shows that loading too."""
    out, err = tmp_path / "out", tmp_path / "err"
    proc = start_script("-m", "scripts.explore", f"--out_dir={det_run}", "--port=0", data_dir=data_root, out=out,
                        err=err, env=EVERY_ITEM)
    try:
        url = wait_for_line(out, "serving", proc).split("http://")[1].split()[0]
        started = open(err).read().splitlines()
        assert started[0] == f"loading {det_run} ..." and started[1].startswith(f"loading {det_run}: done in ")
        for view, fields in (("uncertainty", dict(text="K>__KKKKKKKK__", passes="1", seed="1")),
                             ("minds", dict(prompt="K>", k="2", sigma="0.1", max_new_tokens="4", temperature="1",
                                            latent_seed="1", seed="1"))):
            request = urllib.request.Request(f"http://{url}/api/{view}", method="POST",
                                             data=json.dumps({"run": str(det_run), **fields}).encode())
            with urllib.request.urlopen(request, timeout=120) as response:
                assert response.status == 200 and "error" not in response.read().decode()
        loads = [line for line in open(err).read().splitlines() if line.startswith("loading ")]
        assert [line.split(" ...")[0] for line in loads if line.endswith(" ...")] == [  # the mean model: σ = 0
            f"loading {det_run}", f"loading {det_run} as btrans", f"loading {det_run} as btrans"]
    finally:
        proc.terminate()
    quiet = start_script("-m", "scripts.explore", f"--out_dir={det_run}", "--port=0", "--quiet", data_dir=data_root,
                         out=tmp_path / "quiet.out", err=tmp_path / "quiet.err", env=EVERY_ITEM)
    try:
        wait_for_line(tmp_path / "quiet.out", "serving", quiet)
        assert open(tmp_path / "quiet.err").read() == ""
    finally:
        quiet.terminate()


def test_the_speedrun_bench_reads_each_arms_step_from_its_log(tmp_path):
    from scripts import bench_speedrun
    log = tmp_path / "log"
    log.write_text("number of parameters: 0.8M\n")
    assert bench_speedrun.logged_step(log, ["python", "train.py", "--max_iters=2000"]) is None
    log.write_text("iter 0: loss 4.2, time 90ms\nstep 0: train loss 4.2\niter 17: loss 3.1, time 88ms\n")  # nanoGPT
    assert bench_speedrun.logged_step(log, ["python", "train.py", "--max_iters=50", "--max_iters=2000"]) == (17, 2000)
    log.write_text("iter 10/150: loss 2.9 | 80 ms\niter 20/150: loss 2.5 | 81 ms\n")  # ours: the total in the line
    assert bench_speedrun.logged_step(log, ["python", "train.py", "config/det_speedrun_char.py"]) == (20, 150)


@pytest.mark.slow
def test_the_speedrun_bench_shows_an_arms_step_and_eta_while_it_runs(tmp_path, monkeypatch, capsys):
    from scripts import bench_speedrun
    monkeypatch.setenv(common.PROGRESS_ENV, "1")  # a line a second
    child = "import time\nfor i in range(1, 5):\n    print(f'iter {i}: loss 1.0', flush=True)\n    time.sleep(1)\n"
    seconds, _ = bench_speedrun.timed_run([sys.executable, "-c", child, "--max_iters=4"], str(tmp_path),
                                          dict(os.environ), tmp_path / "arm.log")  # and the loads before, after
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2 and all(line.startswith("-c in ") and ", ETA " in line for line in lines), lines
    steps = [int(line.split("step ")[1].split("/")[0]) for line in lines]
    assert steps == sorted(steps) and set(steps) <= {1, 2, 3, 4} and all("/4, " in line for line in lines)
    assert 4 <= seconds < 30 and open(tmp_path / "arm.log").read().count("iter ") == 4


@pytest.mark.slow
def test_the_suites_quiet_output_names_each_file_as_it_runs():
    """The README's `python -m pytest -q tests` shows where a slow suite is: a line per file with its share done."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_help.py",
                           "tests/test_progress.py", "-k", "h_is_help or quiet_outside"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("tests/test_help.py .") and line.endswith("%]") for line in lines), proc.stdout
    assert any(line.startswith("tests/test_progress.py .") and line.endswith("[100%]") for line in lines), proc.stdout
