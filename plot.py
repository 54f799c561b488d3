"""Turn run records into pictures (needs matplotlib: pip install matplotlib).

    python plot.py out-det out-eve --keys=val_ce,kl --out=curves.png      # metrics.jsonl of each run, vs iter
    python plot.py out-det out-eve --keys=val_loss --x=tokens
    python plot.py --eval det.json eve.json --out=epistemic.png            # evaluate.py's MC metrics, log axis
"""

import argparse
import json
import os
import sys

import common

# evaluate.py's Monte Carlo metrics, in the order of the EVE paper's Fig. 3 view
EVAL_KEYS = ("nll", "cvar_nll", "ece", "brier", "entropy", "mi", "epistemic_ratio", "cond_var", "flip_rate")


def read_records(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        common.die(f"{run_dir} has no metrics.jsonl: is it a train.py out_dir?")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        common.die(f"{path} is empty: the run logged nothing yet")
    return records


def plot_runs(run_dirs, keys, x_key, out):
    runs = {os.path.basename(os.path.normpath(d)): read_records(d) for d in run_dirs}
    known = sorted({k for records in runs.values() for r in records for k in r})
    for key in keys:
        if key not in known:
            common.die(f"unknown key {key!r}; the records have: {', '.join(known)}")
    plt = common.pyplot("plot.py")  # imported only once the input has been read and checked
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
    plt = common.pyplot("plot.py")  # imported only once the input has been read and checked
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="train.py out_dirs, or evaluate.py JSON files with --eval")
    parser.add_argument("--keys", default="val_loss", help="comma-separated metrics.jsonl keys, one panel each")
    parser.add_argument("--x", default="iter", choices=("iter", "tokens"))
    parser.add_argument("--eval", action="store_true", help="the paths are evaluate.py JSON files")
    parser.add_argument("--out", default="plot.png")
    args = parser.parse_args(argv)
    if args.eval:
        plot_eval(args.paths, args.out)
    else:
        plot_runs(args.paths, args.keys.split(","), args.x, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
