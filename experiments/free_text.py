"""The Free Transformer on real text beside det: what Z costs in likelihood and what it carries (Tiny Shakespeare).

    python prepare.py text --input=input.txt --tokenizer=char --name=shakespeare_char   # input.txt: Tiny Shakespeare
    python -m experiments.free_text                    # trains what is missing, then measures (CPU: ~2.5 min a run)
    python -m experiments.free_text --seeds=1, --kappas=1_2

det (config/det_text.py) and the Free Transformer (H = 8, config/free_text*.py at κ = 1/8, 1/2, 2 bits per token) on
the same backbone, data, batches and steps, for every seed. Per run, on the first `max_tokens` characters of the
held-out split (evaluate.py, the same windows and draws for every run, nats per character):
  det CE        det's cross-entropy: its exact NLL;
  prior-Z CE    every Z_t from the uniform prior, one draw per window: E_Z[-log P(S | Z)], an upper bound on the NLL;
  posterior CE  Z from the encoder, which reads the whole window it scores (§3.3): it reads the future, no likelihood;
  -ELBO         posterior CE + the full KL(Q(Z | S) || P(Z)) (Eq. 3), an upper bound on the NLL;
  IW K          the importance-weighted bound with the encoder as proposal and K draws (Burda et al. 2016):
                -log P(S) <= IW_K <= IW_1 = -ELBO in expectation, tightening as K grows;
  KL            bits per token of the encoder's posterior, against the free-bits floor κ (Eq. 5).
The price of Z is the Free Transformer's tightest upper bound on the NLL (the smaller of the prior-Z CE and IW 64)
minus det's CE, paired by seed (the same seed draws the same training batches): the true NLL lies below the bound, so
a positive price is the most Z can cost, a negative one a gain that holds. Per run, where the KL sits against the
free-bits floor κ (under it, at it within 10%, above), and whether the decoder ignores Z (posterior CE within 0.01
nats of the prior-Z CE).
What Z carries, from one prompt (`prompt`, temperature `temperature`): `groups` groups of `group_size` generations
sharing one Z (the prompt's Z from the encoder, each new token's Z uniform, Fig. 3's green boxes) against as many with
a Z per sequence, cut into groups alike. Within a group: the share of pairs that agree on opening with a speaker's name
line (the play's "ROMEO:"; our models invent most names, so the names themselves seldom agree), the std of the
generations' mean line length, distinct-4 of the pooled characters and the mean Jaccard overlap of their character
4-gram sets. det, which has no Z, draws both sets the same way: its difference is the noise floor. Steering: for each
of `references` passages of the held-out text that start a speech (as the prompt does), generations with Z pinned from
the encoder on the passage, either the whole Z of the passage (sample.py --latents=posterior) or only the prompt's,
compared with that passage's own continuation (characters equal position by position; the Jaccard overlap of the
character 4-gram sets) and with the other passages': matched minus mismatched is what pinning moves toward it.
The numbers go to the JSON beside --figure; runs already in that file with the same settings stay in it, so seeds
trained at different times make one table.
"""

import json
import os
import re
import subprocess
import sys

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch

from experiments import study
from nanolatent import ckpt, common, metrics, models, tokendata

kappas = ("1_8", "1_2", "2")  # config/free_text_k<kappa>.py; κ = 1/2 is config/free_text.py; det is always run
seeds = (1, 2, 3)
runs_dir = "out-free-text"  # each run in runs_dir/<det or k<kappa>>_s<seed>
parallel = 1  # training runs at once
max_tokens = 8192  # held-out tokens scored by evaluate.py (its first windows of block_size)
eval_batch = 0  # windows per evaluate.py batch; 0 = all in one (the draws nest across K); on GPUs at 124M: 8
iw_samples = (1, 16, 64)  # K of the importance-weighted bound
prompt = "\n\n"  # a speech has just ended: in the play a speaker's name follows
temperature = 1.0
groups = 8  # shared-Z groups (and independent-Z groups) for the text statistics
group_size = 8
references = 8  # held-out passages for the steering test
per_reference = 8  # generations per passage and condition
device = "cuda" if torch.cuda.is_available() else "cpu"
figure = "assets/free_text.png"  # its JSON beside it
train_args = ""  # extra train.py arguments, e.g. "--max_iters=800"
configurator.apply(globals())
KAPPA_BITS = {"1_8": 1 / 8, "1_2": 1 / 2, "2": 2.0}
if set(kappas) - set(KAPPA_BITS):
    common.die(f"--kappas takes some of {','.join(KAPPA_BITS)} (the config files there are), got {','.join(kappas)}")
