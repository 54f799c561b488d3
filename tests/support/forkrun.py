"""torchrun --standalone for the suite's multi-process runs: the workers are forks of this process, which (run by
tests/conftest.py's run_script, a fork of launcher.py) has imported torch; under torchrun each worker is a new
interpreter that imports it, most of a tiny run's time on two cores. Each worker gets the variables train.py reads
from torchrun (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); as under torchrun, the
first worker to fail ends the others and the job exits 1. The job is this process and its workers, parent first, as
torchrun's is (kill_in_save.py kills it whole). torchrun itself runs test_resume's jobs SIGKILLed at random
steps, SIGTERMed, or losing a process, and test_train's DDP run.

    python tests/support/forkrun.py --nproc_per_node=2 train.py ARGS...
"""

import os
import signal
import socket
import sys

from launcher import script


def main(nproc, argv):
    with socket.socket() as s:  # a free port for rank 0's store, as torchrun --standalone picks one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            os._exit(script(argv, os.getcwd()))
        workers.append(pid)
    code = 0
    while workers:
        pid, status = os.wait()
        workers.remove(pid)
        if os.waitstatus_to_exitcode(status) and not code:
            code = 1
            for other in workers:
                os.kill(other, signal.SIGKILL)
    return code


if __name__ == "__main__":
    flag, *argv = sys.argv[1:]
    sys.exit(main(int(flag.removeprefix("--nproc_per_node=")), argv))
