"""nanolatent/lock.py, one writer per out_dir: a second train.py stops at once naming the first, and --eval_only takes
no lock, so it reads a run that is training; where the filesystem has no flock (Lustre mounted noflock, NFS without
lockd) flock is made to fail as there, and the lock file that stands in for it is checked in process and against a
second process."""

import contextlib
import errno
import fcntl
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, assert_one_line_error, snapshot, train_det

from nanolatent import lock

HOST = socket.gethostname()


@pytest.fixture
def no_flock(monkeypatch):
    def flock(f, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", flock)


@pytest.fixture
def out_dir(tmp_path):
    yield tmp_path / "run"
    lock.release_out_dir(tmp_path / "run")  # a test that took the lock gives it back


SECOND_WRITER = """
import errno, fcntl, os, sys
def flock(f, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
fcntl.flock = flock
from nanolatent import lock
lock.lock_out_dir(sys.argv[1], "rlvr.py")
"""


@pytest.mark.slow  # starts two processes
def test_without_flock_a_lock_file_names_the_writer_and_stops_a_second_one(no_flock, out_dir):
    lock.lock_out_dir(out_dir, "train.py")
    held = out_dir / ".lock.held"
    assert held.read_text() == f"train.py (pid {os.getpid()} on {HOST})"
    proc = subprocess.run([sys.executable, "-c", SECOND_WRITER, str(out_dir)], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"is in use by train.py (pid {os.getpid()} on {HOST})" in proc.stderr and str(held) in proc.stderr
    assert held.read_text() == f"train.py (pid {os.getpid()} on {HOST})"  # the second writer left it alone
    lock.release_out_dir(out_dir)
    assert not held.exists()
    proc = subprocess.run([sys.executable, "-c", SECOND_WRITER, str(out_dir)], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and not held.exists()  # released: it took the lock, and gave it back at its exit


@pytest.mark.slow  # starts a process, for a pid that is gone
def test_a_lock_file_of_a_process_that_is_gone_is_taken_over(no_flock, out_dir, capsys):
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    os.makedirs(out_dir)
    (out_dir / ".lock.held").write_text(f"train.py (pid {dead.pid} on {HOST})")  # killed by kill -9
    lock.lock_out_dir(out_dir, "train.py")
    assert f"took over the lock of train.py (pid {dead.pid} on {HOST}): that process is no longer running" in \
        capsys.readouterr().out
    assert (out_dir / ".lock.held").read_text() == f"train.py (pid {os.getpid()} on {HOST})"


@pytest.mark.parametrize("silent_s, taken", [(600, True), (10, False)])
def test_a_lock_file_of_another_host_is_stale_once_its_heartbeat_stops(silent_s, taken, no_flock, out_dir, capsys):
    os.makedirs(out_dir)
    held = out_dir / ".lock.held"
    held.write_text("train.py (pid 4242 on node-17)")  # a job on another node: its pid says nothing here
    os.utime(held, (time.time() - silent_s,) * 2)
    if taken:
        lock.lock_out_dir(out_dir, "train.py")
        assert "last touched 600 s ago" in capsys.readouterr().out
        assert held.read_text() == f"train.py (pid {os.getpid()} on {HOST})"
    else:
        with pytest.raises(SystemExit) as stop:
            lock.lock_out_dir(out_dir, "train.py")
        assert stop.value.code == 2 and "is in use by train.py (pid 4242 on node-17)" in capsys.readouterr().err
        assert held.read_text() == "train.py (pid 4242 on node-17)"


def test_the_holder_keeps_its_lock_file_fresh(no_flock, out_dir, monkeypatch):
    monkeypatch.setattr(lock.HeldFile, "HEARTBEAT", 0.05)
    lock.lock_out_dir(out_dir, "train.py")
    held = out_dir / ".lock.held"
    os.utime(held, (time.time() - 600,) * 2)
    time.sleep(0.5)
    assert time.time() - os.path.getmtime(held) < 5


def test_another_flock_failure_is_one_line(monkeypatch, out_dir, capsys):
    def flock(f, operation):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(SystemExit) as stop:
        lock.lock_out_dir(out_dir, "train.py")
    assert stop.value.code == 2 and f"cannot lock out_dir {out_dir}: Input/output error" in capsys.readouterr().err


@contextlib.contextmanager
def held(folder):
    """folder/.lock held as a running train.py holds it."""
    with open(folder / ".lock", "w") as lock:
        lock.write("train.py (pid 4242)")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


@pytest.mark.slow
def test_a_second_writer_stops_at_once_naming_the_first(run, data_root):
    with held(run):
        before = snapshot(run)
        proc = train_det(data_root, run, "--init_from=resume", "--max_iters=6", check=False)
        assert_one_line_error(proc, "is in use by train.py (pid 4242)")
        assert snapshot(run) == before
    train_det(data_root, run, "--init_from=resume", "--max_iters=6")  # released: the lock never outlives its holder


@pytest.mark.slow
def test_eval_only_takes_no_lock_so_it_reads_a_run_that_is_training(run, data_root):
    with held(run):
        before = snapshot(run)
        proc = train_det(data_root, run, "--eval_only=True")
        assert "val_loss" in proc.stdout and snapshot(run) == before
