"""EVE's uncertainty as §5 claims it, "informative uncertainty signals, including mutual information ... and Monte Carlo
flip rate", tested on the primary setting's runs (docs/reproductions.md) against the baselines every uncertainty paper
compares with, det's max-softmax probability and predictive entropy: one AUROC per run and question.

    python -m experiments.eve_uncertainty                  # every finished seed: assets/eve_uncertainty.{json,png}
    python -m experiments.eve_uncertainty --replot=True    # the figure again from the JSON

In domain, per token: evaluate.py's windows of the whole validation split (339 x 256 tokens), its M = 8 passes with
its latent draws (seed 1337, batches of 8), its definitions: mi = H(p̄) - mean_m H(p_m), flip = the share of passes
whose argmax differs from p̄'s. A token is an error when argmax p̄ != the target. Each score's AUROC is the chance that
a random error scores above a random right answer (ties count half): EVE's mi, flip, 1 - max p̄ and H(p̄) on EVE's
errors, det's 1 - max p and H(p) on det's own errors.

Out of domain, per document: a document is a window of 256 tokens, its score the mean of the per-token score over the
window. In domain: the same 339 validation windows; out of domain: `ood_docs` windows spread evenly over TinyStories
and over Tiny Shakespeare, each text in GPT-2 BPE as prepare.py encodes it and renumbered into the run's vocabulary
(--vocab=used: the GPT-2 ids of the training and validation text). A GPT-2 token outside that vocabulary has no id in
the model: it is spelled with the longest vocabulary tokens that make up its bytes (greedy, left to right), so the text
stays whole; a byte no vocabulary token covers is dropped. The JSON counts both per text. AUROC: out of domain positive.

Every per-seed AUROC, each run's per-document scores and the document counts go to the JSON; experiments/results.py
makes the README's two rows from it (EVE's MI AUROC against the better of det's two baselines, paired by seed).
"""

import collections
import json
import os
import platform
import sys
import time

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch
import torch.nn.functional as F

from nanolatent import ckpt, common, cpu, metrics, speedups, tokendata

runs_dir = "out-eve-primary"  # the primary setting's runs, det-s<seed> and eve-s<seed>
seeds = (1, 2, 3, 4, 5)  # those whose det and EVE runs are finished are measured; the JSON lists the others
seq_len = 256  # evaluate.py's window on these runs (their block_size)
mc_samples = 8  # M
batch_size = 8  # windows per forward, as evaluate.py: its latent draws come in this order
seed = 1337  # evaluate.py's: the same latents
kernels = "fast"  # 'plain': the model file's own modules, no speed-up applied from outside (docs/models.md)
ood_docs = 100  # documents (windows) per out-of-domain text
tinystories = tokendata.local_data("tinystories/tinystories_head_197k.txt")  # '' = the hub's validation stories
shakespeare = tokendata.local_data("tinyshakespeare/input.txt", "input.txt")  # README's curl of char-rnn's input.txt
results = "assets/eve_uncertainty.json"
parts = "out-eve-uncertainty"  # each run's numbers as measured, reused by a later invocation with the same settings:
# seeds measured by separate processes (--seeds=1,2 and --seeds=3,4 at once) are merged by one more invocation
figure = "assets/eve_uncertainty.png"
replot = False  # redraw the figure from `results`, measuring nothing
SCORES = {"eve": ("mi", "flip", "one_minus_maxprob", "entropy"), "det": ("one_minus_maxprob", "entropy")}
BASELINES = ("one_minus_maxprob", "entropy")  # det's, the bar EVE's MI is compared with
OOD = ("tinystories", "shakespeare")
LABELS = {"mi": "MI", "flip": "flip rate", "one_minus_maxprob": "1 - max p", "entropy": "entropy"}


