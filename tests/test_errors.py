"""Everyday mistakes, each run as a user runs it: one line on stderr, exit code 2, no traceback, and nothing on disk
changed. Then the cases that must be accepted and do the right thing (eval_only, a partial log line, a lock), and
stopping: Ctrl-C, SIGTERM and a full disk (simulated by a sitecustomize.py the subprocess imports) leave a loadable
checkpoint at the expected step and no temporary file."""

import subprocess

import pytest

from conftest import FORKRUN, TINY, assert_one_line_error, run_script, train_in_process


# ----------------------------------------------------------------------------------------------------------------
# train.py


@pytest.mark.parametrize("world_size", ["0", "-2", "two"])
def test_a_dry_run_under_a_world_size_that_is_no_number_of_processes_is_one_line(world_size, data_root, tmp_path,
                                                                                   monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    code, out, err = train_in_process(monkeypatch, capsys, data_root, tmp_path / "fresh", "--dry_run=True")
    assert_one_line_error(subprocess.CompletedProcess([], code, out, err), f"WORLD_SIZE={world_size!r}",
                          "--dry_run_world_size")


# ----------------------------------------------------------------------------------------------------------------
# stopping: Ctrl-C, SIGTERM, a full disk


# ----------------------------------------------------------------------------------------------------------------
# rlvr.py and convert.py write runs too


# ----------------------------------------------------------------------------------------------------------------
# sample.py, prepare.py, evaluate.py


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
