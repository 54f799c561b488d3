"""Sampling with pinned latents and scoring one text token by token: what sample.py, evaluate.py --task=tokens and
the explorer's page (scripts/explore.py) compute, one function each, so the page shows exactly the scripts' texts and
numbers."""

import contextlib
import math

import torch
import torch.nn.functional as F

import numpy as np

from nanolatent import common, cpu, metrics, models, tasks

LATENTS = ("independent", "shared", "posterior")


def check_length(ids, block_size, what="the prompt", hint=""):
    if len(ids) > block_size:
        common.die(f"{what} has {len(ids)} tokens, more than the context (block_size={block_size}){hint}")


def pin_latents(model, prompt, how, generator, prompt_latents="encoder", reference=None, pin=-1):
    """The latents of num_samples = prompt.size(0) sequences: 'independent' a draw each, 'shared' one draw for all
    (one prompt-Z draw and one sequence of per-token codes for the Free Transformer), 'posterior' the codes the
    Free Transformer's encoder infers from `reference` (1, T) token ids. Free: the prompt's Z from the encoder on the
    prompt (§3.2), or with prompt_latents='prior' from the uniform prior as well. None: the model has none.
    pin >= 0 with 'independent': every sequence gets draw number `pin` of the num_samples draws (one B-Trans mind
    kept while its tokens are drawn afresh)."""
    n = prompt.size(0)
    consistent_with = prompt[:1] if prompt_latents == "encoder" else None
    if how == "independent":
        drawn = model.sample_latents(n, generator, prompt=consistent_with)
        return drawn if pin < 0 or drawn is None else models.repeat_latents(drawn[pin:pin + 1], n)
    if how == "shared":
        return models.repeat_latents(model.sample_latents(1, generator, prompt=consistent_with), n)
    if model.latent_kind != "code":
        common.die(f"--latents=posterior needs a model with an encoder (free); this one's latents are "
                   f"{model.latent_kind!r}")
    return models.repeat_latents(model.posterior_latents(reference, generator), n)


@torch.no_grad()
def sample(model, ids, num_samples, max_new_tokens, *, seed, latent_seed=-1, latents="independent",
           prompt_latents="encoder", reference=None, temperature=0.8, top_k=0, dtype="float32", compile=False,
           on_token=None, pin=-1, codes=None):
    """num_samples continuations of the prompt `ids` (token ids): (tokens (num_samples, T + max_new_tokens), the
    pinned latents or None). The tokens are drawn from a generator seeded by `seed`, the latents from one seeded by
    latent_seed (-1: seed), so either can be held while the other varies. reference: token ids for 'posterior'.
    on_token(tokens (num_samples, 1)) sees each new token but the last as it is fed back (the explorer streams them);
    it changes no draw, and an exception it raises ends the generation. pin: see pin_latents. codes (Free): Z of the
    first len(codes) positions, ints, in place of the drawn ones (a bit flipped to see what it changes)."""
    device = model.tok_emb.weight.device
    torch.manual_seed(seed)
    token_generator = torch.Generator(device).manual_seed(seed)
    latent_generator = torch.Generator(device).manual_seed(seed if latent_seed < 0 else latent_seed)
    check_length(ids, model.config.block_size)
    prompt = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # (num_samples, T)
    if latents == "posterior":
        check_length(reference, model.config.block_size, "the --reference", ": the encoder reads it whole; shorten it")
        reference = torch.tensor([reference], dtype=torch.long, device=device)  # (1, T_ref)
    if not -1 <= pin < num_samples:
        common.die(f"--pin_mind={pin} names no draw: 0..{num_samples - 1}, or -1 for a draw each")
    pinned = pin_latents(model, prompt, latents, latent_generator, prompt_latents, reference, pin)
    if codes:
        if model.latent_kind != "code" or latents == "independent":
            common.die("--z sets the Free Transformer's codes of pinned latents: a free run with --latents=shared or "
                       "posterior")
        check_length(codes, model.config.block_size, "--z", ": give at most one code per position")
        pinned[:, :len(codes)] = torch.tensor(codes, device=device)
    # The decode step compiled once for every position: the position is an int that changes at each step (dynamic).
    step = (common.first_call(torch.compile(model.forward, dynamic=True), "compiling the decode step") if compile
            else None)
    if on_token is not None:
        decode_step = step or model

        def step(idx_next, **kwargs):
            on_token(idx_next)
            return decode_step(idx_next, **kwargs)
    products = contextlib.nullcontext() if compile else \
        cpu.inference_linears(model, common.DTYPES[dtype], batch_size=num_samples)
    try:
        with products:
            out = model.generate(prompt, max_new_tokens, temperature=temperature, top_k=top_k or None, latents=pinned,
                               generator=token_generator, step=step)
    except ValueError as e:
        common.die(str(e))
    return out, pinned


