"""Multiple-choice scoring for every model: examples from a local .jsonl or the hub, each choice's log-likelihood
under M Monte Carlo passes whose latents the choices share (evaluate.py --task=mc, scripts/harness.py,
scripts/bench_cpu.py)."""

import json
import math
import os
import re
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from nanolatent import common, models, tokendata

MC_LOGITS = 2 ** 25  # score_choices: logits per forward (128 MiB in float32), passes batched up to it

HF_TASKS = {  # name: (hub path, config, split), loaded with datasets.load_dataset when online
    "hellaswag": ("Rowan/hellaswag", None, "validation"),  # offline: LOCAL_COPIES below
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
    "piqa": ("baber/piqa", None, "validation"),  # parquet; ybisk/piqa's loading script no longer loads
}


# under $NANOLATENT_LOCAL_DATA, read in place of the hub (tokendata.local_data): a sample of the split
LOCAL_COPIES = {"hellaswag": "hellaswag/hellaswag_val_sample1000.jsonl"}


def hellaswag_preprocess(text):
    """lm-evaluation-harness' HellaSwag cleanup: the brackets are artifacts of its WikiHow part."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_example(doc):
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"context": hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [hellaswag_preprocess(e) for e in doc["endings"]],
            "label": int(doc["label"]) if str(doc["label"]).isdigit() else doc["label"]}  # checked by mc_example


def hub_example(name, doc):
    """The harness' zero-shot prompts: ARC and PIQA as "Question: ...\\nAnswer:"."""
    if name == "hellaswag":
        return hellaswag_example(doc)
    if name == "piqa":
        return {"context": f"Question: {doc['goal']}\nAnswer:", "choices": [doc["sol1"], doc["sol2"]],
                "label": int(doc["label"])}
    return {"context": f"Question: {doc['question']}\nAnswer:", "choices": list(doc["choices"]["text"]),
            "label": list(doc["choices"]["label"]).index(doc["answerKey"])}


