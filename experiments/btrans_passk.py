"""B-Trans Pass@K at CPU scale, decoded as the paper decodes (§5.1, Fig. 2): do more samples find more correct
answers when each comes from its own mind than when they come from temperature sampling alone?

    python -m experiments.btrans_passk              # trains config/det_arith.py first if needed

One det model on prepare.py's arithmetic task; n samples per held-out val problem, every arm at the same `temperature`
(the paper contrasts B-Trans with "high-temperature sampling" of the base model, minds sampled at that temperature):
  temperature    the det model alone,
  minds          B-Trans: the same weights wrapped plug-and-play, one eps per sample drawn once and frozen (§4.3),
  minds, no final-norm noise    the same minds with norm_f carrying mu only (final_norm_noise=False; the paper
                 does not say whether the final norm is wrapped, so both are run),
  token noise    a fresh eps at every step (§6.1 ablation),
and `greedy minds` (the same minds at temperature 0: all diversity from the minds), for each sigma of `sigmas`.
sigma is not tuned to match anything: pass@1 of every arm is reported, and the paper's "matches the baseline at
K = 1" is a measured row, not a setting. pass@k, k = 1 ... n, is the unbiased estimator (metrics.pass_at_k) averaged
over prompts, for each seed (of the token draws and, separately, of the minds; minds arms share their eps); the
table gives mean ± std over seeds, and a difference from temperature is called only where the mean ± std intervals
do not overlap. Every per-seed number, and each problem's count of correct samples per seed (the README's row
resamples the problems, experiments/results.py), goes to `json_out`, the curves to `figure`.
"""

import json
import os

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch

from experiments import study
from nanolatent import ckpt, common, grpo, metrics, tasks, tokendata

sft_dir = "out-det-arith"
num_prompts = 128  # the first val problems
n = 64  # samples per prompt
ks = (1, 2, 4, 8, 16, 32, 64)  # the table's columns; the JSON and the figure have every k
temperature = 1.0  # every arm's sampling temperature, the greedy minds' excepted
sigmas = (0.1, 0.2)  # the minds' spread (model_btrans.Config.sigma, scaled as sigma_scale says)
sigma_scale = "absolute"  # model_btrans.Config.sigma_scale; this small model's gains are near 1 (printed)
seeds = (1, 2, 3, 4, 5)  # five: the rules' verdict (docs/reproductions.md); three make a pilot
json_out = "assets/btrans_passk.json"
figure = "assets/btrans_passk.png"
device = "cpu"
configurator.apply(globals())

study.train_if_missing(sft_dir, "config/det_arith.py", f"--device={device}", "--compile=False")
det, checkpoint = ckpt.load_model(sft_dir, device)
det.eval()
spec = tasks.TASKS["arith"]
meta = tokendata.load_meta(spec.dataset)
encode, decode = tokendata.tokenizer(meta)
prompts = tasks.load_prompts("arith", spec.dataset, "val", meta)[:num_prompts]
prompt_ids = [encode(p) for p in prompts]

# the det weights as B-Trans, one wrapper per noise setting; each run sets the spread of every wrapped norm in place
wrapped = {arm: ckpt.load_model(sft_dir, device, "btrans", checkpoint=checkpoint, sigma_scale=sigma_scale,
                                **overrides)[0].eval()
           for arm, overrides in (("minds", {}), ("minds, no final-norm noise", {"final_norm_noise": False}),
                                  ("token noise", {"noise_mode": "token"}))}
gains = [norm.weight.abs().mean().item() for norm in wrapped["minds"].norms()]
print(f"{sft_dir}: mean |gain| per wrapped norm {min(gains):.2f} ... {max(gains):.2f}; sigma_scale={sigma_scale}")


def correct_counts(arm, sigma, seed):
    """Correct samples out of n for each prompt."""
    model = det if arm == "temperature" else wrapped["minds" if arm == "greedy minds" else arm]
    for norm in (model.norms() if model is not det else []):
        norm.fixed_sigma = sigma
    T = 0.0 if arm == "greedy minds" else temperature
    tokens, latents = (torch.Generator(device).manual_seed(common.seed_of(seed, i)) for i in range(2))
    completions, _ = grpo.rollouts(model, prompt_ids, n, spec.max_new_tokens, T, tokens, latents)
    ok = [spec.verify(p, decode(c)) for p, c in zip(np.repeat(prompts, n), completions.tolist())]
    return np.array(ok).reshape(len(prompts), n).sum(1)