def auroc(scores, positive):
    """P(a positive scores above a negative) + P(a tie) / 2: the Mann-Whitney U over n_pos * n_neg, from ranks (ties
    take their average rank)."""
    s, pos = np.asarray(scores, np.float64), np.asarray(positive, bool)
    order = np.argsort(s, kind="stable")
    _, first, counts = np.unique(s[order], return_index=True, return_counts=True)
    ranks = np.empty(len(s))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)  # 1-based, each tie group at its mean rank
    n_pos = int(pos.sum())
    n_neg = len(s) - n_pos
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def token_scores(passes, targets):
    """Per-token scores of M passes (metrics.pass_statistics, metrics.MCStats token by token): passes yields M
    log-softmaxes (N, V) one at a time, targets (N,); identical passes (det) give mi and flip exactly 0.
    -> {name: (N,) float64 array}"""
    stats = metrics.pass_statistics(passes, targets)
    conf, pred = stats["p_bar"].max(-1)  # (N,) each; max's index is argmax's (ties break alike)
    out = {"mi": stats["mi"], "flip": sum((a != pred).double() for a in stats["argmaxes"]) / stats["passes"],
           "one_minus_maxprob": 1 - conf, "entropy": stats["entropy"], "wrong": pred != targets}
    return {k: v.double().cpu().numpy() for k, v in out.items()}


@torch.no_grad()
def window_scores(model, data, starts, generator):
    """token_scores over the windows data[s:s+T] -> data[s+1:s+T+1], batch by batch as evaluate.py runs them, with
    fresh latents per pass from `generator` (det: one pass). -> {name: (windows, T) array}"""
    T, M = seq_len, 1 if model.latent_kind == "none" else mc_samples
    out = collections.defaultdict(list)
    for i in common.progress(range(0, len(starts), batch_size), desc="batches"):
        xy = torch.stack([torch.from_numpy(data[s:s + T + 1].astype("int64")) for s in starts[i:i + batch_size]])
        x, y = xy[:, :-1], xy[:, 1:]  # (B, T) each
        passes = (F.log_softmax(model(x, y, latents=model.sample_latents(len(x), generator))[0].float(), -1)
                  .flatten(0, 1) for _ in range(M))  # M x (B*T, V)
        for k, v in token_scores(passes, y.reshape(-1)).items():
            out[k].append(v.reshape(len(x), T))
    return {k: np.concatenate(v) for k, v in out.items()}


def encode_into(text, meta):
    """text in GPT-2 BPE (prepare.py's encode_ordinary), renumbered into the run's vocabulary (meta's token_ids); a
    token outside it spelled with the longest vocabulary tokens that make up its bytes, a byte none covers dropped.
    -> (ids, tokens GPT-2 made, tokens re-spelled, bytes dropped)"""
    encoding, _ = tokendata.gpt2_encoding(meta.get("bpe_file") if meta.get("bpe_file") and os.path.exists(
        meta["bpe_file"]) else None)
    new_id = {g: i for i, g in enumerate(meta["token_ids"])}
    spelled = {encoding.decode_single_token_bytes(g): i for g, i in new_id.items() if g != encoding.eot_token}
    longest = max(map(len, spelled))
    ids, respelled, dropped = [], 0, 0
    gpt2 = encoding.encode_ordinary(text)
    for g in gpt2:
        if g in new_id:
            ids.append(new_id[g])
            continue
        respelled += 1
        b, i = encoding.decode_single_token_bytes(g), 0
        while i < len(b):
            j = next((j for j in range(min(len(b), i + longest), i, -1) if b[i:j] in spelled), None)
            if j is None:
                dropped, i = dropped + 1, i + 1
            else:
                ids.append(spelled[b[i:j]])
                i = j
    return np.array(ids, np.int64), len(gpt2), respelled, dropped


def ood_text(name):
    """An out-of-domain text: a local file, or (TinyStories, '') the hub's validation stories."""
    path = {"tinystories": tinystories, "shakespeare": shakespeare}[name]
    if path:
        if not os.path.isfile(path):
            common.die(f"--{name}={path} is not a file: give a plain-text file (offline: under ${tokendata.LOCAL_DATA_ENV}"
                       f", {'tinystories/tinystories_head_197k.txt' if name == 'tinystories' else 'tinyshakespeare/input.txt'})")
        with open(path, encoding="utf-8") as f:
            return f.read(), os.path.basename(path)
    try:
        import datasets
        stories = datasets.load_dataset("roneneldan/TinyStories", split="validation")
    except Exception as e:
        common.die(f"TinyStories did not load from the hub ({type(e).__name__}): pass --tinystories=<a plain-text file>")
    return "\n\n".join(stories[i]["text"] for i in range(1000)), "roneneldan/TinyStories validation"


