"""B-Trans Pass@K at CPU scale (the paper's §5.1, Fig. 2): at the same pass@1, do more samples find more correct
answers when they come from different minds than when they come from temperature sampling?

    python -m experiments.btrans_passk              # trains config/det_arith.py first if needed

One det model on prepare.py's arithmetic task, n samples per held-out val problem from
  temperature  the det model, token sampling at `temperature` (the reference),
  minds        B-Trans: the same weights wrapped plug-and-play, one eps per sample drawn once and frozen (§4.3),
               decoded at `minds_temperature` (0: greedy, so every difference between samples comes from the minds),
  token        the same wrapper with a fresh eps at every step (§6.1 ablation), same decoding.
Matching: pass@1 is what the paper holds equal (Fig. 2 starts the curves together at K = 1). The reference is det at
`temperature`; for minds and token noise sigma is swept on the first seed, and the sigma at which pass@1 equals the
reference's is interpolated (tasks.matching_setting), measured, added to the sweep and interpolated again, until
pass@1 is within `tolerance` of the reference. Then every source runs at its matched setting on every seed (seeds of
the latents and of the token draws), and pass@k, k = 1 ... n, is the unbiased estimator (tasks.pass_at_k) averaged
over prompts.
"""

import os

import numpy as np
import torch

import common
import configurator
import rlvr
import tasks

sft_dir = "out-det-arith"
num_prompts = 128  # the first val problems
n = 64  # samples per prompt
ks = (1, 2, 4, 8, 16, 32, 64)  # the table's columns; the figure has every k
temperature = 1.0  # the det reference
minds_temperature = 0.0  # decoding of minds and token noise (0: greedy)
sigmas = (0.0, 0.1, 0.2, 0.4)  # the matching sweep for minds and token noise (0: the greedy det model)
tolerance = 0.005  # |pass@1 - reference pass@1| accepted as matched
match_rounds = 3  # interpolate-and-measure rounds at most
seeds = (1, 2, 3)
figure = "assets/btrans_passk.png"
device = "cpu"
configurator.apply(globals())

common.train_if_missing(sft_dir, "config/det_arith.py", f"--device={device}", "--compile=False")
det, checkpoint = common.load_model(sft_dir, device)
det.eval()
spec = tasks.TASKS["arith"]
meta = common.load_meta(spec.dataset)
encode, decode = common.tokenizer(meta)
prompts = tasks.load_prompts("arith", spec.dataset, "val", meta)[:num_prompts]
prompt_ids = [encode(p) for p in prompts]


# the det weights as B-Trans, loaded once per noise mode; each run sets the spread of every wrapped norm in place
wrapped = {source: common.load_model(sft_dir, device, "btrans", checkpoint=checkpoint, noise_mode=mode)[0].eval()
           for source, mode in (("minds", "sequence"), ("token", "token"))}


def net_for(source, sigma):
    if source == "temperature":
        return det
    net = wrapped[source]
    for norm in net.norms():
        norm.fixed_sigma = sigma
    return net


def correct_counts(source, setting, seed):
    """Correct samples out of n for each prompt. setting: the temperature (det) or sigma (minds, token)."""
    net = net_for(source, setting)
    T = setting if source == "temperature" else minds_temperature
    tokens, latents = (torch.Generator(device).manual_seed(common.seed_of(seed, i)) for i in range(2))
    completions, _ = rlvr.rollouts(net, prompt_ids, n, spec.max_new_tokens, T, tokens, latents)
    ok = [spec.verify(p, decode(c)) for p, c in zip(np.repeat(prompts, n), completions.tolist())]
    return np.array(ok).reshape(len(prompts), n).sum(1)


def pass1(counts):
    return float(np.mean(counts)) / n


def match(source, target):
    """The sigma at which the source's pass@1 on the first seed is within tolerance of target: (sigma, sweep)."""
    sweep = {s: pass1(correct_counts(source, s, seeds[0])) for s in sigmas}
    for _ in range(match_rounds):
        sigma = tasks.matching_setting(list(sweep), list(sweep.values()), target)
        if sigma is None:
            common.die(f"{source}: pass@1 over sigma {sorted(sweep)} is {[round(v, 3) for v in sweep.values()]}, "
                       f"never {target:.3f}; widen --sigmas")
        sweep[sigma] = pass1(correct_counts(source, sigma, seeds[0]))
        if abs(sweep[sigma] - target) <= tolerance:
            break
    print(f"{source}: sweep (sigma: pass@1) " + ", ".join(f"{s:.3f}: {v:.3f}" for s, v in sorted(sweep.items())))
    return sigma, sweep


print(f"{len(prompts)} val problems of arith, n={n} samples each, {sft_dir}; reference: det at T={temperature}")
reference = correct_counts("temperature", temperature, seeds[0])
settings = {"temperature": temperature}
for source in ("minds", "token"):
    settings[source], _ = match(source, pass1(reference))

all_k = range(1, n + 1)
curves = {}  # source -> (seeds, n) pass@k for k = 1 ... n
for source, setting in settings.items():
    counts = [reference if (source, seed) == ("temperature", seeds[0]) else correct_counts(source, setting, seed)
              for seed in seeds]
    curves[source] = np.array([list(tasks.pass_at_k_curve(c, n, all_k).values()) for c in counts])

decoding = "greedy" if minds_temperature == 0 else f"T={minds_temperature}"
label = {"temperature": f"det, T={temperature}", "minds": f"minds, sigma={settings['minds']:.3f}, {decoding}",
         "token": f"token noise, sigma={settings['token']:.3f}, {decoding}"}
print(f"\npass@k, mean ± std over seeds {list(seeds)}; matched pass@1 (sigma interpolated on seed {seeds[0]} to "
      f"within {tolerance} of the reference)\n")
print("| source | " + " | ".join(f"k={k}" for k in ks) + " |")
print("|---|" + "---|" * len(ks))
for source, c in curves.items():
    print(f"| {label[source]} | " + " | ".join(f"{c[:, k - 1].mean():.3f} ± {c[:, k - 1].std():.3f}" for k in ks) + " |")
gaps = {s: curves[s].mean(0) - curves["temperature"].mean(0) for s in ("minds", "token")}
print("\npass@k minus temperature's: " + "; ".join(
    f"{s}: " + ", ".join(f"k={k} {gaps[s][k - 1]:+.3f}" for k in ks) for s in gaps))

plt = common.pyplot("the table is above; the figure")
fig, ax = plt.subplots(figsize=(5.5, 4))
for source, c in curves.items():
    ax.plot(all_k, c.mean(0), label=label[source])
    ax.fill_between(all_k, c.min(0), c.max(0), alpha=0.2)
ax.set_xscale("log", base=2)
ax.set_xlabel("k (samples per problem)")
ax.set_ylabel(f"pass@k ({len(prompts)} val problems)")
ax.set_title(f"arith, matched pass@1; mean of {len(seeds)} seeds, band: min-max", fontsize=9)
ax.legend()
fig.tight_layout()
os.makedirs(os.path.dirname(figure), exist_ok=True)
fig.savefig(figure, dpi=100)
print(f"\nwrote {figure}")
