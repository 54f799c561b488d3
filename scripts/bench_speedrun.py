"""Time to quality: nanoGPT's CPU recipe against config/det_speedrun_char.py, each a whole process timed from its start
to its exit, one after the other, and each final model's loss on the whole val split.

    python -m scripts.bench_speedrun --nanogpt=../nanoGPT --input=input.txt --seeds=5 --threads=2
    python -m scripts.bench_speedrun --nanogpt=../nanoGPT --input=input.txt --muon_dtypes=float32,bfloat16

--nanogpt is a nanoGPT checkout (git clone https://github.com/karpathy/nanoGPT: its train.py, model.py, configurator.py,
config/train_shakespeare_char.py and data/shakespeare_char/prepare.py; never copied here), --input Tiny Shakespeare's
input.txt. Into a scratch folder (--work_dir, else a temporary one) the script copies the checkout, prepares the text
with nanoGPT's data script and with prepare.py (and checks that both wrote the same train.bin and val.bin: the same
characters, the same 90/10 split), then runs the two arms in turns, nanoGPT, ours, nanoGPT, ours, ..., every process
with OMP_NUM_THREADS=--threads (a loaded machine slows both alike; the load average is printed before each run). nanoGPT
runs its README's "I only have a macbook" command (4 layers x 128, context 64, batch 12, 2,000 steps, dropout 0, no
compile), evaluating 20 batches every 250 steps; its train.py fixes its seed, so its runs repeat one training and time
it again. Ours runs `train.py config/det_speedrun_char.py --seed=1337+i`, once in each turn per --muon_dtypes entry (an
arm each: Muon's Newton-Schulz in the machine's fast precision, 'auto', or in the one named). After each run (outside
its time) its final checkpoint is scored the same way: the mean cross-entropy per token over the whole val split cut
into windows of 64 tokens (each token predicted from the up to 63 before it in its window), by nanoGPT's model.py for
its runs and ours for ours. The table shows each run's wall time, the load average before and after it, the val loss it
printed itself and that whole-split loss; then each arm's means, and for each of ours against nanoGPT, paired by turn:
the time ratio and the whole-split loss difference with their 95% Student-t intervals, and the runs within MARGIN of
nanoGPT's loss. Extra flags for either arm: --nanogpt_args="--max_iters=500", --ours_args="--max_iters=200".
"""

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch
import torch.nn.functional as F

from experiments import stats
from nanolatent import ckpt, common, optim

nanogpt = ""  # a nanoGPT checkout (required)
input = ""  # Tiny Shakespeare's input.txt (required)
seeds = 5  # runs per arm
threads = 2  # OMP_NUM_THREADS of every run, the same for both arms
work_dir = ""  # scratch folder for the copy, the data and the runs ('' = a temporary one, deleted at the end)
nanogpt_args = ""  # extra flags for nanoGPT's train.py
ours_args = ""  # extra flags for our train.py
muon_dtypes = "auto"  # our arms: train.py's --muon_dtype of each, comma-separated ('float32,bfloat16' times both)
out_json = ""  # also write the runs and the summary here
# ----------------------------------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# nanoGPT's README, "I only have a macbook", word for word
NANOGPT_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                  "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
                  "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py")
CONTEXT = 64  # the window of the whole-split score: both recipes' context
MARGIN = 0.01  # a run of ours counts when its whole-split loss is at most nanoGPT's (its runs' mean) + MARGIN


def arm_name(dtype):
    return "ours" if dtype == "auto" else f"ours-{dtype}"


def summary(runs):
    """{arm: {wall_s, val_loss (means), n}}, and for each arm of ours also, against nanoGPT's run of the same turn:
    ratio (its wall time over nanoGPT's) and gap (its whole-split loss minus nanoGPT's), each stats.paired's mean with
    its 95% Student-t interval over the turns, and within: its runs at most nanoGPT's mean loss + MARGIN. runs: dicts
    with arm, wall_s, val_loss, in turns (every arm once per turn, nanoGPT first)."""
    arms = {}
    for r in runs:
        arms.setdefault(r["arm"], []).append(r)
    out = {arm: {"wall_s": statistics.fmean(r["wall_s"] for r in mine),
                 "val_loss": statistics.fmean(r["val_loss"] for r in mine), "n": len(mine)}
           for arm, mine in arms.items()}
    for arm, mine in arms.items():
        if arm != "nanogpt":
            theirs = arms["nanogpt"][:len(mine)]  # a bench cut short mid-turn: the turns each arm finished
            ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(mine, theirs)]
            out[arm].update(ratio=stats.paired(ratios, [0.0] * len(ratios)),
                            gap=stats.paired([r["val_loss"] for r in mine], [r["val_loss"] for r in theirs]),
                            within=sum(r["val_loss"] <= out["nanogpt"]["val_loss"] + MARGIN for r in mine))
    return out


