"""EVE against its deterministic twin in the paper's own regime (Table 4, §4.5, Fig. 2): small data, 5 epochs, each
model kept at its best validation CE, frozen pretrained embeddings (§1), so that det can overfit and EVE's noise can
act as the regulariser the paper reports.

    python -m experiments.eve_paper_protocol --extra="--eval_iters=5"   # CPU: 100 stories, n_embd 128 (42 min, loaded)
    python -m experiments.eve_paper_protocol --extra="--eval_iters=5" --embeddings=trained --seeds=1, \
        --runs_dir=out-eve-matched-trained --results=assets/eve_paper_protocol_trained5.json \
        --figure=/tmp/eve_trained5.png
    python -m experiments.eve_paper_protocol --dataset=wp_sample --device=cuda --batch_size=48 --block_size=512 \
        --extra="--n_head=6 --eval_iters=40 --dtype=bfloat16 --compile=True" --n_embd=384 \
        --eval_tokens=0 --runs_dir=out-eve-paper-gpu                                                           # GPU

Data: a 500 + 100-story sample of WritingPrompts, GPT-2 BPE (docs/reproductions.md and config/det_wp_sample.py say how
to prepare them: wp_sample_cpu, the first 100 training stories in the GPT-2 ids they use; wp_sample, all 500 in the
whole vocabulary; the full data set online: `python prepare.py writingprompts`). For each seed it trains three arms:
det (config/det_wp_sample.py), det with residual dropout (the same, --dropout, the ordinary regulariser EVE's noise
is to beat) and EVE (config/eve_wp_sample.py), which differ in the feed-forward neurons alone (the same 3 blocks,
widths, head with its layer weights, optimiser, batches and selection: §3.7, §4.1), for `epochs` passes over the
training tokens, evaluating once per epoch on the test stories and keeping the checkpoint of best validation CE
(select_by=ce), then runs evaluate.py on the same test tokens twice: one pass (Table 4's "final validation" CE, PPL,
Acc) and M = mc_samples passes (its "extended validation" MC NLL, ECE, MI, flip rate, CVaR-NLL). Runs that hold a
checkpoint are not retrained. The figure is the validation CE per epoch (Fig. 2), mean over seeds, band min-max; the
JSON beside it holds every number of the tables and the figure.

Embeddings (§1: "frozen GPT-style embeddings"): GPT-2's weights cannot be had offline, so embeddings="smollm2" takes
SmolLM2-135M-Instruct's token embedding into the dataset's GPT-2 ids, on its first n_embd principal components
(experiments/smollm2_embedding.py says how), loaded by train.py --init_embeddings and held frozen
(--freeze_embeddings=True): the tied head is that matrix too. "trained": learned from a random init.
"""

import json
import os
import subprocess
import sys

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np

from experiments import smollm2_embedding
from experiments import study
from nanolatent import ckpt, common, records, tokendata

arms = ("det", "dropout0.1", "eve")  # det, det with residual dropout at the rate its name ends with, EVE
dataset = "wp_sample_cpu"  # or wp_sample (500 stories, the whole GPT-2 vocabulary: a GPU run)
runs_dir = "out-eve-matched"  # one folder per (model, seed)
seeds = (1, 2, 3)
epochs = 5  # §4.5
batch_size = 8
block_size = 256
n_embd = 128
embeddings = "smollm2"  # frozen SmolLM2-135M embeddings in the dataset's GPT-2 ids (see above), or "trained"
embedding_std = 0.05  # per-entry std of the frozen matrix (see above)
mc_samples = 8  # M
eval_tokens = 16384  # test tokens evaluate.py scores (0: all 86,899, GPU)
extra = ""  # more train.py arguments, space-separated (the width, dtype, compile for a GPU run)
parallel = 1  # evaluate.py processes at once (one thread each with OMP_NUM_THREADS=1)
train_only = False  # train the runs and stop: processes training other seeds or arms at once, one evaluates after
figure = "assets/eve_paper_protocol.png"
results = "assets/eve_paper_protocol.json"
device = "cpu"
configurator.apply(globals())
configurator.require(globals(), choices={"embeddings": ("smollm2", "trained")})
# train.py arguments of each arm: the same but for the feed-forward; dropout<rate> is det with Config.dropout = rate
# (nanoGPT's resid_dropout on each block's two branches)
ARMS = {"det": ["config/det_wp_sample.py"], "eve": ["config/eve_wp_sample.py"],
        **{m: ["config/det_wp_sample.py", f"--dropout={m[7:]}"] for m in arms if m.startswith("dropout")}}
unknown = [m for m in arms if m not in ARMS or m.startswith("dropout") and not m[7:].replace(".", "", 1).isdigit()]
if unknown:
    common.die(f"--arms: {', '.join(unknown)} unknown; give det, eve or dropout<rate> (dropout0.1)")