def spread(n_windows, k):
    """k window indices spread evenly over n_windows (all of them if k >= n_windows)."""
    return list(range(n_windows)) if k >= n_windows else np.linspace(0, n_windows - 1, k).round().astype(int).tolist()


def rounded(values):
    return [float(f"{v:.6g}") for v in values]


def measure():
    """Every finished seed's runs, in domain and out: the JSON's dict."""
    finished = [s for s in seeds if all(ckpt.finished(os.path.join(runs_dir, f"{m}-s{s}")) for m in ("det", "eve"))]
    if not finished:
        common.die(f"no seed of {list(seeds)} has finished det and eve runs in {runs_dir}: train them as "
                   f"docs/reproductions.md's primary setting says, or point --runs_dir at them")
    checkpoint = ckpt.load_checkpoint(os.path.join(runs_dir, f"det-s{finished[0]}"))
    dataset = checkpoint["config"]["dataset"]
    meta = tokendata.load_meta(dataset)
    val, train = (tokendata.load_tokens(dataset, split, meta) for split in ("val", "train"))
    starts = list(range(0, len(val) - seq_len, seq_len))  # evaluate.py's windows of the whole split
    trained_ids = np.unique(np.asarray(train))
    texts, streams = {}, {"wp_val": (np.asarray(val), starts)}
    for name in OOD:
        text, source = ood_text(name)
        ids, gpt2, respelled, dropped = encode_into(text, meta)
        pieces = list(range(0, len(ids) - seq_len, seq_len))
        chosen = [pieces[i] for i in spread(len(pieces), ood_docs)]
        streams[name] = (ids, chosen)
        texts[name] = {"source": source, "characters": len(text), "gpt2_tokens": gpt2, "respelled_tokens": respelled,
                       "dropped_bytes": dropped, "tokens": len(ids), "windows_available": len(pieces),
                       "documents": len(chosen)}
        print(f"{name}: {source}, {gpt2:,} GPT-2 tokens, {respelled:,} outside the vocabulary re-spelled "
              f"({dropped} bytes dropped), {len(ids):,} tokens; {len(chosen)} of {len(pieces)} windows")
    for name, (ids, chosen) in streams.items():  # context: how much of each set the training tokens never held
        windows = np.concatenate([ids[s:s + seq_len + 1] for s in chosen])
        texts.setdefault(name, {"source": f"{dataset} val", "documents": len(chosen)})["untrained_share"] = float(
            1 - np.isin(windows, trained_ids).mean())
    record = {"protocol": {"runs_dir": runs_dir, "dataset": dataset, "seq_len": seq_len, "mc_samples": mc_samples,
                           "batch_size": batch_size, "seed": seed, "tokens": len(starts) * seq_len,
                           "baselines": list(BASELINES), "ood_texts": list(OOD),
                           "windows": len(starts), "ood_docs": ood_docs, "texts": texts,
                           "seeds": finished, "unfinished_seeds": [s for s in seeds if s not in finished],
                           "command": " ".join(["python -m experiments.eve_uncertainty", *sys.argv[1:]]),
                           "machine": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} "
                                      f"torch thread(s)"},
              "runs": {}}
    for s in finished:
        for m in ("det", "eve"):
            name = f"{m}-s{s}"
            run = measure_run(name, m, streams, texts)
            record["runs"][name] = run
            print(f"{name}: error rate {run['error_rate']:.4f}, token AUROC " + ", ".join(
                f"{k} {v:.4f}" for k, v in run["token_auroc"].items()) + "; document AUROC " + "; ".join(
                f"{t} " + ", ".join(f"{k} {v:.4f}" for k, v in a.items()) for t, a in run["document_auroc"].items())
                + f" ({run['measured']})")
    return record


