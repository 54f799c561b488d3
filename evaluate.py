"""Evaluate any nanolatent model: Monte Carlo metrics on a token stream, multiple-choice benchmarks, and population
metrics of K minds. Prints a table (one column per checkpoint, all on the same tokens) and optionally writes JSON.

    python evaluate.py --out_dir=out-det-synthetic                        # lm metrics on the val split it trained on
    python evaluate.py --out_dir=out-det,out-eve,out-free --mc_samples=16 --out_json=eval.json  # side by side
    python evaluate.py --out_dir=out-free --iw_samples=32                 # + Free Transformer ELBO and IW bound
    python evaluate.py --out_dir=out-det --model_type=btrans --sigma=0.05        # a det checkpoint as B-Trans minds
    python evaluate.py --task=mc --mc_file=hellaswag_val.jsonl --out_dir=out-gpt2   # or --mc_file=arc_easy (online)
    python evaluate.py --task=population --out_dir=out-det,out-btrans --minds=8 --num_prompts=64
    python evaluate.py --task=tokens --out_dir=out-eve --text="K>___KKKKKKKK" --out_json=tokens.json  # per token

Definitions (N predicted tokens, M passes, p_m the softmax of pass m, p̄ = (1/M) sum_m p_m, y the target token):
    nll              -log p̄(y), computed as -(logsumexp_m log p_m(y) - log M); ppl = exp(nll)
    acc              argmax p̄ == y
    ece              15 equal-width bins [k/15, (k+1)/15) on max p̄ (the last bin closed: 1.0 falls in it),
                     sum_b (n_b / N) |accuracy_b - mean confidence_b|
    brier            sum_v (p̄_v - 1[v == y])^2, mean over tokens
    entropy          H(p̄) in nats (total predictive uncertainty); expected_entropy = mean_m H(p_m) (aleatoric)
    mi               H(p̄) - mean_m H(p_m): mutual information between the prediction and the latents (epistemic)
    epistemic_ratio  mean mi / mean entropy (a ratio of means over tokens, so tokens with H(p̄) ~ 0 cannot blow up)
    cond_var         Var_m p_m(y) (population variance over the M passes), mean over tokens
    flip_rate        share of (pass, token) pairs with argmax p_m != argmax p̄
    cvar_nll         mean of the worst ceil(5% N) token NLLs
    seq_nll          -1/T log mean_m prod_t p_m(y_t) per window: the likelihood when a latent is frozen for the whole
                     window (B-Trans minds, Eq. 3), where nll mixes the passes token by token; equal for det
Each pass draws fresh latents with model.sample_latents(B, generator): EVE fresh eps, B-Trans one mind per sequence,
the Free Transformer every Z_t from its uniform prior: the prior predictive, an honest likelihood (the encoder's
posterior reads the tokens it scores), but not quite what generation sees, which draws the prompt's Z from the
encoder run on the prompt (§3.2) and only the new tokens' Z from the prior. det has none: M = 1.
For the Free Transformer also: neg_elbo (posterior CE + full KL, nats/token, from forward(x, y)) and iw_bound
(-1/T log (1/K) sum_k p(y|z_k) p(z_k) / q(z_k|x) per sequence, encoder as proposal); both are upper bounds on the NLL.
"""

import gc
import json
import os
import re
from contextlib import nullcontext

import configurator  # before torch: it answers a bare --help from this file's source

import torch

from nanolatent import ckpt, common, cpu, metrics, models, multiple_choice, sampling, speedups, tasks, tokendata

