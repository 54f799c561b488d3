"""B-Trans at CPU scale (the paper's §5.1 question, §6.1 ablation): is a population of minds more diverse than
temperature sampling at the same per-token quality?

    python -m experiments.btrans_diversity          # trains config/det_shakespeare_char.py first if needed (~8 min)

One det model trained on character-level Tiny Shakespeare, k generations per prompt from
  (a) the det model with temperature sampling, over a sweep of temperatures,
  (b) B-Trans minds: the same weights wrapped plug-and-play, one eps per sequence (§4.3), greedy decoding, so every
      difference between the k generations comes from the minds,
  (c) token-wise noise: the same wrapper with a fresh eps at every step (§6.1), greedy decoding.
Diversity: distinct-n pooled over the group and mean pairwise normalised edit distance. Quality: the mean per-token
NLL of the generated characters under the det model (a coherence proxy: lower reads more like Shakespeare). The
det sweep traces diversity against NLL; each B-Trans row is compared with the det curve interpolated at its own NLL.
"""

import json
import os

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch

from experiments import study
from nanolatent import ckpt, common, tokendata
from nanolatent.metrics import distinct_n, pairwise_distance

out_dir = "out-det-shakespeare-char"
prompts = ("ROMEO:\n", "JULIET:\n", "First Citizen:\n", "KING HENRY VI:\n", "MENENIUS:\n", "LADY CAPULET:\n")
k = 8  # generations (minds) per prompt
max_new_tokens = 100
temperatures = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1)
sigmas = (0.1, 0.2, 0.4)
sigma_scale = "absolute"  # Eq. 4 as written, as the README's table was measured (model_btrans's default is 'gain')
seed = 1337
figure = "assets/btrans_diversity.png"
device = "cpu"
configurator.apply(globals())

study.train_if_missing(out_dir, "config/det_shakespeare_char.py", f"--device={device}")
det, checkpoint = ckpt.load_model(out_dir, device)
det.eval()
encode, decode = tokendata.tokenizer(checkpoint["meta"])


@torch.no_grad()
def nll_under_det(rows, prompt_len):
    """Mean per-token NLL of the generated part of each row under the det model."""
    idx = torch.tensor(rows, device=device)
    targets = idx[:, 1:].clone()
    targets[:, :prompt_len - 1] = -1  # score the continuation only
    _, loss, _ = det(idx[:, :-1], targets=targets)
    return loss.item()


@torch.no_grad()
def run(model, temperature):
    """Generate k continuations per prompt; average the metrics over prompts."""
    generator = torch.Generator(device).manual_seed(seed)
    metrics = []
    for prompt in prompts:
        idx = torch.tensor([encode(prompt)] * k, device=device)
        latents = model.sample_latents(k, generator)
        rows = model.generate(idx, max_new_tokens, temperature=temperature, latents=latents, generator=generator).tolist()
        texts = [decode(r[idx.size(1):]) for r in rows]
        metrics.append([nll_under_det(rows, idx.size(1)), distinct_n(texts, 2), distinct_n(texts, 3),
                        pairwise_distance(texts)])
    return dict(zip(("nll", "distinct_2", "distinct_3", "pairwise"), np.mean(metrics, axis=0)), sample=texts[0])


rows = [dict(source="det", setting=f"T={t}", **run(det, t))
        for t in common.progress(temperatures, desc="det's temperatures")]
for mode in ("sequence", "token"):
    for sigma in common.progress(sigmas, desc=f"{mode} minds' sigmas"):
        minds, _ = ckpt.load_model(out_dir, device, "btrans", sigma=sigma, noise_mode=mode,
                                   sigma_scale=sigma_scale)
        rows.append(dict(source="minds" if mode == "sequence" else "token", setting=f"sigma={sigma}, greedy",
                         **run(minds.eval(), 0.0)))

det_rows = sorted((r for r in rows if r["source"] == "det"), key=lambda r: r["nll"])
print(f"{k} generations of {max_new_tokens} characters for each of {len(prompts)} prompts, {out_dir}\n")
print("| source | setting | NLL under det | distinct-2 | distinct-3 | pairwise edit | det distinct-2 at equal NLL |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    matched = np.interp(r["nll"], [d["nll"] for d in det_rows], [d["distinct_2"] for d in det_rows])
    outside = not det_rows[0]["nll"] <= r["nll"] <= det_rows[-1]["nll"]
    print(f"| {r['source']} | {r['setting']} | {r['nll']:.3f} | {r['distinct_2']:.3f} | {r['distinct_3']:.3f} | "
          f"{r['pairwise']:.3f} | {'-' if r['source'] == 'det' else f'{matched:.3f}' + (' (outside the det sweep)' * outside)} |")
print("\none sample per source (last prompt):")
for r in rows:
    print(f"--- {r['source']} {r['setting']}:\n{r['sample']}")

data = os.path.splitext(figure)[0] + ".json"  # the table's rows, beside the figure
os.makedirs(os.path.dirname(data) or ".", exist_ok=True)
with open(data, "w") as f:
    json.dump({"out_dir": out_dir, "K": k, "max_new_tokens": max_new_tokens, "prompts": list(prompts), "seed": seed,
               "rows": rows}, f, indent=1, default=float)
print(f"\nwrote {data}")

plt = common.pyplot("the table is above; the figure")
fig, ax = plt.subplots(figsize=(5.5, 4))
for source, style in (("det", "o-"), ("minds", "s"), ("token", "^")):
    points = sorted((r["nll"], r["distinct_2"]) for r in rows if r["source"] == source)
    ax.plot(*zip(*points), style, label={"det": "det, temperature sweep", "minds": "B-Trans minds (greedy)",
                                         "token": "token-wise noise (greedy)"}[source])
ax.set_xlabel("NLL of the generations under det (nats/char)")
ax.set_ylabel(f"distinct-2 over {k} generations")
ax.legend()
fig.tight_layout()
os.makedirs(os.path.dirname(figure), exist_ok=True)
fig.savefig(figure, dpi=100)
print(f"\nwrote {figure}")