def table(runs):
    """The runs' rows, then each arm's means, then each arm of ours against nanoGPT: the lines the script prints."""
    lines = ["arm | seed | wall s | load before, after | own val | val (whole split)"]
    for r in runs:
        lines.append(f"{r['arm']} | {r['seed']} | {r['wall_s']:.1f} | {r['load'][0]:.2f}, {r['load'][1]:.2f} | "
                     f"{r['printed_val']:.4f} | {r['val_loss']:.4f}")
    arms = summary(runs)
    for arm, s in arms.items():
        lines.append(f"{arm} | mean of {s['n']} | {s['wall_s']:.1f} |  |  | {s['val_loss']:.4f}")
    for arm, s in arms.items():
        if arm != "nanogpt":
            lines.append(f"{arm} / nanoGPT time: {stats.formatted(s['ratio'], '.3f')}; val {arm} - nanoGPT: "
                         f"{stats.formatted(s['gap'], '+.4f')} (95% t intervals over {s['n']} turns); "
                         f"{s['within']}/{s['n']} runs within {MARGIN:+} of nanoGPT's loss")
    return lines


def val_windows(path):
    """The val split as (N, 65) windows: 64 inputs and their 64 next tokens, side by side, the last partial one out."""
    data = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    n = (len(data) - 1) // CONTEXT
    x = torch.from_numpy(data[:n * CONTEXT].reshape(n, CONTEXT))
    y = torch.from_numpy(data[1:n * CONTEXT + 1].reshape(n, CONTEXT))
    return x, y


@torch.no_grad()
def whole_split_loss(logits_of, x, y, batch=256):
    """Mean cross-entropy per token of logits_of(x, y) -> (B, T, V) over all windows."""
    total = 0.0
    for i in range(0, len(x), batch):
        logits = logits_of(x[i:i + batch], y[i:i + batch]).float()
        total += F.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(), reduction="sum").item()
    return total / y.numel()


def nanogpt_loss(run_dir, copy, x, y):
    """nanoGPT's final checkpoint scored by its own model.py."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", os.path.join(copy, "model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checkpoint = torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=False)
    with contextlib.redirect_stdout(io.StringIO()):  # its "number of parameters" line
        model = module.GPT(module.GPTConfig(**checkpoint["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()})
    model.eval()
    return whole_split_loss(lambda a, b: model(a, b)[0], x, y)


def ours_loss(run_dir, x, y):
    model, _ = ckpt.load_model(run_dir)
    model.eval()
    return whole_split_loss(lambda a, b: model(a, b)[0], x, y)


def logged_step(log, cmd):
    """(the last step a training log printed, the run's steps) from its 'iter N' lines (ours print 'iter N/M'; the
    total is otherwise the command's last --max_iters), or None before the first."""
    with open(log, errors="replace") as f:
        found = re.findall(r"^iter (\d+)(?:/(\d+))?", f.read(), re.M)
    given = [int(a.split("=")[1]) for a in cmd if a.startswith("--max_iters=")]
    if not found or not (found[-1][1] or given):
        return None
    return int(found[-1][0]), int(found[-1][1] or given[-1])


def timed_run(cmd, cwd, env, log):
    """(seconds the process ran, from its start to its exit, (load average before, after)); its output goes to `log`.
    The load average over the last minute is printed before it starts: a shared machine's. Meanwhile, where progress
    lines are on (common.progress_every), the step the log has reached and an ETA, every few seconds: an arm takes
    minutes."""
    before = os.getloadavg()[0]
    print(f"load average {before:.2f}: {' '.join(cmd[1:3])} ...", flush=True)
    every = common.progress_every()
    every = None if every is None else 5.0 if every == "bar" else max(every, 1.0)  # a line, not a bar, in seconds
    with open(log, "w") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        while True:
            try:
                code = proc.wait(timeout=every)  # its exit ends the wait at once: the time stays exact
                break
            except subprocess.TimeoutExpired:
                elapsed, step = time.perf_counter() - t0, logged_step(log, cmd)
                if step and step[0]:
                    print(f"{cmd[1]} in {os.path.basename(cwd)}: step {step[0]}/{step[1]}, {elapsed:.0f} s elapsed, "
                          f"ETA {elapsed / step[0] * (step[1] - step[0]):.0f} s", file=sys.stderr, flush=True)
        seconds = time.perf_counter() - t0
    if code:
        common.die(f"{' '.join(cmd)} (in {cwd}) failed with exit code {code}: see {log}")
    return seconds, (before, os.getloadavg()[0])


def printed_val(log, pattern):
    """The last val loss a run printed."""
    with open(log) as f:
        found = re.findall(pattern, f.read())
    if not found:
        common.die(f"{log} holds no val loss: the run printed no evaluation")
    return float(found[-1])


def prepare(copy, data, env):
    """Tiny Shakespeare prepared by nanoGPT's data script in the copy and by prepare.py under `data`: the same."""
    shutil.copy(input, os.path.join(copy, "data", "shakespeare_char", "input.txt"))
    subprocess.run([sys.executable, "data/shakespeare_char/prepare.py"], cwd=copy, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "prepare.py", "text", f"--input={os.path.abspath(input)}", "--tokenizer=char",
                    "--name=shakespeare_char"], cwd=ROOT, env={**env, "NANOLATENT_DATA": data}, check=True,
                   stdout=subprocess.DEVNULL)
    for split in ("train", "val"):
        theirs = os.path.join(copy, "data", "shakespeare_char", f"{split}.bin")
        ours = os.path.join(data, "shakespeare_char", f"{split}.bin")
        if not np.array_equal(np.fromfile(theirs, dtype=np.uint16), np.fromfile(ours, dtype=np.uint16)):
            common.die(f"prepare.py and nanoGPT's data script wrote different {split}.bin from {input}: the arms "
                       f"would not train and score on the same tokens")


