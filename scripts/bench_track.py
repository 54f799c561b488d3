"""The CPU reference track: what each architecture's latents cost in seconds to a loss. The four models trained by det's
speedrun recipe (config/<model>_speedrun_char.py: the same shape, data, Muon, steps and schedule), each run a whole
process timed from its start to its exit, the arms in turns for each seed (det, eve, free, btrans, det, ...), every
process with OMP_NUM_THREADS=--threads; then each final model scored by evaluate.py on the same val tokens by its honest
measure (HONEST): det's likelihood, EVE's Monte Carlo likelihood over --mc_samples passes of its noise, the Free
Transformer's importance-weighted bound over --iw_samples encoder samples (an upper bound on its NLL: its posterior
reads the tokens it scores), B-Trans's likelihood over minds (one mind per window, Eq. 3) and at sigma = 0.

    python -m scripts.bench_track --input=input.txt --seeds=5 --out_json=track.json --plot=track.png
    python -m scripts.bench_track --input=input.txt --arms="det,det --warmdown_iters=50"   # the schedule, measured
    python -m scripts.bench_track --from_json=track.json --plot=track.png                  # the figure again

An arm is a model, or a model and train.py flags. The table gives each arm's wall time and honest loss (means, 95%
Student-t intervals over seeds), its runs at or below --target, and against the first arm (the det control), paired by
seed: the time ratio and the loss difference, each with its interval.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time


import configurator
from experiments import stats
from nanolatent import common

input = ""  # Tiny Shakespeare's input.txt (required unless --from_json)
arms = "det,eve,free,btrans"  # comma-separated: a model, or a model and train.py flags ("det --warmdown_iters=50")
seeds = 5  # runs per arm, seeds 1337, 1338, ...
threads = 1  # OMP_NUM_THREADS of every run
target = 1.908  # the loss each arm is timed to: nanoGPT's README CPU recipe's whole-split val loss (1.898) + 0.01
max_tokens = 8192  # val tokens evaluate.py scores (the same for every run)
mc_samples = 8  # evaluate.py's passes of a stochastic model's latents
iw_samples = 8  # evaluate.py's encoder samples of the Free Transformer's bound
train_args = ""  # extra flags for every train.py run
work_dir = ""  # scratch folder for the data and the runs ('' = a temporary one, kept: it holds the checkpoints)
out_json = ""  # write the runs and the summary here
from_json = ""  # draw --plot from this file instead of running
plot = ""  # a figure of every run's wall time against its honest loss
# ----------------------------------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("det", "eve", "free", "btrans")
HONEST = {"det": "nll", "eve": "nll", "free": "iw_bound", "btrans": "seq_nll"}  # evaluate.py's key of each model's


def parse_arms(text):
    """[(name, model, flags)] of --arms."""
    out = []
    for name in (part.strip() for part in text.split(",")):
        model, *flags = shlex.split(name) or [""]
        if model not in MODELS:
            common.die(f"--arms={text}: {name!r} does not start with a model ({', '.join(MODELS)})")
        out.append((name, model, flags))
    return out


def interval(values):
    """stats.paired's mean and 95% t interval of `values` (against 0)."""
    return stats.paired(values, [0.0] * len(values))


def with_sigma0(runs):
    """runs, then B-Trans's runs again scored at sigma = 0 (its weights without the minds: det's likelihood), an arm
    of their own."""
    return runs + [{**r, "arm": f"{r['arm']} at sigma 0", "measure": "nll", "loss": r["scores"]["sigma0_nll"]}
                   for r in runs if "sigma0_nll" in r.get("scores", {})]


def summary(runs):
    """{arm: {n, wall, loss, reached}}, and for every arm after the first also ratio (its wall time over the first arm's
    run of the same seed) and gap (its honest loss minus that run's): stats.paired effects. runs: dicts with arm,
    seed, wall_s, loss, in turns; B-Trans's also at sigma = 0 (with_sigma0)."""
    by_arm = {}
    for r in with_sigma0(runs):
        by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    control = next(iter(by_arm.values()))
    out = {}
    for arm, mine in by_arm.items():
        out[arm] = {"n": len(mine), "wall": interval([r["wall_s"] for r in mine.values()]),
                    "loss": interval([r["loss"] for r in mine.values()]),
                    "reached": sum(r["loss"] <= r["target"] for r in mine.values())}
        paired = [s for s in mine if s in control]
        if mine is not control and paired:
            out[arm]["ratio"] = interval([mine[s]["wall_s"] / control[s]["wall_s"] for s in paired])
            out[arm]["gap"] = stats.paired([mine[s]["loss"] for s in paired], [control[s]["loss"] for s in paired])
    return out