# ----------------------------------------------------------------------------------------------------------------
# what to evaluate
out_dir = "out"  # the run to evaluate (a folder or a ckpt.pt), or several side by side: out-det,out-eve
model_type = ""  # load every checkpoint into this model type ('btrans' turns a det checkpoint into B-Trans minds)
task = "lm"  # 'lm' (token-stream metrics), 'mc' (multiple choice), 'population' (K minds on the letters task), 'tokens'
# (one --text, each token's nll, entropy, expected_entropy and mi: the explorer's Uncertainty view)
out_json = ""  # also write the results to this file
out_items = ""  # mc: also write one JSON line per (run, example): per-choice log-likelihoods, predictions, truncation
seed = 1337  # latents (and any other draw); reset for each checkpoint so all see the same windows and draws
# lm: Monte Carlo metrics on a prepared dataset's token stream
dataset = ""  # '' = the dataset the checkpoints were trained on (recorded in them)
split = "val"
seq_len = 0  # window length in tokens; 0 = the smallest block_size of the checkpoints
max_tokens = 8192  # evaluate about this many predicted tokens (0 = the whole split: minutes to hours on a CPU)
batch_size = 8  # windows per forward; memory is a few (batch_size * seq_len, vocab) float32 tensors
mc_samples = 8  # M stochastic passes per window (det: 1)
iw_samples = 8  # Free Transformer: K encoder samples per sequence for the importance-weighted bound (0 = skip)
ece_bins = 15
cvar_alpha = 0.05  # cvar_nll averages the worst cvar_alpha share of token NLLs
# mc: multiple-choice benchmarks
mc_file = ""  # a local .jsonl ({"context", "choices", "label"} or HellaSwag's format), or a hub name (HF_TASKS)
max_examples = 0  # 0 = all
mixture = "auto"  # passes average per 'token' or per 'sequence' (score_choices); auto: sequence for B-Trans minds
# population: K minds on the synthetic letters task (Free Transformer §4.1)
minds = 8  # K: latents per prompt, one generation each
num_prompts = 32  # prompts "K>" taken from the first sequences of the split
max_new_tokens = 64
temperature = 1.0  # 0 = greedy: then all diversity comes from the latents
top_k = 0  # 0 = no top-k filtering
ngram = 4  # n of distinct-n
# tokens: one text scored token by token over --mc_samples passes
text = ""  # the text, or FILE:path to read it from a UTF-8 file; its first token is the context of the others
top_tokens = 0  # --task=tokens: also each position's N most likely tokens under p̄ and each pass's probability of them
# system
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if torch.cuda.is_available() else "float32"
kernels = "fast"  # CPU float32 and bfloat16: matmuls through oneDNN (cpu.inference_linears, each after a probe of its
# module): faster, rounding apart. 'plain': every module's own forward (docs/models.md, Changing a model)
# ----------------------------------------------------------------------------------------------------------------


def load_net(path, checkpoint):
    """The checkpoint as a model in eval mode (into --model when given, with the Config overrides it takes) and a
    generator, both seeded alike for every run so all see the same draws."""
    fields = models.config_fields(model_type or checkpoint["model_type"])
    with common.phase(f"loading {path}"):
        model, _ = ckpt.load_model(path, device, model_type or None, checkpoint=checkpoint,
                                 **{k: v for k, v in overrides.items() if k in fields})
    torch.manual_seed(seed)  # draws from the global RNG (Free's encoder in forward(x, y), B-Trans 'token')
    return model.eval(), torch.Generator(device).manual_seed(seed)


def matmuls(model):
    """Where the run's matrix products go: oneDNN's packed weights on a CPU (cpu.inference_linears: a no-op elsewhere),
    packed in --dtype, the dtype autocast runs them in; with --kernels=plain torch's own kernels (bit for bit what the
    model's forward computes)."""
    return cpu.inference_linears(model, common.DTYPES[dtype])


def dataset_for(checkpoints):
    """The prepared dataset the runs are evaluated on (--dataset, or the one they were trained on), refusing a run
    whose tokenizer does not fit it. -> (name, meta)"""
    trained_on = {p: c.get("config", {}).get("dataset") for p, c in checkpoints.items()}
    name = dataset or next(iter(trained_on.values()))
    if not dataset and len(set(trained_on.values())) > 1:
        common.die(f"the checkpoints were trained on different datasets ({trained_on}); choose one with --dataset=")
    if not name:
        common.die("the checkpoint records no dataset: pass --dataset=NAME (a folder prepared by prepare.py)")
    meta = tokendata.load_meta(name)
    for path, checkpoint in checkpoints.items():
        if (checkpoint["meta"]["tokenizer"], checkpoint["meta"].get("chars")) != (meta["tokenizer"], meta.get("chars")):
            common.die(f"{path} was trained with another tokenizer or vocabulary than dataset {name!r}")
    return name, meta


