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


def run_names(run_dirs):
    """A label per run: its folder's name, or its path where two runs share a name (a/run, b/run)."""
    paths = [os.path.normpath(d) for d in run_dirs]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        common.die(f"{', '.join(twice)} given twice: give each run once")
    names = [os.path.basename(p) for p in paths]
    return [name if names.count(name) == 1 else path for name, path in zip(names, paths)]


SIGNATURE = "nanolatent plot.py"  # in each figure's metadata and JSON: what plot.py may replace


def check_out(out, *beside):
    """--out, and the files beside it plot.py writes, must be plot.py's own if they exist: a file there that plot.py
    did not write (evaluate.py's --out_json, a study's figure) is refused before anything is drawn."""
    for path in (out, *beside):
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    ours = SIGNATURE.encode() in f.read()
            except OSError:
                ours = False
            if not ours:
                common.die(f"--out={out} would replace {path}, which plot.py did not write: choose another --out")


def save(fig, out):
    """The figure, signed in its metadata (PNG's Software, PDF's and SVG's Creator)."""
    fig.savefig(out, dpi=100, metadata={"Software" if out.lower().endswith(".png") else "Creator": SIGNATURE})


def plot_runs(run_dirs, keys, x_key, out):
    runs = {name: read_records(d) for name, d in zip(run_names(run_dirs), run_dirs)}
    points_json = os.path.splitext(out)[0] + ".json"  # the points drawn, beside the figure
    check_out(out, points_json)
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
    save(fig, out)
    with open(points_json, "w") as f:
        json.dump({"written_by": SIGNATURE, "x": x_key,
                   **{key: {name: [(r[x_key], r[key]) for r in records if r.get(key) is not None]
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
    check_out(out)
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
    save(fig, out)


if not paths:
    common.die("what to plot? give train.py out_dirs, or evaluate.py JSON files: python -m scripts.plot out-det out-eve")
if not keys or not all(keys):  # --keys= : no panel to draw
    common.die(f"--keys={','.join(keys)} names no key: give the metrics.jsonl keys to plot, e.g. --keys=val_loss,val_ce")
if os.path.splitext(out)[1].lower() not in (".png", ".pdf", ".svg"):
    common.die(f"--out={out} is the figure: name a .png, .pdf or .svg file")
if all(path.endswith(".json") for path in paths):
    plot_eval(paths, out)
elif any(path.endswith(".json") for path in paths):
    common.die("plot either runs (out_dirs) or evaluate.py JSON files, not both at once")
else:
    plot_runs(paths, keys, x, out)
print(f"wrote {out}")