MODELS = ("det", *(f"k{k}" for k in kappas))  # a run's name: det or k<kappa>
Z_IGNORED = 0.01  # nats: a posterior CE this close to the prior-Z CE says the decoder reads nothing from Z
SPEAKER = re.compile(r"^[A-Z][A-Za-z']*(?: [A-Z][A-Za-z']*){0,3}:$", re.M)  # "ROMEO:", "First Citizen:"


def run_dir(name, seed):
    return os.path.join(runs_dir, f"{name}_s{seed}")


def config_file(name):
    return {"det": "config/det_text.py", "k1_2": "config/free_text.py"}.get(name, f"config/free_text_{name}.py")


def evaluate(K):
    """evaluate.py on every run of this invocation side by side (the same windows, each run's draws from the same
    seed), by default with all windows in one batch (batch_size >= the windows): the K draws of the bound then nest
    across the K (the same first draws). The prior-Z CE is one draw per window (--mc_samples=1). -> {run_dir: result}"""
    path = os.path.join(runs_dir, f"eval_iw{K}.json")
    out_dirs = ",".join(run_dir(m, s) for s in seeds for m in MODELS)
    cmd = [sys.executable, "evaluate.py", f"--out_dir={out_dirs}", f"--max_tokens={max_tokens}",
           f"--batch_size={eval_batch or max_tokens}", "--mc_samples=1", f"--iw_samples={K}", f"--device={device}",
           f"--out_json={path}"]
    print(" ".join(cmd))
    with open(os.path.join(runs_dir, f"eval_iw{K}.log"), "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
            common.die(f"evaluate.py failed: see {log.name}")
    with open(path) as f:
        return json.load(f)["results"]


def opens_with_name(text):
    return SPEAKER.match(text) is not None


def mean_line_length(text):
    lines = text.split("\n")[:-1]  # complete lines only: the last one is cut by the end of the generation
    return float(np.mean([len(line) for line in lines])) if lines else float(len(text))


def grams(text, n=4):
    return {text[i:i + n] for i in range(len(text) - n + 1)}


def group_stats(texts):
    """The within-group statistics of one group of generations."""
    pairs = [(a, b) for i, a in enumerate(texts) for b in texts[i + 1:]]
    return {"name_agree": float(np.mean([opens_with_name(a) == opens_with_name(b) for a, b in pairs])),
            "line_len_std": float(np.std([mean_line_length(t) for t in texts])),
            "distinct_4": metrics.distinct_n(texts, 4), "jaccard_4": float(np.mean([same_grams(a, b) for a, b in pairs]))}


STATS = ("name_agree", "line_len_std", "distinct_4", "jaccard_4")


def mean_stats(texts):
    """group_stats averaged over consecutive groups of group_size."""
    per_group = [group_stats(texts[i:i + group_size]) for i in range(0, len(texts), group_size)]
    return {k: float(np.mean([g[k] for g in per_group])) for k in STATS}


@torch.no_grad()
def generate(model, latents, encode, decode, seed, n):
    idx = torch.tensor([encode(prompt)] * n, device=device)
    out = model.generate(idx, model.config.block_size - idx.size(1), temperature=temperature, latents=latents,
                         generator=torch.Generator(device).manual_seed(seed))
    return [decode(row[idx.size(1):]) for row in out.tolist()]


def passages(text, length):
    """`references` held-out passages of `length` characters that start with the prompt, evenly spaced."""
    starts = [m.start() for m in re.finditer(re.escape(prompt), text) if m.start() + length <= len(text)]
    if len(starts) < references:
        common.die(f"the held-out text has {len(starts)} passages starting with {prompt!r}, fewer than "
                   f"--references={references}")
    return [text[starts[i]:starts[i] + length] for i in np.linspace(0, len(starts) - 1, references).astype(int)]


def matched_minus_mismatched(texts, refs, measure):
    """texts[r * per_reference + j] was pinned to refs[r]: (mean measure with its own passage, with the others')."""
    P = len(prompt)
    matched, mismatched = [], []
    for i, text in enumerate(texts):
        own = i // per_reference
        for r, ref in enumerate(refs):
            (matched if r == own else mismatched).append(measure(text, ref[P:]))
    return float(np.mean(matched)), float(np.mean(mismatched))


def same_chars(text, ref):
    return float(np.mean([a == b for a, b in zip(text, ref)]))


def same_grams(text, ref):
    """Jaccard overlap of the character 4-gram sets: shared wording, wherever it stands."""
    return len(grams(text) & grams(ref)) / max(len(grams(text) | grams(ref)), 1)


def analyse(name, seed, evals, refs_text):
    model, checkpoint = ckpt.load_model(run_dir(name, seed), device)
    model.eval()
    encode, decode = tokendata.tokenizer(checkpoint["meta"])
    record = {"model": name, "seed": seed, "iters": checkpoint["iter_num"]}
    evals = {K: e[run_dir(name, seed)] for K, e in evals.items()}
    first = evals[iw_samples[0]]
    if name == "det":
        record["ce"] = first["nll"]
    else:
        record.update(kappa_bits=KAPPA_BITS[name[1:]], ce_prior=first["nll"], ce_posterior=first["stats/ce_posterior"],
                      neg_elbo=first["neg_elbo"], kl_bits=first["stats/kl"],
                      **{f"iw_{K}": e["iw_bound"] for K, e in evals.items()})
        # Eq. 5 makes KL below κ free, so nothing pulls it down to 0: under, at (within 10%) or above the floor
        ratio = record["kl_bits"] / record["kappa_bits"]
        record["floor"] = "under" if ratio < 0.9 else "at" if ratio <= 1.1 else "above"
        # Z ignored: the decoder predicts as well from uniform codes as from the encoder's, which know the future
        record["z_ignored"] = bool(record["ce_prior"] - record["ce_posterior"] < Z_IGNORED)
        # the prior-Z CE is an upper bound on the NLL too (Jensen: -log E_Z P(S | Z) <= E_Z -log P(S | Z)). With
        # many nats of KL per window the importance weights span many orders of magnitude, IW_K is never below its
        # best draw's -log w, and it closes the gap slowly in K: the prior-Z CE can be the tighter bound
        record["best_bound"] = min(record["ce_prior"], record[f"iw_{iw_samples[-1]}"])
    record["tokens"] = first["tokens"]
    # What Z carries (Fig. 3 on text): the prompt's Z from the encoder on the prompt (§3.2), new tokens' Z uniform
    latent_gen = torch.Generator(device).manual_seed(seed)
    prompt_ids = torch.tensor([encode(prompt)], device=device)
    n = groups * group_size
    indep_latents = model.sample_latents(n, latent_gen, prompt=prompt_ids)
    shared_latents = None if indep_latents is None else torch.cat(
        [models.repeat_latents(model.sample_latents(1, latent_gen, prompt=prompt_ids), group_size)
         for _ in range(groups)])
    indep = generate(model, indep_latents, encode, decode, seed, n)
    shared = generate(model, shared_latents, encode, decode, seed + 1, n)
    record["independent"], record["shared"] = mean_stats(indep), mean_stats(shared)
    record["examples"] = {"independent": indep[:group_size], "shared": shared[:2 * group_size]}
    if name == "det":
        return record
    # Steering: Z pinned from the encoder on a reference passage (sample.py --latents=posterior --reference=...)
    refs = passages(refs_text, model.config.block_size)  # as many characters as tokens fit: all of them, or more
    P = prompt_ids.size(1)  # the prompt's tokens
    posts = [model.posterior_latents(torch.tensor([encode(ref)], device=device), latent_gen) for ref in refs]
    full = torch.cat([models.repeat_latents(p, per_reference) for p in posts])  # (R * per_reference, block_size)
    only_prompt = model.sample_latents(len(full), latent_gen)  # every Z_t uniform, a draw per sequence ...
    only_prompt[:, :P] = full[:, :P]  # ... but the prompt's, from the encoder on the passage
    for condition, latents in (("full", full), ("prompt", only_prompt)):
        texts = generate(model, latents, encode, decode, seed + 2, len(latents))
        for measure in (same_chars, same_grams):
            matched, mismatched = matched_minus_mismatched(texts, refs, measure)
            key = f"steer_{condition}_{measure.__name__}"
            record[key] = {"matched": matched, "mismatched": mismatched, "difference": matched - mismatched}
        record["examples"][f"pinned_{condition}"] = texts[:2]
    record["examples"]["reference"] = refs[0]
    return record


def spread(values):
    """mean ± std over seeds (ddof 0, as study.intervals_apart calls differences)."""
    values = [v for v in values if v == v]
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=len(values) > 1):.3f}" if values else "-"