def code_bits(codes, n_bits):
    """Free Transformer codes as strings of their H bits, most significant first: [int] -> ['01101001', ...]."""
    return [format(int(c), f"0{n_bits}b") for c in codes]


def parse_bits(text, n_bits):
    """--z's codes: H-bit strings separated by spaces (as code_bits writes them), most significant first -> [int]."""
    words = text.split()
    if not all(len(w) == n_bits and set(w) <= {"0", "1"} for w in words):
        bad = next(w for w in words if len(w) != n_bits or not set(w) <= {"0", "1"})
        common.die(f"--z takes {n_bits}-bit codes of 0s and 1s separated by spaces, got {bad[:20]!r}")
    return [int(w, 2) for w in words]


@torch.no_grad()
def posterior_kl_bits(model, ids):
    """Free Eq. 4 per position: KL(Q(Z_t | S) || uniform) of the encoder reading the text `ids`, in bits."""
    bit_logits = model.encoder_logits(torch.tensor([ids], device=model.tok_emb.weight.device))  # (1, T, H)
    return (models.import_model("free").kl_per_token(bit_logits)[0] / math.log(2)).tolist()


@torch.no_grad()
def token_uncertainty(model, ids, n_passes, generator, autocast=contextlib.nullcontext(), dtype="float32",
                      posterior=False):
    """Each predicted token of one text (ids[1:] given what precedes it), over M = n_passes passes with fresh
    latents (det: one pass): nll -log p̄(y), entropy H(p̄), expected_entropy mean_m H(p_m) (aleatoric) and mi
    H(p̄) - mean_m H(p_m) (epistemic), in nats, as lists of floats (metrics.pass_statistics). posterior (Free): each
    pass's Z drawn from the encoder reading the whole text, not from the prior."""
    device = model.tok_emb.weight.device
    check_length(ids[:-1], model.config.block_size, "the text", " (its last token is only predicted); shorten it")
    if len(ids) < 2:
        common.die("the text has fewer than 2 tokens: nothing to predict (the first token is the context)")
    x = torch.tensor([ids[:-1]], dtype=torch.long, device=device)  # (1, T)
    y = torch.tensor(ids[1:], dtype=torch.long, device=device)  # (T,)
    full = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T + 1): what the encoder reads
    M = 1 if model.latent_kind == "none" else n_passes

    def passes():
        for _ in common.progress(range(M), desc="passes over the text"):  # a large model on a long text: not instant
            with autocast:
                latents = (None if model.latent_kind == "none" else model.posterior_latents(full, generator)
                           if posterior else model.sample_latents(1, generator))
                logits = model(x, y[None], latents=latents)[0][0]  # (T, V): targets ask for every position
            yield F.log_softmax(logits.float(), dim=-1)  # (T, V)

    with cpu.inference_linears(model, common.DTYPES[dtype]):
        stats = metrics.pass_statistics(passes(), y)
    return {**{k: stats[k].tolist() for k in ("nll", "entropy", "expected_entropy", "mi")}, "passes": M}