def run_lm(checkpoints):
    """Monte Carlo metrics of every run on the same windows of a token stream."""
    name, meta = dataset_for(checkpoints)
    data = tokendata.load_tokens(name, split, meta)
    block = min(overrides.get("block_size", c["model_config"]["block_size"]) for c in checkpoints.values())
    limit = min(block, meta["doc_len"] - 1) if "doc_len" in meta else block
    if seq_len > limit:
        common.die(f"--seq_len={seq_len} exceeds " + (f"{name}'s sequences of {meta['doc_len']} tokens (at most "
                   f"{limit})" if limit < block else f"the smallest block_size of the checkpoints ({block})")
                   + ": lower it, or 0 for the longest that fits")
    T = seq_len or limit
    starts = metrics.lm_windows(len(data), T, meta.get("doc_len"), max_tokens)
    if not starts:
        common.die(f"{name}/{split}.bin holds {len(data)} tokens: too few for one window of {T + 1}")
    print(f"lm: {len(starts) * T:,} tokens in {len(starts)} windows of {T} from {name}/{split}.bin, "
          f"mc_samples={mc_samples}" + ("" if max_tokens else " (the whole split)"))
    results = {}
    for path, checkpoint in checkpoints.items():
        model, generator = load_net(path, checkpoint)
        n_passes = 1 if model.latent_kind == "none" else mc_samples
        with matmuls(model):
            results[path] = metrics.evaluate_lm(model, data, starts, T, n_passes, generator, batch_size=batch_size,
                                                iw_samples=iw_samples, n_bins=ece_bins, cvar_alpha=cvar_alpha,
                                                autocast=autocast)
    if any("neg_elbo" in r for r in results.values()):
        print("free: nll ... cvar_nll use every Z_t from the uniform prior (the prior predictive; generation draws the "
              "prompt's Z from the encoder); neg_elbo and iw_bound are "
              "upper bounds on the NLL through the encoder; stats/ce_posterior reads the future, not a likelihood")
    return {"dataset": name, "split": split, "seq_len": T, "windows": len(starts), "mc_samples": mc_samples,
            "iw_samples": iw_samples}, results


def run_mc(checkpoints):
    """Multiple-choice accuracy of every run on the same examples (and draws), and with --out_items each item's
    scores, one JSON line per (run, example)."""
    if not mc_file:
        common.die(f"--task=mc needs --mc_file: a .jsonl file or one of {', '.join(multiple_choice.HF_TASKS)}")
    if out_items and (os.path.isdir(out_items) or not os.path.isdir(os.path.dirname(os.path.abspath(out_items)))):
        common.die(f"--out_items={out_items} is a folder or in a folder that does not exist: name a .jsonl file to "
                   f"write in an existing folder")
    examples = multiple_choice.load_mc_examples(mc_file, max_examples)
    print(f"mc: {len(examples)} examples from {mc_file}; choices scored by the log-likelihood of ' ' + choice; "
          f"stochastic models by a mixture of {mc_samples} passes (latents shared by the choices)")
    results, items = {}, []
    for path, checkpoint in checkpoints.items():
        model, _ = load_net(path, checkpoint)
        encode, decode = tokendata.tokenizer(checkpoint["meta"])
        n_passes = 1 if model.latent_kind == "none" else mc_samples
        how = multiple_choice.mixture_for(model, mixture)
        eot = encode("<|endoftext|>")[0] if checkpoint["meta"]["tokenizer"] == "gpt2" else None
        run_items = [] if out_items else None
        with matmuls(model):
            results[path] = metrics.evaluate_mc(model, examples, encode, decode, n_passes, seed, autocast=autocast,
                                                mixture=how, eot=eot, items=run_items)
        items += [{"out_dir": path, "mixture": results[path]["mixture"], **item} for item in run_items or []]
        if results[path]["truncated"]:
            print(f"{path}: {results[path]['truncated']} examples longer than block_size={model.config.block_size} "
                  f"were left-truncated (their first tokens dropped)")
    if out_items:
        write_output(out_items, "".join(json.dumps(item) + "\n" for item in items), "items")
        print(f"wrote {out_items}: {len(items)} items")
    return {"mc_file": mc_file, "mc_samples": mc_samples}, results


