"""EVE against det in the paper's own regime (Table 4, §4.5, Fig. 2): small data, several epochs, each model kept at
its best validation CE, so that det can overfit and EVE's noise can act as the regulariser the paper reports.

    python -m experiments.eve_paper_protocol                      # CPU size: 100 stories, n_embd 128 (~70 min)
    python -m experiments.eve_paper_protocol --dataset=wp_sample --device=cuda --batch_size=48 --block_size=512 \
        --extra="--vocab_size=50304 --n_embd=384 --n_head=6 --eval_iters=40 --dtype=bfloat16 --compile=True" \
        --eval_tokens=0 --runs_dir=out-eve-paper-gpu                                                           # GPU

Data: WritingPrompts stories of ../shared/data/writingprompts, GPT-2 BPE (config/det_wp_sample.py says how to
prepare them: wp_sample_cpu, the first 100 training stories in the GPT-2 ids they use; wp_sample, all 500 in the
whole vocabulary; the full data set online: `python prepare.py writingprompts`). For each seed it trains
config/det_wp_sample.py and config/eve_wp_sample.py (same backbone, 3 blocks, same batches) for `epochs` passes over
the training tokens, evaluating once per epoch on the test stories and keeping the checkpoint of best validation CE
(select_by=ce), then runs evaluate.py on the same test tokens twice: one pass (Table 4's "final validation" CE, PPL,
Acc) and M = mc_samples passes (its "extended validation" MC NLL, ECE, MI, flip rate, CVaR-NLL). Runs that hold a
checkpoint are not retrained. The figure is the validation CE per epoch (Fig. 2), mean over seeds, band min-max.
"""

import json
import os
import subprocess
import sys

import numpy as np

import common
import configurator

configs = {"det": "config/det_wp_sample.py", "eve": "config/eve_wp_sample.py"}
dataset = "wp_sample_cpu"  # or wp_sample (500 stories, the whole GPT-2 vocabulary: a GPU run)
runs_dir = "out-eve-paper"  # one folder per (model, seed)
seeds = (1, 2, 3)
epochs = 16
batch_size = 8
block_size = 256
mc_samples = 8  # M
eval_tokens = 16384  # test tokens evaluate.py scores (0: all 86,899, GPU)
extra = ""  # more train.py arguments, space-separated (the width, dtype, compile for a GPU run)
figure = "assets/eve_paper_protocol.png"
results = "assets/eve_paper_protocol.json"
device = "cpu"
configurator.apply(globals())

meta = common.load_meta(dataset)
epoch_iters = meta["train_tokens"] // (batch_size * block_size)  # train.py draws random windows: an epoch's worth
runs = {(m, s): os.path.join(runs_dir, f"{m}-s{s}") for m in configs for s in seeds}
print(f"{dataset}: {meta['train_tokens']:,} train tokens = {epoch_iters} steps of {batch_size} x {block_size} per "
      f"epoch; {epochs} epochs, seeds {list(seeds)}, evaluated once per epoch")
for (m, s), out in runs.items():
    common.train_if_missing(out, configs[m], f"--dataset={dataset}", f"--seed={s}", f"--batch_size={batch_size}",
                            f"--block_size={block_size}", f"--max_iters={epochs * epoch_iters}",
                            f"--lr_decay_iters={epochs * epoch_iters}", f"--eval_interval={epoch_iters}",
                            f"--device={device}", "--compile=False", *extra.split())

evals = {}
for passes in (1, mc_samples):
    path = results.replace(".json", f"_m{passes}.json")
    subprocess.run([sys.executable, "evaluate.py", f"--out_dir={','.join(runs.values())}", f"--mc_samples={passes}",
                    f"--max_tokens={eval_tokens}", f"--seq_len={block_size}", f"--device={device}",
                    f"--out_json={path}"], check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        evals[passes] = json.load(f)["results"]

curves, selected = {}, {}  # (model, seed) -> val CE per epoch, the epoch of the checkpoint kept
for key, out in runs.items():
    records = [r for r in common.read_records(os.path.join(out, "metrics.jsonl")) if "val_ce" in r and r["iter"] > 0]
    curves[key] = [r["val_ce"] for r in records]
    selected[key] = common.load_checkpoint(out)["iter_num"] // epoch_iters  # the kept checkpoint's epoch

columns = [("CE", 1, "nll"), ("PPL", 1, "ppl"), ("Acc", 1, "acc"), ("MC NLL", mc_samples, "nll"),
           ("ECE", mc_samples, "ece"), ("MI", mc_samples, "mi"), ("Flip", mc_samples, "flip_rate"),
           ("CVaR", mc_samples, "cvar_nll")]
tokens = evals[1][runs["det", seeds[0]]]["tokens"]
print(f"\nmean ± std over seeds {list(seeds)}; {tokens:,} test tokens; CE, PPL, Acc: one pass; the rest: M = "
      f"{mc_samples} passes; selected epoch: best validation CE\n")
print("| model | " + " | ".join(name for name, _, _ in columns) + " | selected epoch |")
print("|---|" + "---|" * (len(columns) + 1))
for m in configs:
    cells = []
    for _, passes, key in columns:
        v = np.array([evals[passes][runs[m, s]][key] for s in seeds])
        cells.append(f"{v.mean():.4f} ± {v.std():.4f}")
    print(f"| {m.upper()} | " + " | ".join(cells) + f" | {', '.join(str(selected[m, s]) for s in seeds)} |")

print("\nvalidation CE per epoch (mean over seeds)\n")
n_epochs = min(len(c) for c in curves.values())
print("| model | " + " | ".join(f"epoch {e}" for e in range(1, n_epochs + 1)) + " |")
print("|---|" + "---|" * n_epochs)
for m in configs:
    mean = np.mean([curves[m, s][:n_epochs] for s in seeds], axis=0)
    print(f"| {m.upper()} | " + " | ".join(f"{v:.4f}" for v in mean) + " |")

plt = common.pyplot("the tables are above; the figure")
fig, ax = plt.subplots(figsize=(5.5, 4))
x = np.arange(1, n_epochs + 1)
for m in configs:
    c = np.array([curves[m, s][:n_epochs] for s in seeds])
    ax.plot(x, c.mean(0), "o-", label=m.upper())
    ax.fill_between(x, c.min(0), c.max(0), alpha=0.2)
ax.set_xlabel("epoch")
ax.set_ylabel("validation CE (nats/token)")
ax.set_title(f"{dataset} ({meta['vocab_size']:,} GPT-2 ids), 3 blocks; {len(seeds)} seeds, band: min-max", fontsize=9)
ax.legend()
fig.tight_layout()
os.makedirs(os.path.dirname(figure), exist_ok=True)
fig.savefig(figure, dpi=100)
print(f"\nwrote {figure}")