study.train_all_missing({run_dir(m, s): [config_file(m), f"--seed={s}", f"--device={device}", *train_args.split()]
                        for s in seeds for m in MODELS}, parallel)
data = os.path.splitext(figure)[0] + ".json"  # every number of the tables and the figure, beside it
settings = {"prompt": prompt, "temperature": temperature, "groups": groups, "group_size": group_size,
            "references": references, "per_reference": per_reference, "max_tokens": max_tokens,
            "eval_batch": eval_batch,
            "iw_samples": list(iw_samples), "train_args": train_args}
dataset = ckpt.load_checkpoint(run_dir("det", seeds[0]))["config"]["dataset"]
meta = tokendata.load_meta(dataset)
# the steering test's passages come from the held-out text past the windows evaluate.py scores
refs_text = tokendata.tokenizer(meta)[1](tokendata.load_tokens(dataset, "val", meta)[max_tokens:].tolist())
runs = study.earlier_runs(data, settings, key=lambda r: (r["model"], r["seed"]))
evals = {K: evaluate(K) for K in iw_samples}
for s, name in common.progress([(s, name) for s in seeds for name in MODELS], desc="runs analysed"):
    print(f"generating from {run_dir(name, s)}")
    runs[(name, s)] = analyse(name, s, evals, refs_text)
