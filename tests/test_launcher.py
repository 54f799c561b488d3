"""The suite's launcher (tests/launcher.py): a script run as its fork gives what its own process gives."""

import subprocess
import sys

import pytest

from conftest import ROOT, TINY, Launcher, run_script, script_env


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