RESULTS_START = '{\n "task": '  # how every --out_json file begins (json.dumps(..., indent=1)): one that does not
# is not evaluate.py's, and is never replaced


def write_output(path, text, what):
    """A file written after the whole evaluation (which can take an hour), through a temporary file renamed once
    whole. A write that fails (a full disk) keeps the file there as it was and loses nothing: the text goes to
    stdout, then one line says why."""
    try:
        with common.replacing(path) as tmp, open(tmp, "w") as f:
            f.write(text)
    except OSError as e:
        print(text)
        common.die(f"could not write {path}: {e.strerror or e}{common.free_space(path)}; the {what} are printed "
                   f"above instead, and {path} is as it was")


def run_population(checkpoints):
    """K minds per prompt of the letters task, for every run on the same prompts."""
    name, meta = dataset_for(checkpoints)
    if meta.get("doc_len") is None or meta["tokenizer"] != "char":
        common.die(f"--task=population runs on the synthetic letters task; {name!r} is not it "
                   f"(python prepare.py synthetic, then --dataset=synthetic)")
    prompts = tasks.load_prompts("letters", name, split, meta)[:num_prompts]
    if not prompts or not all(re.fullmatch(r"[A-Z]>", p) for p in prompts):
        common.die(f"--task=population runs on the synthetic letters task; {name!r} is not it "
                   f"(python prepare.py synthetic, then --dataset=synthetic)")
    results = {}
    for path, checkpoint in checkpoints.items():
        model, generator = load_net(path, checkpoint)
        encode, decode = tokendata.tokenizer(checkpoint["meta"])
        with matmuls(model), autocast:
            results[path] = metrics.evaluate_population(model, prompts, encode, decode, minds, generator,
                                                        max_new_tokens=max_new_tokens, temperature=temperature,
                                                        top_k=top_k, n=ngram)
    return {"dataset": name, "split": split, "minds": minds, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k}, results


def run_tokens(checkpoints):
    """Each token of --text scored by every run over the same draws: -log p̄(y), H(p̄), mean H(p_m) and their
    difference, the mutual information (sampling.token_uncertainty)."""
    body = text
    if body.startswith("FILE:"):
        body = common.read_text_file("text", body[5:])
    if not body:
        common.die("--task=tokens needs --text: the text to score (its first token is the context of the others)")
    results = {}
    for path, checkpoint in checkpoints.items():
        model, generator = load_net(path, checkpoint)
        encode, decode = tokendata.tokenizer(checkpoint["meta"])
        ids = encode(body)
        values = sampling.token_uncertainty(model, ids, mc_samples, generator, autocast, dtype)
        if top_tokens:  # the same passes again: the generator and the global RNG as load_net left them
            torch.manual_seed(seed)
            with autocast:
                values["top"] = sampling.top_predictions(model, ids, mc_samples, torch.Generator(device).manual_seed(
                    seed), decode, top_tokens, dtype)
        if model.latent_kind == "code":  # what Z carries about the text and changes in it (the explorer's Z view)
            values["kl_bits"] = sampling.posterior_kl_bits(model, ids)
            values["z_effect_bits"] = sampling.z_effect_bits(model, ids, mc_samples, seed, autocast, dtype)
        results[path] = {"tokens": [decode([t]) for t in ids[1:]], **values}
    return {"text": body, "mc_samples": mc_samples}, results


