"""EVE against det at CPU scale (the EVE paper's §4.5 pattern): the same backbone, data and steps, one with a
SwiGLU feed-forward and one with variational neurons, compared on the paper's table.

    python -m experiments.eve_vs_det            # trains both on shakespeare_char if needed (~8 min each on 2 cores)

Trains config/det_shakespeare_char.py and config/eve_shakespeare_char.py (skipped when their checkpoints exist), then
evaluate.py on the same validation tokens (CE, PPL, accuracy, MC-NLL, ECE, MI, flip rate, CVaR-NLL, ..., and EVE's
internal diagnostics as stats/*), and scripts/plot.py for the figures: validation CE against iterations (the paper's Fig. 2)
and the Monte Carlo metrics on a log axis (Fig. 3).
"""

import subprocess
import sys

import configurator
from experiments import study

det_dir = "out-det-shakespeare-char"
eve_dir = "out-eve-shakespeare-char"
mc_samples = 8
max_tokens = 65536  # validation tokens evaluated (the same windows for both models)
device = "cpu"
results = "assets/eve_vs_det.json"
configurator.apply(globals())

study.train_if_missing(det_dir, "config/det_shakespeare_char.py", f"--device={device}")
study.train_if_missing(eve_dir, "config/eve_shakespeare_char.py", f"--device={device}")
steps = [
    ["evaluate.py", f"--out_dir={det_dir},{eve_dir}", f"--mc_samples={mc_samples}", f"--max_tokens={max_tokens}",
     f"--device={device}", f"--out_json={results}"],
    ["scripts/plot.py", det_dir, eve_dir, "--keys=val_ce,val_loss", "--out=assets/eve_vs_det_curves.png"],
    ["scripts/plot.py", results, "--out=assets/eve_vs_det_metrics.png"],
]
for step in steps:
    subprocess.run([sys.executable, *step], check=True)
