"""What every study shares beside its protocol: train.py run once per run folder (alone, or a grid in parallel), the
runs an earlier invocation analysed, kept, the statistics its tables and verdicts use (mean ± std over seeds,
intervals apart), and its figure beside its JSON."""

import json
import os
import subprocess
import sys

import numpy as np

from nanolatent import ckpt
from nanolatent.common import die, progress


TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")


def train_if_missing(out_dir, *train_args):
    """Reproduction scripts train their models on first use: run train.py unless out_dir holds a finished run; one
    stopped or killed on the way goes on from its last checkpoint (--init_from=auto)."""
    if not ckpt.finished(out_dir):
        subprocess.run([sys.executable, TRAIN, *train_args, f"--out_dir={out_dir}", "--init_from=auto"], check=True)


def train_all_missing(runs, parallel=1):
    """train_if_missing for a study's grid: train.py for every run of `runs` ({out_dir: its train.py arguments})
    whose out_dir holds no finished run, `parallel` processes at a time, each logging to out_dir/train.log; one line
    naming the logs when a run failed."""
    if parallel < 1:
        die(f"--parallel={parallel}: the training runs at once must be >= 1")
    running = []
    for out_dir, train_args in progress(list(runs.items()), desc="training runs started"):
        if ckpt.finished(out_dir):
            continue
        os.makedirs(out_dir, exist_ok=True)
        cmd = [sys.executable, TRAIN, *train_args, f"--out_dir={out_dir}", "--init_from=auto"]
        if len(running) == parallel:
            running.pop(0).wait()
        print(" ".join(cmd))
        with open(os.path.join(out_dir, "train.log"), "a") as log:  # the child holds its own copy of the file
            running.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    for process in running:
        process.wait()
    failed = [out_dir for out_dir in runs if not ckpt.finished(out_dir)]
    if failed:
        die(f"training failed for {', '.join(failed)}: see train.log in each")


def earlier_runs(path, settings, key):
    """The runs another invocation of a study wrote to its JSON at `path` with the same settings, by key(run): a seed
    trained at another time joins the table instead of replacing it, and a run analysed before keeps its row without
    being trained again. Written with other settings: none kept."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        earlier = json.load(f)
    if any(earlier.get(name) != value for name, value in settings.items()):
        print(f"{path} was written with other settings: its runs are replaced, not merged")
        return {}
    return {key(r): r for r in earlier["runs"]}


def intervals_apart(a, b):
    """+1 when the mean ± std interval of the values a (one per seed) lies wholly above b's, -1 wholly below, 0 when
    the two overlap: the differences the studies' own tables mark (std with ddof = 1, as they print it). Also 0
    when either side has fewer than two seeds: its std is 0 by construction, not a measured spread, and any two
    distinct points would be 'apart'."""
    if min(len(a), len(b)) < 2:
        return 0
    (ma, sa), (mb, sb) = ((float(np.mean(v)), float(np.std(v, ddof=1))) for v in (a, b))
    return int(ma - sa > mb + sb) - int(ma + sa < mb - sb)


def mean_std(values, digits=3, sign=""):
    """'mean ± std' of the values (one per seed) for a table; the mean alone for one seed, whose std of 0 says
    nothing. sign='+' prints the mean's sign (a change)."""
    mean = f"{float(np.mean(values)):{sign}.{digits}f}"
    return mean if len(values) < 2 else f"{mean} ± {float(np.std(values, ddof=1)):.{digits}f}"


def one_seed_note(seeds):
    """The line a study prints under a table of fewer than two seeds, saying why it shows no spread and calls no
    difference; '' otherwise."""
    if len(seeds) >= 2:
        return ""
    return (f"one seed ({', '.join(map(str, seeds))}): no spread over seeds, so no ± and no interval test (nothing is "
            f"marked *); give two or more seeds, --seeds=1,2,3, for them")


def save_figure(fig, json_out):
    """A study's figure beside its JSON: json_out's name with .png."""
    figure = os.path.splitext(json_out)[0] + ".png"
    fig.savefig(figure, dpi=100)
    print(f"wrote {figure}")


def report_from_json(json_out, report):
    """--from_json=True: report(the record in json_out), its table and figure, running nothing; then exit."""
    if not os.path.exists(json_out):
        die(f"--from_json=True reads {json_out}, which is not there: run the experiment first (or --json_out=)")
    with open(json_out) as f:
        report(json.load(f))
    raise SystemExit


def match_temperature(nll_at, target, first=1.0, slope=5.0, max_probes=4, tolerance=0.02, bounds=(0.05, 4.0)):
    """A direct search for the temperature whose generations' NLL equals `target`: nll_at(T) -> (nll, result) is a
    real run at T, and every probe is one (no interpolation between measured points). The first probe is at `first`;
    the second steps (target - nll) / slope; then the secant through the last two probes, replaced by the bisection of
    the bracket (the nearest probes below and above target) where the secant leaves it or its slope is not positive;
    each T clipped to `bounds`. It stops when |nll - target| < tolerance or after max_probes. Returns the probes
    [(T, nll, result)] in order and the index of the one closest to target in NLL (the arm reported)."""
    probes, t = [], first
    while True:
        nll, result = nll_at(t)
        probes.append((t, nll, result))
        if abs(nll - target) < tolerance or len(probes) == max_probes:
            return probes, min(range(len(probes)), key=lambda i: abs(probes[i][1] - target))
        below = [p[0] for p in probes if p[1] < target]
        above = [p[0] for p in probes if p[1] > target]
        bracket = (max(below), min(above)) if below and above else None
        step = (target - nll) / slope
        if len(probes) > 1:
            (t0, n0, _), (t1, n1, _) = probes[-2:]
            secant = (n1 - n0) / (t1 - t0) if t1 != t0 else 0.0
            step = (target - nll) / secant if secant > 0 else step
        t = t + step
        if bracket and not min(bracket) < t < max(bracket):
            t = sum(bracket) / 2
        t = float(np.clip(t, *bounds))