@torch.no_grad()
def top_predictions(model, ids, n_passes, generator, decode, k=5, dtype="float32"):
    """What the passes predict at each position of one text: the k tokens most likely under p̄ (the mean over M
    passes with fresh latents, drawn from `generator` as token_uncertainty draws them), p̄ of each, each pass's p_m of
    each (M, k) and their spread, the standard deviation of p_m over the passes (0 for a det model's one pass).
    -> [{"tokens", "mean", "passes", "spread"}] per predicted position."""
    x = torch.tensor([ids[:-1]], dtype=torch.long, device=model.tok_emb.weight.device)  # (1, T)
    y = torch.tensor([ids[1:]], dtype=torch.long, device=x.device)  # (1, T): targets, as token_uncertainty's
    M = 1 if model.latent_kind == "none" else n_passes
    drawn = [None if model.latent_kind == "none" else model.sample_latents(1, generator) for _ in range(M)]
    with cpu.inference_linears(model, common.DTYPES[dtype]):
        probs = lambda latents: F.softmax(model(x, y, latents=latents)[0][0].float(), dim=-1)  # (T, V)
        # The passes run twice (p̄, then each p_m at p̄'s top k, rather than M full distributions held): the second
        # time from the same global RNG state, which a B-Trans forward with noise_mode='token' draws from.
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            p_bar = sum(probs(latents) for latents in drawn) / M  # (T, V)
        mean, top = p_bar.topk(min(k, p_bar.size(-1)), dim=-1)  # (T, k)
        passes = torch.stack([probs(latents).gather(1, top) for latents in drawn], dim=1)  # (T, M, k)
    spread = passes.std(dim=1, unbiased=False)  # (T, k)
    return [{"tokens": [decode([t]) for t in top[t].tolist()], "mean": mean[t].tolist(), "passes": passes[t].tolist(),
             "spread": spread[t].tolist()} for t in range(x.size(1))]


@torch.no_grad()
def minds_nll(model, ids, minds):
    """Each mind's NLL per token of one text (ids[1:] given what precedes them): the same text and no token draw for
    every mind, so the spread is the minds' own (exactly 0 when they are one model, as at σ = 0). minds: the
    (K, n_norms, C) latents of sample()'s K minds. -> [float] K, in nats, one forward a mind."""
    x = torch.tensor([ids[:-1]], dtype=torch.long, device=model.tok_emb.weight.device)  # (1, T)
    y = torch.tensor([ids[1:]], dtype=torch.long, device=x.device)  # (1, T)
    return [F.cross_entropy(model(x, y, latents=mind[None])[0][0].float(), y[0]).item() for mind in minds]


def minds_line(nll, sigma):
    """The Minds view's headline: the spread of minds_nll, or that the minds are one model."""
    if max(nll) == min(nll):
        return (f"the minds are one model at σ = {sigma:g}: each of the {len(nll)} gives this text the same NLL, "
                f"{nll[0]:.4f} nats per token" + ("" if sigma == 0 else " (this σ changes no prediction)"))
    return (f"the {len(nll)} minds on one text: NLL std {np.std(nll):.4f}, range {max(nll) - min(nll):.4f} nats per "
            f"token (mean {np.mean(nll):.4f})")


def z_effect_bits(model, ids, n_passes, seed, autocast=contextlib.nullcontext(), dtype="float32"):
    """What the Free Transformer's Z does to one text, position by position, in bits: its NLL with Z drawn from the
    encoder reading the text minus its NLL with Z from the uniform prior, each over n_passes draws as evaluate.py
    --task=tokens draws them (seeded by seed); 0 at every position for a decoder that ignores Z. -> [float] T - 1"""
    device, nll = model.tok_emb.weight.device, {}
    for posterior in (False, True):
        torch.manual_seed(seed)
        nll[posterior] = token_uncertainty(model, ids, n_passes, torch.Generator(device).manual_seed(seed), autocast,
                                           dtype, posterior)["nll"]
    return [(q - p) / math.log(2) for p, q in zip(nll[False], nll[True])]


