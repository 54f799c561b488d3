"""What every script shares: one-line errors (die), seeded draws, devices, dtypes and autocast, GPUs' peak FLOPs, a
progress line, matplotlib if present, free disk space, a file replaced in one rename, a training loop's stop on a
signal, the CPU's thread count. Model files never import this module."""

import contextlib
import os
import shutil
import signal
import sys
import threading
import time

import numpy as np
import torch


# Peak dense bf16 tensor throughput by device name, for MFU; None where unknown (and on CPU).
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}


def peak_flops(device):
    if not str(device).startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


PROGRESS_ENV = "NANOLATENT_PROGRESS"  # "off" (--quiet sets it), or S: plain lines every S seconds outside a terminal


def progress_every():
    """None for no progress lines, 'bar' for tqdm's bar (a terminal), or S: a plain line every S seconds (0: after
    every item). Quiet where the output is not a terminal (a log, CI, a pipe) unless NANOLATENT_PROGRESS=S asks."""
    setting = os.environ.get(PROGRESS_ENV, "")
    if setting == "off":
        return None
    try:
        return float(setting)
    except ValueError:
        return "bar" if sys.stderr.isatty() else None


def progress(iterable, desc="", total=None):
    """Each item of iterable, with a progress line on stderr for a phase that can take more than ~10 s on a 2-core
    CPU: on a terminal tqdm's bar (tqdm comes with datasets), done/total, rate and ETA; elsewhere nothing, or with
    NANOLATENT_PROGRESS=S a plain line every S seconds: done/total, elapsed and ETA."""
    every = progress_every()
    if every == "bar":
        from tqdm import tqdm
        yield from tqdm(iterable, desc=desc, total=total, leave=False)
        return
    total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
    start = last = time.time()
    for i, item in enumerate(iterable):
        yield item
        now = time.time()
        if every is not None and now - last >= every:
            last = now
            done = f"{i + 1}/{total} ({(i + 1) / total:.0%})" if total else f"{i + 1}"
            eta = f", ETA {(now - start) / (i + 1) * (total - i - 1):.0f} s" if total else ""
            print(f"{desc}: {done}, {now - start:.0f} s elapsed{eta}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def phase(desc):
    """A phase that is one call, not an iteration (loading a model, a first compilation): its name on stderr as it
    starts and its time as it ends, where progress() would show a line."""
    if progress_every() is None:
        yield
        return
    print(f"{desc} ...", file=sys.stderr, flush=True)
    start = time.time()
    yield
    print(f"{desc}: done in {time.time() - start:.1f} s", file=sys.stderr, flush=True)


def first_call(fn, desc):
    """fn, its first call inside phase(desc): a compiled function compiles there."""
    calls = []

    def call(*args, **kwargs):
        if calls:
            return fn(*args, **kwargs)
        calls.append(1)
        with phase(desc):
            return fn(*args, **kwargs)
    return call


def pyplot(who):
    """matplotlib is optional: pyplot for writing files, or one line saying what needs it."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        die(f"{who} needs matplotlib: pip install matplotlib")
    return plt


def free_space(path):
    """', N MiB free on that disk' for a message about a failed write ('' when the folder is gone)."""
    try:
        return f", {shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free / 2**20:,.0f} MiB free on that disk"
    except OSError:
        return ""


@contextlib.contextmanager
def replacing(path):
    """A temporary name of this process beside path for the block to write; renamed to path when the block ends (a
    kill leaves the old file or the new one, never a part, and two writers never share a temporary name), removed
    when it raises (the error goes on to the caller)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class Refused(SystemExit):
    """die's exit (code 2), holding its message: a script ends on it; a caller that goes on (the explorer's server)
    catches it and shows the message."""

    def __init__(self, message):
        super().__init__(2)
        self.message = message


def die(message):
    """One clear line on stderr and exit code 2: the scripts' answer to bad input. Under torchrun every process meets
    the same bad input: rank 0 says it, the others exit 2 silently (the line once, not once per GPU)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr)
    raise Refused(message)


def read_text_file(flag, path):
    """The text of the file --flag=FILE:path names (sample.py's prompt, evaluate.py's text): UTF-8 whatever the
    locale, as prepared text is, a byte-order mark dropped; a folder, a missing file or another encoding is one line."""
    if os.path.isdir(path):
        die(f"--{flag}=FILE:{path} is a folder; give the path of a UTF-8 text file")
    if not os.path.isfile(path):
        die(f"--{flag}=FILE:{path}: no such file; give the path of a UTF-8 text file")
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError as e:
        die(f"--{flag}=FILE:{path} is not UTF-8 text (byte {e.start}: {e.reason}); convert it, e.g. iconv -t utf-8")


def seeded(seed, *key):
    """A generator for the draws of (seed, *key), non-negative ints: every batch and every noise draw of a run derives
    from its step (and micro-step, process, ...), so a resumed run, or one on another number of processes, draws
    exactly what an uninterrupted single run draws, with no generator state to save."""
    return np.random.default_rng([seed, *key])


def seed_of(seed, *key):
    """An int seed for torch (manual_seed, torch.Generator) from the stream (seed, *key)."""
    return int(seeded(seed, *key).integers(2**62))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(device, dtype):
    """(device_type, the context a forward runs in): torch.autocast to bfloat16/float16, or nothing for float32."""
    if dtype not in DTYPES:
        die(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device_type = "cuda" if str(device).startswith("cuda") else "cpu"
    if DTYPES[dtype] == torch.float32:
        return device_type, contextlib.nullcontext()
    return device_type, torch.autocast(device_type=device_type, dtype=DTYPES[dtype])


def check_device(device):
    """One line for a device this machine does not have, before any work starts; on the CPU, the thread count."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        die(f"device={device!r} but this machine has no CUDA GPU (or this torch build has no CUDA): use --device=cpu")
    if not str(device).startswith(("cuda", "cpu", "mps")):
        die(f"device must be cpu, cuda, cuda:N or mps, got {device!r}")
    if str(device).startswith("mps") and not torch.backends.mps.is_available():
        die(f"device={device!r} but this machine has no Apple GPU (or this torch build has no MPS): use --device=cpu")
    if str(device).startswith("cuda:") and torch.cuda.is_available():
        index = device.split(":", 1)[1]
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            die(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA GPU(s): use cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}")
    if str(device) == "cpu":
        cpu_threads()


def cpu_threads():
    """Threads for torch's CPU kernels. torch takes one per core, which on a machine shared with other work makes
    each thread wait for a core and the run several times slower (docs/training.md, Shared CPUs). Unless
    OMP_NUM_THREADS says otherwise: the cores not busy when the script starts, at least one."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    idle = cores - round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else cores
    threads = max(1, min(cores, idle))
    torch.set_num_threads(threads)
    return threads


class Stop:
    """SIGINT (Ctrl-C) and SIGTERM (kill, a scheduler's preemption) during a training loop: the handler only notes
    the signal, and the loop, between two whole steps, saves and exits (stopping inside an optimizer step would
    save half an update). A second signal stops at once, without saving: the last checkpoint stays as it is."""

    STUCK = 10  # seconds a signal may wait for the interpreter before the process leaves without saving

    def __init__(self):
        self.signum, self.handled = 0, 0
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.handle)
        # The handler above runs only between two bytecodes of the main thread: never while it waits in C++ code, as
        # in a collective whose other process died (until dist_timeout), where torchrun's SIGTERM to the survivors
        # would go unread until its SIGKILL 30 s later. The C-level handler also writes each signal's number to this
        # pipe, at once; a thread that reads it ends the process when the handler has not run STUCK seconds later.
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self.watch, args=(read,), daemon=True).start()

    def watch(self, read):
        seen = 0
        while True:
            signum = os.read(read, 1)[0]
            if signal.getsignal(signum) != self.handle:  # another signal, or this Stop's handlers are gone
                continue
            seen += 1
            deadline = time.time() + self.STUCK
            while self.handled < seen and time.time() < deadline:
                time.sleep(0.05)
            if self.handled < seen:
                os.write(2, f"\nstopped by {signal.Signals(signum).name} without saving: the process was blocked "
                            f"{self.STUCK} s in a collective or another call (a lost process?); the last checkpoint "
                            f"is unchanged\n".encode())
                os._exit(128 + signum)

    def handle(self, signum, frame):
        self.handled += 1
        if self.signum:
            print(f"\nstopped by a second {signal.Signals(signum).name} without saving: the last checkpoint is "
                  f"unchanged", file=sys.stderr)
            self.exit(128 + signum)  # SystemExit: a checkpoint being written removes its temporary file
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: saving at the end of this step, then stopping (again to stop "
              f"without saving)", flush=True)

    def __bool__(self):
        return bool(self.signum)

    def exit(self, code):
        """sys.exit(code) once the run is saved, with the default handlers back: a signal during the interpreter's
        exit (atexit callbacks, such as torch's) then ends the process at once, without a traceback."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        sys.exit(code)


# ----------------------------------------------------------------------------------------------------------------
# models


