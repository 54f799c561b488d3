"""The Free Transformer's synthetic experiment (§4.1, Fig. 3): what does Z encode at each free-bits threshold κ?

    python -m experiments.free_synthetic                       # trains what is missing, then reports (CPU: ~8 min a run)
    python -m experiments.free_synthetic --seeds=1, --parallel=2

For every κ in {1/64, 1/8, 1, 8} bits and every seed, a Free Transformer trained on `prepare.py synthetic` with
config/free_synthetic_k<κ>.py generates, for one prompt, an independent-Z group (a Z per sequence, Fig. 3's blue boxes)
and shared-Z groups (one Z for the whole group, the green boxes). Numbers per run:
  well-formed  share of independent-Z generations that are a valid sequence of the prompt's letter (evaluate.py's
               letters verifier: one run of 8 letters, '!' noise allowed);
  spread       sample standard deviation (ddof 1) of the target's start position within each shared-Z group
               (averaged over groups) and across the independent-Z samples, the starts kept in the JSON; runs without
               spread_ddof = 1 in it were analysed with ddof 0. Z encoding the position makes the first much smaller;
  KL           bits/token of the encoder's posterior, and the CE with Z from the posterior, from the prior, and the
               -ELBO, from the run's last evaluation (train.py's metrics.jsonl).
The numbers go to the JSON beside --figure; runs already in that file with the same generation settings stay in it,
so seeds trained at different times make one table (the figure shows the first seed of each κ).
Expected (§4.1): at 1/64 bit Z is unused (shared groups no tighter than independent ones); from 1/8 to 1 bit the shared
groups agree on the position; at 8 bits Z carries everything and prior samples degrade (fewer well-formed).
"""

import json
import math
import os

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch

from experiments import study
from nanolatent import ckpt, common, models, records, tokendata
from nanolatent.tasks import letters_answer

kappas = ("1_64", "1_8", "1", "8")  # config/free_synthetic_k<kappa>.py; κ = 1 is config/free_synthetic.py
seeds = (1, 2, 3)
runs_dir = "out-free-synthetic"  # each run in runs_dir/k<kappa>_s<seed>
letter = "K"  # the prompt is letter + ">"
show = 8  # generations per printed group
shared_groups = 8  # shared-Z groups for the numbers (of `show` generations each)
independent = 64  # independent-Z generations for the numbers
temperature = 1.0
prompt_z = "encoder"  # the prompt's Z from the 'encoder' (§3.2), or from the uniform 'prior' (as the README compares)
parallel = 1  # training runs at once (a GPU holds several of these small models)
device = "cuda" if torch.cuda.is_available() else "cpu"
figure = ""  # default: assets/free_synthetic_<prompt_z>_z.png, its JSON beside it
train_args = ""  # extra train.py arguments, e.g. "--max_iters=3000"
configurator.apply(globals())
figure = figure or f"assets/free_synthetic_{prompt_z}_z.png"
KAPPA_BITS = {"1_64": 1 / 64, "1_8": 1 / 8, "1": 1.0, "8": 8.0}
if not kappas or set(kappas) - set(KAPPA_BITS):
    common.die(f"--kappas takes some of {','.join(KAPPA_BITS)} (the config files there are), got {','.join(kappas)}")


def run_dir(kappa, seed):
    return os.path.join(runs_dir, f"k{kappa}_s{seed}")


def config_file(kappa):
    return "config/free_synthetic.py" if kappa == "1" else f"config/free_synthetic_k{kappa}.py"


def target_start(text):
    """Where the target run starts in a well-formed continuation (the first position of its letter), else None."""
    return text.index(letter) if letters_answer(text) == letter else None


@torch.no_grad()
def generate(model, latents, encode, decode, seed):
    prompt = torch.tensor([encode(letter + ">")] * latents.size(0), device=device)
    out = model.generate(prompt, 64, temperature=temperature, latents=latents,
                         generator=torch.Generator(device).manual_seed(seed))
    return [decode(row[2:]) for row in out.tolist()]


