"""Turn run records into pictures (needs matplotlib: pip install matplotlib).

    python -m scripts.plot out-det out-eve --keys=val_ce,kl --out=curves.png      # metrics.jsonl of each run, vs iter
    python -m scripts.plot out-det out-eve --keys=val_loss --x=tokens
    python -m scripts.plot det.json eve.json --out=epistemic.png                   # evaluate.py's MC metrics, log axis

A run's default panels are val_loss, and beside it val_ce_prior where the run logs it (the stochastic models' CE with
latents from the prior: the Free Transformer's honest number, its val_loss reading the future through the encoder).
"""

import json
import os

import configurator
from nanolatent import common, records as run_records

# ----------------------------------------------------------------------------------------------------------------
paths = ()  # train.py out_dirs, or evaluate.py --out_json files (*.json): the arguments that are not --key=value
keys = ("val_loss",)  # metrics.jsonl keys, one panel each: --keys=val_ce,kl
x = "iter"  # or tokens
out = "plot.png"
configurator.apply(globals(), positional="paths")
configurator.require(globals(), choices={"x": ("iter", "tokens")})
# ----------------------------------------------------------------------------------------------------------------

# evaluate.py's Monte Carlo metrics, in the order of the EVE paper's Fig. 3 view
EVAL_KEYS = ("nll", "cvar_nll", "ece", "brier", "entropy", "mi", "epistemic_ratio", "cond_var", "flip_rate")


def read_records(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        common.die(f"{run_dir} has no metrics.jsonl: is it a train.py out_dir?")
    records = run_records.read_records(path)
    if not records:
        common.die(f"{path} is empty: the run logged nothing yet")
    return records


def plot_runs(run_dirs, keys, x_key, out):
    runs = {os.path.basename(os.path.normpath(d)): read_records(d) for d in run_dirs}
    known = sorted({k for records in runs.values() for r in records for k in r})
    if keys == ("val_loss",) and "val_ce_prior" in known:  # the default panel, and the honest CE beside it
        keys = (*keys, "val_ce_prior")
    for key in keys:
        if key not in known:
            common.die(f"unknown key {key!r}; the records have: {', '.join(known)}")
    plt = common.pyplot("scripts/plot.py")  # imported only once the input has been read and checked
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, records in runs.items():
            points = [(r[x_key], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), label=name)
        ax.set_xlabel(x_key)
        ax.set_title(key)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:  # the points drawn, beside the figure
        json.dump({"x": x_key, **{key: {name: [(r[x_key], r[key]) for r in records if r.get(key) is not None]
                                        for name, records in runs.items()} for key in keys}}, f, indent=1)


def read_eval(path):
    """evaluate.py's --out_json: {'results': {checkpoint: {metric: value}}, ...} for one or several checkpoints."""
    if not os.path.exists(path):
        common.die(f"{path} not found: write it with evaluate.py --out_json={path}")
    with open(path) as f:
        runs = json.load(f).get("results")
    if not runs:
        common.die(f"{path} holds no runs: is it evaluate.py's --out_json output?")
    return runs


def plot_eval(paths, out, floor=1e-6):
    """Bars per metric and run on a log axis; exact zeros (a deterministic model's MI, flip rate) drawn at a marked
    floor, as the EVE paper does, since log(0) has no place on the axis."""
    runs = {name: metrics for path in paths for name, metrics in read_eval(path).items()}
    keys = [k for k in EVAL_KEYS if any(k in m for m in runs.values())]
    if not keys:
        common.die(f"none of the Monte Carlo metrics {', '.join(EVAL_KEYS)} is in {', '.join(paths)}")
    plt = common.pyplot("scripts/plot.py")  # imported only once the input has been read and checked
    fig, ax = plt.subplots(figsize=(0.5 * len(keys) * len(runs) + 3, 4))
    width = 0.8 / len(runs)
    for i, (name, metrics) in enumerate(runs.items()):
        values = [metrics.get(k, float("nan")) for k in keys]
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [max(v, floor) for v in values], width, label=name)
        for x, v in zip(xs, values):
            if v == 0:
                ax.annotate("0", (x, floor), ha="center", va="bottom", fontsize=8)
    ax.axhline(floor, color="gray", linestyle=":", linewidth=1, label=f"floor {floor:g} (exact 0)")
    ax.set_yscale("log")
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(keys))], keys, rotation=30, ha="right")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if not paths:
    common.die("what to plot? give train.py out_dirs, or evaluate.py JSON files: python -m scripts.plot out-det out-eve")
if all(path.endswith(".json") for path in paths):
    plot_eval(paths, out)
elif any(path.endswith(".json") for path in paths):
    common.die("plot either runs (out_dirs) or evaluate.py JSON files, not both at once")
else:
    plot_runs(paths, keys, x, out)
print(f"wrote {out}")
