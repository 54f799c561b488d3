"""The suite's launcher: imports torch once, then runs each script it is sent in a fork of itself as `python <script>
args...` would (tests/conftest.py's run_script, start_script): importing torch is most of a tiny run's time on two
cores. What differs from a process of its own: torch, numpy and the parts of torch train.py loads (distributed
checkpoints; dynamo, through the meta device's initialisation) are imported before the script runs (what they print
at import, the launcher printed once), and str hashes use the launcher's seed.

Protocol, a line each way: in, a JSON request {"id", "argv", "cwd", "env", "out", "err"}; out, "<id> pid <pid>" when
forked and "<id> exit <code>" when reaped (code as subprocess's returncode: -N for signal N)."""

import atexit
import json
import os
import runpy
import select
import sys
import threading
import traceback

import numpy as np
import torch  # noqa: F401  what the forks share: 2.3 s of a 2.5 s tiny train.py run
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401

ARGS = ("argv", "cwd", "env", "out", "err")


def run(argv, cwd, env, out, err):
    """In the fork: the script's exit status, its stdin /dev/null and its stdout and stderr the files out and err."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    written = os.O_WRONLY | os.O_CREAT | os.O_APPEND  # out and err may be one file (2>&1)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, written), (2, err, written)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
    return script(argv, cwd)


def script(argv, cwd):
    """`python argv...` run in this fresh fork: its exit status, after its atexit callbacks, as the interpreter would
    end it."""
    np.random.seed()  # a fresh process seeds numpy's global generator from the OS; forks would share the server's
    try:
        if argv[0] == "-m":  # python -m: the working directory first on sys.path
            sys.argv, sys.path[0] = argv[1:], cwd
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter takes it: an int is the status, None 0, anything else printed and 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        tb = e.__traceback__  # from the script's frames on, as python prints it
        while tb and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        code = 1
    threading._shutdown()  # as the interpreter ends: its threads joined, then its atexit callbacks
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main():
    jobs, pending = {}, b""  # pid -> request id; bytes read but not yet a whole line
    while True:
        if select.select([0], [], [], 0.01)[0]:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the suite ended
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        code = run(*(request[k] for k in ARGS))
                    finally:  # whatever escapes (a signal handler raising at exit), the fork ends here
                        os._exit(code)
                jobs[pid] = request["id"]
                print(request["id"], "pid", pid, flush=True)
        while jobs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            print(jobs.pop(pid), "exit", os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