def table(runs):
    """The markdown table the script prints (and BENCHMARKS.md holds)."""
    arms_, runs = summary(runs), with_sigma0(runs)
    first = next(iter(arms_))
    lines = [f"| arm | seeds | wall s | honest val loss | at or below {runs[0]['target']} | time / {first} | "
             f"loss - {first} |", "|---|---|---|---|---|---|---|"]
    for arm, s in arms_.items():
        lines.append(f"| {arm} ({runs[[r['arm'] for r in runs].index(arm)]['measure']}) | {s['n']} | "
                     f"{stats.formatted(s['wall'], '.1f')} | {stats.formatted(s['loss'], '.4f')} | "
                     f"{s['reached']}/{s['n']} | "
                     f"{stats.formatted(s['ratio'], '.3f') if 'ratio' in s else '-'} | "
                     f"{stats.formatted(s['gap'], '+.4f') if 'gap' in s else '-'} |")
    return lines


def draw(result, path):
    """Every run's wall time against its honest loss, one colour per arm, the target as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(r["arm"] for r in result["runs"]):
        mine = [r for r in result["runs"] if r["arm"] == arm]
        ax.scatter([r["wall_s"] for r in mine], [r["loss"] for r in mine], label=f"{arm} ({mine[0]['measure']})")
    ax.axhline(result["runs"][0]["target"], color="grey", linestyle="--", label="target")
    ax.set_xlabel("wall seconds, whole process")
    ax.set_ylabel("honest val loss (nats/char)")
    ax.set_title("CPU reference track: seconds to a loss, the four models")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def evaluate(out, model, env, log):
    """{measure: value} of evaluate.py on the run `out` (B-Trans: also at sigma = 0)."""
    scores = {}
    passes = [("", [])] + ([("sigma0_", ["--sigma=0"])] if model == "btrans" else [])
    for prefix, extra in passes:
        path = f"{out}.{prefix}eval.json"
        subprocess.run([sys.executable, "evaluate.py", f"--out_dir={out}", f"--max_tokens={max_tokens}",
                        f"--mc_samples={mc_samples}", f"--iw_samples={iw_samples}", f"--out_json={path}", *extra],
                       cwd=ROOT, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
        with open(path) as f:
            result = next(iter(json.load(f)["results"].values()))
        scores.update({prefix + k: result[k] for k in ("nll", "seq_nll", "iw_bound", "neg_elbo", "mi") if k in result})
    return scores


def main():
    scratch = work_dir or tempfile.mkdtemp(prefix="bench_track_")
    data = os.path.join(scratch, "data")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "NANOLATENT_DATA": data}
    subprocess.run([sys.executable, "prepare.py", "text", f"--input={os.path.abspath(input)}", "--tokenizer=char",
                    "--name=shakespeare_char"], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    runs = []
    for i in range(seeds):
        for name, model, flags in parse_arms(arms):
            out = os.path.join(scratch, f"{re.sub(r'[^A-Za-z0-9_.=-]+', '_', name)}_{1337 + i}")
            cmd = [sys.executable, "train.py", f"config/{model}_speedrun_char.py", f"--out_dir={out}",
                   "--overwrite=True", f"--seed={1337 + i}", *flags, *shlex.split(train_args)]
            before = os.getloadavg()[0]
            with open(f"{out}.log", "w") as log:
                t0 = time.perf_counter()
                code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
                wall = time.perf_counter() - t0
                load = (before, os.getloadavg()[0])
                if code:
                    common.die(f"{' '.join(cmd)} failed with exit code {code}: see {out}.log")
                scores = evaluate(out, model, env, log)
            runs.append({"arm": name, "model": model, "seed": 1337 + i, "wall_s": wall, "load": load,
                         "measure": HONEST[model], "loss": scores[HONEST[model]], "scores": scores, "target": target,
                         "out_dir": out})
            print(f"{name} seed {1337 + i}: {wall:.1f} s (load {load[0]:.2f}, {load[1]:.2f}), {HONEST[model]} "
                  f"{runs[-1]['loss']:.4f}", flush=True)
            if out_json:  # after every run, by one rename: a track cut short keeps what ran
                with common.replacing(out_json) as tmp, open(tmp, "w") as f:
                    json.dump({"config": config, "runs": runs, "summary": summary(runs)}, f, indent=1)
    print("\n".join(table(runs)))
    return {"runs": runs}


if __name__ == "__main__":
    config, _ = configurator.apply(globals())
    configurator.require(config, positive=("seeds", "threads", "max_tokens", "mc_samples"))
    if from_json:
        with open(from_json) as f:
            result = json.load(f)
        print("\n".join(table(result["runs"])))
    else:
        parse_arms(arms)
        if not os.path.isfile(input):
            common.die(f"--input={input or '(not given)'} is not a file: pass Tiny Shakespeare's input.txt")
        result = main()
    if plot:
        draw(result, plot)