meta = tokendata.load_meta(dataset)
epoch_iters = meta["train_tokens"] // (batch_size * block_size)  # train.py draws random windows: an epoch's worth
runs = {(m, s): os.path.join(runs_dir, f"{m}-s{s}") for s in seeds for m in arms}  # trained seed by seed
print(f"{dataset}: {meta['train_tokens']:,} train tokens = {epoch_iters} steps of {batch_size} x {block_size} per "
      f"epoch; {epochs} epochs, seeds {list(seeds)}, evaluated once per epoch; embeddings: {embeddings}")
frozen = []
if embeddings == "smollm2":
    path = os.path.join(tokendata.data_dir(dataset), f"smollm2_embedding_{n_embd}.npy")
    matrix, found, kept = smollm2_embedding.embedding(meta, n_embd, embedding_std)
    np.save(path, matrix)
    print(f"SmolLM2-135M embedding: {found:.1%} of the {meta['vocab_size']:,} GPT-2 ids are SmolLM2 tokens; "
          f"{n_embd} principal components keep {kept:.1%} of its variance")
    frozen = [f"--init_embeddings={path}", "--freeze_embeddings=True"]
for (m, s), out in common.progress(list(runs.items()), desc="runs trained"):
    study.train_if_missing(out, *ARMS[m], f"--dataset={dataset}", f"--seed={s}", f"--batch_size={batch_size}",
                          f"--block_size={block_size}", f"--n_embd={n_embd}", f"--max_iters={epochs * epoch_iters}",
                          f"--lr_decay_iters={epochs * epoch_iters}", f"--eval_interval={epoch_iters}",
                          f"--device={device}", "--compile=False", *frozen, *extra.split())
if train_only:
    raise SystemExit(f"trained {len(runs)} runs in {runs_dir}; evaluate them without --train_only")

# evaluate.py once per (passes, run), `parallel` processes at a time, the M-pass ones first (the longest), each into
# its own JSON; each M's results are then merged into one JSON in evaluate.py's own form, in the runs' order. det and
# the dropout arms have no latents, so evaluate.py takes one pass at any M: their one-pass JSON is their M-pass one.
tasks = [(passes, out) for passes in (mc_samples, 1) for (m, s), out in runs.items() if passes == 1 or m == "eve"]
part = lambda passes, out: results.replace(".json", f"_m{passes}.{os.path.basename(out)}.json")
running, codes = [], []
for passes, out in tasks:
    if os.path.exists(part(passes, out)):  # evaluated by an invocation that stopped before merging: kept
        continue
    if len(running) == parallel:
        codes.append(running.pop(0).wait())
    running.append(subprocess.Popen([sys.executable, "evaluate.py", f"--out_dir={out}", f"--mc_samples={passes}",
                                     f"--max_tokens={eval_tokens}", f"--seq_len={block_size}", f"--device={device}",
                                     f"--out_json={part(passes, out)}"], stdout=subprocess.DEVNULL))
if any(codes + [process.wait() for process in running]):
    common.die("evaluate.py failed: see its error above")
evals = {}
for passes in (1, mc_samples):
    merged = None
    for out in runs.values():
        with open(part(passes, out) if os.path.exists(part(passes, out)) else part(1, out)) as f:
            record = {**json.load(f), "mc_samples": passes}  # a det arm's M-pass record: its one pass (above)
        merged = merged or {**record, "results": {}}
        merged["results"].update(record["results"])
    with open(results.replace(".json", f"_m{passes}.json"), "w") as f:
        json.dump(merged, f, indent=1)
    evals[passes] = merged["results"]
for passes, out in tasks:
    os.remove(part(passes, out))

curves, train_curves, selected, weights, trainable = {}, {}, {}, {}, {}  # per (model, seed)
for key, out in runs.items():
    logged = [r for r in records.read_records(os.path.join(out, "metrics.jsonl")) if "val_ce" in r and r["iter"] > 0]
    curves[key] = [r["val_ce"] for r in logged]
    train_curves[key] = [r["train_ce"] for r in logged]
    checkpoint = ckpt.load_checkpoint(out)
    selected[key] = checkpoint["iter_num"] // epoch_iters  # the kept checkpoint's epoch
    logits = checkpoint["model"].get("layer_logits")  # the head's layer weights w_1..w_L, both arms (§4.2)
    weights[key] = None if logits is None else [round(w, 4) for w in logits.float().softmax(0).tolist()]
    model = ckpt.load_model(out, checkpoint=checkpoint)[0] if key[1] == seeds[0] else None
    if model is not None:
        trainable[key[0]] = sum(p.numel() for p in model.parameters() if p.requires_grad)

