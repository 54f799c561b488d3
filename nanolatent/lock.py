"""An out_dir's one writer: an exclusive lock held for the life of the process (flock, or a heartbeat file where
the filesystem has none), taken by every script that writes a run; what killed writers left is removed on taking it."""

import atexit
import contextlib
import errno
import os
import re
import shutil
import socket
import threading
import time

from nanolatent.ckpt import CHECKPOINTS
from nanolatent.common import die


_locks = {}  # out_dir's real path -> its open lock file: the locks live as long as the process
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # NFS without lockd, Lustre mounted noflock, some FUSE


def lock_out_dir(out_dir, who):
    """One writer per out_dir: an exclusive flock on out_dir/.lock, released by the OS when the process ends, however
    it ends (kill -9 included), so it is never left held. Where the filesystem has no flock, a lock file instead
    (HeldFile). A second writer stops at once, naming the first. A process that holds the lock already
    (convert.main called twice in one process) keeps it."""
    import fcntl
    refuse_file_out_dir(out_dir)
    if os.path.realpath(out_dir) in _locks:
        return
    try:
        os.makedirs(out_dir, exist_ok=True)
        f = open(os.path.join(out_dir, ".lock"), "a+")
    except OSError as e:
        die(f"cannot write to out_dir {out_dir}: {e.strerror or e}; choose a writable --out_dir")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.seek(0)
        f.truncate()
        f.write(f"{who} (pid {os.getpid()})")
        f.flush()
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        die(f"{out_dir} is in use by {holder}: wait for it to finish, or choose another --out_dir")
    except OSError as e:
        f.close()
        if e.errno not in NO_FLOCK:
            die(f"cannot lock out_dir {out_dir}: {e.strerror or e}; choose an --out_dir on another filesystem")
        f = HeldFile(out_dir, who)
    _locks[os.path.realpath(out_dir)] = f
    # Only the lock holder writes temporary files here, so any left now are from a writer killed mid-write
    # (kill -9 during a checkpoint save): nobody will rename them, and a checkpoint's is as large as the model.
    stale = [name for name in os.listdir(out_dir) if re.fullmatch(r".+\.tmp\d+", name)]
    for name in stale:
        os.remove(os.path.join(out_dir, name))
    folders = os.path.join(out_dir, CHECKPOINTS)  # train.py's saves and deletions killed halfway (prune)
    for name in os.listdir(folders) if os.path.isdir(folders) else []:
        if re.fullmatch(r"iter_\d+\.(tmp|old)", name):
            shutil.rmtree(os.path.join(folders, name))
            stale.append(os.path.join(CHECKPOINTS, name))
    if stale:
        print(f"removed {len(stale)} temporary file(s) left in {out_dir} by a writer that was killed: "
              f"{', '.join(sorted(stale))}")


class HeldFile:
    """The lock of an out_dir on a filesystem without flock: out_dir/.lock.held, created exclusively (O_EXCL) and
    naming its holder, pid and host. The holder touches it every HEARTBEAT seconds and removes it when it exits; a
    holder killed by kill -9 leaves it behind, and the next writer takes it over when its process is gone (same
    host) or it has not been touched for STALE seconds (another host: a job requeued on another node)."""

    HEARTBEAT, STALE = 30, 120

    def __init__(self, out_dir, who):
        self.path = os.path.join(out_dir, ".lock.held")
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                break
            except FileExistsError:
                holder, gone = self.holder()
                if not gone:
                    die(f"{out_dir} is in use by {holder} (the filesystem has no flock: {self.path} says so): wait "
                        f"for it to finish, choose another --out_dir, or delete {self.path} if that process is gone")
                print(f"took over the lock of {holder}: {gone}")
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
        with os.fdopen(fd, "w") as f:
            f.write(f"{who} (pid {os.getpid()} on {socket.gethostname()})")
        self.stopped = threading.Event()
        threading.Thread(target=self.beat, daemon=True).start()
        atexit.register(self.close)

    def holder(self):
        """(what the lock file says, why its holder is gone or None while it may be alive)."""
        try:
            with open(self.path) as f:
                holder = f.read().strip() or "another process"
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return "a writer that just finished", "its lock is gone"
        m = re.fullmatch(r".*\(pid (\d+) on (\S+)\)", holder)
        if m and m.group(2) == socket.gethostname():
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                return holder, "that process is no longer running"
            except PermissionError:  # alive, another user's
                pass
            return holder, None
        return holder, (f"its lock was last touched {age:.0f} s ago" if age > self.STALE else None)

    def beat(self):
        while not self.stopped.wait(self.HEARTBEAT):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def close(self):
        if not self.stopped.is_set():
            self.stopped.set()
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


def refuse_file_out_dir(out_dir):
    """out_dir names a run's folder; the path of its ckpt.pt (which sample.py and evaluate.py take) is one line
    naming the folder, not a message about out_dir/ckpt.pt/ckpt.pt."""
    if os.path.isfile(out_dir):
        die(f"--out_dir={out_dir} is a file{' (a checkpoint)' if out_dir.endswith('.pt') else ''}: out_dir is the "
            f"run's folder, --out_dir={os.path.dirname(out_dir) or '.'}")


def release_out_dir(out_dir):
    """Give back lock_out_dir's lock before the process ends: for a writer called as a function (convert.main in
    a notebook or a test), so the process can go on while another writes there."""
    lock = _locks.pop(os.path.realpath(out_dir), None)
    if lock is not None:
        lock.close()  # closing the file releases the flock; a HeldFile removes itself
