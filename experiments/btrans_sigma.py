"""How sigma moves a pretrained model, to pick it (B-Trans §4.1 Eq. 4 gives no value): the sweep behind the README's
sigma guidance for a pretrained model.

    python -m scripts.convert gguf --src=SmolLM2-135M-Instruct.Q4_1.gguf --out_dir=out-smollm2   # or scripts/convert.py hf
    python -m experiments.btrans_sigma --out_dir=out-smollm2

For each way of scaling the offset (model_btrans.Config.sigma_scale: 'absolute' is Eq. 4 as written, 'gain' and
'mean_gain' are ours) and each sigma, `minds` minds read the same `num_seqs` windows of `seq_len` tokens of held-out
text, each mind one eps per window (§4.3), the same eps at every sigma and scale (paired draws). Against the det
model (sigma = 0) on the same tokens:
  d_nll      mean per-token NLL of a mind minus det's (nats): what a mind costs in quality,
  flip       the fraction of positions where a mind's argmax differs from det's,
  disagree   the fraction of positions where two minds' argmaxes differ, averaged over pairs: the minds' diversity,
  kl         KL(det || mind) per token (nats).
The table is printed, and written with every number to `json_out`, the figure to `figure`.
"""

import itertools
import json
import os

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch
import torch.nn.functional as F

from nanolatent import ckpt, common, tokendata

out_dir = "out-smollm2"
# held-out text: a plain-text file; '' = TinyStories' validation stories from the hub (offline: the opening 197 KB of
# TinyStories under $NANOLATENT_LOCAL_DATA, on which docs/pretrained.md's table was measured)
text_file = tokendata.local_data("tinystories/tinystories_head_197k.txt")
text_offset = 100_000  # characters skipped first: later stories than a prompt taken from the text's start
num_seqs = 2  # windows of held-out text
seq_len = 256  # tokens per window
minds = 3  # minds per setting
scales = ("absolute", "gain", "mean_gain")
absolute_sigmas = (0.001, 0.003, 0.01, 0.02, 0.03)
gain_sigmas = (0.01, 0.02, 0.03, 0.1, 0.3)
mean_gain_sigmas = (0.01, 0.02, 0.03, 0.1, 0.3)
seed = 1
json_out = "assets/btrans_sigma.json"
figure = "assets/btrans_sigma.png"
replot = False  # redraw the figure from json_out, measuring nothing
device = "cpu"
configurator.apply(globals())


def plot(result):
    plt = common.pyplot("the table is above; the figure")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for scale in dict.fromkeys(r["scale"] for r in result["rows"]):
        rs = [r for r in result["rows"] if r["scale"] == scale]
        axes[0].plot([r["sigma"] for r in rs], [r["d_nll"] for r in rs], "o-", label=scale)
        axes[1].plot([r["sigma"] for r in rs], [r["flip"] for r in rs], "o-", label=scale)
    for ax, what in zip(axes, ("NLL of a mind - det's NLL (nats)", "argmax flip rate against det")):
        ax.set_xscale("log")
        ax.set_xlabel("sigma")
        ax.set_ylabel(what)
    axes[0].set_yscale("log")
    axes[0].legend(title="sigma_scale")
    fig.suptitle(f"{os.path.basename(os.path.normpath(result['out_dir']))}: {result['num_seqs']} x "
                 f"{result['seq_len']} held-out tokens, {result['minds']} minds", fontsize=9)
    fig.tight_layout()
    fig.savefig(figure, dpi=100)
    print(f"wrote {figure}")


if replot:
    with open(json_out) as f:
        plot(json.load(f))
    raise SystemExit

if text_file and not os.path.exists(text_file):
    common.die(f"{text_file} not found: point --text_file at a plain-text file the model did not see in the prompt")
det, checkpoint = ckpt.load_model(out_dir, device)
det.eval()
encode, _ = tokendata.tokenizer(checkpoint["meta"])
if text_file:
    with open(text_file) as f:
        text = f.read()
else:
    try:
        import datasets
        stories = datasets.load_dataset("roneneldan/TinyStories", split="validation")
    except Exception as e:
        common.die(f"TinyStories did not load from the hub ({type(e).__name__}): pass --text_file=<a plain-text file>")
    text_file = "roneneldan/TinyStories validation"
    text = "\n\n".join(stories[i]["text"] for i in range(2000))  # ~1.7M characters, more than enough
