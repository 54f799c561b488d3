"""GRPO rollouts at CPU scale (the paper's §5.2 question, §6.1 ablation): does a population of B-Trans minds explore
better than temperature sampling, at the same group size, steps and seeds?

    python -m experiments.rlvr_compare              # trains config/det_arith.py first if needed
    python -m experiments.rlvr_compare --rlvr_config=config/rlvr_smollm2.py --sft_dir=out-smollm2 ...  # README

From one supervised det checkpoint on prepare.py's arithmetic task, scripts/rlvr.py runs GRPO in these arms, every
other setting equal (config/rlvr_arith.py):
  temperature       the det model, action-space noise only (token sampling at `temperature`), verifier reward
  minds             B-Trans: each rollout of a group its own mind, eps drawn once and frozen (§4.3), same temperature
  token             the same sigma, a fresh eps at every step (§6.1)
  ttrl-temperature  §5.3's label-free TTRL: reward = agreement with the group's majority answer, trained on the
                    held-out prompts themselves (no label read), temperature rollouts
  ttrl-minds        the same with minds' rollouts
--rlvr_config=config/rlvr_smollm2.py runs the same comparison from a pretrained chat model (its task and data).
With --gap=G the arms' knobs are set by one rule before any GRPO step: on the selection set (--select_prompts
problems after the test ones), each value of temperature_grid (temperature rollouts, sigma unused) and of sigma_grid
(minds and token rollouts, decoded greedily: all their exploration from the offsets) is measured once on the
starting model, and each arm takes the value whose rollouts are right as often as the greedy answer minus G
(closest): the same tuning budget for both knobs, rollouts of the same quality. With --eval_interval the held-out
sets are evaluated during the run, and each run's peak (§5.3) is the step whose greedy accuracy on the selection set
is highest (the earliest of ties), read on the test set.
The updates and the evaluation use the mean model in every case (§5), so the arms differ only in how rollouts are
drawn. Printed: held-out pass@1, pass@k and greedy accuracy before and after (mean and spread over seeds), reward
over the first and last `window` steps, distinct answers per group, the share of groups with a learning signal
(rewards not all equal) and time per step; the reward curves and the rollouts' accuracy (for TTRL the reward is
agreement, not correctness) go to `figure`, every number to the JSON beside it.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np

from experiments import study
from nanolatent import ckpt, common
from nanolatent.records import read_records

rlvr_config = "config/rlvr_arith.py"  # scripts/rlvr.py's config: task, data, held-out split; the settings below override it
sft_dir = "out-det-arith"  # GRPO starts from this: a train.py run, or a folder of one ckpt.pt
sft_args = ""  # more train.py arguments for config/det_arith.py when sft_dir holds no checkpoint
runs_dir = "out-rlvr-compare"  # one folder per (mode, seed)
modes = ("temperature", "minds", "token", "ttrl-temperature", "ttrl-minds")  # names of ARMS below
seeds = (1, 2, 3)
steps = 200
group_size = 8
prompts_per_step = 8
sigma = 0.2  # minds and token; config/rlvr_arith.py says how it was chosen
temperature = 1.0
gap = 0.0  # > 0: sigma and temperature set by the rule above (the grids' values), not by the two settings above
temperature_grid = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0)
sigma_grid = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8)
eval_interval = 0  # held-out evaluation every eval_interval steps (0: before and after only)
select_prompts = 0  # the selection set: scripts/rlvr.py's --select_prompts (needed by gap and by a peak)
learning_rate = 1e-5
eval_prompts = 200
eval_samples = 8
window = 20  # reward summary: mean over the first and the last `window` steps
parallel = 2  # scripts/rlvr.py processes at once (one thread each)
reuse = False  # take a finished run's metrics.jsonl in runs_dir as it is (redraw the table and figure), not rerun it
extra = ""  # more scripts/rlvr.py arguments, space-separated, e.g. "--reward=ttrl --train_prompts=eval"
figure = "assets/rlvr_compare.png"
device = "cpu"
configurator.apply(globals())
configurator.require(globals(), positive=("parallel",), non_negative=("gap", "eval_interval", "select_prompts"))
if gap and not select_prompts:
    common.die("--gap sets sigma and the temperature on the selection set: give --select_prompts=N as well")

lone = os.path.exists(os.path.join(sft_dir, "ckpt.pt")) and not ckpt.saved_steps(sft_dir)  # a step kept from a run
if rlvr_config == "config/rlvr_arith.py" and not lone:  # a train.py run in sft_dir is trained to its end first
    study.train_if_missing(sft_dir, "config/det_arith.py", f"--device={device}", "--compile=False", *sft_args.split())
ARMS = {"temperature": "--rollout=temperature", "minds": "--rollout=minds", "token": "--rollout=token",
        "ttrl-temperature": "--rollout=temperature --reward=ttrl --train_prompts=eval",
        "ttrl-minds": "--rollout=minds --reward=ttrl --train_prompts=eval"}  # scripts/rlvr.py arguments of each arm
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
knobs = {mode: {"sigma": sigma, "temperature": temperature} for mode in modes}  # each arm's, unless the rule sets them


def run(mode, seed, name=None, max_steps=steps, **settings):
    """One scripts/rlvr.py run (settings: sigma, temperature); its metrics.jsonl records."""
    out = os.path.join(runs_dir, name or f"{mode}-s{seed}")
    metrics = os.path.join(out, "metrics.jsonl")
    done = os.path.exists(metrics) and any(r.get("iter") == max_steps and "eval_pass@1" in r  # not a stopped run's
                                           for r in read_records(metrics))
    if not (reuse and done):
        os.makedirs(out, exist_ok=True)
        settings = {**knobs[mode], **settings}
        args = [rlvr_config, f"--init_from={sft_dir}", f"--out_dir={out}", *ARMS[mode].split(), f"--seed={seed}",
                f"--max_steps={max_steps}", f"--eval_interval={eval_interval or max(max_steps, 1)}",
                f"--group_size={group_size}", f"--prompts_per_step={prompts_per_step}",
                f"--sigma={settings['sigma']}", f"--temperature={settings['temperature']}",
                f"--learning_rate={learning_rate}", f"--eval_prompts={eval_prompts}", f"--eval_samples={eval_samples}",
                f"--select_prompts={select_prompts}", f"--device={device}", "--overwrite=True",
                *extra.split()]  # each run of the experiment starts afresh
        with open(os.path.join(out, "log.txt"), "w") as log:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}  # `-m scripts.rlvr` from any folder
            proc = subprocess.run([sys.executable, "-m", "scripts.rlvr", *args], check=False, stdout=log,
                                  stderr=subprocess.STDOUT, env=env)
        if proc.returncode:
            common.die(f"scripts/rlvr.py failed for {mode}, seed {seed}: see {out}/log.txt")
    with open(metrics) as f:
        return [json.loads(line) for line in f]


calibration = None
if gap:  # the rule, on the starting model: one zero-step run per grid value, the first seed's draws
    probes = [("temperature", {"temperature": t, "sigma": 0.0}) for t in temperature_grid] + [
        ("minds", {"temperature": 0.0, "sigma": s}) for s in sigma_grid]
    with ThreadPoolExecutor(parallel) as pool:
        measured = list(pool.map(lambda p: run(p[0], seeds[0], f"rule-{p[0]}-{'-'.join(map(str, p[1].values()))}",
                                               0, **p[1])[0], probes))
    greedy = measured[0]["select_greedy"]  # the mean model's: the same in every probe
    calibration = {"greedy": greedy, "target": greedy - gap, "temperature": {}, "sigma": {}}
    for (kind, setting), record in zip(probes, measured):
        knob = "temperature" if kind == "temperature" else "sigma"
        calibration[knob][str(setting[knob])] = record["select_rollout_pass@1"]
    chosen = {knob: float(min(values, key=lambda v: abs(values[v] - greedy + gap)))
              for knob, values in calibration.items() if knob in ("temperature", "sigma")}
    calibration["chosen"] = chosen
    print(f"the rule: rollouts right as often as greedy ({greedy:.3f}) minus {gap} on the {select_prompts} selection "
          f"problems -> " + ", ".join(f"{knob} {chosen[knob]} (pass@1 {calibration[knob][str(chosen[knob])]:.3f})"
                                      for knob in ("temperature", "sigma")) + ", minds decoded greedily")
    for mode in modes:
        knobs[mode] = ({"temperature": chosen["temperature"], "sigma": 0.0} if "--rollout=temperature" in ARMS[mode]
                       else {"temperature": 0.0, "sigma": chosen["sigma"]})

jobs = [(mode, seed) for mode in modes for seed in seeds]
print(f"{len(jobs)} GRPO runs of {steps} steps, {prompts_per_step} prompts x {group_size} rollouts, "
      + ", ".join(f"{mode}: sigma={k['sigma']} T={k['temperature']}" for mode, k in knobs.items())
      + f", lr={learning_rate}, from {sft_dir}; logs in {runs_dir}/")
with ThreadPoolExecutor(parallel) as pool:
    done = common.progress(pool.map(lambda job: run(*job), jobs), desc="GRPO runs", total=len(jobs))
    records = dict(zip(jobs, done))

k = eval_samples
columns = [("greedy", "eval_greedy"), ("pass@1", "eval_pass@1"), (f"pass@{k}", f"eval_pass@{k}")]
summary = {}
for mode in modes:
    rows = []
    for seed in seeds:
        evals = [r for r in records[mode, seed] if "eval_pass@1" in r]
        train = [r for r in records[mode, seed] if "reward" in r]
        before, after = evals[0], evals[-1]
        # the peak (§5.3): chosen on the selection set, read on the test set; without one, the last evaluation
        peak = max(evals, key=lambda r: (r.get("select_greedy", 0.0), -r["iter"])) if select_prompts else after
        rows.append({**{f"{name} before": before[key] for name, key in columns},
                     **{f"{name} after": after[key] for name, key in columns},
                     "reward first": np.mean([r["reward"] for r in train[:window]]),
                     "reward last": np.mean([r["reward"] for r in train[-window:]]),
                     "distinct": np.mean([r["distinct"] for r in train]),
                     "informative": np.mean([r["informative"] for r in train]),
                     "s/step": np.mean([r["step_s"] for r in train]),
                     "peak step": peak["iter"], "greedy at peak": peak["eval_greedy"],
                     "correct before": before["eval_greedy_correct"], "correct after": after["eval_greedy_correct"],
                     "correct at peak": peak["eval_greedy_correct"],  # each test problem's greedy 0/1: a bootstrap
                     "evals": [{k: v for k, v in r.items() if k != "eval_greedy_correct"} for r in evals],
                     "curve": [r["reward"] for r in train],
                     "accuracy_curve": [r["pass_rate"] for r in train]})  # the rollouts' share correct
    summary[mode] = rows

paired = [("greedy before -> after", "greedy"), ("pass@1 before -> after", "pass@1"),
          (f"pass@{k} before -> after", f"pass@{k}"), ("reward first -> last", "reward")]
single = ["distinct", "informative", "s/step"]
print(f"\nmean over seeds {list(seeds)} (in brackets: the change, mean ± std over seeds); held-out: the first "
      f"{eval_prompts} val problems, the mean model, greedy and {k} samples at T=1 (pass@1, pass@{k}); reward: the "
      f"rollouts' mean over the first -> last {window} steps; distinct answers and share of informative groups "
      f"(rewards not all equal) per group of {group_size}, averaged over steps\n")
print("| rollout | " + " | ".join(name for name, _ in paired) + " | " + " | ".join(single) + " |")
print("|---|" + "---|" * (len(paired) + len(single)))
for mode, rows in summary.items():
    cells = []
    for _, key in paired:
        first, last = ("reward first", "reward last") if key == "reward" else (f"{key} before", f"{key} after")
        a, b = np.array([r[first] for r in rows]), np.array([r[last] for r in rows])
        cells.append(f"{a.mean():.3f} -> {b.mean():.3f} ({study.mean_std(b - a, sign='+')})")
    cells += [f"{np.mean([r[key] for r in rows]):.3f}" for key in single]
    print(f"| {mode} | " + " | ".join(cells) + " |")
if select_prompts:
    print(f"\nthe peak: each run's step of highest greedy accuracy on the {select_prompts} selection problems, read "
          f"on the {eval_prompts} test problems (evaluated every {eval_interval or steps} steps)\n")
    print("| rollout | sigma, T | greedy before | greedy at the peak (change) | peak steps |")
    print("|---|---|---|---|---|")
    for mode, rows in summary.items():
        a, b = np.array([r["greedy before"] for r in rows]), np.array([r["greedy at peak"] for r in rows])
        print(f"| {mode} | {knobs[mode]['sigma']}, {knobs[mode]['temperature']} | {a.mean():.3f} | {b.mean():.3f} "
              f"({study.mean_std(b - a, sign='+')}) | {', '.join(str(r['peak step']) for r in rows)} |")
if study.one_seed_note(seeds):
    print(f"\n{study.one_seed_note(seeds)}")

data = os.path.splitext(figure)[0] + ".json"  # the table's numbers per seed and the reward curves, beside the figure
spread = lambda values: [float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0]
changes = {mode: {f"{name} {side}": spread([r[f"{name} {side}"] for r in rows]) for name, _ in columns
                  for side in ("before", "after")} | {f"{name} change": spread(
                      [r[f"{name} after"] - r[f"{name} before"] for r in rows]) for name, _ in columns}
           for mode, rows in summary.items()}  # [mean, std] over seeds
os.makedirs(os.path.dirname(data) or ".", exist_ok=True)
with open(data, "w") as f:
    json.dump({"rlvr_config": rlvr_config, "sft_dir": sft_dir, "steps": steps, "prompts_per_step": prompts_per_step,
               "group_size": group_size, "sigma": sigma, "modes": {mode: ARMS[mode] for mode in modes},
               "temperature": temperature, "learning_rate": learning_rate, "eval_prompts": eval_prompts,
               "eval_samples": eval_samples, "extra": extra, "seeds": list(seeds), "window": window,
               "gap": gap, "calibration": calibration, "knobs": knobs, "eval_interval": eval_interval,
               "select_prompts": select_prompts, "mean_std": changes, "runs": summary}, f, indent=1, default=float)
print(f"\nwrote {data}")

plt = common.pyplot("the table is above; the figure")
fig, axes = plt.subplots(1, 3, figsize=(15, 4))
smooth = lambda c: np.convolve(c, np.ones(window) / window, mode="valid")  # moving mean over `window` steps
for ax, key, label in zip(axes, ("curve", "accuracy_curve"), ("rollout reward", "rollouts correct")):
    for mode, rows in summary.items():
        curves = np.array([r[key] for r in rows])  # (seeds, steps)
        mean, lo, hi = smooth(curves.mean(0)), *(smooth(f(curves, 0)) for f in (np.min, np.max))
        x = np.arange(len(mean)) + window - 1
        ax.plot(x, mean, label=mode, linestyle="--" if mode.startswith("ttrl") else "-")
        ax.fill_between(x, lo, hi, alpha=0.15)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"{label} ({window}-step moving mean)")
axes[0].set_title("reward (TTRL: agreement with the group's majority)", fontsize=9)
axes[1].set_title("share of rollouts with the right answer", fontsize=9)
axes[1].legend(fontsize=8)
for m, mode in enumerate(summary):  # held-out before (x) and after (o), mean ± std over seeds, per measure
    for c, (name, _) in enumerate(columns):
        x = c + (m - (len(summary) - 1) / 2) * 0.13
        before, after = changes[mode][f"{name} before"], changes[mode][f"{name} after"]
        axes[2].errorbar(x - 0.03, before[0], yerr=before[1], fmt="x", color=f"C{m}", alpha=0.5)
        axes[2].errorbar(x + 0.03, after[0], yerr=after[1], fmt="o", color=f"C{m}", label=mode if not c else None)
axes[2].set_xticks(range(len(columns)), [name for name, _ in columns])
axes[2].set_ylabel("held-out accuracy (mean ± std over seeds)")
axes[2].set_title(f"{eval_prompts} held-out problems: before (x) and after (o) GRPO", fontsize=9)
axes[2].legend(fontsize=8)
settings = (f"by the rule: T={calibration['chosen']['temperature']}, minds sigma={calibration['chosen']['sigma']} "
            f"decoded greedily" if gap else f"sigma={sigma}, T={temperature}")
fig.suptitle(f"GRPO from {sft_dir}, {prompts_per_step} prompts x {group_size} rollouts, {settings}; mean of "
             f"{len(seeds)} seeds, band: min-max", fontsize=9)
fig.tight_layout()
os.makedirs(os.path.dirname(figure) or ".", exist_ok=True)
fig.savefig(figure, dpi=100)
print(f"\nwrote {figure}")