def measure_run(name, m, streams, texts):
    """One run's scores in domain and out (its part file's when one holds the same settings)."""
    checkpoint = ckpt.load_checkpoint(os.path.join(runs_dir, name))
    settings = {"run": os.path.abspath(os.path.join(runs_dir, name)), "iter": checkpoint["iter_num"], "seq_len": seq_len,
                "mc_samples": mc_samples, "batch_size": batch_size, "seed": seed, "texts": texts}
    part = os.path.join(parts, f"{name}.json")
    if os.path.exists(part):
        with open(part) as f:
            kept = json.load(f)
        if kept["settings"] == settings:
            print(f"{name}: measured {kept['run']['measured']}, kept from {part}")
            return kept["run"]
    t0, load = time.time(), os.getloadavg()[0]
    model, _ = ckpt.load_model(os.path.join(runs_dir, name), checkpoint=checkpoint)
    model.eval()
    # the passes need the logits alone: §3.6's objective and its diagnostics (a finiteness check over every logit)
    # would take half of each pass's time, and change no logit
    model.objective = lambda ce, logits, auxs: (ce, {})
    torch.manual_seed(seed)
    scores = {}
    with cpu.inference_linears(model):  # evaluate.py's products
        for text, (ids, chosen) in streams.items():  # each text with evaluate.py's draws from its start
            scores[text] = window_scores(model, ids, chosen, torch.Generator().manual_seed(seed))
    tokens = scores["wp_val"]
    run = {"error_rate": float(tokens["wrong"].mean()), "mean": {k: float(tokens[k].mean()) for k in SCORES[m]},
           "token_auroc": {k: auroc(tokens[k].ravel(), tokens["wrong"].ravel()) for k in SCORES[m]},
           "documents": {text: {k: rounded(v[k].mean(1)) for k in SCORES[m]} for text, v in scores.items()}}
    run["document_auroc"] = {text: {k: auroc(run["documents"]["wp_val"][k] + run["documents"][text][k],
                                             [0] * len(streams["wp_val"][1]) + [1] * len(streams[text][1]))
                                    for k in SCORES[m]} for text in OOD}
    run["measured"] = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))}, {time.time() - t0:.0f} s, "
                       f"load {load:.1f}")
    os.makedirs(parts, exist_ok=True)
    with common.replacing(part) as tmp, open(tmp, "w") as f:
        json.dump({"settings": settings, "run": run}, f)
    return run


def plot(record):
    """Per-token AUROC on errors (left) and per-document AUROC out of domain (right), every seed a dot, the mean a bar."""
    plt = common.pyplot(f"the numbers are in {results}; the figure")
    runs, seeds_ = record["runs"], record["protocol"]["seeds"]
    bars = [("eve", k) for k in SCORES["eve"]] + [("det", k) for k in SCORES["det"]]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), sharey=True)
    panels = [("token_auroc", None, "in domain: errors vs right answers, per token")] + [
        ("document_auroc", t, f"{t} vs WritingPrompts val, per 256-token document") for t in OOD]
    for ax, (key, text, title) in zip(axes, panels):
        for i, (m, k) in enumerate(bars):
            values = [runs[f"{m}-s{s}"][key][text][k] if text else runs[f"{m}-s{s}"][key][k] for s in seeds_]
            ax.bar(i, np.mean(values), color="tab:orange" if m == "eve" else "tab:blue", alpha=0.6)
            ax.plot([i] * len(values), values, "k.", ms=4)
        ax.axhline(0.5, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(bars)), [f"{m.upper()} {LABELS[k]}" for m, k in bars], rotation=40, ha="right",
                      fontsize=8)
        ax.set_title(title, fontsize=8)
    axes[0].set_ylabel("AUROC (0.5: chance)")
    fig.suptitle(f"EVE's uncertainty, primary setting, seeds {seeds_} (dots), mean (bars)", fontsize=9)
    fig.tight_layout()
    fig.savefig(figure, dpi=100)
    print(f"wrote {figure}")


if __name__ == "__main__":
    configurator.apply(globals())
    configurator.require(globals(), positive=("seq_len", "mc_samples", "batch_size", "ood_docs"),
                         choices={"kernels": speedups.KERNELS})
    speedups.use(kernels)
    if replot:
        with open(results) as f:
            plot(json.load(f))
        raise SystemExit
    if os.path.isdir(results) or not os.path.isdir(os.path.dirname(os.path.abspath(results))):
        common.die(f"--results={results} cannot be written: give a .json file in an existing folder")
    record = measure()
    with common.replacing(results) as tmp, open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {results}")
    plot(record)