print(f"{len(prompts)} val problems of arith, n={n} samples each, T={temperature}, seeds {list(seeds)}")
all_k = range(1, n + 1)
runs = [("temperature", 0.0)] + [(arm, s) for s in sigmas for arm in (*wrapped, "greedy minds")]
curves, counts_of = {}, {}  # (arm, sigma) -> (seeds, n): pass@k for k = 1 ... n; (seeds, prompts): correct of n
for arm, sigma in common.progress(runs, desc="arms"):
    counts = counts_of[arm, sigma] = [correct_counts(arm, sigma, seed) for seed in seeds]
    curves[arm, sigma] = np.array([list(metrics.pass_at_k_curve(c, n, all_k).values()) for c in counts])
    print(f"{arm}{'' if arm == 'temperature' else f', sigma={sigma:g}'}: pass@1 "
          f"{study.mean_std(curves[arm, sigma][:, 0])}", flush=True)


def label(arm, sigma):
    decoding = "greedy" if arm == "greedy minds" else f"T={temperature:g}"
    return f"det, {decoding}" if arm == "temperature" else f"{arm}, σ={sigma:g}, {decoding}"


ref = curves["temperature", 0.0]
print(f"\npass@k, mean ± std over seeds {list(seeds)}; * marks a mean ± std interval apart from temperature's\n")
print("| source | " + " | ".join(f"k={k}" for k in ks) + " |")
print("|---|" + "---|" * len(ks))
for key, c in curves.items():
    marks = ["*" if key != ("temperature", 0.0) and study.intervals_apart(c[:, k - 1], ref[:, k - 1]) else ""
             for k in ks]
    print(f"| {label(*key)} | " + " | ".join(f"{study.mean_std(c[:, k - 1])}{m}" for k, m in zip(ks, marks)) + " |")
if study.one_seed_note(seeds):
    print(f"\n{study.one_seed_note(seeds)}")
os.makedirs(os.path.dirname(json_out), exist_ok=True)
with open(json_out, "w") as f:
    json.dump({"sft_dir": sft_dir, "num_prompts": len(prompts), "n": n, "temperature": temperature,
               "sigma_scale": sigma_scale, "seeds": list(seeds), "mean_gain_per_norm": gains,
               "runs": [{"arm": arm, "sigma": sigma, "label": label(arm, sigma),
                         "pass_at_k_per_seed": curves[arm, sigma].round(6).tolist(),
                         "correct_per_seed_problem": np.array(counts_of[arm, sigma]).tolist(),
                         "apart_from_temperature": {k: study.intervals_apart(curves[arm, sigma][:, k - 1],
                                                                             ref[:, k - 1]) for k in all_k}}
                        for arm, sigma in curves]}, f, indent=1)
print(f"\nwrote {json_out}")

plt = common.pyplot("the table is above; the figure")
fig, axes = plt.subplots(1, len(sigmas), figsize=(5 * len(sigmas), 4), sharey=True, squeeze=False)
for ax, sigma in zip(axes[0], sigmas):
    for key in [("temperature", 0.0)] + [(arm, sigma) for arm in (*wrapped, "greedy minds")]:
        c = curves[key]
        ax.plot(all_k, c.mean(0), label=label(*key))
        ax.fill_between(all_k, c.mean(0) - c.std(0, ddof=int(len(c) > 1)), c.mean(0) + c.std(0, ddof=int(len(c) > 1)), alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples per problem)")
    ax.set_title(f"σ = {sigma:g} ({sigma_scale}); mean ± std of {len(seeds)} seeds", fontsize=9)
    ax.legend(fontsize=7)
axes[0][0].set_ylabel(f"pass@k ({len(prompts)} arith val problems)")
fig.tight_layout()
fig.savefig(figure, dpi=100)
print(f"wrote {figure}")