def interval(values, resamples=2000, seed=0):
    """The mean of values (one per position) and its 95% percentile bootstrap interval over them: (d, lo, hi)."""
    v = np.asarray(values, float)
    means = v[np.random.default_rng(seed).integers(0, len(v), size=(resamples, len(v)))].mean(1)  # (resamples,)
    return float(v.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def verdict(what, values, over, unit="", how=""):
    """One line: whether the latents change `what` (values: its change at each of `over`, measured as `how` says), by
    the mean change and its 95% interval, or no measurable effect where the interval holds 0, bounded by its wider
    end; no effect at all where every change is exactly 0."""
    d, lo, hi = interval(values)
    where = f"{how + '; ' if how else ''}95% bootstrap interval over {len(values)} {over}"
    if not np.any(values):
        return f"no measurable effect of the latents on {what} (d = 0 exactly at each of the {len(values)} {over})"
    if lo > 0 or hi < 0:
        return f"the latents change {what} by {d:+.4f} [{lo:+.4f}, {hi:+.4f}]{unit} ({where})"
    return f"no measurable effect of the latents on {what} (|d| <= {max(-lo, hi):.4f}{unit}; {where})"


def z_lines(kl_bits, effect_bits):
    """The Z view's headline and verdict, as evaluate.py --task=tokens prints them for a Free run: the encoder's KL
    from the prior per position and in total (what Z can carry about the text), then what Z changes in its NLL."""
    return [f"Z carries {np.mean(kl_bits):.4f} bits per position, {sum(kl_bits):.2f} bits over the text's "
            f"{len(kl_bits)} positions (KL of the encoder reading it from the uniform prior)",
            verdict("its NLL", effect_bits, "predicted positions", " bits per token",
                    "Z from the encoder reading the text, minus Z from the prior")]


def agreement(rows):
    """Per position, the share of pairs of rows (equal-length token lists) that hold the same token there: 1 where all
    agree, 1/K-ish where K rows each hold another. [[int]] (K >= 2 rows) -> [float] per position."""
    k = len(rows)
    return [float(sum(c * (c - 1) for c in np.unique(column, return_counts=True)[1]) / (k * (k - 1)))
            for column in zip(*rows)]


def letter_spread(groups):
    """The synthetic task's measure (docs/reproductions.md, Free §4.1): the sample standard deviation (ddof 1) of the
    target's start position over the well-formed continuations of each group, averaged over groups with at least 2 of
    them (None where none has). [[str]] -> (spread, well-formed count)."""
    spreads, formed = [], 0
    for texts in groups:
        starts = [t.index(tasks.letters_answer(t)) for t in texts if tasks.letters_answer(t)]
        formed += len(starts)
        if len(starts) >= 2:
            spreads.append(float(np.std(starts, ddof=1)))
    return (float(np.mean(spreads)) if spreads else None), formed


def group_summary(shared, independent, prompt_length, decode, dataset=None):
    """How much one draw of the latents carries (the explorer's Groups numbers, sample.py --summary): shared, a list
    of G blocks of K rows (token ids, prompt first) each sharing one draw; independent, K rows with a draw each; every
    block drawn with the same token seed. Agreement (see agreement) of pairs within a shared block, averaged over the
    blocks, against pairs of the independent block, per new position and in the mean; on the synthetic task also
    letter_spread of the continuations; identical: every block equals the independent one, row for row (the latents
    change nothing). A measure with nothing to average (K = 1: no pairs) is None."""
    new = lambda rows: [r[prompt_length:] for r in rows]
    k = len(independent)
    within = np.mean([agreement(new(g)) for g in shared], axis=0).tolist() if k >= 2 else []
    across = agreement(new(independent)) if k >= 2 else []
    summary = {"k": k, "groups": len(shared), "within": within, "across": across,
               "within_mean": float(np.mean(within)) if within else None,
               "across_mean": float(np.mean(across)) if across else None,
               "identical": all(g == independent for g in shared)}
    if dataset == "synthetic":
        text = lambda rows: [decode(r) for r in new(rows)]
        summary["spread_shared"], summary["formed_shared"] = letter_spread([text(g) for g in shared])
        summary["spread_independent"], summary["formed_independent"] = letter_spread([text(independent)])
    return summary


def summary_lines(s):
    """group_summary as sample.py --summary prints it and the explorer shows it, line for line, ending in the
    verdict on the agreement of pairs."""
    per = lambda values: " ".join(f"{v:.2f}" for v in values) or "none: K = 1 makes no pairs"
    f = lambda value, digits: "n/a" if value is None else f"{value:.{digits}f}"
    lines = [f"agreement of pairs sharing a draw: {f(s['within_mean'], 4)} (mean over {s['groups']} groups of "
             f"{s['k']}; per new position: {per(s['within'])})",
             f"agreement of pairs with a draw each: {f(s['across_mean'], 4)} (per new position: {per(s['across'])})"]
    if "spread_shared" in s:
        lines.append(f"target start spread (std, ddof 1, well-formed only): sharing a draw {f(s['spread_shared'], 2)} "
                     f"({s['formed_shared']} of {s['groups'] * s['k']} well-formed), a draw each "
                     f"{f(s['spread_independent'], 2)} ({s['formed_independent']} of {s['k']})")
    if s["identical"]:
        lines.append("warning: every group is identical to the samples with a draw each: the latents change "
                     "nothing in this run")
    if s["within"]:
        lines.append(verdict("the agreement of pairs", np.subtract(s["within"], s["across"]), "new positions",
                             how="pairs sharing a draw, minus pairs with a draw each"))
    else:
        lines.append("no verdict: K = 1 makes no pairs to agree")
    return lines
