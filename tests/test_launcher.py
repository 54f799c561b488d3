"""The suite's launcher (tests/support/launcher.py): a script run as its fork gives what its own process gives;
tests/support/forkrun.py gives its workers torchrun's variables and ends the job when one fails."""

import subprocess
import sys

import pytest

from conftest import FORKRUN, ROOT, TINY, Launcher, run_script, script_env


@pytest.mark.slow
@pytest.mark.parametrize("args", [["train.py", "--model_type=det", *TINY, "--n_layer=0"],
                                  ["sample.py", "--out_dir=/nonexistent/run"],
                                  ["-m", "scripts.convert", "to_hf", "--out_dir=/nonexistent/run", "--dst=/tmp/x"]])
def test_a_forked_script_exits_and_prints_as_its_own_process(args, tmp_path):
    env = script_env(tmp_path)
    launcher = Launcher.started(env)
    launched = len(launcher.jobs)
    forked = run_script(*args, data_dir=tmp_path, check=False)
    assert len(launcher.jobs) == launched + 1  # a fork of the launcher ran it
    own = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert forked.returncode == own.returncode == 2
    assert (forked.stdout, forked.stderr) == (own.stdout, own.stderr) and own.stderr.count("\n") == 1


@pytest.mark.slow
def test_forkrun_gives_each_worker_its_rank_and_a_failed_worker_ends_the_job(tmp_path):
    """Rank 1 fails at once; rank 0, which would wait 10 minutes, is killed and the job exits 1, as under torchrun."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, sys, time\n"
                      "print(*(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE')))\n"
                      "sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(600)\n")
    proc = run_script(FORKRUN, "--nproc_per_node=2", worker, data_dir=tmp_path, check=False, timeout=60)
    assert proc.returncode == 1 and sorted(proc.stdout.splitlines()) == ["0 0 2 2", "1 1 2 2"], proc