def mc_example(line, where):
    """One example of a local .jsonl line, checked: a list of at least two strings as choices, an integer label
    that indexes them (a line with "endings" is HellaSwag's original format)."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        common.die(f"{where} is not JSON ({e.msg}): one object per line, e.g. "
                   f'{{"context": "...", "choices": ["...", "..."], "label": 0}}')
    if not isinstance(doc, dict) or not ({"context", "choices", "label"} <= set(doc) or "endings" in doc):
        common.die(f"{where} has keys {sorted(doc) if isinstance(doc, dict) else type(doc).__name__}: expected "
                   f"context, choices, label (or HellaSwag's activity_label, ctx_a, ctx_b, endings, label)")
    example = hellaswag_example(doc) if "endings" in doc else dict(doc)
    choices, label = example["choices"], example["label"]
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        common.die(f"{where}: choices must be a list of at least two non-empty strings, got {choices!r}")
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        label = int(label)  # HellaSwag's labels are strings of digits
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
        common.die(f"{where}: label must be the index (0 to {len(choices) - 1}) of the right choice, got {label!r}")
    if not isinstance(example["context"], str):
        common.die(f"{where}: context must be a string, got {example['context']!r}")
    return {"context": example["context"], "choices": choices, "label": label}


def load_mc_examples(source, limit=0):
    """Examples from a local .jsonl (a line with "endings" is HellaSwag's original format), or a hub name (its local
    copy under $NANOLATENT_LOCAL_DATA when there is one)."""
    copy = tokendata.local_data(LOCAL_COPIES[source]) if source in LOCAL_COPIES else ""
    if copy:
        print(f"{source}: reading {copy} ({tokendata.LOCAL_DATA_ENV}) in place of the hub")
        source = copy
    if os.path.isfile(source):
        examples = []
        with open(source) as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    examples.append(mc_example(line, f"{source} line {i}"))
    elif source in HF_TASKS:
        import datasets
        path, name, hub_split = HF_TASKS[source]
        try:
            docs = datasets.load_dataset(path, name, split=hub_split)
        except Exception as e:
            offline = (f"export {tokendata.LOCAL_DATA_ENV}=DIR with DIR/{LOCAL_COPIES[source]}, or "
                       if source in LOCAL_COPIES else "")
            common.die(f"could not load {path} from the Hugging Face hub ({type(e).__name__}); offline, {offline}pass "
                       f"a local jsonl: --mc_file=FILE.jsonl with {{\"context\", \"choices\", \"label\"}} per line "
                       f"(HellaSwag's original jsonl also works)")
        examples = [hub_example(source, doc) for doc in docs]
    else:
        common.die(f"--mc_file={source!r} is neither a file nor one of {', '.join(HF_TASKS)}")
    if not examples:
        common.die(f"no examples in {source}")
    return examples[:limit] if limit else examples


def choice_tokens(encode, context, choice, eot=None, delimiter=" "):
    """(context ids, continuation ids) of the continuation delimiter + choice, as lm-evaluation-harness's
    _encode_pair makes them: trailing whitespace of the context moves onto the continuation, the pair is encoded whole
    and the continuation is the tokens past the context's. An empty context conditions on the end-of-text token
    `eot`. (The harness' requests carry their delimiter in the continuation: scripts/harness.py passes delimiter="".)"""
    continuation = delimiter + choice
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    if not context:
        if eot is None:
            common.die("a multiple-choice example has an empty context, and this tokenizer has no end-of-text "
                       "token to condition on: give every example a context")
        return [eot], encode(continuation)
    ctx = encode(context)
    return ctx, encode(context + continuation)[len(ctx):]


def example_latents(model, contexts, generator):
    """One draw of latents for all the choices of an example, consistent with its context: the Free Transformer's Z
    for the context from its encoder on the context alone, for the choice tokens from the uniform prior (§3.2: the
    encoder never reads the answer). When left-truncation leaves the choices different contexts (Free only: the
    other models' latents ignore the tokens), each gets its own encoder draw on the same uniform codes."""
    device = model.tok_emb.weight.device
    if model.latent_kind != "code" or all(c == contexts[0] for c in contexts):
        latents = model.sample_latents(1, generator, prompt=torch.tensor([contexts[0]], device=device))
        return None if latents is None else models.repeat_latents(latents, len(contexts))
    state = generator.get_state()
    rows = []
    for context in contexts:
        generator.set_state(state)
        rows.append(model.sample_latents(1, generator, prompt=torch.tensor([context], device=device)))
    return torch.cat(rows)  # (n_choices, block_size)


@torch.no_grad()
def score_choices(model, pairs, n_passes, generator, autocast=nullcontext(), mixture="token"):
    """Log-likelihood of each choice's continuation tokens under n_passes passes whose latents all choices of the
    example share. mixture 'token': sum over tokens of log p̄(token), p̄ the mean of the passes' softmaxes; 'sequence':
    log mean_m prod_t p_m(token_t), the likelihood under the population when a latent is frozen for the whole sequence
    (a B-Trans mind, B-Trans Eq. 3); 'none': no mixture, each pass's own log-likelihoods (a list per pass). pairs:
    [(context ids, continuation ids)] -> (log-likelihoods [float], scored token counts [int], truncated: bool). A
    sequence longer than block_size + 1 keeps its last tokens.

    Every pass and choice goes into one batch (cut into pieces of at most MC_LOGITS logits). When the choices share
    their context and the latents do not depend on the tokens (det, B-Trans minds), the context goes through the
    model once per pass, into a KV cache that every choice's continuation then reads; otherwise each row is the whole
    sequence. The passes' latents are drawn as one pass after another would draw them."""
    device, T, V = model.tok_emb.weight.device, model.config.block_size, model.config.vocab_size
    seqs = [(ctx + cont)[-(T + 1):] for ctx, cont in pairs]  # left-truncate
    n_cont = [min(len(cont), len(seq) - 1) for (_, cont), seq in zip(pairs, seqs)]
    contexts = [seq[:len(seq) - n] for seq, n in zip(seqs, n_cont)]  # what precedes each continuation
    C = len(seqs)
    latents = [example_latents(model, contexts, generator) for _ in range(n_passes)]  # (C, ...) each, pass by pass
    if model.latent_kind in ("none", "mind") and all(c == contexts[0] for c in contexts):
        # Rows are [last context token, continuation but its last token], right-padded: causal, so padding changes
        # nothing before it; the context but its last token is the prefix in the cache.
        prefix, L = contexts[0][:-1], max(n_cont)
        x = torch.zeros(C, L, dtype=torch.long)
        y = torch.full((C, L), -1, dtype=torch.long)  # -1: not a continuation token (ignored)
        for i, (seq, n) in enumerate(zip(seqs, n_cont)):
            x[i, :n] = torch.tensor(seq[len(seq) - n - 1:-1])
            y[i, :n] = torch.tensor(seq[len(seq) - n:])
    else:
        prefix, L = [], max(len(seq) for seq in seqs) - 1
        x = torch.zeros(C, L, dtype=torch.long)
        y = torch.full((C, L), -1, dtype=torch.long)
        for i, (seq, n) in enumerate(zip(seqs, n_cont)):  # right-padded, as above
            x[i, :len(seq) - 1] = torch.tensor(seq[:-1])
            y[i, len(seq) - 1 - n:len(seq) - 1] = torch.tensor(seq[len(seq) - n:])
    x, y = x.to(device), y.to(device)
    per_piece = max(1, MC_LOGITS // (C * L * V))  # passes per forward
    log_p = []  # (passes, C, L) pieces
    for m0 in range(0, n_passes, per_piece):
        m1 = min(m0 + per_piece, n_passes)
        lat = None if latents[0] is None else torch.cat(latents[m0:m1])  # (rows, ...)
        with autocast:
            if prefix:
                first = None if lat is None else lat[::C]  # a row a pass
                model.setup_kv_cache(m1 - m0, len(prefix) + L)
                try:
                    model(torch.tensor([prefix], device=device).expand(m1 - m0, -1), latents=first)
                    model.repeat_kv_cache(C)  # row m C + c continues pass m's context with choice c
                    logits = model(x.repeat(m1 - m0, 1), y.repeat(m1 - m0, 1), latents=lat, start_pos=len(prefix))[0]
                finally:
                    model.clear_kv_cache()
            else:
                logits = model(x.repeat(m1 - m0, 1), y.repeat(m1 - m0, 1), latents=lat)[0]  # (rows, L, V)
        log_probs = F.log_softmax(logits.float(), dim=-1)  # (rows, L, V)
        del logits
        target = log_probs.gather(-1, y.repeat(m1 - m0, 1).clamp_min(0).unsqueeze(-1)).squeeze(-1)  # (rows, L)
        log_p.append(target.view(m1 - m0, C, L))
    log_p = torch.cat(log_p).masked_fill(y == -1, 0.0)  # (passes, C, L)
    truncated = any(len(ctx) + len(cont) > T + 1 for ctx, cont in pairs)
    if mixture == "none":
        return log_p.sum(2).tolist(), n_cont, truncated  # (passes, C)
    if mixture == "sequence":
        log_p = log_p.sum(2)  # (passes, C) log prod_t p_m(token_t)
    log_mix = torch.logsumexp(log_p, dim=0) - math.log(n_passes)
    if mixture == "token":
        log_mix = log_mix.masked_fill(y == -1, 0.0).sum(1)
    return log_mix.tolist(), n_cont, truncated


def mixture_for(model, mixture):
    """--mixture=auto: 'sequence' for B-Trans minds (one mind frozen for the whole sequence), 'token' otherwise."""
    return mixture if mixture != "auto" else "sequence" if model.latent_kind == "mind" else "token"


def example_generator(model, seed, index):
    """The draws of multiple-choice example `index` (its position in the file, the harness' doc_id): a generator of
    its own, seeded from (seed, index), so an example's latents depend on neither the examples before it nor how
    they are batched. seed None: torch's global generator."""
    if seed is None:
        return None
    return torch.Generator(model.tok_emb.weight.device).manual_seed(common.seed_of(seed, index))