def print_tokens(results):
    """One row per predicted token, four columns per checkpoint (the JSON has the values to the last bit)."""
    keys = ("nll", "entropy", "expected_entropy", "mi")
    for path, r in results.items():
        print(f"{path} ({r['model_type']}, {r['passes']} passes): nats")
        print(f"{'token':>8}  " + "  ".join(f"{k:>16}" for k in keys))
        for i, token in enumerate(r["tokens"]):
            print(f"{token!r:>8}  " + "  ".join(f"{r[k][i]:16.6f}" for k in keys))
        print(f"{'mean':>8}  " + "  ".join(f"{sum(r[k]) / len(r[k]):16.6f}" for k in keys))
        if "kl_bits" in r:
            print("\n".join(sampling.z_lines(r["kl_bits"], r["z_effect_bits"])))


def print_table(results):
    """One row per metric, one column per checkpoint."""
    names = list(results)
    keys = list(dict.fromkeys(k for r in results.values() for k in r))
    keys.sort(key=lambda k: k.startswith("stats/"))  # the model's own diagnostics last
    fmt = lambda v: "-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))
    cells = [[k] + [fmt(results[n].get(k)) for n in names] for k in keys]
    widths = [max(len(row[i]) for row in cells + [["metric"] + names]) for i in range(len(names) + 1)]
    for row in [["metric"] + names] + cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


if __name__ == "__main__":
    checkpoints = {}

    def model_fields(values):
        """Config fields may be overridden (--sigma=0.05): those of any model the checkpoints are loaded into.
        Reading a checkpoint here costs little: its tensors are memory-mapped, read once a model is built."""
        fields = {}
        for path in [p for p in values["out_dir"].split(",") if p]:
            checkpoints[path] = ckpt.load_checkpoint(path)
            fields.update(models.config_fields(values["model_type"] or checkpoints[path]["model_type"]))
        return fields

    config, overrides = configurator.apply(globals(), model_fields=model_fields)
    configurator.require(config, positive=("batch_size", "mc_samples", "ece_bins", "minds", "num_prompts",
                                           "max_new_tokens", "ngram"),
                         non_negative=("seq_len", "max_tokens", "iw_samples", "max_examples", "temperature", "top_k",
                                       "top_tokens", "seed"),
                         choices={"task": ("lm", "mc", "population", "tokens"), "dtype": tuple(common.DTYPES),
                                  "mixture": ("auto", "token", "sequence"), "kernels": speedups.KERNELS},
                         within={"cvar_alpha": "(0, 1]"})
    common.check_device(device)
    speedups.use(kernels)
    if out_items and task != "mc":  # else the run would end with no file and no word
        common.die(f"--out_items={out_items} writes the items of --task=mc, and --task={task} has none: add "
                   f"--task=mc --mc_file=..., or drop --out_items")
    if out_json:  # checked before the evaluation, which can take an hour, not after it
        folder = os.path.dirname(os.path.abspath(out_json))
        if os.path.isdir(out_json) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            common.die(f"--out_json={out_json} cannot be written: " + ("it is a folder" if os.path.isdir(out_json)
                       else f"no folder {folder}" if not os.path.isdir(folder) else f"{folder} is not writable")
                       + "; give a file in an existing, writable folder")
        with open(out_json, encoding="utf-8", errors="replace") if os.path.isfile(out_json) else nullcontext() as f:
            if f is not None and f.read(len(RESULTS_START)) != RESULTS_START:  # a run's metrics.jsonl, say
                common.die(f"--out_json={out_json} exists and evaluate.py did not write it (its results begin "
                           f"{RESULTS_START!r}): choose another file, or move that one away")
    if not checkpoints:
        common.die("--out_dir names no run: give a folder or ckpt.pt, or several separated by commas")
    _, autocast = common.autocast(device, dtype)
    gc.freeze()  # as train.py: start-up's objects live to the end, so no collection walks them again, nor the exit
    header, results = {"lm": run_lm, "mc": run_mc, "population": run_population, "tokens": run_tokens}[task](
        checkpoints)
    results = {path: {"model_type": model_type or checkpoints[path]["model_type"], **r} for path, r in results.items()}
    (print_tokens if task == "tokens" else print_table)(results)
    if out_json:
        write_output(out_json, json.dumps({"task": task, "seed": seed, **header, "results": results}, indent=1),
                     "results")
        print(f"wrote {out_json}")