order = ["det"] + [f"k{k}" for k in KAPPA_BITS]
results = [runs[key] for key in sorted(runs, key=lambda key: (order.index(key[0]), key[1]))]
by_model = {m: [r for r in results if r["model"] == m] for m in order if any(r["model"] == m for r in results)}
det_ce = {r["seed"]: r["ce"] for r in by_model.get("det", [])}
label = lambda m: "det" if m == "det" else f"free κ = {KAPPA_BITS[m[1:]]:g}"

print(f"\nheld-out: the first {results[0]['tokens']:,} characters of {dataset}/val.bin, nats per character; "
      "mean ± std over seeds\n")
print("| model | seeds | det CE / prior-Z CE | posterior CE (reads the future) | -ELBO | IW K=1 | IW K=16 | IW K=64 "
      "| KL bits/token | KL under / at / above κ | Z ignored | price of Z (best bound - det CE) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for m, rs in by_model.items():
    if m == "det":
        print(f"| det | {len(rs)} | {spread([r['ce'] for r in rs])} | - | - | - | - | - | - | - | - | - |")
        continue
    price = [r["best_bound"] - det_ce[r["seed"]] for r in rs if r["seed"] in det_ce]
    floors = " / ".join(str(sum(r["floor"] == f for r in rs)) for f in ("under", "at", "above"))
    print(f"| {label(m)} | {len(rs)} | {spread([r['ce_prior'] for r in rs])} "
          f"| {spread([r['ce_posterior'] for r in rs])} | {spread([r['neg_elbo'] for r in rs])} | "
          + " | ".join(spread([r.get(f"iw_{K}", float("nan")) for r in rs]) for K in (1, 16, 64))
          + f" | {spread([r['kl_bits'] for r in rs])} | {floors} | {sum(r['z_ignored'] for r in rs)} of {len(rs)} "
          f"| {spread(price)} |")

print(f"\nwhat Z carries: prompt {prompt!r}, {groups} groups of {group_size}, shared Z / independent Z (det: two "
      "independent sets, the noise floor); steering: matched - mismatched reference, Z pinned on the whole passage / "
      "on the prompt only\n")
print("| model | opens with a name: agreement | line-length std | distinct-4 | 4-gram Jaccard | steer: same characters "
      "(whole / prompt) | steer: 4-gram Jaccard (whole / prompt) |")
print("|---|---|---|---|---|---|---|")
for m, rs in by_model.items():
    cells = [f"{spread([r['shared'][k] for r in rs])} / {spread([r['independent'][k] for r in rs])}" for k in STATS]
    for measure in ("same_chars", "same_grams"):
        cells.append(" / ".join(spread([r[f"steer_{c}_{measure}"]["difference"] for r in rs])
                                if m != "det" else "-" for c in ("full", "prompt")))
    print(f"| {label(m)} | " + " | ".join(cells) + " |")

os.makedirs(os.path.dirname(data) or ".", exist_ok=True)
with open(data, "w") as f:
    json.dump({**settings, "dataset": dataset, "runs": results}, f, indent=1, default=float)
print(f"\nwrote {data}")

plt = common.pyplot("the tables are above; the figure")
fig, axes = plt.subplots(2, 2, figsize=(12, 9))
frees = [m for m in by_model if m != "det"]
x = [KAPPA_BITS[m[1:]] for m in frees]
mean_std = lambda values: (np.mean(values), np.std(values, ddof=len(values) > 1))  # std over seeds, ddof 1
ax = axes[0, 0]
if "det" in by_model:
    mu, sd = mean_std([r["ce"] for r in by_model["det"]])
    ax.axhspan(mu - sd, mu + sd, color="black", alpha=0.15)
    ax.axhline(mu, color="black", label="det CE")
for key, text, style in [("ce_prior", "prior-Z CE", "-o"), ("neg_elbo", "-ELBO", "-s"), ("iw_1", "IW K=1", ":^"),
                         ("iw_16", "IW K=16", ":v"), ("iw_64", "IW K=64", "-D"),
                         ("ce_posterior", "posterior CE (reads the future)", "--x")]:
    stats = [mean_std([r[key] for r in by_model[m] if key in r]) for m in frees]
    ax.errorbar(x, [s[0] for s in stats], yerr=[s[1] for s in stats], fmt=style, capsize=3, label=text)
ax.set_xscale("log", base=2)
ax.set_xlabel("κ (free bits per token)")
ax.set_ylabel("nats per character, held out")
ax.set_title("what Z costs: bounds on the NLL against det's CE")
ax.legend(fontsize=8)
ax = axes[0, 1]
for m in frees:
    ax.scatter([KAPPA_BITS[m[1:]]] * len(by_model[m]), [r["kl_bits"] for r in by_model[m]], color="tab:blue")
ax.plot(x, x, "k--", label="free-bits floor KL = κ")
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_xlabel("κ (free bits per token)")
ax.set_ylabel("KL bits per token (one point a seed)")
ax.set_title("how much Z carries")
ax.legend(fontsize=8)
ax = axes[1, 0]
names = list(by_model)
for i, k in enumerate(("name_agree", "jaccard_4")):
    diffs = [mean_std([r["shared"][k] - r["independent"][k] for r in by_model[m]]) for m in names]
    ax.bar(np.arange(len(names)) + 0.4 * i - 0.2, [d[0] for d in diffs], 0.4, yerr=[d[1] for d in diffs],
           capsize=3, label={"name_agree": "agree on opening with a name", "jaccard_4": "4-gram Jaccard"}[k])
ax.axhline(0, color="black", lw=0.8)
ax.set_xticks(range(len(names)), [label(m) for m in names], fontsize=8)
ax.set_ylabel("shared Z minus independent Z, within a group")
ax.set_title("does a shared Z make a group alike? (det: noise floor)")
ax.legend(fontsize=8)
ax = axes[1, 1]
for condition, style in (("full", "-o"), ("prompt", "--s")):
    for measure, color in (("same_chars", "tab:blue"), ("same_grams", "tab:orange")):
        stats = [mean_std([r[f"steer_{condition}_{measure}"]["difference"] for r in by_model[m]]) for m in frees]
        ax.errorbar(x, [s[0] for s in stats], yerr=[s[1] for s in stats], fmt=style, color=color, capsize=3,
                    label=f"{'same characters' if measure == 'same_chars' else '4-gram Jaccard'}, Z of the "
                          f"{'whole passage' if condition == 'full' else 'prompt only'}")
ax.axhline(0, color="black", lw=0.8)
ax.set_xscale("log", base=2)
ax.set_xlabel("κ (free bits per token)")
ax.set_ylabel("own passage minus the others'")
ax.set_title("does Z pinned from a reference move generation toward it?")
ax.legend(fontsize=8)
fig.tight_layout()
os.makedirs(os.path.dirname(figure) or ".", exist_ok=True)
fig.savefig(figure, dpi=80)
print(f"wrote {figure}")