def analyse(kappa, seed):
    model, checkpoint = ckpt.load_model(run_dir(kappa, seed), device)
    model.eval()
    encode, decode = tokendata.tokenizer(checkpoint["meta"])
    latent_gen = torch.Generator(device).manual_seed(seed)
    # §3.2: the prompt's Z from the encoder on the prompt, each new token's Z uniform; a shared group shares both
    prompt = torch.tensor([encode(letter + ">")], device=device)
    draw = lambda n: model.sample_latents(n, latent_gen, prompt=prompt if prompt_z == "encoder" else None)
    indep = generate(model, draw(independent), encode, decode, seed)
    groups = [generate(model, models.repeat_latents(draw(1), show), encode, decode, seed + g)
              for g in range(shared_groups)]
    starts = lambda texts: [s for s in map(target_start, texts) if s is not None]
    # the sample SD (ddof 1), rule 1's convention: with ddof 0 a group of 8 would read smaller than the 64 independent
    spread = lambda texts: float(np.std(starts(texts), ddof=1)) if len(starts(texts)) >= 2 else float("nan")
    group_spreads = [spread(g) for g in groups if len(starts(g)) >= 2]
    last_eval = [r for r in records.read_records(os.path.join(run_dir(kappa, seed), "metrics.jsonl"))
                 if "val_loss" in r][-1]
    return dict(kappa=kappa, seed=seed, iters=last_eval["iter"], kl_bits=last_eval["val_kl"],
                ce_posterior=last_eval["val_ce"], ce_prior=last_eval["val_ce_prior"], neg_elbo=last_eval["val_elbo"],
                well_formed=np.mean([letters_answer(t) == letter for t in indep]),
                spread_shared=float(np.mean(group_spreads)) if group_spreads else float("nan"),
                spread_independent=spread(indep), spread_ddof=1, starts_shared=[starts(g) for g in groups],
                starts_independent=starts(indep), indep=indep[:show], groups=groups[:2])


study.train_all_missing({run_dir(k, s): [config_file(k), f"--seed={s}", f"--device={device}", *train_args.split()]
                        for k in kappas for s in seeds}, parallel)
data = os.path.splitext(figure)[0] + ".json"  # every number of the table and the figure's texts, beside it
settings = {"letter": letter, "temperature": temperature, "prompt_z": prompt_z, "shared_groups": shared_groups,
            "show": show, "independent": independent, "train_args": train_args}
runs = study.earlier_runs(data, settings, key=lambda r: (r["kappa"], r["seed"]))
runs.update({(k, s): {**analyse(k, s), "kappa_bits": KAPPA_BITS[k]}
             for k, s in common.progress([(k, s) for k in kappas for s in seeds], desc="runs analysed")})
results = [runs[key] for key in sorted(runs, key=lambda key: (KAPPA_BITS[key[0]], key[1]))]
seeds = sorted({r["seed"] for r in results})  # the table and the figure show every run in the file
print(f"\nprompt {letter}>, temperature {temperature}; spread = std of the target's start position "
      f"({shared_groups} shared-Z groups of {show}, {independent} independent-Z samples)\n")
print("| κ (bits) | seed | iters | KL bits/token | CE posterior | CE prior Z | -ELBO | well-formed | spread shared Z "
      "| spread independent Z |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in results:
    print(f"| {KAPPA_BITS[r['kappa']]:g} | {r['seed']} | {r['iters']} | {r['kl_bits']:.3f} | {r['ce_posterior']:.3f} | "
          f"{r['ce_prior']:.3f} | {r['neg_elbo']:.3f} | {r['well_formed']:.2f} | {r['spread_shared']:.1f} | "
          f"{r['spread_independent']:.1f} |")
for r in results:
    if r["seed"] != seeds[0]:
        continue
    print(f"\nκ = {KAPPA_BITS[r['kappa']]:g} bit, seed {r['seed']}\nindependent Z:")
    print("\n".join(f"  {letter}>{t!r}" for t in r["indep"]))
    for i, group in enumerate(r["groups"]):
        print(f"shared Z #{i + 1}:")
        print("\n".join(f"  {letter}>{t!r}" for t in group))

os.makedirs(os.path.dirname(data) or ".", exist_ok=True)
with open(data, "w") as f:
    json.dump({**settings, "runs": results}, f, indent=1, default=float)
print(f"\nwrote {data}")

plt = common.pyplot("the table is above; the figure")
firsts = [r for r in results if r["seed"] == seeds[0]]
rows = math.ceil(len(firsts) / 2)  # a run of fewer kappas draws only their panels
fig, axes = plt.subplots(rows, min(len(firsts), 2), figsize=(6.5 * min(len(firsts), 2), 5.5 * rows), squeeze=False)
for ax in axes.flat[len(firsts):]:
    ax.remove()
for ax, r in zip(axes.flat, firsts):
    lines = [("independent Z", "black")] + [(f"{letter}>{t}", "tab:blue") for t in r["indep"]]
    for i, group in enumerate(r["groups"]):
        lines += [(f"shared Z #{i + 1}", "black")] + [(f"{letter}>{t}", "tab:green") for t in group]
    for row, (text, color) in enumerate(lines):
        ax.text(0, 1 - row / len(lines), text, family="monospace", fontsize=7, color=color, va="top",
                transform=ax.transAxes)
    ax.set_title(f"κ = {KAPPA_BITS[r['kappa']]:g} bit: KL {r['kl_bits']:.2f} bits/token, "
                 f"well-formed {r['well_formed']:.2f}", fontsize=9)
    ax.axis("off")
fig.tight_layout()
os.makedirs(os.path.dirname(figure), exist_ok=True)
fig.savefig(figure, dpi=80)
print(f"\nwrote {figure}")