columns = [("CE", 1, "nll"), ("PPL", 1, "ppl"), ("Acc", 1, "acc"), ("MC NLL", mc_samples, "nll"),
           ("ECE", mc_samples, "ece"), ("MI", mc_samples, "mi"), ("Flip", mc_samples, "flip_rate"),
           ("CVaR", mc_samples, "cvar_nll")]
tokens = evals[1][runs["det", seeds[0]]]["tokens"]
n_epochs = min(len(c) for c in curves.values())
summary = {
    "protocol": {"dataset": dataset, "train_tokens": meta["train_tokens"], "vocab_size": meta["vocab_size"],
                 "epochs": epochs, "steps_per_epoch": epoch_iters, "batch_size": batch_size, "block_size": block_size,
                 "n_embd": n_embd, "embeddings": embeddings, "arms": list(arms), "extra": extra,
                 "embedding_std": embedding_std if frozen else None,
                 "smollm2_ids_found": found if frozen else None, "pca_variance_kept": kept if frozen else None,
                 "seeds": list(seeds), "mc_samples": mc_samples, "test_tokens": tokens, "select_by": "ce",
                 "trainable_parameters": trainable},
    "runs": {f"{m}-s{s}": {"val_ce_per_epoch": curves[m, s], "train_ce_per_epoch": train_curves[m, s],
                           "selected_epoch": selected[m, s],
                           "turned": int(np.argmin(curves[m, s])) + 1 < len(curves[m, s]),  # best before the last
                           "layer_weights": weights[m, s],
                           "kl_mu2_per_layer": {k[6:]: v for k, v in evals[mc_samples][runs[m, s]].items()
                                                if k.startswith(("stats/kl_", "stats/mu2_"))},  # EVE's, M passes
                           **{f"{name} (M={passes})": evals[passes][runs[m, s]][key] for name, passes, key in columns}}
             for (m, s) in runs},
    "mean_std": {m: {name: [float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0]
                     for name, passes, key in columns
                     for v in [[evals[passes][runs[m, s]][key] for s in seeds]]} for m in arms},
    "val_ce_per_epoch_mean": {m: np.mean([curves[m, s][:n_epochs] for s in seeds], axis=0).tolist() for m in arms},
}
os.makedirs(os.path.dirname(results), exist_ok=True)
with open(results, "w") as f:
    json.dump(summary, f, indent=1)
print(f"\nwrote {results} (evaluate.py's own output beside it: *_m1.json, *_m{mc_samples}.json)")

print(f"\nmean ± std over seeds {list(seeds)}; {tokens:,} test tokens; CE, PPL, Acc: one pass; the rest: M = "
      f"{mc_samples} passes; selected epoch: best validation CE; trainable parameters {trainable}\n")
print("| model | " + " | ".join(name for name, _, _ in columns) + " | selected epoch |")
print("|---|" + "---|" * (len(columns) + 1))
for m in arms:
    cells = [f"{mean:.4f}" + (f" ± {std:.4f}" if len(seeds) > 1 else "")  # one seed's std is 0, not a spread
             for mean, std in summary["mean_std"][m].values()]
    print(f"| {m.upper()} | " + " | ".join(cells) + f" | {', '.join(str(selected[m, s]) for s in seeds)} |")
if study.one_seed_note(seeds):
    print(f"\n{study.one_seed_note(seeds)}")

print("\nvalidation CE per epoch (mean over seeds)\n")
print("| model | " + " | ".join(f"epoch {e}" for e in range(1, n_epochs + 1)) + " |")
print("|---|" + "---|" * n_epochs)
for m in arms:
    print(f"| {m.upper()} | " + " | ".join(f"{v:.4f}" for v in summary["val_ce_per_epoch_mean"][m]) + " |")
print("\nhead layer weights of the kept checkpoints: " + "; ".join(f"{m}-s{s} {weights[m, s]}" for m, s in runs))

plt = common.pyplot(f"the tables are above and in {results}; the figure")
fig, ax = plt.subplots(figsize=(5.5, 4))
x = np.arange(1, n_epochs + 1)
for m in arms:
    c = np.array([curves[m, s][:n_epochs] for s in seeds])
    ax.plot(x, c.mean(0), "o-", label=m.upper())
    ax.fill_between(x, c.min(0), c.max(0), alpha=0.2)
ax.set_xlabel("epoch")
ax.set_ylabel("validation CE (nats/token)")
ax.set_title(f"{dataset} ({meta['vocab_size']:,} GPT-2 ids), 3 blocks, {embeddings} embeddings; {len(seeds)} seeds, "
             f"band: min-max", fontsize=8)
ax.legend()
fig.tight_layout()
fig.savefig(figure, dpi=100)
print(f"wrote {figure}")