def cpu_name():
    """The CPU's model name (Linux), for the record."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return ""


def save(runs):
    """--out_json after every run, by one rename: a bench cut short keeps what ran (its summary over the turns so far)."""
    if out_json:
        with common.replacing(out_json) as tmp, open(tmp, "w") as f:
            json.dump({"config": config, "cpu": cpu_name(), "runs": runs, "summary": summary(runs),
                       "bf16_instructions": torch.ops.mkldnn._is_mkldnn_bf16_supported()}, f, indent=1)


def main():
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    scratch = work_dir or tempfile.mkdtemp(prefix="bench_speedrun_")
    copy, data = os.path.join(scratch, "nanogpt"), os.path.join(scratch, "data")
    shutil.rmtree(copy, ignore_errors=True)
    for name in NANOGPT_FILES:
        os.makedirs(os.path.dirname(os.path.join(copy, name)), exist_ok=True)
        shutil.copy(os.path.join(nanogpt, name), os.path.join(copy, name))
    prepare(copy, data, env)
    runs = []
    x, y = val_windows(os.path.join(data, "shakespeare_char", "val.bin"))
    for i in range(seeds):
        out = os.path.join(scratch, f"nanogpt_{i}")
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "train.py", *NANOGPT_RECIPE, f"--out_dir={out}", *shlex.split(nanogpt_args)]
        wall, load = timed_run(cmd, copy, env, f"{out}.log")
        runs.append({"arm": "nanogpt", "seed": 1337, "wall_s": wall, "load": load, "out_dir": out,
                     "printed_val": printed_val(f"{out}.log", r"val loss (\d+\.\d+)"),
                     "val_loss": nanogpt_loss(out, copy, x, y)})
        print(f"nanogpt run {i + 1}/{seeds}: {wall:.1f} s, val {runs[-1]['val_loss']:.4f}", flush=True)
        save(runs)
        for dtype in dtypes:
            arm = arm_name(dtype)
            out = os.path.join(scratch, f"{arm}_{i}")
            cmd = [sys.executable, "train.py", "config/det_speedrun_char.py", f"--out_dir={out}", "--overwrite=True",
                   f"--seed={1337 + i}", f"--muon_dtype={dtype}", *shlex.split(ours_args)]
            wall, load = timed_run(cmd, ROOT, {**env, "NANOLATENT_DATA": data}, f"{out}.log")
            runs.append({"arm": arm, "seed": 1337 + i, "wall_s": wall, "load": load, "out_dir": out,
                         "printed_val": printed_val(f"{out}.log", r"val_loss (\d+\.\d+)"),
                         "newton_schulz": re.search(r"Newton-Schulz in (\w+)", open(f"{out}.log").read()).group(1),
                         "val_loss": ours_loss(out, x, y)})
            print(f"{arm} run {i + 1}/{seeds}: {wall:.1f} s, val {runs[-1]['val_loss']:.4f}, Newton-Schulz in "
                  f"{runs[-1]['newton_schulz']}", flush=True)
            save(runs)
    print("\n".join(table(runs)))
    if not work_dir:
        shutil.rmtree(scratch)


if __name__ == "__main__":
    config, _ = configurator.apply(globals())
    configurator.require(config, positive=("seeds", "threads"))
    if not nanogpt:
        common.die("--nanogpt is required: git clone https://github.com/karpathy/nanoGPT and pass --nanogpt=<its folder>")
    missing = [name for name in NANOGPT_FILES if not os.path.isfile(os.path.join(nanogpt, name))]
    if missing:
        common.die(f"--nanogpt={nanogpt} is not a nanoGPT checkout (it lacks {', '.join(missing)}): "
                   f"git clone https://github.com/karpathy/nanoGPT and pass --nanogpt=<its folder>")
    dtypes = muon_dtypes.split(",")
    if not all(dtype in optim.NS_DTYPES for dtype in dtypes) or len(set(dtypes)) < len(dtypes):
        common.die(f"--muon_dtypes={muon_dtypes}: give distinct values of {', '.join(optim.NS_DTYPES)}, "
                   f"comma-separated")
    if not os.path.isfile(input):
        common.die(f"--input={input or '(not given)'} is not a file: pass Tiny Shakespeare's input.txt")
    main()
