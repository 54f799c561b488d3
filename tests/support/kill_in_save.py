"""Run a script (train.py) with a SIGKILL of the whole job injected before its Nth change to a checkpoint: the
test harness of test_resume.py, which kills a save at each of its steps.

    NANOLATENT_KILL_AT=N NANOLATENT_KILL_LOG=ops.txt python tests/support/kill_in_save.py train.py ARGS...
    ... python -m torch.distributed.run --nproc_per_node=2 tests/support/kill_in_save.py train.py ARGS...
    ... python tests/support/forkrun.py --nproc_per_node=2 tests/support/kill_in_save.py train.py ARGS...

A change is a call of os.makedirs, os.replace, os.remove, os.symlink, shutil.rmtree, torch.save or
torch.distributed.checkpoint.save naming a path under out_dir/checkpoints or out_dir/ckpt*. Rank 0 counts them and
appends each one done to the log; at the Nth it kills every process of the job before the call (torchrun or
forkrun.py and its workers, or itself), as a scheduler's SIGKILL leaves them. N=0 kills nothing: the log lists
every change of the run.
"""

import contextlib
import os
import runpy
import shutil
import signal
import sys

import torch
import torch.distributed.checkpoint as dcp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job(pid):
    """pid and its descendants, parents first. torchrun starts each worker in a session of its own, so no process
    group holds a whole job."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [pid, *(p for child in f.read().split() for p in job(int(child)))]


def kill_job(pids):
    """SIGKILL to every process of a job still running (its command names train.py, or it is a fork of the suite's
    launcher.py: a pid that ended may have been given to another process), torchrun first (it would restart or
    tear down the rest)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
            if b"train.py" in command or b"tests/support/launcher.py" in command:
                os.kill(pid, signal.SIGKILL)


def watched(module, name, path_arg):
    call = getattr(module, name)

    def wrapper(*args, **kwargs):
        global done
        path = kwargs.get("checkpoint_id", args[path_arg] if len(args) > path_arg else None)
        named = isinstance(path, (str, os.PathLike))  # not torch.save into an open file (DCP's writer)
        if not (counted and named and ("/checkpoints" in str(path) or os.path.basename(path).startswith("ckpt"))):
            return call(*args, **kwargs)
        done += 1
        if done == kill_at:  # a worker's parent (torchrun, forkrun.py) started the job; a plain run dies alone
            kill_job(job(os.getppid()) if "RANK" in os.environ else [os.getpid()])
        with open(log, "a") as f:  # before the call: a call that raises (a missing file to remove) counts too
            f.write(f"{name} {' '.join(str(a) for a in args if isinstance(a, (str, os.PathLike)))}\n")
        return call(*args, **kwargs)

    setattr(module, name, wrapper)


if __name__ == "__main__":
    kill_at, log = int(os.environ["NANOLATENT_KILL_AT"]), os.environ["NANOLATENT_KILL_LOG"]
    counted = os.environ.get("RANK", "0") == "0"
    done = 0
    for module, name, path_arg in [(os, "makedirs", 0), (os, "replace", 1), (os, "remove", 0), (os, "symlink", 1),
                                   (shutil, "rmtree", 0), (torch, "save", 1), (dcp, "save", 1)]:
        watched(module, name, path_arg)
    sys.path.insert(0, ROOT)
    sys.argv = sys.argv[1:]
    runpy.run_path(os.path.join(ROOT, sys.argv[0]), run_name="__main__")