ids = encode(text[text_offset:])
if len(ids) < num_seqs * (seq_len + 1):
    common.die(f"{text_file} has {len(ids)} tokens past text_offset: too few for {num_seqs} x {seq_len + 1}")
data = torch.tensor(ids[:num_seqs * (seq_len + 1)], device=device).view(num_seqs, seq_len + 1)
x, y = data[:, :-1], data[:, 1:]  # (num_seqs, seq_len) each


@torch.no_grad()
def log_probs(model, latents=None):
    logits, _, _ = model(x, targets=y, latents=latents)  # (B, T, V)
    return F.log_softmax(logits.float(), dim=-1)


det_logp = log_probs(det)
det_nll = -det_logp.gather(-1, y[..., None]).mean().item()
det_argmax = det_logp.argmax(-1)
det_p = det_logp.exp()
print(f"{out_dir}: det NLL {det_nll:.4f} on {num_seqs} x {seq_len} tokens of {text_file}; {minds} minds per setting")

names = [f"block {i // 2} {('attn', 'mlp')[i % 2]}_norm" for i in range(2 * det.config.n_layer)] + ["norm_f"]
wrapped = {scale: ckpt.load_model(out_dir, device, "btrans", checkpoint=checkpoint, sigma_scale=scale)[0].eval()
           for scale in scales}
mean_gains = torch.stack([norm.weight.abs().float().mean() for norm in wrapped[scales[0]].norms()])  # (n_norms,)
print(f"norm gains: mean |w| per norm median {mean_gains.median():.3f}, min {mean_gains.min():.3f} "
      f"({names[int(mean_gains.argmin())]}), max {mean_gains.max():.3f} ({names[int(mean_gains.argmax())]})")

rows = []
sweeps = {"absolute": absolute_sigmas, "gain": gain_sigmas, "mean_gain": mean_gain_sigmas}
for scale in common.progress(scales, desc="sigma scales"):
    model = wrapped[scale]
    latents = [model.sample_latents(num_seqs, torch.Generator().manual_seed(common.seed_of(seed, m)))
               for m in range(minds)]
    for sigma in sweeps[scale]:
        for norm in model.norms():
            norm.fixed_sigma = sigma
        nll, flip, kl, argmaxes = [], [], [], []
        for lat in latents:
            logp = log_probs(model, lat)
            nll.append(-logp.gather(-1, y[..., None]).mean().item())
            argmaxes.append(logp.argmax(-1))
            flip.append((argmaxes[-1] != det_argmax).float().mean().item())
            kl.append((det_p * (det_logp - logp)).sum(-1).mean().item())
        disagree = [(a != b).float().mean().item() for a, b in itertools.combinations(argmaxes, 2)]
        row = {"scale": scale, "sigma": sigma, "d_nll": float(np.mean(nll)) - det_nll,
               "d_nll_std": float(np.std(nll)), "flip": float(np.mean(flip)), "disagree": float(np.mean(disagree)),
               "kl": float(np.mean(kl))}
        rows.append(row)
        print(f"{scale:>9} sigma {sigma:<6g} d_nll {row['d_nll']:+.4f} (± {row['d_nll_std']:.4f} over minds), "
              f"flip {row['flip']:.3f}, disagree {row['disagree']:.3f}, kl {row['kl']:.4f}", flush=True)

print("\n| sigma_scale | sigma | NLL - det's (nats) | flip vs det | minds disagree | KL(det ‖ mind) |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['scale']} | {r['sigma']:g} | {r['d_nll']:+.3f} ± {r['d_nll_std']:.3f} | {r['flip']:.3f} | "
          f"{r['disagree']:.3f} | {r['kl']:.3f} |")
os.makedirs(os.path.dirname(json_out), exist_ok=True)
result = {"out_dir": out_dir, "text_file": os.path.basename(text_file), "text_offset": text_offset,
          "num_seqs": num_seqs, "seq_len": seq_len, "minds": minds, "seed": seed, "det_nll": det_nll,
          "mean_gain_per_norm": dict(zip(names, mean_gains.tolist())), "rows": rows}
with open(json_out, "w") as f:
    json.dump(result, f, indent=1)
print(f"wrote {json_out}")
plot(result)
